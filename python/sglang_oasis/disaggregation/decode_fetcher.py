"""The decode node's side of remote partial fetching: admit arriving requests by reading what their first
working sets need (``decode_admission``), read their other blocks when they are missed (or, with the
decode radix cache, in the background), and release their staging on the prefill node when they are
done."""

from __future__ import annotations

import logging
import queue
import threading
import urllib.error
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import torch

from sglang_oasis.disaggregation.decode_admission import Arrival, DecodeAdmissions, Origin
from sglang_oasis.disaggregation.handoff import pool_buffers
from sglang_oasis.disaggregation.remote_fetch import RemotePartialFetcher, RemoteRequest
from sglang_oasis.disaggregation.side_channel import EndpointDirectory, open_url
from sglang_oasis.disaggregation.transfer_engine import MooncakeEndpoint
from sglang_oasis.memory.key_code_store import KeyCodeStore
from sglang_oasis.memory.summary_store import BlockSummaryStore
from sglang_oasis.stats import OasisStats

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

logger = logging.getLogger(__name__)

RELEASE_QUEUE = 1024  # hand-off releases waiting for the prefill node; beyond it they expire there (TTL)


class FetchTarget(Protocol):
    """What the decode node's fetcher writes into: the host tier, the summaries, the counters."""

    block_size: int
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    summaries: BlockSummaryStore
    codes: KeyCodeStore | None  # --oasis-selector codes: full blocks' key codes arrive with the summaries
    stats: OasisStats


def _log_failure(job: Future[bool]) -> None:
    if not job.cancelled() and job.exception() is not None:
        logger.error("oasis: a background read failed", exc_info=job.exception())


class DecodeFetcher:
    """Decode side: admits arriving requests by reading what their first working sets need, and keeps
    their staging alive on the prefill node until they finish.

    An admission's network I/O (the hand-off over HTTP, the Mooncake reads) runs on admission workers,
    never on the scheduler thread: ``admission_done`` starts it when SGLang's own transfer of a request
    has completed and says when it is over (SGLang's transfer queue keeps the request waiting meanwhile,
    ``sglang_hooks.wait_for_admissions``, while the running requests decode), and ``admit`` applies it
    at the request's commit. With the decode radix cache on, ``complete_later`` reads an admitted request's
    remaining blocks on the completion worker, so its KV can be shared at its finish without a read then."""

    def __init__(self, backend: FetchTarget, host: str, rank: int = 0, tp_size: int = 1) -> None:
        self.backend = backend
        # Under tensor parallelism each rank holds its own KV heads and reads them from the prefill
        # node's rank of the same number (the same --tp-size on both: ``EndpointDirectory``).
        self.rank, self.tp_size = rank, tp_size
        self.endpoint = MooncakeEndpoint(host)
        self.fetcher = RemotePartialFetcher(
            self.endpoint,
            *pool_buffers(backend.token_to_kv_pool),
            backend.block_size,
            backend.summaries.kmin,
            backend.summaries.kmax,
            None if backend.codes is None else backend.codes.codes,
        )
        self.endpoints = EndpointDirectory(rank, tp_size)
        self.admissions = DecodeAdmissions(backend, self.fetcher, self.endpoints, self._release_remote)
        self.arrivals: dict[int, Arrival] = {}  # request slot -> arrival not yet claimed
        self._staged: dict[int, tuple[int, str, int]] = {}  # slot -> (generation, handoff url, room)
        self._lock = threading.Lock()
        self._counted: dict[str, int] = {}  # stat -> the fetcher's running total it was last given
        # Releases go to the prefill node from one worker (never the scheduler thread), at most
        # RELEASE_QUEUE waiting: during a prefill outage the rest expire there by their TTL.
        self._releases: queue.Queue[tuple[str, int]] = queue.Queue(RELEASE_QUEUE)
        threading.Thread(target=self._release_worker, name="oasis-release", daemon=True).start()
        self._completer = ThreadPoolExecutor(1, thread_name_prefix="oasis-complete")

    def held(self) -> int:
        """Requests this node holds remote-fetch state for (fetch state, a staged hand-off, an arrival)."""
        with self._lock:
            slots = set(self._staged) | set(self.arrivals)
        return len(slots | self.admissions.slots() | set(self.fetcher.requests))

    def admission_done(self, slot: int, generation: int, origin: Origin) -> bool:
        """Starts the admission of the request in ``slot`` (from ``origin``) on the admission worker
        (once); True when it is over (read, or failed: ``admit`` then raises). Called by SGLang's transfer
        queue's poll on the scheduler thread; never waits."""
        done = self.admissions.done(slot, generation)
        if done is not None:
            return done
        self.release_slot(slot)  # the slot's previous request, if its release is still pending
        return self.admissions.start(slot, generation, origin)

    def admission_error(self, slot: int, generation: int) -> str | None:
        """Why the admission of the request in ``slot`` failed, once its job is over; None while it runs,
        after it succeeded, or for a request with no admission here."""
        return self.admissions.error(slot, generation)

    def admit(self, slot: int, generation: int, origin: Origin) -> bool:
        """Admits the request in ``slot``: its hand-off and its admission blocks and summaries (read by
        the admission worker; waits for it if ``admission_done`` did not see it over). Returns False for
        a request that arrived whole; raises ``RemoteFetchError`` if it cannot be admitted."""
        self.admission_done(slot, generation, origin)
        admitted = self.admissions.take(slot)  # raises the job's RemoteFetchError
        if admitted is None:
            return False
        handoff = admitted.handoff
        stats = self.backend.stats
        # Sent whole (the prefill's staging cap, or before it knew this node fetches): its first
        # selection is loaded from the KV that arrived, its summaries caught up here.
        whole = admitted.local_pages is None
        with self._lock:
            self._staged[slot] = (generation, admitted.url, admitted.room)  # released as a staged one
            self.arrivals[slot] = Arrival(
                generation, handoff.selection, handoff.num_tokens, handoff.pinned, summaries_read=not whole
            )
        if admitted.local_pages is None:
            stats.add("remote_whole_requests")
            return False
        stats.add("remote_requests")
        for name, value in admitted.reads._asdict().items():
            stats.add(f"remote_{name}", value)
        stats.add("remote_draft_bytes", admitted.draft_bytes)
        self.backend.summaries.recycle(admitted.local_pages[admitted.cached_blocks :])
        if self.backend.codes is not None:  # read with the summaries: coded at the pages' new epochs
            full = handoff.num_tokens // self.backend.block_size
            self.backend.codes.arrived(admitted.local_pages[admitted.cached_blocks : full])
        return True

    def take_arrival(self, slot: int, generation: int) -> Arrival | None:
        with self._lock:
            arrival = self.arrivals.get(slot)
            if arrival is None or arrival.generation != generation:
                return None
            return self.arrivals.pop(slot)

    def ensure(self, layer: int, wanted: dict[int, torch.Tensor]) -> dict[int, str]:
        """Before a layer's working-set loads: read the blocks still remote (see ``RemotePartialFetcher``)."""
        failed = self.fetcher.ensure(layer, wanted)
        with self._lock:  # runs in the pipeline's thread and (``complete``) in the scheduler's
            self._count("remote_miss_bytes", self.fetcher.counters.miss_bytes)
            if failed:
                self.backend.stats.add("remote_failed_reads", len(failed))
        return failed

    def _count(self, stat: str, total: int) -> None:
        """Add to the server's ``stat`` what the fetcher's running ``total`` grew by since it was last
        counted (under ``_lock``: the pipeline's, the scheduler's and the completion's threads count)."""
        self.backend.stats.add(stat, total - self._counted.get(stat, 0))
        self._counted[stat] = total

    def complete(self, slot: int) -> bool:
        """Reads every still-remote block of the request in ``slot`` now (before a retracted request's KV
        is backed up); False if that failed (on any tensor-parallel rank: ``on_every_rank``)."""
        request = self.fetcher.requests.get(slot)
        try:
            whole = request is None or self._complete(slot, request)
        except Exception:  # the request cannot be backed up (SGLang aborts it); the ranks still agree
            logger.exception("oasis: reading request slot %d's remaining blocks failed", slot)
            whole = False
        return self.on_every_rank(whole)

    def on_every_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every tensor-parallel rank (one all-reduce over the ranks' CPU group;
        at TP 1, ``flag``). For what changes the scheduler's decisions (a retracted request kept or aborted,
        a finished one shared through the radix cache), which must be the same on every rank: each rank
        reads its own KV heads' blocks, and one may still miss some when another holds all of its own.
        Every rank calls it at the same point (the schedulers decide alike)."""
        if self.tp_size == 1:
            return flag
        import torch.distributed as dist
        from sglang.srt.distributed.parallel_state import get_tp_group

        value = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
        return bool(value.item())

    def complete_later(self, slot: int) -> None:
        """Starts reading every still-remote block of the admitted request in ``slot`` on the completion
        worker (the decode radix cache shares only whole KV, ``whole``); it stops when the request is
        released (``release`` fences a read in flight)."""
        request = self.fetcher.requests.get(slot)
        if request is not None:
            job = self._completer.submit(self._complete, slot, request)
            job.add_done_callback(_log_failure)

    def whole(self, slot: int) -> bool:
        """Whether the request in ``slot`` holds all its KV locally (never reads)."""
        return self.fetcher.whole(slot)

    def _complete(self, slot: int, request: RemoteRequest) -> bool:
        full = torch.arange(request.layout.num_pages)
        for layer in range(request.layout.num_layers):
            if self.fetcher.requests.get(slot) is not request:  # released: its pages are another's
                return False
            failed = self.fetcher.ensure(layer, {slot: full}, completion=True)
            with self._lock:
                self._count("remote_completion_bytes", self.fetcher.counters.completion_bytes)
            if failed:
                logger.info(
                    "oasis: reading request slot %d's remaining blocks failed: %s", slot, failed[slot]
                )
                return False
        return True

    def release_slot(self, slot: int, bootstrap: tuple[str, int, int] | None = None) -> None:
        """The request in ``slot`` is done (SGLang freed its row, ``sglang_hooks.release_freed_rows``, or
        a new request takes it): drop its fetch state and release its staging on the prefill node (over
        HTTP, in the background: never on the scheduler thread).

        ``bootstrap``: the request's ``(bootstrap host, port, room)``. A request that failed or was
        aborted before its admission read a hand-off here (its transfer failed on another tensor-parallel
        rank, its admission was cancelled, its client left) left no record of its room, yet its prefill
        node may have staged it for this node; it is released by that address, at a prefill node already
        known to stage (none is looked up here). Before, it stayed staged there until the TTL.

        An admission still waiting for its hand-off is not waited for (``_Claim``): it reads nothing and
        releases its room itself."""
        with self._lock:
            staged = self._staged.pop(slot, None)
            self.arrivals.pop(slot, None)
        # began: its job had started (not a request that never began its admission here); admitted: what
        # it read into the slot's pages (waited for before SGLang hands the pages on)
        began, admitted = self.admissions.withdraw(slot)
        self.fetcher.release(slot)
        release = None if staged is None else (staged[1], staged[2])
        if admitted is not None:
            release = (admitted.url, admitted.room)
        if release is None and not began and bootstrap is not None:
            url = self.endpoints.known(*bootstrap[:2])
            release = None if url is None else (url, bootstrap[2])
        if release is not None:
            try:
                self._releases.put_nowait(release)
            except queue.Full:
                logger.warning(
                    "oasis: %d hand-off releases pending; room %d expires by its TTL",
                    RELEASE_QUEUE,
                    release[1],
                )

    def _release_worker(self) -> None:
        while True:
            self._release_remote(*self._releases.get())

    @staticmethod
    def _release_remote(url: str, room: int) -> None:
        try:
            open_url(f"{url}/handoff/{room}", "DELETE").read()
        except (urllib.error.URLError, OSError) as error:  # the prefill node is gone: nothing to release
            logger.info("oasis: releasing bootstrap room %d at %s failed: %s", room, url, error)
