"""Requests whose block transfer failed, each tagged with the generation of the request that caused it.

A prefetch job records the generation of every request it moves blocks for when it is built; a failure
it reports is filed under that generation. SGLang reuses a freed request row for the next request (with
a new generation), so a failure that surfaces after its request finished is never blamed on the row's
next owner. The scheduler hook (``sglang_hooks.abort_failed_transfers``) has ``abort_failed`` take each
failure when the failing request's batch result is processed and abort that request alone.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

logger = logging.getLogger(__name__)


class TransferFailures:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # the scheduler hook reads while the backend files
        self._pending: dict[int, tuple[int, str]] = {}  # req -> (generation, message), not yet taken
        self._reported: dict[int, int] = {}  # req -> the latest generation that failed

    def report(self, req: int, generation: int, message: str) -> bool:
        """File a failure of request ``req`` of ``generation``; False if that request already has one
        (a later layer or step of the same failure)."""
        with self._lock:
            if self._reported.get(req) == generation:
                return False
            self._reported[req] = generation
            self._pending[req] = (generation, message)
            return True

    def take(self, req: int, generation: int) -> str | None:
        """The message of request ``req`` of ``generation``, removed once taken. A failure of an older
        generation (a finished request) is dropped; one of a newer generation stays."""
        with self._lock:
            entry = self._pending.get(req)
            if entry is None:
                return None
            if entry[0] != generation:
                if entry[0] < generation:
                    del self._pending[req]
                return None
            del self._pending[req]
            return entry[1]

    def failed(self, req: int, generation: int) -> bool:
        """Whether request ``req`` of ``generation`` had a transfer fail (its working sets may map blocks
        that never arrived)."""
        return self._reported.get(req) == generation

    def held(self) -> int:
        """Failures filed and not taken by the scheduler yet."""
        return len(self._pending)

    def __bool__(self) -> bool:
        return bool(self._pending)


def abort_failed(scheduler: Scheduler, batch: ScheduleBatch, backend: AttentionBackend | None) -> None:
    """Before ``batch``'s result is processed: the in-flight requests whose working-set transfers failed
    (on any tensor-parallel rank: ``agree_on_failures``) get SGLang's ``to_finish = FINISH_ABORT``, so
    they finish at this step with the message and a 500, their KV freed and not shared; first, a CUDA
    graph replay of this batch has its counts folded (the backend's ``settle``)."""
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
