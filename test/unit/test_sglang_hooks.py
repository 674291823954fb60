"""The SGLang hooks (``sglang_oasis.sglang_hooks``): each target still exists with the parameters the
hook relies on (an SGLang upgrade that moves one fails here), and each hook does what it claims.

Run in a subprocess on SGLang's CPU engine: the speculative modules import ``sgl_kernel`` at import time.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from sglang_oasis.testing.server_process import child_env

CHECK = textwrap.dedent(
    """
    import inspect, pkgutil
    import torch
    from sglang_oasis import sglang_hooks as hooks

    expected = {
        hooks.DRAFT_EXTEND_TARGET: ["self"],
        hooks.VERIFY_GREEDY_TARGET: ["predicts", "accept_index", "accept_token_num", "candidates",
                                     "retrieve_index", "retrieve_next_token", "retrieve_next_sibling",
                                     "target_predict"],
        hooks.LAST_LOC_TARGET: ["req_to_token", "req_pool_indices_tensor", "prefix_lens_tensor"],
        hooks.PROCESS_RESULT_TARGET: ["self", "batch", "result"],
        "sglang.srt.managers.schedule_batch.FINISH_ABORT": ["message", "status_code", "err_type"],
    }
    for target, params in expected.items():
        found = list(inspect.signature(pkgutil.resolve_name(target)).parameters)
        assert found[: len(params)] == params, (target, found)
    from sglang.srt.speculative.draft_utils import DraftBackendFactory
    assert "attention_backends" in inspect.getsource(DraftBackendFactory._create_backend)

    # reject: the draft token equals the target's prediction, yet nothing is accepted.
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_func
    def run(verify):
        predicts = torch.full((2,), -5, dtype=torch.int64)
        accept_index = torch.full((1, 2), -1, dtype=torch.int64)
        accept_num = torch.zeros(1, dtype=torch.int64)
        verify(predicts, accept_index, accept_num, torch.tensor([[7, 42]]), torch.tensor([[0, 1]]),
               torch.tensor([[1, -1]]), torch.tensor([[-1, -1]]), torch.tensor([[42, 9]]))
        return predicts.tolist(), accept_index.tolist(), accept_num.tolist()
    assert run(verify_tree_greedy_func) == ([42, 9], [[0, 1]], [1]), run(verify_tree_greedy_func)
    rejecting = lambda *a, **k: hooks.reject_drafts(verify_tree_greedy_func, *a, **k)
    assert run(rejecting) == ([42, -5], [[0, -1]], [0]), run(rejecting)

    # last loc: SGLang's torch version on CPU tensors.
    req_to_token = torch.arange(40, dtype=torch.int32).view(4, 10)
    got = hooks.last_loc_on_cpu(None, req_to_token, torch.tensor([2, 0]), torch.tensor([3, 0]))
    assert got.tolist() == [22, -1], got
    # abort: what the hook touches on SGLang's scheduler and requests still exists.
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.schedule_batch import Req
    assert callable(Scheduler.collect_inflight_reqs)
    req_init = inspect.getsource(Req.__init__)
    assert "self.to_finish" in req_init and "self.skip_radix_cache_insert" in req_init
    assert "update_finish_state" in inspect.getsource(Req) and "self.to_finish" in inspect.getsource(
        Req.update_finish_state)
    from types import SimpleNamespace as NS
    from sglang_oasis.attention.oasis_backend import OasisAttnBackend
    backend = NS(failed_requests={3: (7, "boom")}, has_failed_requests=True)
    backend.take_failed_request = lambda slot, gen: OasisAttnBackend.take_failed_request(
        NS(failed_requests=backend.failed_requests, _failed_lock=__import__("threading").Lock()), slot, gen)
    def request(slot):
        return NS(kv=NS(req_pool_idx=slot), to_finish=None, skip_radix_cache_insert=False,
                  finished=lambda: False)
    failing, other = request(3), request(4)
    scheduler = NS(tp_worker=NS(model_runner=NS(attn_backend=backend)),
                   req_to_token_pool=NS(req_generation=torch.tensor([0, 0, 0, 7, 2])),
                   collect_inflight_reqs=lambda: [other])
    out = hooks.abort_failed_transfers(lambda s, b, r: "processed", scheduler, NS(reqs=[failing, other]), 1)
    assert out == "processed"
    assert failing.to_finish is not None and failing.to_finish.message == "boom", failing.to_finish
    assert int(failing.to_finish.status_code) == 500 and failing.skip_radix_cache_insert
    assert other.to_finish is None and backend.failed_requests == {}

    # PD on the CPU engine: the sender attribute and the early-send switch are still what prefill reads.
    import os
    from sglang.srt.disaggregation import prefill
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
    from sglang.srt.environ import envs
    source = inspect.getsource(prefill)
    assert f'"{hooks.HOST_INDICES_ATTRIBUTE}"' in source and hooks.EARLY_SEND_ENV in source
    assert MooncakeKVSender.supports_host_tensor_indices is True
    os.environ.pop(hooks.EARLY_SEND_ENV, None)
    hooks.patch_cpu_disaggregation()
    assert MooncakeKVSender.supports_host_tensor_indices is False
    assert getattr(envs, hooks.EARLY_SEND_ENV).get() is False
    print("hooks-ok")
    """
)


def test_hook_targets_exist_and_hooks_behave() -> None:
    env = child_env({"SGLANG_USE_CPU_ENGINE": "1"})
    result = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert "hooks-ok" in result.stdout, result.stderr[-3000:]
