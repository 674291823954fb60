"""The SGLang hooks (``sglang_oasis.sglang_hooks``): each target still exists with the parameters the
hook relies on (an SGLang upgrade that moves one fails here), and each hook does what it claims.

Run in a subprocess on SGLang's CPU engine: the speculative modules import ``sgl_kernel`` at import time.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from sglang_oasis.server_process import child_env

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
    from sglang_oasis.attention.transfer_failures import TransferFailures
    backend = NS(failures=TransferFailures())
    backend.failures.report(3, 7, "boom")
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
    assert other.to_finish is None and not backend.failures

    # Prefix cap: SGLang's own limit (input - 1, or the logprob start), then at most input - window.
    import functools
    assert list(inspect.signature(Req._compute_max_prefix_len).parameters) == ["self", "input_len"]
    assert "self._compute_max_prefix_len(input_len)" in inspect.getsource(Req.init_next_round_input)
    capped = functools.partial(hooks.cap_prefix_match, 32, Req._compute_max_prefix_len)
    plain = NS(dllm_config=None, return_logprob=False, logprob_start_len=-1, is_dllm=lambda: False)
    assert Req._compute_max_prefix_len(plain, 100) == 99 and capped(plain, 100) == 68
    assert capped(plain, 20) == 0
    logprobs = NS(dllm_config=None, return_logprob=True, logprob_start_len=10, is_dllm=lambda: False)
    assert capped(logprobs, 100) == 10

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

    # Hook 7 (remote partial fetching): targets, and what the hooks read of SGLang's objects.
    remote_fetch = {
        hooks.PREFILL_SEND_TARGET: ["self", "req", "last_chunk", "end_idx"],
        hooks.SEND_INDICES_TARGET: ["self", "kv_indices", "state_indices"],
        hooks.BOOTSTRAP_ROUTES_TARGET: ["self"],
        hooks.DECODE_COMMIT_TARGET: ["self", "decode_req"],
        hooks.DECODE_FREE_TARGET: ["self", "req"],
        hooks.BACKUP_TARGET: ["req", "tree_cache", "req_to_token_pool", "token_to_kv_pool_allocator", "backend"],
        hooks.RELEASE_TARGET: ["req", "remaing_req_count", "req_to_token_pool"],
        "sglang.srt.disaggregation.utils.prepare_abort": ["req", "error_message", "status_code"],
        "sglang.srt.mem_cache.common.release_kv_cache": ["req", "tree_cache"],
    }
    for target, params in remote_fetch.items():
        found = list(inspect.signature(pkgutil.resolve_name(target)).parameters)
        assert found[: len(params)] == params, (target, found)
    from sglang.srt.disaggregation.common.conn import CommonKVManager, CommonKVSender
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
    from sglang.srt.mem_cache.common import release_kv_cache
    assert "self._prepare_send_indices(" in inspect.getsource(CommonKVSender.send)
    assert "self.curr_idx == self.num_kv_indices" in inspect.getsource(CommonKVSender._prepare_send_indices)
    assert callable(CommonKVManager.record_failure) and callable(CommonKVManager.update_status)
    send_source = inspect.getsource(prefill.SchedulerDisaggregationPrefillMixin._send_kv_chunk)
    assert "req.extend_end" in send_source and "req.disagg_decode_prefix_len" in send_source
    assert "self.tree_cache = tree_cache" in inspect.getsource(DecodeTransferQueue.__init__)
    assert "tree_cache.checkpoint(req, up_to=" in inspect.getsource(release_kv_cache)
    assert FAKE_BOOTSTRAP_HOST == "2.2.2.2"
    assert "tree_cache.req_to_token_pool.free(req)" in inspect.getsource(release_kv_cache)

    # release_freed_rows: SGLang frees the row, then the pool's listener hears which.
    from sglang.srt.disaggregation.decode import DecodeReqToTokenPool
    freed: list[int] = []
    pool = NS(free_slots=[], **{hooks.FREED_ROW_LISTENER: freed.append})
    request = NS(kv=NS(req_pool_idx=7, holds_kv=True))
    hooks.release_freed_rows(DecodeReqToTokenPool.free, pool, request)
    assert pool.free_slots == [7] and request.kv.req_pool_idx is None and freed == [7]

    # complete_before_backup: a retracted request's remote blocks are read before SGLang backs it up;
    # if they cannot be, SGLang hears "cannot be backed up" (and aborts it) and nothing is backed up.
    from sglang.srt.mem_cache.common import backup_kv_cache
    assert "return False" in inspect.getsource(backup_kv_cache)  # False: SGLang aborts the request
    calls: list[object] = []
    def backup(req, tree_cache, req_to_token_pool, allocator, backend):
        calls.append("backup")
        return True
    for whole, expected in ((True, ["complete 3", "backup"]), (False, ["complete 3"])):
        calls.clear()
        def complete(row, whole=whole):
            calls.append(f"complete {row}")
            return whole
        pool = NS(**{hooks.BEFORE_BACKUP_LISTENER: complete})
        answer = hooks.complete_before_backup(backup, NS(kv=NS(req_pool_idx=3), rid="r"), None, pool, None, "cpu_tensor")
        assert answer is whole and calls == expected
    # ... and once the backup is whole, the backend keeps the request's selection state (row, rid, tokens).
    kept = []
    pool = NS(**{hooks.BEFORE_BACKUP_LISTENER: lambda row: True, hooks.RETRACT_LISTENER: lambda *a: kept.append(a)})
    request = NS(kv=NS(req_pool_idx=3), rid="r", origin_input_ids=[1, 2, 3], output_ids=[4])
    assert hooks.complete_before_backup(backup, request, None, pool, None, "cpu_tensor") is True
    assert kept == [(3, "r", 4, True)], kept

    # Hook 8: release_req (keyword arguments only) keeps an unfinished request's state (not backed up).
    from sglang.srt.managers import schedule_batch
    params = inspect.signature(pkgutil.resolve_name(hooks.RELEASE_TARGET)).parameters
    assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in ("req", "req_to_token_pool"))
    assert "reset_for_retract" in inspect.getsource(schedule_batch.release_req)
    kept.clear()
    released = []
    for finished in (False, True):
        request = NS(kv=NS(req_pool_idx=5), rid=f"r{finished}", origin_input_ids=[1, 2], output_ids=[3, 4],
                     finished=lambda finished=finished: finished)
        hooks.keep_before_release(lambda **kw: released.append(kw["req"].rid), req=request, req_to_token_pool=pool)
    assert kept == [(5, "rFalse", 4, False)] and released == ["rFalse", "rTrue"], (kept, released)

    # send_last_page_only: earlier chunks send nothing, the last stages and sends only the last page.
    import numpy as np
    staged = []
    stager = NS(stage=lambda *args: staged.append(args))
    sender = NS(_oasis_stager=stager, _oasis_stage=(5, 40, 16), bootstrap_room=9)
    def chunk(kv, sl, last):
        return hooks.send_last_page_only(lambda s, k, *a: (k, sl, last, False), sender, np.asarray(kv, dtype=np.int32))
    kv, sl, last, skip = chunk([10, 11], slice(0, 2), False)
    assert len(kv) == 0 and sl == slice(2, 2) and not last and not skip and staged == []
    kv, sl, last, skip = chunk([], slice(2, 2), True)  # a last chunk without new pages
    assert kv.tolist() == [11] and sl == slice(1, 2) and last and not skip, (kv, sl)
    assert staged == [(9, 5, 40, 16)]
    plain = NS(bootstrap_room=3)  # not staged: untouched
    out = hooks.send_last_page_only(lambda s, k, *a: (k, slice(0, 2), True, False), plain, np.asarray([1, 2]))
    assert out[0].tolist() == [1, 2] and out[1] == slice(0, 2)
    failures, statuses = {}, []
    def broken(*args):
        raise RuntimeError("no memory")
    failing = NS(_oasis_stager=NS(stage=broken), _oasis_stage=(1, 2, 0), bootstrap_room=4,
                 kv_mgr=NS(record_failure=failures.__setitem__, update_status=lambda r, s: statuses.append((r, s))))
    out = hooks.send_last_page_only(lambda s, k, *a: (k, slice(0, 1), True, False), failing, np.asarray([7]))
    from sglang.srt.disaggregation.base.conn import KVPoll
    assert out[3] is True and "no memory" in failures[4] and statuses == [(4, KVPoll.Failed)]
    # the bootstrap server's extra route
    from aiohttp import web
    from sglang_oasis.disaggregation.pd_partial import ENDPOINT_ROUTE
    server = NS(app=web.Application())
    hooks.remote_fetch_routes(lambda s: None, server)
    assert ENDPOINT_ROUTE in [route.resource.canonical for route in server.app.router.routes()]
    # a decode server that does not fetch refuses requests from a staging prefill node, by name
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    class Bootstrap(BaseHTTPRequestHandler):
        asked = []
        def do_GET(self):
            Bootstrap.asked.append(self.server.server_port)
            staging = self.path.startswith(ENDPOINT_ROUTE) and self.server.server_port == staging_port
            self.send_response(200 if staging else 404)
            self.end_headers()
            self.wfile.write(b'{"url": "http://127.0.0.1:1"}' if staging else b"{}")
        def log_message(self, *args):
            pass
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Bootstrap) for _ in range(2)]
    for http in servers:
        threading.Thread(target=http.serve_forever, daemon=True).start()
    staging_port, plain_port = (http.server_port for http in servers)
    def decode_request(port):
        return NS(req=NS(bootstrap_host="127.0.0.1", bootstrap_port=port, finished=lambda: False,
                         return_logprob=False, finished_reason=None, skip_radix_cache_insert=False))
    refused, accepted = decode_request(staging_port), decode_request(plain_port)
    for decode_req in (refused, accepted):
        assert hooks.refuse_staged_requests(lambda q, d: "committed", NS(), decode_req) == "committed"
    reason = refused.req.finished_reason
    assert reason is not None and "--oasis-remote-fetch" in reason.message and int(reason.status_code) == 500
    assert accepted.req.finished_reason is None
    # asked once per prefill node, not once per request
    again = decode_request(staging_port)
    hooks.refuse_staged_requests(lambda q, d: "committed", NS(), again)
    assert again.req.finished_reason is not None and sorted(Bootstrap.asked) == sorted([staging_port, plain_port])
    # A sparse decode server whose fetching turned itself off (no fetcher: --tp-size 2, ...) refuses too.
    off, whole = decode_request(staging_port), decode_request(plain_port)
    queue = NS(scheduler=NS(tp_worker=NS(model_runner=NS(attn_backend=NS(remote=None)))))
    for decode_req in (off, whole):
        assert hooks.fetch_admission_blocks(lambda q, d: "committed", queue, decode_req) == "committed"
    assert off.req.finished_reason is not None and "--tp-size 1" in off.req.finished_reason.message
    assert whole.req.finished_reason is None

    # Hook 9: each request's custom_params, noted by rid as a forward batch is built.
    # ForwardBatch.init_new is a classmethod taking (batch, model_runner) whose batch has the requests
    # (it reads their rids, which the batch the backend gets carries).
    from types import SimpleNamespace
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang_oasis.attention.request_options import batch_params
    assert isinstance(ForwardBatch.__dict__["init_new"], classmethod)
    found = list(inspect.signature(pkgutil.resolve_name(hooks.FORWARD_BATCH_TARGET)).parameters)
    assert found[:2] == ["batch", "model_runner"], found
    assert "rids=[req.rid for req in batch.reqs]" in inspect.getsource(ForwardBatch.init_new)
    reqs = [SimpleNamespace(rid=rid, sampling_params=SimpleNamespace(custom_params=p))
            for rid, p in (("a", {"oasis_top_k": 8}), ("b", None))]
    built = hooks.carry_request_params(lambda cls, batch, runner: "built", ForwardBatch, SimpleNamespace(reqs=reqs), None)
    assert built == "built" and batch_params(["b", "a", "c"]) == [None, {"oasis_top_k": 8}, None]

    # Hook 10: a finished request's own figures go out with its last output (meta_info["oasis"]).
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang_oasis.attention.request_ledger import RequestLedger
    found = list(inspect.signature(pkgutil.resolve_name(hooks.STREAMER_TARGET)).parameters)
    assert found == ["self"], found
    assert "self.get_output_streamer_class()(" in inspect.getsource(Scheduler)
    assert SchedulerOutputStreamer.has_additional_customized_info is False
    streamer_source = inspect.getsource(SchedulerOutputStreamer._stream_output_generation)
    assert "build_additional_customized_info(" in streamer_source, "hook 10: SGLang no longer asks for fields"
    assert "customized_info" in inspect.getsource(TokenizerManager.update_request_meta_info)
    ledger = RequestLedger()
    ledger.begin([1, 2], [0, 0], ["done", "running"], decode=True)
    scheduler = SimpleNamespace(rust_server=None, tp_worker=SimpleNamespace(model_runner=SimpleNamespace(
        attn_backend=SimpleNamespace(stats=SimpleNamespace(requests=ledger)))))
    cls = hooks.report_request_figures(lambda s: SchedulerOutputStreamer, scheduler)
    assert issubclass(cls, SchedulerOutputStreamer) and cls.has_additional_customized_info
    reqs = [SimpleNamespace(rid="done", finished=lambda: True), SimpleNamespace(rid="running", finished=lambda: False)]
    info = cls.build_additional_customized_info(None, reqs)
    assert info == {"oasis": [[ledger_figures := info["oasis"][0][0]], []]}, info
    assert ledger_figures["decode_steps"] == 1 and ledger.take("done") is None
    rust = SimpleNamespace(rust_server=object())
    assert hooks.report_request_figures(lambda s: SchedulerOutputStreamer, rust) is SchedulerOutputStreamer

    # 11: the oasis backend's dense extend overrides SGLang's torch_native one by name and parameters.
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang_oasis.attention.extend_attention import CachedPrefixExtend
    theirs = list(inspect.signature(TorchNativeAttnBackend._run_sdpa_forward_extend).parameters)
    ours = list(inspect.signature(CachedPrefixExtend._run_sdpa_forward_extend).parameters)
    assert theirs == ours, (theirs, ours)
    assert "self._run_sdpa_forward_extend(" in inspect.getsource(TorchNativeAttnBackend.forward_extend)
    print("hooks-ok")
    """
)


def test_hook_targets_exist_and_hooks_behave() -> None:
    env = child_env({"SGLANG_USE_CPU_ENGINE": "1"})
    result = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert "hooks-ok" in result.stdout, result.stderr[-3000:]
