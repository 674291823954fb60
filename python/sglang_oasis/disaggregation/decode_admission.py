"""The decode node's admissions under remote partial fetching: for each arriving request, its hand-off and
the blocks its first working sets need, read on admission workers (never the scheduler thread) into the
pages SGLang allocated for it; ``DecodeFetcher.admit`` applies what was read."""

from __future__ import annotations

import dataclasses
import os
import threading
import urllib.error
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

from sglang_oasis.disaggregation.handoff import Handoff, draft_kv_pool, pool_buffers
from sglang_oasis.disaggregation.remote_fetch import AdmissionReads, RemotePartialFetcher
from sglang_oasis.disaggregation.side_channel import EndpointDirectory, RemoteFetchError, open_url
from sglang_oasis.disaggregation.transfer_engine import RemoteReadError
from sglang_oasis.stats import injects_here

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

# Fault injection (tests): "<prompt tokens>": the decode node's admission of prompts that long fails (on
# the tensor-parallel rank ``SGLANG_OASIS_INJECT_ON_RANK`` names only, if set).
ADMISSION_FAILURE_ENV = "SGLANG_OASIS_INJECT_ADMISSION_FAILURE"
ADMISSION_WORKERS = 4  # admissions read at once (hand-off and Mooncake reads, off the scheduler thread)


class Origin(NamedTuple):
    """Where a transferred request came from: its prefill node's bootstrap address and room, and this
    node's SGLang transfer session (named to the prefill node, which then stages this node's requests:
    ``PrefillStager.fetch``)."""

    host: str
    port: int
    room: int
    session: str | None = None


@dataclass
class Arrival:
    """A request admitted by remote fetching, waiting for its first decode step here."""

    generation: int
    selection: torch.Tensor  # [layers, kv_heads, full blocks]
    num_tokens: int
    pinned: torch.Tensor | None = None  # like selection: the blocks the prefill window keeps selected
    summaries_read: bool = True  # False: its KV arrived whole; the summaries are caught up here


@dataclass(frozen=True)
class _Admitted:
    """What an admission job read (on the admission worker), applied on the scheduler thread."""

    url: str
    room: int
    handoff: Handoff
    local_pages: torch.Tensor | None = None  # None: the request arrived whole
    cached_blocks: int = 0
    reads: AdmissionReads = dataclasses.field(default_factory=AdmissionReads)
    draft_bytes: int = 0


class _Claim:
    """Whether an admission job may write into its request's pages. The job claims them once it holds the
    hand-off, before any read; ``release_slot`` withdraws them. A job withdrawn before its claim reads
    nothing and releases its room itself, so a release never waits for a slow hand-off (up to twice
    ``HTTP_TIMEOUT_S`` on the scheduler thread, before); after its claim, the release waits for its reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claimed = self._withdrawn = False

    def claim(self) -> bool:
        """The job's: True if it may go on (not withdrawn)."""
        with self._lock:
            self._claimed = not self._withdrawn
            return self._claimed

    def withdraw(self) -> bool:
        """The release's: True if the job had claimed the pages (wait for it)."""
        with self._lock:
            self._withdrawn = True
            return self._claimed


@dataclass(frozen=True)
class _Admission:
    """A request's admission job on the admission worker, for the request of ``generation`` in a slot."""

    generation: int
    job: Future[_Admitted | None]
    claim: _Claim


class AdmissionTarget(Protocol):
    """What an admission reads of the decode node's attention backend (a ``FetchTarget``)."""

    block_size: int
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool


class DecodeAdmissions:
    """The admission jobs of a ``DecodeFetcher``, by request slot: started when SGLang's own transfer of a
    request has completed, taken when it commits, withdrawn when its slot is released.

    ``fetcher`` reads the target model's KV and summaries; ``release`` sends a room's release to its
    prefill node (a job that fails, or whose request was freed meanwhile, releases its room itself)."""

    def __init__(
        self,
        backend: AdmissionTarget,
        fetcher: RemotePartialFetcher,
        endpoints: EndpointDirectory,
        release: Callable[[str, int], None],
    ) -> None:
        self.backend = backend
        self.fetcher = fetcher
        self.endpoints = endpoints
        self._release_remote = release
        self._draft_fetcher: RemotePartialFetcher | None = None  # made at the first draft hand-off
        self._lock = threading.Lock()
        # A few at once: one slow prefill node must not hold up the others' arrivals.
        self._admitter = ThreadPoolExecutor(ADMISSION_WORKERS, thread_name_prefix="oasis-admit")
        self._admitting: dict[int, _Admission] = {}  # by slot

    def slots(self) -> set[int]:
        """The slots with an admission job (running, or over and not taken yet)."""
        with self._lock:
            return set(self._admitting)

    def done(self, slot: int, generation: int) -> bool | None:
        """Whether the admission of the request of ``generation`` in ``slot`` is over; None if it has
        none (not started, or the slot's previous request's)."""
        with self._lock:
            pending = self._admitting.get(slot)
        if pending is None or pending.generation != generation:
            return None
        return pending.job.done()

    def start(self, slot: int, generation: int, origin: Origin) -> bool:
        """Starts the admission of the request in ``slot`` on an admission worker; True if it is over
        already."""
        claim = _Claim()
        job = self._admitter.submit(self._read_admission, slot, origin, claim)
        with self._lock:
            self._admitting[slot] = _Admission(generation, job, claim)
        return job.done()

    def error(self, slot: int, generation: int) -> str | None:
        """Why the admission of the request in ``slot`` failed, once its job is over; None while it runs,
        after it succeeded, or for a request with no admission here."""
        with self._lock:
            pending = self._admitting.get(slot)
        if (
            pending is None
            or pending.generation != generation
            or not pending.job.done()
            or pending.job.cancelled()
        ):
            return None
        error = pending.job.exception()
        return None if error is None else f"oasis: remote partial fetching failed ({error})"

    def take(self, slot: int) -> _Admitted | None:
        """The admission of the request in ``slot``, once its job is over (waits for it); None for a
        request that arrived whole; raises the job's ``RemoteFetchError``."""
        with self._lock:
            job = self._admitting.pop(slot).job
        return job.result()

    def withdraw(self, slot: int) -> tuple[bool, _Admitted | None]:
        """Drops the admission of the request in ``slot`` (its slot is released): whether its job had
        started (a job not started yet is cancelled), and what it read if it had claimed the request's
        pages (its reads write into them: waited for, before SGLang hands the pages on)."""
        with self._lock:
            pending = self._admitting.pop(slot, None)
        if pending is None:
            return False, None
        began = not pending.job.cancel()
        admitted = None
        if began and pending.claim.withdraw():
            try:
                admitted = pending.job.result()
            except Exception:  # its error went to the request (``error``, ``take``); it released its room
                admitted = None
        return began, admitted

    def _read_admission(self, slot: int, origin: Origin, claim: _Claim) -> _Admitted | None:
        """The admission worker's job: the hand-off, then the admission blocks and summaries into the
        request's pages (allocated by SGLang, its alone until it is freed: ``release_slot`` waits once the
        job has claimed them)."""
        room = origin.room
        found = self._get_handoff(origin)
        if found is None:
            return None
        url, handoff = found
        if not claim.claim():  # the request was freed while its hand-off was on its way
            self._release_remote(url, room)
            return None
        try:
            return self._admit_handoff(slot, url, room, handoff)
        except RemoteFetchError:  # the request fails: the prefill node's staging of it goes now
            self._release_remote(url, room)
            raise

    def _admit_handoff(self, slot: int, url: str, room: int, handoff: Handoff) -> _Admitted:
        """``_read_admission``'s reads, once it holds the hand-off and has claimed the request's pages."""
        self._check_handoff(handoff, slot)  # before anything is sized from it
        if os.environ.get(ADMISSION_FAILURE_ENV) == str(handoff.num_tokens) and injects_here():
            raise RemoteFetchError(f"injected admission failure ({ADMISSION_FAILURE_ENV})")
        layout = handoff.layout
        if layout is None:
            return _Admitted(url, room, handoff)
        block = self.backend.block_size
        req_to_token = self.backend.req_to_token_pool.req_to_token
        local_pages = req_to_token[slot, 0 : layout.num_pages * block : block].to(torch.int64) // block
        selection = handoff.selection
        wanted = torch.zeros((layout.num_layers, layout.num_pages), dtype=torch.bool)
        wanted[:, : selection.shape[2]] = selection.any(dim=1)
        cached_blocks = handoff.decode_prefix_len // block
        try:
            reads = self.fetcher.admit(slot, layout, local_pages, wanted, cached_blocks, have_last=True)
            draft_bytes = self._admit_draft(slot, handoff, local_pages, cached_blocks)
        except RemoteReadError as error:
            self.fetcher.release(slot)
            raise RemoteFetchError(f"admission read failed: {error}") from None
        return _Admitted(url, room, handoff, local_pages, cached_blocks, reads, draft_bytes)

    def _check_handoff(self, handoff: Handoff, slot: int) -> None:
        """A hand-off must describe this model's KV and fit the request's row: it comes from a peer."""
        pool, block = self.backend.token_to_kv_pool, self.backend.block_size
        row = int(self.backend.req_to_token_pool.req_to_token.shape[1])
        if handoff.layout is not None:
            try:
                self.fetcher.check_layout(handoff.layout)
            except ValueError as error:
                raise RemoteFetchError(str(error)) from None
        tokens = handoff.num_tokens
        want = (int(pool.layer_num), int(pool.head_num), tokens // block)
        if (
            not 0 <= tokens <= row
            or tuple(handoff.selection.shape) != want
            or handoff.decode_prefix_len > tokens
        ):
            raise RemoteFetchError(
                f"a hand-off for {tokens} tokens with a {tuple(handoff.selection.shape)} selection does not fit "
                f"request slot {slot} ({row} tokens, selection {want})"
            )

    def _admit_draft(self, slot: int, handoff: Handoff, local_pages: torch.Tensor, cached_blocks: int) -> int:
        """Reads the request's whole draft-model KV (but its cached blocks and the last page, which came
        with SGLang's transfer) into the local draft pool; returns the bytes read. Nothing to read if
        either node runs no EAGLE-3 draft model."""
        local = draft_kv_pool(self.backend.req_to_token_pool)
        if handoff.draft is None or local is None:
            return 0
        if self._draft_fetcher is None:
            self._draft_fetcher = RemotePartialFetcher(
                self.fetcher.endpoint, *pool_buffers(local), self.backend.block_size
            )
        fetcher = self._draft_fetcher
        everything = torch.ones((handoff.draft.num_layers, handoff.draft.num_pages), dtype=torch.bool)
        reads = fetcher.admit(slot, handoff.draft, local_pages, everything, cached_blocks, have_last=True)
        fetcher.release(slot)  # all present: nothing to read later
        return reads.admission_bytes

    def _get_handoff(self, origin: Origin) -> tuple[str, Handoff] | None:
        bootstrap_host, bootstrap_port, room, session = origin
        url = self.endpoints.url(bootstrap_host, bootstrap_port)
        if url is None:
            return None
        for attempt in range(2):
            try:
                with open_url(f"{url}/handoff/{room}", session=session) as response:
                    return url, Handoff.from_json(response.read()).reached_via(bootstrap_host)
            except urllib.error.HTTPError as error:
                raise RemoteFetchError(f"no hand-off for bootstrap room {room} at {url}: {error}") from None
            except (urllib.error.URLError, OSError, ValueError, KeyError) as error:
                if attempt:  # a restarted prefill node serves hand-offs at a new URL: look it up once
                    raise RemoteFetchError(
                        f"no hand-off for bootstrap room {room} at {url}: {error}"
                    ) from None
                url = self.endpoints.url(bootstrap_host, bootstrap_port, fresh=True)
                if url is None:
                    return None
        return None
