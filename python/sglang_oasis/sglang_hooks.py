"""Every change sglang-oasis makes to SGLang's own functions, in one place, through SGLang's HookRegistry.

Each hook names its target by dotted path; ``test/unit/test_sglang_hooks.py`` resolves every target
and checks its signature, so an SGLang upgrade that moves or reshapes one fails loudly there.

1. ``DraftBackendFactory.create_draft_extend_backend``: its backend table is a literal dict of SGLang's
   own backends with no registry, so with ``--attention-backend oasis`` the EAGLE-3 draft model would
   be refused ("EAGLE is not supported in attention backend oasis"). The hook answers for ``oasis``
   with the dense draft backend; every other backend goes through unchanged.
2. ``verify_tree_greedy_func``: ``--oasis-draft-policy reject`` must never accept a draft token (the
   draft only predicts blocks). Verification runs as usual on candidates whose draft tokens are
   replaced by an id no target prediction equals, so SGLang's own bookkeeping sees "nothing accepted"
   and emits the target's token for the real row, exactly as without speculation.
3. ``allocation.get_last_loc``: SGLang picks its Triton kernel for every attention backend except
   torch_native/ascend (a literal list), and Triton has no CPU driver. Speculative decoding with pages
   larger than one token calls it; on CPU tensors the hook uses SGLang's own torch version.
4. ``Scheduler.process_batch_result``: a failed background block transfer must fail its own request
   only, and SGLang has no hook for a model-side error of one request. Before a batch's result is
   processed, requests the ``oasis`` backend reports as failed get ``to_finish = FINISH_ABORT(...)``
   (SGLang's own way to abort a running request), so they finish at this step with the message and a
   500, their KV is freed and not inserted into the radix cache, and the rest of the batch goes on.
5. PD disaggregation on the CPU engine (``patch_cpu_disaggregation``, not a HookRegistry hook: a class
   attribute and an environment default, applied in every server process by the plugin). Two places on
   the prefill side assume CUDA: ``MooncakeKVSender.supports_host_tensor_indices`` makes
   ``_send_kv_chunk`` stage page indices in pinned memory behind a ``torch.cuda.Event`` ("Found no
   NVIDIA driver"), and the early send of a radix-cached prefix records a ``torch.cuda.Event`` on the
   forward stream (not a ``torch.Stream`` on CPU). On the CPU engine the first is turned off (the
   indices are host tensors already) and so is the second
   (``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0``; the regular send then carries the prefix).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_oasis.config import OasisConfig

DRAFT_EXTEND_TARGET = "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_draft_extend_backend"
VERIFY_GREEDY_TARGET = "sglang.kernels.ops.speculative.spec_tree.verify_tree_greedy_func"
LAST_LOC_TARGET = "sglang.srt.mem_cache.allocation.get_last_loc"
PROCESS_RESULT_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
MOONCAKE_SENDER_TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender"
HOST_INDICES_ATTRIBUTE = "supports_host_tensor_indices"
EARLY_SEND_ENV = "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"
BACKEND_NAME = "oasis"
REJECTED_DRAFT = -1  # no token id: never equal to the target's prediction


def draft_extend_backend(original: Callable[..., Any], factory: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: the draft model's extend backend when the configured backend is oasis."""
    from sglang.srt.runtime_context import attention_backends

    prefill_backend, _decode_backend = attention_backends()
    if (factory.draft_attn_backend or prefill_backend) != BACKEND_NAME:
        return original(factory, *args, **kwargs)
    from sglang_oasis.attention.oasis_backend import DraftAttnBackend

    backend = DraftAttnBackend(factory.draft_model_runner)
    backend.prefill_attention_backend_str = BACKEND_NAME
    backend.decode_attention_backend_str = BACKEND_NAME
    return backend


def reject_drafts(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND hook for ``--oasis-draft-policy reject``: verify against candidates with no draft tokens."""
    position = 3  # (predicts, accept_index, accept_token_num, candidates, ...)
    if len(args) > position:
        args = (*args[:position], _without_drafts(args[position]), *args[position + 1 :])
    else:
        kwargs["candidates"] = _without_drafts(kwargs["candidates"])
    return original(*args, **kwargs)


def _without_drafts(candidates: Any) -> Any:
    """``[batch, n]`` verify tokens: column 0 (the real token) kept, every draft replaced."""
    kept = candidates.clone()
    kept[:, 1:] = REJECTED_DRAFT
    return kept


def last_loc_on_cpu(original: Callable[..., Any], req_to_token: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook: SGLang's torch ``get_last_loc`` for CPU tensors, its own dispatch otherwise."""
    if req_to_token.device.type != "cpu":
        return original(req_to_token, *args, **kwargs)
    from sglang.srt.mem_cache.allocation import get_last_loc_torch

    return get_last_loc_torch(req_to_token, *args, **kwargs)


def abort_failed_transfers(
    original: Callable[..., Any], scheduler: Any, batch: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook: abort the in-flight requests whose working-set transfers failed, then process the
    batch's result as usual."""
    backend: Any = getattr(getattr(scheduler.tp_worker, "model_runner", None), "attn_backend", None)
    if backend is not None and getattr(backend, "has_failed_requests", False):
        from http import HTTPStatus

        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        generations = scheduler.req_to_token_pool.req_generation
        # With the overlap scheduler the failing request may belong to the batch before this one.
        inflight = {id(req): req for req in [*scheduler.collect_inflight_reqs(), *getattr(batch, "reqs", [])]}
        for req in inflight.values():
            slot = req.kv.req_pool_idx
            if slot is None or req.finished() or req.to_finish is not None:
                continue
            message = backend.take_failed_request(int(slot), int(generations[slot]))
            if message is not None:
                req.skip_radix_cache_insert = True  # its KV may be incomplete: never share it
                req.to_finish = FINISH_ABORT(message, HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
    return original(scheduler, batch, *args, **kwargs)


def register(config: OasisConfig) -> None:
    """Register the hooks this configuration needs (SGLang applies them after all plugins load)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if config.mode != "sparse":
        return
    HookRegistry.register(DRAFT_EXTEND_TARGET, draft_extend_backend, HookType.AROUND)
    HookRegistry.register(LAST_LOC_TARGET, last_loc_on_cpu, HookType.AROUND)
    HookRegistry.register(PROCESS_RESULT_TARGET, abort_failed_transfers, HookType.AROUND)
    if config.lookahead != "previous" and config.draft_policy == "reject":
        HookRegistry.register(VERIFY_GREEDY_TARGET, reject_drafts, HookType.AROUND)


def patch_cpu_disaggregation() -> None:
    """Hook 5: PD disaggregation's prefill side on the CPU engine (call only there)."""
    import importlib
    import os

    os.environ.setdefault(EARLY_SEND_ENV, "0")
    module_name, class_name = MOONCAKE_SENDER_TARGET.rsplit(".", 1)
    try:
        sender = getattr(importlib.import_module(module_name), class_name)
    except ImportError:  # no Mooncake build installed: SGLang refuses the mooncake backend itself
        return
    if not hasattr(sender, HOST_INDICES_ATTRIBUTE):
        raise RuntimeError(f"{MOONCAKE_SENDER_TARGET}.{HOST_INDICES_ATTRIBUTE} is gone: re-check hook 5")
    setattr(sender, HOST_INDICES_ATTRIBUTE, False)
