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
   Under tensor parallelism each rank's backend sees only its own KV heads' transfers: the ranks first
   all-reduce which in-flight requests failed (``agree_on_failures``, one small all-reduce per batch
   result), so all abort the same ones. First, on CUDA, a decode graph replay of this batch has its
   counts folded (the backend's ``settle``): a request finishing here then reports its own figures.
5. ``Req._compute_max_prefix_len`` (sparse mode with ``--oasis-prefill-window`` N > 0): the prefill
   window chooses a request's first working set from the exact attention of its prompt's last N
   queries, and those queries exist only for tokens the extend computes. A radix-cache hit that leaves
   one new token would make the first working set (and so the greedy output) depend on what the cache
   held, i.e. on other requests. The hook caps the prefix match at the prompt length minus N, so every
   extend computes at least the window's tokens (at most N + one page more than SGLang would).
6. PD disaggregation on the CPU engine (``patch_cpu_disaggregation``, not a HookRegistry hook: a class
   attribute and an environment default, applied in every server process by the plugin). Two places on
   the prefill side assume CUDA: ``MooncakeKVSender.supports_host_tensor_indices`` makes
   ``_send_kv_chunk`` stage page indices in pinned memory behind a ``torch.cuda.Event`` ("Found no
   NVIDIA driver"), and the early send of a radix-cached prefix records a ``torch.cuda.Event`` on the
   forward stream (not a ``torch.Stream`` on CPU). On the CPU engine the first is turned off (the
   indices are host tensors already) and so is the second
   (``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0``; the regular send then carries the prefix).
7. Remote partial fetching under PD disaggregation (``disaggregation/__init__.py``; sparse mode with
   ``--oasis-remote-fetch``). SGLang's KV sender has no notion of a partial payload, so these places:
   - ``SchedulerDisaggregationPrefillMixin.send_kv_chunk`` (prefill): the only place that knows a
     send's request (its slot, prompt length and the decode node's cached prefix); the hook hands them
     to the request's Mooncake sender.
   - ``CommonKVSender._prepare_send_indices`` (prefill): where every send's pages are decided. For a
     staged request, chunks before the last send nothing; the last stages the whole prompt's KV
     (``PrefillStager.stage``) and sends only the request's last page, so SGLang's protocol (aux data,
     completion, failure handling) runs unchanged. A staging failure fails the request's transfer.
   - ``CommonKVBootstrapServer._setup_routes`` (prefill's HTTP process): adds ``GET/PUT
     /oasis/remote_fetch_endpoint``, where the prefill scheduler registers its hand-off URL and decode
     nodes look it up (decode nodes know a request's bootstrap address, nothing else of the prefill).
   - ``DecodeTransferQueue._pollers`` (decode): a request whose SGLang transfer has completed polls
     ``Transferring`` until its admission blocks are read (hand-off and Mooncake reads on an admission
     worker, ``DecodeFetcher.admission_done``), so no network I/O runs on the scheduler thread and the
     running requests decode meanwhile (SGLang wraps its pollers the same way for HiCache restores).
     A failed admission polls ``Failed`` (its reason recorded as the transfer's): SGLang's queue takes
     the lowest poll over the tensor-parallel ranks, so every rank fails the request at that poll.
   - ``DecodeTransferQueue._commit_transfer_to_req`` (decode): after SGLang commits a transferred
     request, its admission is applied (``DecodeFetcher.admit``); a failure aborts the request
     the way SGLang aborts a corrupted transfer. With the decode radix cache on, an admitted request's
     still-remote blocks are then read in the background (``DecodeFetcher.complete_later``), and the
     queue's tree cache's ``checkpoint`` (which inserts a request's KV as it starts decoding and when it
     finishes) is wrapped on that instance so only KV that is whole locally becomes a shared prefix (a
     request whose blocks are still arriving is not inserted; nothing is read on the scheduler thread;
     under tensor parallelism whole on every rank, ``DecodeFetcher.on_every_rank``).
   A request over ``--oasis-remote-fetch-max-staged-mib`` goes whole (SGLang's own transfer); its
   hand-off then carries only its first selection, which the decode node loads from the KV that arrived.
   A prefill node stages only for a decode node that fetches: one that has asked it for a hand-off,
   naming its SGLang transfer session (the handshake); any other decode node (plain SGLang, dense mode,
   ``--oasis-remote-fetch false``, fetching off) and each fetching one's first requests get them whole.
   - ``MooncakeKVManager._publish_peer_registration`` (prefill): where a decode node's transfer session
     registers with this prefill node, once per decode process. A session that registers again is a new
     process (perhaps a restarted node that does not fetch, at the same address), so the stager forgets
     it (``PrefillStager.forget``) until it asks for a hand-off itself.
   - ``DecodeReqToTokenPool.free`` (decode): where SGLang frees a finished (or aborted) request's row,
     the one moment the decode node knows a request is done with its remote blocks; SGLang has no
     release callback (only ``register_on_alloc_rows``). The hook tells the pool's listener
     (``DecodeFetcher.release_slot``, set on the pool instance by the oasis backend) which row it freed,
     so the prefill node's staging is released from the request's own lifecycle, not by polling. With
     the row goes the request's bootstrap address: a request that fails (on another tensor-parallel
     rank: the ranks' polls are all-reduced) or is aborted before its admission began here has no
     record of its room, and is released by that address.
   - ``mem_cache.common.backup_kv_cache`` (decode retraction): SGLang backs up a retracted request's
     local pool pages and later resumes it in a new row; blocks still on the prefill node would be
     missing (zeros) after the resume, and its KV could enter the radix cache so. The hook first reads
     them (``DecodeFetcher.complete``, the pool's ``oasis_before_backup``), so the backup is whole; if
     that read fails it answers False, SGLang's "cannot be backed up", and SGLang aborts the request.
     After a backup (with or without remote fetching) it hands the request's rid to the backend (the
     pool's ``oasis_on_retract``), which keeps its selection state for the resume
     (``attention/retraction.py``): SGLang has no retraction callback.
8. ``schedule_batch.release_req`` (sparse mode): where SGLang releases a running request it retracts
   (outside PD decode it is re-prefilled later with its output in the prompt); SGLang has no
   retraction callback. The hook hands the unfinished request's rid to the backend first, as hook 7's
   backup does, so the re-prefill continues on the request's path (``attention/retraction.py``; a PD
   decode node keeps only what hook 7 reports backed up).
9. ``ForwardBatch.init_new`` (sparse mode): a request may set its own top-K and recall target in its
   ``custom_params`` (``attention/request_options.py``), but SGLang hands the attention backend the
   forward batch only, which carries no sampling parameters (``SamplingBatchInfo.custom_params`` is
   filled only with custom logit processors enabled). The hook notes each request's ``custom_params`` by
   rid as the forward batch is built; the backend looks its batch's rids up (the batch it is handed is
   a copy of the one built here, so an attribute set on it would not reach it). Nothing else changes.
10. ``Scheduler.get_output_streamer_class`` (sparse mode): each request's own decode figures
   (``attention/request_ledger.py``: steps, blocks and bytes read from the host tier, sampled recall)
   should reach its client, and SGLang's way to add per-request output fields is a subclass of its
   output streamer with ``has_additional_customized_info`` (the scheduler's method picks the class; no
   registry). The hook returns SGLang's class extended so: a finished request's figures go out as
   ``meta_info["oasis"] = [figures]`` (``/generate``; an unfinished one's chunks carry ``[]``; under
   tensor parallelism summed over the ranks, ``sum_over_ranks``: every rank's streamer runs). With
   SGLang's Rust egress (which refuses additional fields) the class is left as it is.
11. ``TorchNativeAttnBackend._run_sdpa_forward_extend`` (sparse mode; not a hook: the oasis backend
   subclasses SGLang's torch_native backend and overrides the method, ``attention/extend_attention.py``):
   it computes an extend's attention over every row of the sequence, cached prefix included, and keeps
   the new ones; the override computes only from the block of rows before them, bitwise the same.
   ``test_sglang_hooks.py`` checks the method's parameters and that SGLang's ``forward_extend`` calls it.
12. ``SamplingParams.verify`` (sparse mode): a request's ``oasis_*`` options are read in the scheduler
   (hook 9), where a bad one could only fail the request with a 500 (and, before, a ``custom_params``
   that was not a dict raised there and took the server down). SGLang checks a request's sampling
   parameters in the tokenizer manager and answers a ``ValueError`` from ``verify`` with HTTP 400 before
   anything is queued; it has no validator registry for ``custom_params``. The hook runs SGLang's
   checks, then ``request_options.check`` (a ``custom_params`` that is not a JSON object, unknown
   ``oasis_*`` keys, bad types and ranges, PD), raising its ``ValueError`` naming the key.
13. ``parallel_state.init_model_parallel_group`` (CPU engine, every mode; ``register_cpu_engine``): with
   ``--tp-size`` above 1 SGLang builds each model-parallel group with a PyNccl communicator unless the
   platform is an out-of-tree one that declares no NCCL; the CPU platform is in-tree, so on a CPU engine
   whose torch is a CUDA build (ours: NCCL's library loads) every rank died in ``PyNcclCommunicator``
   ("Expected a cuda device, but got: cpu"). The hook passes ``use_pynccl=False`` on the CPU engine; the
   groups all-reduce CPU tensors over their gloo process group (or SGLang's shared-memory all-reduce
   where its CPU kernels have it), which is what SGLang's CPU path does once NCCL is out of the way.
14. ``DecodeCudaGraphRunner.can_run_graph`` (sparse mode with ``--oasis-cuda-untested``): SGLang replays a captured decode graph for every
   decode pass whose batch fits one, asking the attention backend nothing; the oasis step must run some
   passes eagerly (admissions, recall samples: ``attention/graph_hooks.py``). The hook answers SGLang's
   checks and then the backend's ``graph_ready`` (which begins and plans the pass); backends without one
   are not asked. Written for CUDA and never run on a GPU.
15. ``KVCacheConfigurator._build_mha_kv_pool`` (sparse mode, the target model on CUDA): SGLang allocates
   its KV pool on the GPU and has no option to put it in host memory (its HiSparse/HiCache host pools
   are copies beside a device pool). In sparse mode that pool is the host tier, so the hook hands SGLang's
   builder our pool class (``memory/host_kv_pool.py``: SGLang's ``MHATokenToKVPool`` whose buffers are
   page-locked host memory seen through CUDA views) in place of its own; SGLang's kernels then write and
   read the host tier in place, and none of it is ever allocated on the GPU. Any other pool class SGLang
   chose (HND, quantized, sharded) is refused by name. The draft model's pool stays SGLang's, on the GPU.
16. ``KVCacheConfigurator._profile_available_bytes`` (same): SGLang sizes its KV pool by the GPU memory
   free after the weights. The host tier's size is host RAM's: the hook returns
   ``--oasis-host-memory-fraction`` of the host RAM available (all of it when ``--oasis-host-kv-tokens``
   is given: SGLang's ``--max-total-tokens`` cap, which the launcher sets from it, takes it down), and
   keeps what SGLang measured (``GpuKVBytes``, shared by the two hooks) for hook 15 to hand the pool:
   the GPU memory SGLang would have given its pool is the device tier's budget.
   Hooks 15 and 16 have never run on a GPU; ``test/unit/test_fake_cuda.py`` runs them on a fake CUDA
   device with SGLang's own configurator methods.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Callable
from dataclasses import astuple
from typing import TYPE_CHECKING, Any, Protocol, cast

from sglang_oasis.attention.request_options import NotedRequest, check, note_requests
from sglang_oasis.config import OasisConfig
from sglang_oasis.sglang_contract import (  # the names the backend and the hooks share
    BACKEND_NAME,
    BEFORE_BACKUP_LISTENER,
    FIGURES_KEY,
    FREED_ROW_LISTENER,
    RETRACT_LISTENER,
    RETRACTION_KEY,
    STAGER_ATTRIBUTE,
)

if TYPE_CHECKING:  # SGLang's own types, for mypy (the hooks are checked against SGLang's signatures)
    import numpy as np
    import numpy.typing as npt
    import torch
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, CommonKVSender
    from sglang.srt.disaggregation.decode import DecodeReqToTokenPool, DecodeRequest, DecodeTransferQueue
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.memory_pool import KVCache, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    from sglang_oasis.attention.request_ledger import RequestFigures
    from sglang_oasis.disaggregation.decode_fetcher import DecodeFetcher
    from sglang_oasis.disaggregation.prefill_stager import PrefillStager

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
    """AROUND hook: abort the in-flight requests whose working-set transfers failed (on any tensor-parallel
    rank: ``agree_on_failures``), then process the batch's result as usual."""
    backend = getattr(getattr(scheduler.tp_worker, "model_runner", None), "attn_backend", None)
    settle = getattr(backend, "settle", None)  # a CUDA graph replay of this batch: its figures first
    if settle is not None:
        settle(
            {
                int(req.kv.req_pool_idx)
                for req in getattr(batch, "reqs", [])
                if req.kv.req_pool_idx is not None
            }
        )
    failures = getattr(backend, "failures", None)  # attention/transfer_failures.py
    ranks = int(getattr(scheduler, "tp_size", 1))
    if failures is not None and (failures or ranks > 1):
        from http import HTTPStatus

        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        # SGLang declares the scheduler's pool ``object`` (mem_cache/kv_cache_builder.py); it is this one
        generations = cast("ReqToTokenPool", scheduler.req_to_token_pool).req_generation
        # With the overlap scheduler the failing request may belong to the batch before this one.
        # Sorted by rid: every rank then lists them in the same order (SGLang collects them in a set).
        found = {id(req): req for req in [*scheduler.collect_inflight_reqs(), *getattr(batch, "reqs", [])]}
        inflight = sorted(found.values(), key=lambda req: str(req.rid))
        messages: list[str | None] = []
        for req in inflight:
            slot = req.kv.req_pool_idx
            live = slot is not None and not req.finished() and req.to_finish is None
            messages.append(failures.take(int(slot), int(generations[slot])) if live else None)
        failed_on = (
            agree_on_failures(scheduler, messages) if ranks > 1 else [int(m is not None) for m in messages]
        )
        for req, message, on in zip(inflight, messages, failed_on, strict=True):
            if not on or req.finished() or req.to_finish is not None:
                continue
            if message is None:  # it failed on other ranks only: one error, the same on every rank
                names = ", ".join(str(rank) for rank in range(ranks) if on >> rank & 1)
                message = f"oasis: a block transfer failed on tensor-parallel rank {names}"
            req.skip_radix_cache_insert = True  # its KV may be incomplete: never share it
            req.to_finish = FINISH_ABORT(message, HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
    return original(scheduler, batch, *args, **kwargs)


def agree_on_failures(scheduler: Scheduler, messages: list[str | None]) -> list[int]:
    """Under tensor parallelism, which ranks failed each in-flight request (a bit per rank): one small
    all-reduce over the ranks' CPU group per batch result, so every rank aborts the same requests at the
    same step (a rank that went on decoding a request another dropped would desynchronise the ranks'
    batches). Every rank lists the same in-flight requests (the schedulers decide alike) in rid order.

    The tensor has the same length on every rank whatever each lists (so the collective itself never
    mismatches): room for the running and the last batch's requests, each holding a request row, after
    the count and its square, whose sums tell whether every rank listed as many (logged if not)."""
    import torch
    import torch.distributed as dist

    group = scheduler.tp_cpu_group
    room = 2 * int(cast("ReqToTokenPool", scheduler.req_to_token_pool).size) + 2
    count, bit = len(messages), 1 << dist.get_rank(group=group)
    flags = torch.zeros(2 + room, dtype=torch.int64)
    flags[0], flags[1] = count, count * count
    for i, message in enumerate(messages[:room]):
        flags[2 + i] = bit if message is not None else 0
    dist.all_reduce(flags, group=group)
    ranks = dist.get_world_size(group=group)
    if int(flags[0]) != ranks * count or int(flags[1]) != ranks * count * count or count > room:
        logger.error("oasis: tensor-parallel ranks list different in-flight requests (%d here)", count)
    return [*flags[2 : 2 + count].tolist(), *([0] * max(0, count - room))]


def _backend(scheduler: Scheduler) -> AttentionBackend | None:
    return getattr(getattr(getattr(scheduler, "tp_worker", None), "model_runner", None), "attn_backend", None)


def _pd_part(scheduler: Scheduler, name: str) -> object:
    """The oasis backend's PD stager (``"stager"``) or fetcher (``"remote"``); None on any other node."""
    return getattr(getattr(_backend(scheduler), "pd", None), name, None)


def _stager(scheduler: Scheduler) -> PrefillStager | None:
    return cast("PrefillStager | None", _pd_part(scheduler, "stager"))


def _fetcher(scheduler: Scheduler) -> DecodeFetcher | None:
    return cast("DecodeFetcher | None", _pd_part(scheduler, "remote"))


def mark_staged_send(
    original: Callable[..., None], scheduler: Scheduler, req: Req, last_chunk: bool = False,
    end_idx: int | None = None,
) -> None:  # fmt: skip
    """AROUND hook (prefill): a request sent by remote partial fetching carries, on its Mooncake sender,
    the stager and (last chunk) what to stage."""
    stager = _stager(scheduler)
    sender: Any = getattr(req, "disagg_kv_sender", None)  # carries our _oasis_* attributes
    if stager is not None and stager.ready.is_set() and _is_mooncake_sender(sender):
        whole = getattr(sender, "_oasis_whole", False)  # decided at its first send
        if not whole and getattr(sender, STAGER_ATTRIBUTE, None) is None:
            # The handshake: only a decode node known to fetch gets a partial payload (its first
            # requests go whole; their hand-off GET names its session).
            sessions = sender.kv_mgr.transfer_infos.get(int(sender.bootstrap_room), {})
            if not stager.fetch(sessions):
                whole = sender._oasis_whole = True
                stager.backend.stats.add("staging_unknown_decoder_sends")
            elif not stager.reserve(int(sender.bootstrap_room), len(req.origin_input_ids)):
                whole = sender._oasis_whole = True  # staging it would pass the cap: SGLang sends it all
                stager.backend.stats.add("staging_whole_sends")
                logger.warning(
                    "oasis: staging is full (--oasis-remote-fetch-max-staged-mib); request %s goes whole",
                    req.rid,
                )
        if not whole:
            setattr(sender, STAGER_ATTRIBUTE, stager)
        setattr(sender.kv_mgr, STAGER_ATTRIBUTE, stager)  # for forget_reregistered_sessions
        if last_chunk:
            prompt = len(req.origin_input_ids)
            extend_end = prompt if req.extend_end is None else req.extend_end
            tokens = end_idx if end_idx is not None else min(extend_end, prompt)
            stage = (int(cast(int, req.kv.req_pool_idx)), int(tokens), int(req.disagg_decode_prefix_len))
            if not whole:
                sender._oasis_stage = stage
            else:  # the decode node asks for its hand-off all the same: its first selection
                try:
                    stager.hand_over_whole(int(sender.bootstrap_room), *stage)
                except Exception:  # the decode node then fails the request, naming the missing hand-off
                    logger.exception("oasis: handing over request %s's first selection failed", req.rid)
    original(scheduler, req, last_chunk=last_chunk, end_idx=end_idx)


def forget_reregistered_sessions(
    original: Callable[..., str | None],
    kv_mgr: MooncakeKVManager,
    mooncake_session_id: str,
    *args: Any,
    **kwargs: Any,
) -> str | None:
    """AROUND hook (prefill): after SGLang records a decode session's registration, this node's stager
    (if it has been used) stages for that session only once it asks for a hand-off again."""
    result = original(kv_mgr, mooncake_session_id, *args, **kwargs)
    stager: PrefillStager | None = getattr(kv_mgr, STAGER_ATTRIBUTE, None)
    if stager is not None:
        stager.forget(str(mooncake_session_id))
    return result


def _is_mooncake_sender(sender: object) -> bool:
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    return isinstance(sender, MooncakeKVSender)


SendIndices = tuple["npt.NDArray[np.int32]", slice, bool, bool]


def send_last_page_only(
    original: Callable[..., SendIndices], sender: CommonKVSender, kv_indices: npt.NDArray[np.int32],
    *args: Any, **kwargs: Any,
) -> SendIndices:  # fmt: skip
    """AROUND hook (prefill): a staged request's chunks send nothing but its last page (see hook 7)."""
    kv_indices, index_slice, is_last, skip = original(sender, kv_indices, *args, **kwargs)
    stager: PrefillStager | None = getattr(sender, STAGER_ATTRIBUTE, None)
    if skip or stager is None:
        return kv_indices, index_slice, is_last, skip
    if len(kv_indices):
        sender._oasis_last_page = kv_indices[-1]  # type: ignore[attr-defined]  # ours, on SGLang's sender
    if not is_last:
        return kv_indices[:0], slice(index_slice.stop, index_slice.stop), is_last, False
    room = int(sender.bootstrap_room)
    try:
        stager.stage(room, *getattr(sender, "_oasis_stage"))  # noqa: B009  # ours, on SGLang's sender
        last = getattr(sender, "_oasis_last_page")  # noqa: B009
    except Exception as error:  # the request fails, the server goes on
        from sglang.srt.disaggregation.base.conn import KVPoll

        logger.exception("oasis: staging bootstrap room %d failed", room)
        sender.kv_mgr.record_failure(
            room, f"oasis: staging the KV for remote partial fetching failed: {error}"
        )
        sender.kv_mgr.update_status(room, cast("KVPoll", KVPoll.Failed))  # SGLang's KVPoll: a class of ints
        return kv_indices[:0], index_slice, is_last, True
    end = index_slice.stop
    return _one_page(kv_indices, last), slice(end - 1, end), True, False


def _one_page(kv_indices: npt.NDArray[np.int32], page: int) -> npt.NDArray[np.int32]:
    import numpy as np

    return np.asarray([page], dtype=np.asarray(kv_indices).dtype)


def remote_fetch_routes(original: Callable[..., None], server: CommonKVBootstrapServer) -> None:
    """AROUND hook (prefill bootstrap server): ``/oasis/remote_fetch_endpoint`` (see hook 7)."""
    from aiohttp import web

    from sglang_oasis.disaggregation.side_channel import ENDPOINT_ROUTE, TOKEN_HEADER, authorized

    original(server)
    endpoints: dict[int, dict[str, object]] = {}  # engine (tensor-parallel) rank -> its URL, --tp-size

    async def handle(request: web.Request) -> web.Response:
        if not authorized(request.headers, request.remote):  # the URL hands out staged KV
            return web.json_response(
                {"error": f"forbidden: this deployment needs its {TOKEN_HEADER}"}, status=403
            )
        if request.method == "PUT":
            data = await request.json()
            endpoints[int(data["engine_rank"])] = {
                "url": str(data["url"]),
                "tp_size": int(data.get("tp_size", 1)),
            }
            return web.json_response({})
        endpoint = endpoints.get(int(request.query.get("engine_rank", 0)))
        if endpoint is None:
            return web.json_response({"error": "this prefill node does not stage KV"}, status=404)
        return web.json_response(endpoint)

    server.app.router.add_route("*", ENDPOINT_ROUTE, handle)


def wait_for_admissions(original: Callable[..., list[_Poller]], queue: DecodeTransferQueue) -> list[_Poller]:
    """AROUND hook (decode): SGLang polls each transferring request through these pollers; a request
    whose own transfer has completed stays ``Transferring`` until its admission (hand-off and Mooncake
    reads, on ``DecodeFetcher``'s admission worker) is over, so the scheduler thread never waits on the
    network while the running requests decode."""
    pollers = original(queue)  # SGLang's receivers, or wrappers of them: anything with poll()
    remote = _fetcher(queue.scheduler)
    if remote is None:
        return pollers
    generations = cast("ReqToTokenPool", queue.scheduler.req_to_token_pool).req_generation
    return [
        _AdmissionGate(poller, entry, remote, generations)
        for poller, entry in zip(pollers, queue.queue, strict=True)
    ]


class _Poller(Protocol):
    """What SGLang's transfer queue polls: a KV receiver, or a wrapper of one (HiCache's, ours)."""

    def poll(self) -> int: ...  # a KVPoll value


class _AdmissionGate:
    """A request's poller whose ``Success`` waits for its admission (``wait_for_admissions``)."""

    def __init__(
        self, poller: _Poller, decode_req: DecodeRequest, remote: DecodeFetcher, generations: torch.Tensor
    ) -> None:
        self.poller, self.req, self.remote, self.generations = poller, decode_req.req, remote, generations
        self.session = _session(decode_req)
        self.kv_mgr = getattr(decode_req.kv_receiver, "kv_mgr", None)

    def poll(self) -> int:  # a KVPoll value
        from sglang.srt.disaggregation.base.conn import KVPoll

        from sglang_oasis.disaggregation.decode_admission import Origin

        state = int(self.poller.poll())
        arrival = _arrival(self.req) if state == KVPoll.Success else None
        if arrival is None:
            return state
        slot, host, port, room = arrival
        generation = int(self.generations[slot])
        if not self.remote.admission_done(slot, generation, Origin(host, port, room, self.session)):
            return int(KVPoll.Transferring)
        error = self.remote.admission_error(slot, generation)
        if error is None:
            return state
        # A failed admission is a failed transfer: SGLang's queue all-reduces the polls over the
        # tensor-parallel ranks (the lowest wins), so every rank fails the request at this poll, with
        # this rank's message (the others': SGLang's "from another rank"), instead of one rank aborting
        # it at its commit while the others decode it.
        if self.kv_mgr is not None:
            self.kv_mgr.record_failure(room, error)
        return int(KVPoll.Failed)


def _session(decode_req: DecodeRequest) -> str | None:
    """This node's SGLang transfer session, which the prefill node sees as the request's destination."""
    kv_mgr = getattr(decode_req.kv_receiver, "kv_mgr", None)
    return None if kv_mgr is None else str(kv_mgr.get_session_id())


def _arrival(req: Req) -> tuple[int, str, int, int] | None:
    """``(request slot, bootstrap host, port, room)`` of a transferred request that remote fetching
    admits (a real PD arrival, not aborted); None for any other."""
    slot, address = req.kv.req_pool_idx, _bootstrap(req)
    if req.finished() or slot is None or address is None:
        return None
    return (int(cast(int, slot)), *address)


def _bootstrap(req: Req) -> tuple[str, int, int] | None:
    """``(bootstrap host, port, room)`` of a request a real prefill node sent; None for any other."""
    host, port, room = req.bootstrap_host, req.bootstrap_port, req.bootstrap_room
    if None in (host, port, room) or host == _fake_bootstrap_host():
        return None
    return str(host), int(cast(int, port)), int(cast(int, room))


def fetch_admission_blocks(
    original: Callable[..., None], queue: DecodeTransferQueue, decode_req: DecodeRequest
) -> None:
    """AROUND hook (decode): after SGLang commits a transferred request, admit it with what its first
    working sets need from the prefill node (read by then: ``wait_for_admissions``; see hook 7)."""
    original(queue, decode_req)
    remote = _fetcher(queue.scheduler)
    req = decode_req.req
    arrival = None if remote is None else _arrival(req)
    if remote is None or arrival is None:  # no fetching here: the prefill node sent it whole
        return
    from sglang_oasis.disaggregation.decode_admission import Origin
    from sglang_oasis.disaggregation.side_channel import RemoteFetchError

    slot, host, port, room = arrival
    generation = int(cast("ReqToTokenPool", queue.scheduler.req_to_token_pool).req_generation[slot])
    from sglang.srt.runtime_context import get_disagg

    sharing = bool(get_disagg().disaggregation_decode_enable_radix_cache)
    if sharing:  # at the first arrival, on every rank alike (its checkpoint agrees over the ranks)
        _share_only_whole(queue.tree_cache, remote)
    try:
        staged = remote.admit(slot, generation, Origin(host, port, room, _session(decode_req)))
    except Exception as error:  # the request fails, the server goes on
        if not isinstance(error, RemoteFetchError):
            logger.exception("oasis: admitting request %s failed", req.rid)
        from http import HTTPStatus

        from sglang.srt.disaggregation.utils import prepare_abort

        req.skip_radix_cache_insert = True
        prepare_abort(
            req,
            f"oasis: remote partial fetching failed ({error})",
            status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
        )
        return
    if staged and sharing:
        remote.complete_later(slot)


def _fake_bootstrap_host() -> str | None:
    try:
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
    except ImportError:
        return None
    return str(FAKE_BOOTSTRAP_HOST)


def _share_only_whole(tree_cache: BasePrefixCache, remote: DecodeFetcher) -> None:
    """Wrap this tree cache's ``checkpoint`` (once) so a finishing request's KV is inserted only if it is
    whole locally (its remaining blocks read in the background by then); it never reads."""
    if getattr(tree_cache, "_oasis_wrapped", False):
        return
    checkpoint = tree_cache.checkpoint

    def checkpoint_complete(req: Req, *args: Any, **kwargs: Any) -> object:
        slot = req.kv.req_pool_idx
        # Every tensor-parallel rank's cache inserts the same requests (each its own KV heads' blocks).
        if not remote.on_every_rank(slot is None or remote.whole(int(slot))):
            # Never share KV with blocks missing. SGLang checkpoints a request as it starts decoding too
            # (its prompt, ``process_prebuilt``); that one is skipped while the completion reads, and the
            # finish inserts the whole sequence.
            if req.finished():
                remote.backend.stats.add("remote_unshared_finishes")
            return None
        return checkpoint(req, *args, **kwargs)

    setattr(tree_cache, "checkpoint", checkpoint_complete)  # noqa: B010  # on this instance only
    setattr(tree_cache, "_oasis_wrapped", True)  # noqa: B010


def release_freed_rows(
    original: Callable[..., Any], pool: DecodeReqToTokenPool, req: Req, *args: Any, **kwargs: Any
) -> None:
    """``DecodeReqToTokenPool.free``: after SGLang frees ``req``'s row, tell the pool's listener the row
    and the request's bootstrap address (a request that failed or was aborted before its admission began
    here left no record of its room, yet its prefill node may have staged it)."""
    row = getattr(getattr(req, "kv", None), "req_pool_idx", None)
    result = original(pool, req, *args, **kwargs)
    listener = getattr(pool, FREED_ROW_LISTENER, None)
    if listener is not None and row is not None:
        try:
            listener(int(row), _bootstrap(req))
        except Exception:  # releasing remote staging is not worth the scheduler
            logger.exception("oasis: releasing request row %s's remote staging failed", row)
    return result


def complete_before_backup(
    original: Callable[..., Any],
    req: Req,
    tree_cache: BasePrefixCache,
    req_to_token_pool: ReqToTokenPool,
    *args: Any,
    **kwargs: Any,
) -> bool:
    """``backup_kv_cache``: a retracted request's still-remote blocks are read before its KV is backed
    up; False (SGLang aborts the request) when they cannot be. Then the backend keeps the request's
    selection state for its resume (``attention/retraction.py``)."""
    complete = getattr(req_to_token_pool, BEFORE_BACKUP_LISTENER, None)
    row = getattr(getattr(req, "kv", None), "req_pool_idx", None)
    if complete is not None and row is not None:
        try:
            whole = bool(complete(int(row)))
        except Exception:
            logger.exception("oasis: reading request %s's remote blocks before its backup failed", req.rid)
            whole = False
        if not whole:
            return False
    saved = original(req, tree_cache, req_to_token_pool, *args, **kwargs)
    if saved:
        _keep_retracted(req_to_token_pool, req, backed_up=True)
    return saved


def keep_before_release(original: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    """``release_req`` (keyword arguments only): a request released unfinished is being retracted; the
    backend keeps its selection state first (a PD decode node keeps only backed-up ones, hook 7: the
    others are sent again by the prefill node)."""
    req, pool = kwargs.get("req"), kwargs.get("req_to_token_pool")
    if req is not None and pool is not None and not req.finished():
        _keep_retracted(pool, req, backed_up=False)
    return original(*args, **kwargs)


def _keep_retracted(req_to_token_pool: ReqToTokenPool, req: Req, backed_up: bool) -> None:
    """Tell the pool's retraction listener (the oasis backend) that ``req`` is retracted: its row, a key
    stamped on the request object (hook 9 hands it to the backend when the request comes back; a new
    request reusing the rid has none), the tokens its resume will hold (prompt and output), and whether its
    KV was backed up."""
    keep = getattr(req_to_token_pool, RETRACT_LISTENER, None)
    row = getattr(getattr(req, "kv", None), "req_pool_idx", None)
    if keep is None or row is None:
        return
    # This request object's key, not its (client-chosen) rid; the same at every retraction of it: one
    # retracted again before it took a step (SGLang resumed it and retracted it at once) still finds
    # the state its first retraction kept.
    key = getattr(req, RETRACTION_KEY, None) or f"{req.rid}#{uuid.uuid4().hex[:16]}"
    setattr(req, RETRACTION_KEY, key)
    try:
        keep(int(row), key, len(req.origin_input_ids) + len(req.output_ids), backed_up)
    except Exception:  # it resumes with a new admission then, as without the hook
        logger.exception("oasis: keeping retracted request %s's selection state failed", req.rid)


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
    send each finished request's figures (``RequestLedger.take_figures``; under tensor parallelism summed
    over the ranks, ``sum_over_ranks``) with its last output."""
    base = original(scheduler, *args, **kwargs)
    if getattr(scheduler, "rust_server", None) is not None:
        return base  # the Rust egress takes no additional fields (SGLang refuses them at start-up)

    def build_additional_customized_info(
        streamer: SchedulerOutputStreamer, reqs: list[Req]
    ) -> dict[str, list]:
        ledger = getattr(getattr(_backend(scheduler), "stats", None), "requests", None)
        figures = [
            ledger.take_figures(str(req.rid)) if ledger is not None and req.finished() else None
            for req in reqs
        ]
        if int(getattr(scheduler, "tp_size", 1)) > 1 and any(req.finished() for req in reqs):
            figures = sum_over_ranks(scheduler, figures)
        return {FIGURES_KEY: [[] if entry is None else [entry.report()] for entry in figures]}

    namespace = {
        "__slots__": (),
        "has_additional_customized_info": True,
        "build_additional_customized_info": build_additional_customized_info,
    }
    return type("OasisOutputStreamer", (base,), namespace)


def sum_over_ranks(scheduler: Scheduler, figures: list[RequestFigures | None]) -> list[RequestFigures | None]:
    """Each request's figures summed over the tensor-parallel ranks (each rank loads its own KV heads'
    blocks): one all-reduce over the ranks' CPU group, which every rank's streamer makes for the same
    finished requests at the same step. A request with figures on no rank stays None."""
    import torch
    import torch.distributed as dist

    from sglang_oasis.attention.request_ledger import RequestFigures

    width = len(astuple(RequestFigures()))
    rows = torch.tensor(
        [[1.0, *astuple(entry)] if entry is not None else [0.0] * (width + 1) for entry in figures],
        dtype=torch.float64,
    ).reshape(len(figures), width + 1)
    dist.all_reduce(rows, group=scheduler.tp_cpu_group)
    out: list[RequestFigures | None] = []
    for present, *values in rows.tolist():
        if present == 0:
            out.append(None)
            continue
        summed = RequestFigures(*(type(v)(x) for v, x in zip(astuple(RequestFigures()), values, strict=True)))
        summed.decode_steps = round(summed.decode_steps / present)  # every rank counts the same steps
        out.append(summed)
    return out


def check_request_options(
    config: OasisConfig, original: Callable[..., Any], params: SamplingParams, *args: Any, **kwargs: Any
) -> None:
    """``SamplingParams.verify`` (hook 12): SGLang's checks, then the request's ``oasis_*`` options; a
    ``ValueError`` (HTTP 400) names what is wrong."""
    result = original(params, *args, **kwargs)
    check(getattr(params, "custom_params", None), config, _disaggregated())
    return result


def _disaggregated() -> bool:
    """Whether this server is either node of a PD pair (SGLang's runtime context, in any process)."""
    try:
        from sglang.srt.runtime_context import get_disagg

        return str(get_disagg().disaggregation_mode) in ("prefill", "decode")
    except Exception:  # no context published in this process: the scheduler checks again
        return False


def ask_backend_to_replay(
    original: Callable[..., bool], runner: DecodeCudaGraphRunner, forward_batch: ForwardBatch
) -> bool:
    """AROUND hook 14: SGLang's checks, then (if they pass) the attention backend's ``graph_ready``."""
    if not original(runner, forward_batch):
        return False
    ready = getattr(getattr(runner, "attn_backend", None), "graph_ready", None)
    return True if ready is None else bool(ready(forward_batch))


def _host_tier_here(configurator: KVCacheConfigurator) -> bool:
    """Whether the configurator builds the target model's KV pool on CUDA (the host tier, hooks 15 and 16)."""
    import torch

    return not configurator.is_draft_worker and torch.device(configurator.device).type == "cuda"


class GpuKVBytes:
    """What hook 16 measured for each configurator (by identity: SGLang's configurator has slots), until
    hook 15 hands it to the pool it builds. Owned by the two registered hooks (``register``)."""

    def __init__(self) -> None:
        self._bytes: dict[int, int] = {}

    def keep(self, configurator: KVCacheConfigurator, gpu_bytes: int) -> None:
        self._bytes[id(configurator)] = gpu_bytes

    def take(self, configurator: KVCacheConfigurator) -> int | None:
        return self._bytes.pop(id(configurator), None)


def host_tier_pool(
    measured: GpuKVBytes, original: Callable[..., KVCache], configurator: KVCacheConfigurator, *,
    max_total_num_tokens: int, mha_pool_class: type, quant_method: object | None = None,
) -> KVCache:  # fmt: skip
    """AROUND hook 15: the target model's KV pool on CUDA built as ``PinnedHostKVPool``."""
    if not _host_tier_here(configurator):
        return original(configurator, max_total_num_tokens=max_total_num_tokens, mha_pool_class=mha_pool_class,
                        quant_method=quant_method)  # fmt: skip
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_oasis.memory.host_kv_pool import PinnedHostKVPool

    if mha_pool_class is not MHATokenToKVPool or quant_method is not None:
        raise ValueError(
            f"oasis sparse mode keeps the KV pool in host memory and serves SGLang's plain MHA pool only; SGLang "
            f"chose {getattr(mha_pool_class, '__name__', mha_pool_class)} (quantized: {quant_method is not None})"
        )
    pool = original(configurator, max_total_num_tokens=max_total_num_tokens, mha_pool_class=PinnedHostKVPool)
    assert isinstance(pool, PinnedHostKVPool)
    pool.gpu_kv_bytes = measured.take(configurator)
    return pool


def host_tier_budget(
    config: OasisConfig, measured: GpuKVBytes, original: Callable[..., int], configurator: KVCacheConfigurator,
    pre_model_load_memory: int,
) -> int:  # fmt: skip
    """AROUND hook 16: the bytes SGLang sizes the target's KV pool by on CUDA: host RAM's share, not the
    GPU's (which is kept for the device tier)."""
    gpu_bytes = original(configurator, pre_model_load_memory)
    if not _host_tier_here(configurator):
        return gpu_bytes
    from sglang_oasis.memory.host_tier import available_host_memory

    measured.keep(configurator, gpu_bytes)
    available = available_host_memory()
    host_bytes = (
        available if config.host_kv_tokens is not None else int(config.host_memory_fraction * available)
    )
    logger.info(
        "oasis: the host KV tier is sized by host RAM (%.1f GiB of %.1f GiB available), not the GPU's %.1f GiB, "
        "which goes to the device tier", host_bytes / 2**30, available / 2**30, gpu_bytes / 2**30,
    )  # fmt: skip
    return host_bytes


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
    measured = GpuKVBytes()
    HookRegistry.register(POOL_BUILD_TARGET, functools.partial(host_tier_pool, measured), HookType.AROUND)
    HookRegistry.register(
        POOL_BUDGET_TARGET, functools.partial(host_tier_budget, config, measured), HookType.AROUND
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
