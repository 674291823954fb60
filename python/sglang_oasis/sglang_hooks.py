"""Every change sglang-oasis makes to SGLang's own functions, in one place, through SGLang's HookRegistry.

Each hook names its target by dotted path; ``test/unit/test_sglang_hooks.py`` checks every target's
signature, so an SGLang upgrade that moves one fails loudly there. A hook hands SGLang's arguments to the
part that decides (named below) and applies its answer (docs/design.md: the table, hook 7's PD route).

1. ``DraftBackendFactory.create_draft_extend_backend``: its backend table is a literal dict, so the EAGLE-3
   draft would be refused with ``--attention-backend oasis``; the hook answers with the dense draft backend.
2. ``verify_tree_greedy_func`` (``--oasis-draft-policy reject``: the draft only predicts blocks):
   verification runs on candidates whose draft tokens are replaced by an id no prediction equals, so
   SGLang's own bookkeeping sees "nothing accepted" and emits the target's token, as without speculation.
3. ``allocation.get_last_loc``: SGLang's Triton kernel has no CPU driver; on CPU, SGLang's torch version.
4. ``Scheduler.process_batch_result``: a failed background block transfer must fail its own request only,
   and SGLang has no hook for a model-side error of one request. Before a batch's result is processed,
   ``transfer_failures.abort_failed`` gives the failed requests SGLang's ``FINISH_ABORT`` (a 500, their KV
   freed and not cached; under tensor parallelism the ranks all-reduce which failed, so all abort the
   same ones), after folding a CUDA graph replay's counts (the backend's ``settle``).
5. ``Req._compute_max_prefix_len`` (``--oasis-prefill-window`` N > 0): the first working set comes from the
   prompt's last N queries, computed only by the extend; the prefix match is capped at the prompt minus N.
6. PD on the CPU engine (``patch_cpu_disaggregation``: a class attribute and an environment default, not
   a HookRegistry hook): ``MooncakeKVSender.supports_host_tensor_indices`` stages page indices behind a
   ``torch.cuda.Event``, and the early send of a cached prefix records one on the forward stream; both are
   turned off there (``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0``: the regular send carries it).
7. Remote partial fetching under PD (``--oasis-remote-fetch``; ``disaggregation/__init__.py``). SGLang's
   KV sender has no notion of a partial payload nor its queue of an admission read, so:
   a. ``SchedulerDisaggregationPrefillMixin.send_kv_chunk`` (prefill), the only place that knows a send's
      request: ``SendPlans.on_chunk`` decides whole or staged (the handshake, the staging cap).
   b. ``CommonKVSender._prepare_send_indices`` (prefill), where every send's pages are decided:
      ``SendPlans.on_prepared`` sends a staged request's last page only, after staging its KV.
   c. ``CommonKVBootstrapServer._setup_routes`` (prefill's HTTP process): ``side_channel.serve_endpoints``
      adds ``/oasis/remote_fetch_endpoint``, where decode nodes find the hand-off channel.
   d. ``DecodeTransferQueue._pollers`` (decode): ``decode_queue.gate_pollers``, a request waits in
      SGLang's queue until its admission read (on a worker, never the scheduler thread) is over.
   e. ``DecodeTransferQueue._commit_transfer_to_req`` (decode): ``decode_queue.admit_committed`` applies
      the admission or aborts the request alone; with the decode radix cache, only whole KV is shared.
   f. ``DecodeReqToTokenPool.free`` (decode; no release callback): the pool's listener
      (``DecodeFetcher.release_slot``) gets the freed row and the request's bootstrap address.
   g. ``mem_cache.common.backup_kv_cache`` (decode retraction): still-remote blocks are read first
      (``decode_queue.whole_before_backup``; False: SGLang's "cannot be backed up"), and after a backup the
      backend keeps the request's selection state (``retraction.keep_retracted``; no retraction callback).
   h. ``MooncakeKVManager._publish_peer_registration`` (prefill): a decode session that registers again is
      a new process, perhaps one that does not fetch: the stager forgets it until it asks for a hand-off.
8. ``schedule_batch.release_req``: where SGLang releases a request it retracts (re-prefilled later); the
   backend keeps its selection state first (``retraction.keep_retracted``), so it goes on on its path.
9. ``ForwardBatch.init_new``: a request's ``custom_params`` (its own top-K, recall target) never reach the
   attention backend (the forward batch carries no sampling parameters); the hook notes them by rid
   (``request_options.note_requests``), with the key a retraction was kept by.
10. ``Scheduler.get_output_streamer_class``: SGLang adds per-request output fields only through a subclass
   of its output streamer; ``request_ledger.streamer_with_figures`` returns one that sends a finished
   request's own figures as ``meta_info["oasis"]`` (summed over tensor-parallel ranks). Not with SGLang's
   Rust egress, which refuses additional fields.
11. ``TorchNativeAttnBackend._run_sdpa_forward_extend`` (not a hook: overridden, ``extend_attention.py``):
   an extend's attention from the block before the new rows only, not every row; bitwise the same.
12. ``SamplingParams.verify``: a bad ``oasis_*`` option read in the scheduler could only fail its request
   with a 500; SGLang answers a ``ValueError`` from ``verify`` with HTTP 400 before anything is queued and
   has no validator registry for ``custom_params``: the hook adds ``request_options.check``.
13. ``parallel_state.init_model_parallel_group`` (CPU engine, every mode; ``register_cpu_engine``): SGLang
   gives each model-parallel group a PyNccl communicator unless the platform is an out-of-tree one
   without NCCL; the CPU platform is in-tree and our torch a CUDA build, so every rank died in
   ``PyNcclCommunicator``. The hook passes ``use_pynccl=False``: the groups all-reduce over gloo.
14. ``DecodeCudaGraphRunner.can_run_graph`` (``--oasis-cuda-untested``): SGLang replays a graph for every
   decode pass that fits one; some oasis passes must run eagerly: the backend's ``graph_ready`` is asked.
15. ``KVCacheConfigurator._build_mha_kv_pool`` (the target on CUDA; 15 and 16 run on a fake CUDA device in
   ``test_fake_cuda.py``): SGLang's KV pool is on the GPU with no host option; in sparse mode it is the host
   tier, so ``host_kv_pool.build_pool`` hands SGLang's builder ``PinnedHostKVPool`` (page-locked host memory
   seen through CUDA views). Other pool classes are refused by name; the draft's stays SGLang's, on the GPU.
16. ``KVCacheConfigurator._profile_available_bytes`` (same): the host tier is sized by host RAM
   (``host_kv_pool.host_tier_bytes``: ``--oasis-host-memory-fraction`` of it), and what SGLang measured on
   the GPU is kept (``GpuKVBytes``) for hook 15 to hand the pool: the device tier's budget.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from sglang_oasis.attention.request_options import NotedRequest, check, disaggregated, note_requests
from sglang_oasis.config import OasisConfig
from sglang_oasis.sglang_contract import (  # the names the backend and the hooks share
    BACKEND_NAME,
    RETRACTION_KEY,
    STAGER_ATTRIBUTE,
)

if TYPE_CHECKING:  # SGLang's own types, for mypy (the hooks are checked against SGLang's signatures)
    import torch
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, CommonKVSender
    from sglang.srt.disaggregation.decode import DecodeReqToTokenPool, DecodeRequest, DecodeTransferQueue
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    from sglang_oasis.disaggregation.decode_fetcher import DecodeFetcher
    from sglang_oasis.disaggregation.decode_queue import Poller
    from sglang_oasis.disaggregation.prefill_stager import PrefillStager
    from sglang_oasis.disaggregation.send_plan import SendIndices

DRAFT_EXTEND_TARGET = "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_draft_extend_backend"
VERIFY_GREEDY_TARGET = "sglang.kernels.ops.speculative.spec_tree.verify_tree_greedy_func"
LAST_LOC_TARGET = "sglang.srt.mem_cache.allocation.get_last_loc"
PROCESS_RESULT_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"
PREFIX_LIMIT_TARGET = "sglang.srt.managers.schedule_batch.Req._compute_max_prefix_len"
MOONCAKE_SENDER_TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender"
HOST_INDICES_ATTRIBUTE = "supports_host_tensor_indices"
EARLY_SEND_ENV = "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"
PREFILL_SEND_TARGET = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin.send_kv_chunk"
SEND_INDICES_TARGET = "sglang.srt.disaggregation.common.conn.CommonKVSender._prepare_send_indices"
PEER_REGISTRATION_TARGET = (
    "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager._publish_peer_registration"
)
BOOTSTRAP_ROUTES_TARGET = "sglang.srt.disaggregation.common.conn.CommonKVBootstrapServer._setup_routes"
DECODE_COMMIT_TARGET = "sglang.srt.disaggregation.decode.DecodeTransferQueue._commit_transfer_to_req"
DECODE_POLLERS_TARGET = "sglang.srt.disaggregation.decode.DecodeTransferQueue._pollers"
DECODE_FREE_TARGET = "sglang.srt.disaggregation.decode.DecodeReqToTokenPool.free"
BACKUP_TARGET = "sglang.srt.mem_cache.common.backup_kv_cache"
RELEASE_TARGET = "sglang.srt.managers.schedule_batch.release_req"
FORWARD_BATCH_TARGET = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
STREAMER_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_output_streamer_class"
PARALLEL_GROUP_TARGET = "sglang.srt.distributed.parallel_state.init_model_parallel_group"
VERIFY_PARAMS_TARGET = "sglang.srt.sampling.sampling_params.SamplingParams.verify"
POOL_BUILD_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mha_kv_pool"
POOL_BUDGET_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes"
GRAPH_RUN_TARGET = (
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph"
)
REJECTED_DRAFT = -1  # no token id: never equal to the target's prediction

logger = logging.getLogger(__name__)


def draft_extend_backend(
    original: Callable[..., Any], factory: DraftBackendFactory, *args: Any, **kwargs: Any
) -> AttentionBackend | None:
    """AROUND hook: the draft model's extend backend when the configured backend is oasis."""
    from sglang.srt.runtime_context import attention_backends

    prefill_backend, _decode_backend = attention_backends()
    if (factory.draft_attn_backend or prefill_backend) != BACKEND_NAME:
        return original(factory, *args, **kwargs)
    from sglang_oasis.attention.draft_backend import DraftAttnBackend

    backend = DraftAttnBackend(factory.draft_model_runner)
    backend.prefill_attention_backend_str = BACKEND_NAME
    backend.decode_attention_backend_str = BACKEND_NAME
    return backend


def reject_drafts(
    original: Callable[..., Any], *args: Any, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AROUND hook for ``--oasis-draft-policy reject``: verify against candidates with no draft tokens."""
    position = 3  # (predicts, accept_index, accept_token_num, candidates, ...)
    if len(args) > position:
        args = (*args[:position], _without_drafts(args[position]), *args[position + 1 :])
    else:
        kwargs["candidates"] = _without_drafts(kwargs["candidates"])
    return original(*args, **kwargs)


def _without_drafts(candidates: torch.Tensor) -> torch.Tensor:
    """``[batch, n]`` verify tokens: column 0 (the real token) kept, every draft replaced."""
    kept = candidates.clone()
    kept[:, 1:] = REJECTED_DRAFT
    return kept


def last_loc_on_cpu(
    original: Callable[..., Any], req_to_token: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """AROUND hook: SGLang's torch ``get_last_loc`` for CPU tensors, its own dispatch otherwise."""
    if req_to_token.device.type != "cpu":
        return original(req_to_token, *args, **kwargs)
    from sglang.srt.mem_cache.allocation import get_last_loc_torch

    return get_last_loc_torch(req_to_token, *args, **kwargs)


def cap_prefix_match(
    window: int, original: Callable[..., Any], req: Req, input_len: int, *args: Any, **kwargs: Any
) -> int:
    """AROUND hook: a prefix match leaves at least the prefill window's ``window`` tokens to compute."""
    return max(0, min(original(req, input_len, *args, **kwargs), input_len - window))


def abort_failed_transfers(
    original: Callable[..., Any], scheduler: Scheduler, batch: ScheduleBatch, *args: Any, **kwargs: Any
) -> None:
    """AROUND hook 4: abort the in-flight requests whose working-set transfers failed
    (``transfer_failures.abort_failed``), then process the batch's result as usual."""
    from sglang_oasis.attention.transfer_failures import abort_failed

    abort_failed(scheduler, batch, _backend(scheduler))
    return original(scheduler, batch, *args, **kwargs)


def _backend(scheduler: Scheduler) -> AttentionBackend | None:
    return getattr(getattr(getattr(scheduler, "tp_worker", None), "model_runner", None), "attn_backend", None)


def _pd_part(scheduler: Scheduler, name: str) -> object:
    """The oasis backend's PD stager (``"stager"``) or fetcher (``"remote"``); None on any other node."""
    return getattr(getattr(_backend(scheduler), "pd", None), name, None)


def _stager(scheduler: Scheduler) -> PrefillStager | None:  # the prefill node's
    return cast("PrefillStager | None", _pd_part(scheduler, "stager"))


def _fetcher(scheduler: Scheduler) -> DecodeFetcher | None:  # the decode node's
    return cast("DecodeFetcher | None", _pd_part(scheduler, "remote"))


def mark_staged_send(
    original: Callable[..., None], scheduler: Scheduler, req: Req, last_chunk: bool = False,
    end_idx: int | None = None,
) -> None:  # fmt: skip
    """AROUND hook (prefill): the node's stager decides the request's send (``SendPlans.on_chunk``)."""
    stager = _stager(scheduler)
    if stager is not None:
        stager.sends.on_chunk(req, last_chunk, end_idx)
    original(scheduler, req, last_chunk=last_chunk, end_idx=end_idx)


def forget_reregistered_sessions(
    original: Callable[..., str | None], kv_mgr: MooncakeKVManager, mooncake_session_id: str, *args: Any,
    **kwargs: Any,
) -> str | None:  # fmt: skip
    """AROUND hook (prefill): after SGLang records a decode session's registration, this node's stager
    (if it has been used) stages for that session only once it asks for a hand-off again."""
    result = original(kv_mgr, mooncake_session_id, *args, **kwargs)
    stager: PrefillStager | None = getattr(kv_mgr, STAGER_ATTRIBUTE, None)
    if stager is not None:
        stager.forget(str(mooncake_session_id))
    return result


def send_last_page_only(
    original: Callable[..., SendIndices], sender: CommonKVSender, *args: Any, **kwargs: Any
) -> SendIndices:
    """AROUND hook (prefill): a staged request's chunks send nothing but its last page
    (``SendPlans.on_prepared``)."""
    prepared = original(sender, *args, **kwargs)
    stager: PrefillStager | None = getattr(getattr(sender, "kv_mgr", None), STAGER_ATTRIBUTE, None)
    return prepared if stager is None else stager.sends.on_prepared(sender, prepared)


def remote_fetch_routes(original: Callable[..., None], server: CommonKVBootstrapServer) -> None:
    """AROUND hook (prefill bootstrap server): ``/oasis/remote_fetch_endpoint`` (``side_channel``)."""
    from sglang_oasis.disaggregation.side_channel import serve_endpoints

    original(server)
    serve_endpoints(server.app)


def wait_for_admissions(original: Callable[..., list[Poller]], queue: DecodeTransferQueue) -> list[Poller]:
    """AROUND hook (decode): a request's poll says ``Success`` only once its admission is over
    (``decode_queue.gate_pollers``)."""
    pollers = original(queue)  # SGLang's receivers, or wrappers of them: anything with poll()
    remote = _fetcher(queue.scheduler)
    if remote is None:
        return pollers
    from sglang_oasis.disaggregation.decode_queue import gate_pollers

    return gate_pollers(pollers, queue, remote)


def fetch_admission_blocks(
    original: Callable[..., None], queue: DecodeTransferQueue, decode_req: DecodeRequest
) -> None:
    """AROUND hook (decode): after SGLang commits a transferred request, it is admitted or aborted alone
    (``decode_queue.admit_committed``)."""
    original(queue, decode_req)
    remote = _fetcher(queue.scheduler)
    if remote is not None:  # else no fetching here: the prefill node sent it whole
        from sglang_oasis.disaggregation.decode_queue import admit_committed

        admit_committed(queue, decode_req, remote)


def release_freed_rows(
    original: Callable[..., Any], pool: DecodeReqToTokenPool, req: Req, *args: Any, **kwargs: Any
) -> None:
    """``DecodeReqToTokenPool.free``: after SGLang frees ``req``'s row, ``decode_queue.row_freed``."""
    from sglang_oasis.disaggregation.decode_queue import row_freed

    row = getattr(getattr(req, "kv", None), "req_pool_idx", None)
    result = original(pool, req, *args, **kwargs)
    row_freed(pool, row, req)
    return result


def complete_before_backup(
    original: Callable[..., Any], req: Req, tree_cache: BasePrefixCache, req_to_token_pool: ReqToTokenPool,
    *args: Any, **kwargs: Any,
) -> bool:  # fmt: skip
    """``backup_kv_cache``: a retracted request's still-remote blocks are read before its KV is backed up
    (``decode_queue.whole_before_backup``; False, SGLang aborts the request, when they cannot be). Then the
    backend keeps the request's selection state for its resume (``retraction.keep_retracted``)."""
    from sglang_oasis.attention.retraction import keep_retracted
    from sglang_oasis.disaggregation.decode_queue import whole_before_backup

    if not whole_before_backup(req_to_token_pool, req):
        return False
    saved = original(req, tree_cache, req_to_token_pool, *args, **kwargs)
    if saved:
        keep_retracted(req_to_token_pool, req, backed_up=True)
    return saved


def keep_before_release(original: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """``release_req`` (keyword arguments only): a request released unfinished is being retracted; the
    backend keeps its selection state first (a PD decode node keeps only backed-up ones, hook 7: the
    others are sent again by the prefill node)."""
    req, pool = kwargs.get("req"), kwargs.get("req_to_token_pool")
    if req is not None and pool is not None and not req.finished():
        from sglang_oasis.attention.retraction import keep_retracted

        keep_retracted(pool, req, backed_up=False)
    return original(*args, **kwargs)


def carry_request_params(
    original: Callable[..., Any], cls: type[ForwardBatch], batch: ScheduleBatch, *args: Any, **kwargs: Any
) -> ForwardBatch:
    """``ForwardBatch.init_new`` (hook 9): note each request's ``custom_params`` by rid for the attention
    backend (``request_options.note_requests``), and the key its retraction was kept by, if any, before
    the forward batch it is about to run is built."""
    reqs = getattr(batch, "reqs", None)
    if reqs is not None:
        note_requests({
            str(r.rid): NotedRequest(getattr(r.sampling_params, "custom_params", None), getattr(r, RETRACTION_KEY, None))
            for r in reqs
        })  # fmt: skip
    return original(cls, batch, *args, **kwargs)


def report_request_figures(
    original: Callable[..., Any], scheduler: Scheduler, *args: Any, **kwargs: Any
) -> type[SchedulerOutputStreamer]:
    """``Scheduler.get_output_streamer_class`` (hook 10): SGLang's output streamer class, extended to
    send each finished request's figures (``request_ledger.streamer_with_figures``)."""
    base = original(scheduler, *args, **kwargs)
    if getattr(scheduler, "rust_server", None) is not None:
        return base  # the Rust egress takes no additional fields (SGLang refuses them at start-up)
    from sglang_oasis.request_ledger import streamer_with_figures

    return streamer_with_figures(
        base, scheduler, lambda: getattr(getattr(_backend(scheduler), "stats", None), "requests", None)
    )


def check_request_options(
    config: OasisConfig, original: Callable[..., Any], params: SamplingParams, *args: Any, **kwargs: Any
) -> None:
    """``SamplingParams.verify`` (hook 12): SGLang's checks, then the request's ``oasis_*`` options; a
    ``ValueError`` (HTTP 400) names what is wrong."""
    result = original(params, *args, **kwargs)
    check(getattr(params, "custom_params", None), config, disaggregated())
    return result


def ask_backend_to_replay(
    original: Callable[..., bool], runner: DecodeCudaGraphRunner, forward_batch: ForwardBatch
) -> bool:
    """AROUND hook 14: SGLang's checks, then (if they pass) the attention backend's ``graph_ready``."""
    if not original(runner, forward_batch):
        return False
    ready = getattr(getattr(runner, "attn_backend", None), "graph_ready", None)
    return True if ready is None else bool(ready(forward_batch))


def register(config: OasisConfig) -> None:
    """Register the hooks this configuration needs (SGLang applies them after all plugins load)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if config.mode != "sparse":
        return
    HookRegistry.register(DRAFT_EXTEND_TARGET, draft_extend_backend, HookType.AROUND)
    HookRegistry.register(LAST_LOC_TARGET, last_loc_on_cpu, HookType.AROUND)
    HookRegistry.register(PROCESS_RESULT_TARGET, abort_failed_transfers, HookType.AROUND)
    if config.prefill_window:
        HookRegistry.register(
            PREFIX_LIMIT_TARGET, functools.partial(cap_prefix_match, config.prefill_window), HookType.AROUND
        )
    if config.lookahead != "previous" and config.draft_policy == "reject":
        HookRegistry.register(VERIFY_GREEDY_TARGET, reject_drafts, HookType.AROUND)
    if config.remote_fetch:
        HookRegistry.register(PREFILL_SEND_TARGET, mark_staged_send, HookType.AROUND)
        HookRegistry.register(SEND_INDICES_TARGET, send_last_page_only, HookType.AROUND)
        HookRegistry.register(BOOTSTRAP_ROUTES_TARGET, remote_fetch_routes, HookType.AROUND)
        HookRegistry.register(PEER_REGISTRATION_TARGET, forget_reregistered_sessions, HookType.AROUND)
        HookRegistry.register(DECODE_POLLERS_TARGET, wait_for_admissions, HookType.AROUND)
        HookRegistry.register(DECODE_COMMIT_TARGET, fetch_admission_blocks, HookType.AROUND)
        HookRegistry.register(DECODE_FREE_TARGET, release_freed_rows, HookType.AROUND)
    HookRegistry.register(BACKUP_TARGET, complete_before_backup, HookType.AROUND)  # PD decode only
    HookRegistry.register(RELEASE_TARGET, keep_before_release, HookType.AROUND)
    HookRegistry.register(FORWARD_BATCH_TARGET, carry_request_params, HookType.AROUND)
    HookRegistry.register(STREAMER_TARGET, report_request_figures, HookType.AROUND)
    HookRegistry.register(
        VERIFY_PARAMS_TARGET, functools.partial(check_request_options, config), HookType.AROUND
    )
    # the host tier on CUDA (the hooks leave a CPU engine's pools alone)
    from sglang_oasis.memory.host_kv_pool import GpuKVBytes, build_pool, host_tier_bytes

    measured = GpuKVBytes()
    HookRegistry.register(POOL_BUILD_TARGET, functools.partial(build_pool, measured), HookType.AROUND)
    HookRegistry.register(
        POOL_BUDGET_TARGET, functools.partial(host_tier_bytes, config, measured), HookType.AROUND
    )
    if config.cuda_untested:  # CUDA graphs: only the CUDA path replays them
        HookRegistry.register(GRAPH_RUN_TARGET, ask_backend_to_replay, HookType.AROUND)


def without_nccl(original: Callable[..., object], *args: Any, **kwargs: Any) -> object:
    """AROUND hook 13 (CPU engine): every model-parallel group is built without a PyNccl communicator."""
    kwargs["use_pynccl"] = False
    return original(*args, **kwargs)


def register_cpu_engine() -> None:
    """Hook 13, in every mode (call only on the CPU engine)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(PARALLEL_GROUP_TARGET, without_nccl, HookType.AROUND)


def patch_cpu_disaggregation() -> None:
    """Hook 6: PD disaggregation's prefill side on the CPU engine (call only there)."""
    import importlib
    import os

    os.environ.setdefault(EARLY_SEND_ENV, "0")
    module_name, class_name = MOONCAKE_SENDER_TARGET.rsplit(".", 1)
    try:
        sender = getattr(importlib.import_module(module_name), class_name)
    except ImportError:  # no Mooncake build installed: SGLang refuses the mooncake backend itself
        return
    if not hasattr(sender, HOST_INDICES_ATTRIBUTE):
        raise RuntimeError(f"{MOONCAKE_SENDER_TARGET}.{HOST_INDICES_ATTRIBUTE} is gone: re-check hook 6")
    setattr(sender, HOST_INDICES_ATTRIBUTE, False)
