"""Remote partial fetching inside SGLang's PD disaggregation (``--oasis-remote-fetch``, sparse mode).

SGLang's Mooncake sender would push a request's whole KV from the prefill node into the decode node's
pool. With remote partial fetching the two nodes' sparse backends take over the payload::

    prefill node (scheduler process)                    decode node (scheduler process)
    extend -> last prompt token's selection             pre-allocates the request's pages as usual
    last send: stage full KV + summaries (registered)   SGLang transfer completes (one page)
      SGLang sends only the last page + aux data   -->  commit: GET the hand-off (layout, selection),
      hand-off kept for GET /handoff/<room>               read the union over heads of the selected
                                                          blocks + every summary (Mooncake reads)
                                                        first decode step: working sets = selection
                                                        later misses: read before their first load
    DELETE /handoff/<room>: staging released     <--    request finished (or its slot reused)

The hand-off travels over a small HTTP side channel in the prefill scheduler process (it owns the staged
memory); the decode node finds it through the prefill's own bootstrap server, where the prefill
registers the channel's URL per engine rank (a route sglang-oasis adds, hook 7 in ``sglang_hooks``).
A prefill node that does not stage (dense mode, or ``--oasis-remote-fetch false``) registers nothing, and
its requests arrive whole, as in plain SGLang.

With ``--oasis-lookahead eagle3`` the draft model's own KV (one layer, which attends every token) is
staged beside the target's and read whole at admission: SGLang's transfer would carry it with the
target's pages, and only the last page goes that way here.

Blocks the decode node already holds through its radix cache (SGLang's ``decode_prefix_len``) are
neither staged for reading nor read. With ``--disaggregation-decode-enable-radix-cache`` a request's
still-remote blocks are read in the background after its admission (one completion worker, never the
scheduler thread), and its KV enters the radix cache at its finish only if they all arrived by then (a
cached prefix is always complete; a request that finished first is just not shared); without it they are
never read.
"""

from __future__ import annotations

import base64
import dataclasses
import hmac
import ipaddress
import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from sglang_oasis.disaggregation.remote_fetch import AdmissionReads, RemotePartialFetcher, RemoteRequest
from sglang_oasis.disaggregation.staging import KVStagingArea, StagedKVLayout
from sglang_oasis.disaggregation.transfer_engine import MooncakeEndpoint, RemoteReadError
from sglang_oasis.memory.summary_store import BlockSummaryStore
from sglang_oasis.stats import OasisStats, injects_here

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

logger = logging.getLogger(__name__)

ENDPOINT_ROUTE = "/oasis/remote_fetch_endpoint"  # on the prefill's bootstrap server
HTTP_TIMEOUT_S = 10.0
TOKEN_ENV = "SGLANG_OASIS_PD_TOKEN"  # a deployment's shared secret (launch_pd makes one)
TOKEN_HEADER = "X-Oasis-PD-Token"
# A decode node that fetches names its SGLang transfer session when it asks for a hand-off: the prefill
# node stages only for decode sessions that did (the others, and each new one's first requests, go whole).
DECODE_SESSION_HEADER = "X-Oasis-Decode-Session"
# Fault injection (tests, bench_pd): "<prompt tokens>:<seconds>": hand-offs of prompts that long are
# answered that late (a slow prefill node).
HANDOFF_DELAY_ENV = "SGLANG_OASIS_INJECT_HANDOFF_DELAY"
# Fault injection (tests): "<prompt tokens>": the decode node's admission of prompts that long fails (on
# the tensor-parallel rank ``SGLANG_OASIS_INJECT_ON_RANK`` names only, if set).
ADMISSION_FAILURE_ENV = "SGLANG_OASIS_INJECT_ADMISSION_FAILURE"
ADMISSION_WORKERS = 4  # admissions read at once (hand-off and Mooncake reads, off the scheduler thread)
RELEASE_QUEUE = 1024  # hand-off releases waiting for the prefill node; beyond it they expire there (TTL)


def _auth_headers() -> dict[str, str]:
    token = os.environ.get(TOKEN_ENV)
    return {TOKEN_HEADER: token} if token else {}


def authorized(headers: Any, client_host: str | None) -> bool:
    """Whether a caller of the hand-off routes (which hand out, register and release staged KV) may: with
    ``SGLANG_OASIS_PD_TOKEN`` set, it sends the same token; without, it calls from this machine."""
    token = os.environ.get(TOKEN_ENV)
    if token:
        return hmac.compare_digest(str(headers.get(TOKEN_HEADER, "")), token)
    try:
        return client_host is not None and ipaddress.ip_address(client_host).is_loopback
    except ValueError:
        return False


def reachable(address: str, via: str) -> str:
    """``address`` (a URL, or a Mooncake session ``host:port``) with a wildcard host (a server bound to
    every interface advertises 0.0.0.0 or ::) replaced by ``via``, the host this node reached the peer's
    bootstrap server at; any other address as it is."""
    url = "://" in address
    parsed = urllib.parse.urlsplit(address if url else f"//{address}")
    if parsed.hostname not in ("0.0.0.0", "::"):
        return address
    host = f"[{via}]" if ":" in via else via
    rebuilt = parsed._replace(netloc=host if parsed.port is None else f"{host}:{parsed.port}").geturl()
    return rebuilt if url else rebuilt.removeprefix("//")


def _open(address: str, method: str = "GET", data: bytes | None = None, session: str | None = None) -> Any:
    headers = _auth_headers() | ({DECODE_SESSION_HEADER: session} if session else {})
    request = urllib.request.Request(address, data=data, method=method, headers=headers)
    return urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S)


class RemoteFetchError(RuntimeError):
    """The hand-off of a request could not be obtained or read; the request fails alone."""


class StagingSource(Protocol):
    """What the prefill node's stager reads of the attention backend (``OasisAttnBackend``)."""

    block_size: int
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool  # the host tier
    stats: OasisStats

    def finish_pending(self) -> None: ...
    def admission_selection(self, req: int, num_tokens: int) -> torch.Tensor: ...
    def admission_pins(self, req: int, num_tokens: int) -> torch.Tensor | None: ...


class FetchTarget(Protocol):
    """What the decode node's fetcher writes into: the host tier, the summaries, the counters."""

    block_size: int
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    summaries: BlockSummaryStore
    stats: OasisStats


_DRAFT_POOL: list[Any] = []  # [pool] once this process's EAGLE-3 draft model has its attention backend


def register_draft_pool(pool: MHATokenToKVPool) -> None:
    """The draft model's KV pool of this process (its attention backend registers it)."""
    _DRAFT_POOL[:] = [pool]


def draft_pool() -> MHATokenToKVPool | None:
    return _DRAFT_POOL[0] if _DRAFT_POOL else None


def pool_buffers(pool: MHATokenToKVPool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A KV pool's per-layer K and V buffers (``[tokens, kv_heads, head_dim]``), in layer order."""
    start = int(getattr(pool, "start_layer", 0) or 0)
    layers = range(start, start + pool.layer_num)
    return [pool.get_key_buffer(layer) for layer in layers], [
        pool.get_value_buffer(layer) for layer in layers
    ]


@dataclass(frozen=True)
class Handoff:
    """What the prefill node hands the decode node for one request."""

    layout: StagedKVLayout | None  # None: sent whole by SGLang (over the staging cap), nothing staged
    selection: torch.Tensor  # bool [layers, kv_heads, full blocks]: the first working sets
    decode_prefix_len: int  # tokens the decode node holds through its radix cache (never read)
    draft: StagedKVLayout | None = None  # the EAGLE-3 draft model's KV (no summaries needed)
    pinned: torch.Tensor | None = None  # bool, like selection: the prefill window's kept blocks
    whole_tokens: int = 0  # a request sent whole: its prompt's tokens (else layout.num_tokens)

    @property
    def num_tokens(self) -> int:
        return self.whole_tokens if self.layout is None else self.layout.num_tokens

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "layout": None if self.layout is None else self.layout.to_dict(),
                "whole_tokens": self.whole_tokens,
                "selection_shape": list(self.selection.shape),
                "selection": _pack_bits(self.selection),
                "pinned": None if self.pinned is None else _pack_bits(self.pinned),
                "decode_prefix_len": self.decode_prefix_len,
                "draft": None if self.draft is None else self.draft.to_dict(),
            }
        ).encode()

    @classmethod
    def from_json(cls, body: bytes) -> Handoff:
        data = json.loads(body)
        shape = tuple(data["selection_shape"])
        layout, draft, pinned = data["layout"], data.get("draft"), data.get("pinned")
        return cls(
            None if layout is None else StagedKVLayout.from_dict(layout),
            _unpack_bits(data["selection"], shape),
            int(data["decode_prefix_len"]),
            None if draft is None else StagedKVLayout.from_dict(draft),
            None if pinned is None else _unpack_bits(pinned, shape),
            int(data.get("whole_tokens", 0)),
        )


def _pack_bits(mask: torch.Tensor) -> str:
    return base64.b64encode(np.packbits(mask.numpy().astype(np.uint8).ravel()).tobytes()).decode("ascii")


def _unpack_bits(text: str, shape: tuple[int, ...]) -> torch.Tensor:
    bits = np.frombuffer(base64.b64decode(text), dtype=np.uint8)
    count = int(np.prod(shape))
    return torch.from_numpy(np.unpackbits(bits)[:count].astype(bool).reshape(shape))


UNREACHABLE_TTL_S = 10.0  # how long a bootstrap server that did not answer is not asked again
_unreachable: dict[tuple[str, int], tuple[str, float]] = {}  # bootstrap address -> (failure, when)


def handoff_endpoint(
    bootstrap_host: str, bootstrap_port: int, engine_rank: int = 0, tp_size: int = 1
) -> str | None:
    """The hand-off URL that tensor-parallel rank ``engine_rank`` of the prefill node at this bootstrap
    address registered with its bootstrap server; None if it does not stage KV, or runs another
    ``--tp-size`` than this node's ``tp_size`` (its ranks hold other KV heads than this node's: its requests
    arrive whole, as SGLang sends them; logged once per address). Raises ``RemoteFetchError`` if the
    bootstrap server cannot answer; that is remembered for ``UNREACHABLE_TTL_S``, so requests arriving
    meanwhile fail at once instead of each holding the decode scheduler's thread for the HTTP timeout."""
    key, now = (bootstrap_host, int(bootstrap_port)), time.monotonic()
    known = _unreachable.get(key)
    if known is not None and now - known[1] < UNREACHABLE_TTL_S:
        raise RemoteFetchError(f"{known[0]} ({now - known[1]:.1f} s ago; not asked again yet)")
    address = f"http://{bootstrap_host}:{bootstrap_port}{ENDPOINT_ROUTE}?engine_rank={engine_rank}"
    try:
        with _open(address) as response:
            answer = json.loads(response.read())
            url, their_tp = str(answer["url"]), int(answer.get("tp_size", 1))
    except (ValueError, KeyError) as error:
        raise RemoteFetchError(f"bootstrap server {address} answered without a URL: {error}") from None
    except urllib.error.HTTPError as error:
        if error.code != 404:
            raise RemoteFetchError(f"bootstrap server {address} answered {error.code}") from None
        return None
    except (urllib.error.URLError, OSError) as error:
        message = f"bootstrap server {address} unreachable: {error}"
        _unreachable[key] = (message, now)
        raise RemoteFetchError(message) from None
    if their_tp != tp_size:
        if key not in _mismatched:
            _mismatched.add(key)
            logger.error(
                "oasis: the prefill node at %s:%d runs --tp-size %d and this decode node %d: remote partial "
                "fetching needs the same on both; its requests arrive whole", *key, their_tp, tp_size,
            )  # fmt: skip
        return None
    return url


_mismatched: set[tuple[str, int]] = set()  # bootstrap addresses of prefill nodes with another --tp-size


# --- prefill node ------------------------------------------------------------------------------------


class PrefillStager:
    """Prefill side: stages finished prefills and serves their hand-offs until the decode node is done."""

    def __init__(
        self, backend: StagingSource, host: str, bootstrap_port: int, engine_rank: int, ttl_s: float,
        max_bytes: int = 0, tp_size: int = 1,
    ) -> None:  # fmt: skip
        self.backend = backend
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes  # 0: no cap
        self.endpoint = MooncakeEndpoint(host)
        self.staging = KVStagingArea(self.endpoint, backend.block_size)
        self._handoffs: dict[int, tuple[bytes, float]] = {}  # room -> (json, staged at)
        # room -> (bytes, when): prompts admitted to staging (``reserve``) and not staged yet
        self._reserved: dict[int, tuple[int, float]] = {}
        self._peak = 0  # the most bytes staged at once
        delay = os.environ.get(HANDOFF_DELAY_ENV, "").partition(":")
        self._delay = (int(delay[0]), float(delay[2])) if delay[1] else None  # (prompt tokens, seconds)
        self._slow_rooms: set[int] = set()
        self._fetching: set[str] = set()  # decode sessions that asked for a hand-off: they fetch
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer((host, 0), self._handler())
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="oasis-handoff", daemon=True).start()
        self.url = f"http://{host}:{self._server.server_address[1]}"
        # Requests are staged only once decode nodes can find the hand-offs; until then they go whole.
        self.ready = threading.Event()
        threading.Thread(
            target=self._register, args=(host, bootstrap_port, engine_rank, tp_size), name="oasis-handoff-register",
            daemon=True,
        ).start()  # fmt: skip
        threading.Thread(target=self._sweep, name="oasis-staging-sweeper", daemon=True).start()

    def held(self) -> int:
        """Hand-offs kept for decode nodes (staged, or sent whole with their first selection)."""
        with self._lock:
            return len(self._handoffs)

    def staging_bytes(self, num_tokens: int) -> int:
        """What staging a ``num_tokens``-token prompt takes: its KV in whole blocks with its summaries
        (one block's worth per block), and the draft model's KV (no summaries) where there is one."""
        block = self.backend.block_size
        tokens = -(-num_tokens // block) * block

        def per_token(pool: MHATokenToKVPool) -> int:
            k_buffers, _ = pool_buffers(pool)
            return 2 * sum(buffer[0].numel() * buffer.element_size() for buffer in k_buffers)

        draft = draft_pool()
        draft_bytes = 0 if draft is None else tokens * per_token(draft)
        return tokens * per_token(self.backend.token_to_kv_pool) * (block + 1) // block + draft_bytes

    def reserve(self, room: int, num_tokens: int) -> bool:
        """Admit room ``room``'s ``num_tokens``-token prompt to staging if it fits within
        ``--oasis-remote-fetch-max-staged-mib`` beside what is staged and what the prompts admitted
        before it will stage (prompts decided in one batch, before any of them is staged, cannot pass
        the cap together); its bytes stay reserved until it is staged, released or expired. False: it
        goes whole."""
        if not self.max_bytes:
            return True
        need = self.staging_bytes(num_tokens)
        with self._lock:
            reserved = sum(nbytes for nbytes, _ in self._reserved.values())
            if self.staging.nbytes + reserved + need > self.max_bytes:
                return False
            self._reserved[room] = (need, time.monotonic())
        return True

    def expire(self, now: float | None = None) -> list[int]:
        """Release the hand-offs older than the TTL (their decode node never released them)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [room for room, (_, at) in self._handoffs.items() if now - at > self.ttl_s]
            for room in [room for room, (_, at) in self._reserved.items() if now - at > self.ttl_s]:
                del self._reserved[room]  # admitted, never staged (aborted before its last chunk)
        for room in expired:
            logger.warning(
                "oasis: staged KV of bootstrap room %d expired unreleased after %.0f s", room, self.ttl_s
            )
            self.release(room)
        return expired

    def _sweep(self) -> None:
        """Expire unreleased hand-offs periodically, also while no new request is staged."""
        period = max(1.0, min(30.0, self.ttl_s / 4))
        while True:
            time.sleep(period)
            try:
                self.expire()
            except Exception:  # the next sweep tries again
                logger.exception("oasis: sweeping staged KV failed")

    def _register(self, host: str, bootstrap_port: int, engine_rank: int, tp_size: int) -> None:
        """Tell the prefill's bootstrap server (started after this process) where this tensor-parallel
        rank's hand-offs are served (each rank stages its own KV heads), and the node's ``--tp-size``;
        retried until it answers."""
        body = json.dumps({"engine_rank": engine_rank, "tp_size": tp_size, "url": self.url}).encode()
        address = f"http://{host}:{bootstrap_port}{ENDPOINT_ROUTE}"
        started = time.monotonic()
        while True:
            try:
                _open(address, "PUT", body).read()
                self.ready.set()
                logger.info("oasis: hand-offs registered at %s", address)
                return
            except (urllib.error.URLError, OSError) as error:
                if time.monotonic() - started > 120:
                    logger.warning(
                        "oasis: cannot register hand-offs at %s yet (%s); requests go whole", address, error
                    )
                    started = time.monotonic()
                time.sleep(0.5)

    def stage(self, room: int, slot: int, num_tokens: int, decode_prefix_len: int) -> None:
        """Stage request slot ``slot``'s first ``num_tokens`` tokens of KV and keep its hand-off. If any
        part fails, whatever was staged for the room is released before the error goes on."""
        try:
            self._stage(room, slot, num_tokens, decode_prefix_len)
        except Exception:
            self.release(room)
            raise

    def hand_over_whole(self, room: int, slot: int, num_tokens: int, decode_prefix_len: int) -> None:
        """A request SGLang sends whole (staging it would pass the cap): keep a hand-off with its first
        selection only, so the decode node starts from the working sets the prefill chose (as a staged
        request or a server without PD would), reading its blocks from the KV that arrived."""
        self.backend.finish_pending()  # the last extend's selection job may still be running
        self._hand_off(room, slot, num_tokens, decode_prefix_len, None, None)

    def _hand_off(
        self, room: int, slot: int, num_tokens: int, decode_prefix_len: int, layout: StagedKVLayout | None,
        draft: StagedKVLayout | None,
    ) -> None:  # fmt: skip
        """Keep room ``room``'s hand-off: where its KV is staged (``layout``; None: sent whole) and the
        first selection of request slot ``slot`` (its ``num_tokens`` prompt tokens)."""
        selection = self.backend.admission_selection(slot, num_tokens)
        pinned = self.backend.admission_pins(slot, num_tokens)
        whole_tokens = num_tokens if layout is None else 0
        body = Handoff(layout, selection, decode_prefix_len, draft, pinned, whole_tokens).to_json()
        with self._lock:
            self._handoffs[room] = (body, time.monotonic())
            if self._delay is not None and self._delay[0] == num_tokens:
                self._slow_rooms.add(room)

    def _stage(self, room: int, slot: int, num_tokens: int, decode_prefix_len: int) -> None:
        backend = self.backend
        backend.finish_pending()  # the last extend's selection job may still be running
        locations = backend.req_to_token_pool.req_to_token[slot, :num_tokens].to(torch.int64)

        def gathered(pool: MHATokenToKVPool) -> tuple[torch.Tensor, torch.Tensor]:
            k_buffers, v_buffers = pool_buffers(pool)
            return (
                torch.stack([buffer[locations].cpu() for buffer in k_buffers]),
                torch.stack([buffer[locations].cpu() for buffer in v_buffers]),
            )

        layout = self.staging.stage(str(room), *gathered(backend.token_to_kv_pool))
        draft = draft_pool()  # the draft shares the target's token locations
        draft_layout = (
            None if draft is None else self.staging.stage(f"{room}/draft", *gathered(draft), summaries=False)
        )
        self._hand_off(room, slot, num_tokens, decode_prefix_len, layout, draft_layout)
        staged = self.staging.nbytes
        with self._lock:
            self._reserved.pop(room, None)  # now counted in the staged bytes
            self._peak = max(self._peak, staged)
        self.expire()
        backend.stats.add("staged_requests")
        backend.stats.set("staged_bytes", staged)
        backend.stats.set("staged_bytes_peak", self._peak)

    def release(self, room: int) -> bool:
        with self._lock:
            found = self._handoffs.pop(room, None) is not None
            self._slow_rooms.discard(room)
            self._reserved.pop(room, None)
        self.staging.release(str(room))
        self.staging.release(f"{room}/draft")
        self.backend.stats.set("staged_bytes", self.staging.nbytes)
        return found

    def handoff(self, room: int, decode_session: str | None = None) -> bytes | None:
        """Room ``room``'s hand-off; ``decode_session`` (the asking decode node's SGLang transfer session)
        is remembered as one that fetches."""
        with self._lock:
            entry = self._handoffs.get(room)
            if decode_session:
                self._fetching.add(decode_session)
        return None if entry is None else entry[0]

    def forget(self, decode_session: str) -> None:
        """A decode node registered (again) at ``decode_session``: a new process, perhaps one that does not
        fetch, at a restarted node's address; it is staged for only once it asks for a hand-off itself."""
        with self._lock:
            self._fetching.discard(decode_session)

    def fetch(self, decode_sessions: Iterable[str]) -> bool:
        """Whether every one of a request's decode sessions fetches (has asked for a hand-off before):
        only then is the request staged. An unknown decode node (plain SGLang, a server without remote
        fetching, or one not heard from yet) gets its requests whole, as SGLang sends them."""
        sessions = set(decode_sessions)
        with self._lock:
            return bool(sessions) and sessions <= self._fetching

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        stager = self

        class Handler(BaseHTTPRequestHandler):
            def _room(self) -> int | None:
                if not authorized(self.headers, self.client_address[0]):
                    self._reply(403, b'{"error": "forbidden: this deployment needs its X-Oasis-PD-Token"}')
                    return None
                prefix = "/handoff/"
                if not self.path.startswith(prefix):
                    self._reply(404, b'{"error": "unknown path"}')
                    return None
                try:
                    return int(self.path[len(prefix) :])
                except ValueError:
                    self._reply(400, b'{"error": "bad bootstrap room"}')
                    return None

            def do_GET(self) -> None:
                room = self._room()
                if room is not None:
                    if stager._delay is not None and room in stager._slow_rooms:  # HANDOFF_DELAY_ENV
                        time.sleep(stager._delay[1])
                    body = stager.handoff(room, self.headers.get(DECODE_SESSION_HEADER))
                    self._reply(200, body) if body is not None else self._reply(
                        404, b'{"error": "not staged"}'
                    )

            def do_DELETE(self) -> None:
                room = self._room()
                if room is not None:
                    self._reply(200 if stager.release(room) else 404, b"{}")

            def _reply(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler


# --- decode node -------------------------------------------------------------------------------------


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
        # node's rank of the same number (the same --tp-size on both: ``handoff_endpoint``).
        self.rank, self.tp_size = rank, tp_size
        self.endpoint = MooncakeEndpoint(host)
        self.fetcher = RemotePartialFetcher(
            self.endpoint,
            *pool_buffers(backend.token_to_kv_pool),
            backend.block_size,
            backend.summaries.kmin,
            backend.summaries.kmax,
        )
        self._draft_fetcher: RemotePartialFetcher | None = None  # made at the first draft hand-off
        self.arrivals: dict[int, Arrival] = {}  # request slot -> arrival not yet claimed
        self._staged: dict[int, tuple[int, str, int]] = {}  # slot -> (generation, handoff url, room)
        self._endpoints: dict[tuple[str, int], str | None] = {}  # bootstrap address -> handoff URL
        self._lock = threading.Lock()
        self._counted: dict[str, int] = {}  # stat -> the fetcher's running total it was last given
        # Releases go to the prefill node from one worker (never the scheduler thread), at most
        # RELEASE_QUEUE waiting: during a prefill outage the rest expire there by their TTL.
        self._releases: queue.Queue[tuple[str, int]] = queue.Queue(RELEASE_QUEUE)
        threading.Thread(target=self._release_worker, name="oasis-release", daemon=True).start()
        # A few at once: one slow prefill node must not hold up the others' arrivals.
        self._admitter = ThreadPoolExecutor(ADMISSION_WORKERS, thread_name_prefix="oasis-admit")
        self._admitting: dict[int, _Admission] = {}  # by slot
        self._completer = ThreadPoolExecutor(1, thread_name_prefix="oasis-complete")

    def held(self) -> int:
        """Requests this node holds remote-fetch state for (fetch state, a staged hand-off, an arrival)."""
        with self._lock:
            slots = set(self._staged) | set(self.arrivals) | set(self._admitting)
        return len(slots | set(self.fetcher.requests))

    def _handoff_url(self, bootstrap_host: str, bootstrap_port: int, fresh: bool = False) -> str | None:
        """The hand-off URL of the prefill node at this bootstrap address; None if it does not stage."""
        key = (bootstrap_host, int(bootstrap_port))
        url = None if fresh else self._endpoints.get(key)
        if url is None:
            url = handoff_endpoint(bootstrap_host, bootstrap_port, self.rank, self.tp_size)
            if url is not None:
                url = self._endpoints[key] = reachable(url, bootstrap_host)
        return url

    def _get_handoff(
        self, bootstrap_host: str, bootstrap_port: int, room: int, session: str | None
    ) -> tuple[str, Handoff] | None:
        url = self._handoff_url(bootstrap_host, bootstrap_port)
        if url is None:
            return None
        for attempt in range(2):
            try:
                with _open(f"{url}/handoff/{room}", session=session) as response:
                    return url, self._reachable(Handoff.from_json(response.read()), bootstrap_host)
            except urllib.error.HTTPError as error:
                raise RemoteFetchError(f"no hand-off for bootstrap room {room} at {url}: {error}") from None
            except (urllib.error.URLError, OSError, ValueError, KeyError) as error:
                if attempt:  # a restarted prefill node serves hand-offs at a new URL: look it up once
                    raise RemoteFetchError(
                        f"no hand-off for bootstrap room {room} at {url}: {error}"
                    ) from None
                url = self._handoff_url(bootstrap_host, bootstrap_port, fresh=True)
                if url is None:
                    return None
        return None

    def admission_done(
        self, slot: int, generation: int, bootstrap_host: str, bootstrap_port: int, room: int,
        session: str | None = None,
    ) -> bool:  # fmt: skip
        """Starts the admission of the request in ``slot`` on the admission worker (once); True when it
        is over (read, or failed: ``admit`` then raises). ``session``: this node's SGLang transfer session,
        named to the prefill node, which then stages this node's requests (``PrefillStager.fetch``).
        Called by SGLang's transfer queue's poll on the scheduler thread; never waits."""
        with self._lock:
            pending = self._admitting.get(slot)
        if pending is not None and pending.generation == generation:
            return pending.job.done()
        self.release_slot(slot)  # the slot's previous request, if its release is still pending
        claim = _Claim()
        job = self._admitter.submit(
            self._read_admission, slot, bootstrap_host, bootstrap_port, room, session, claim
        )
        with self._lock:
            self._admitting[slot] = _Admission(generation, job, claim)
        return job.done()

    def admission_error(self, slot: int, generation: int) -> str | None:
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

    def admit(
        self, slot: int, generation: int, bootstrap_host: str, bootstrap_port: int, room: int,
        session: str | None = None,
    ) -> bool:  # fmt: skip
        """Admits the request in ``slot``: its hand-off and its admission blocks and summaries (read by
        the admission worker; waits for it if ``admission_done`` did not see it over). Returns False for
        a request that arrived whole; raises ``RemoteFetchError`` if it cannot be admitted."""
        self.admission_done(slot, generation, bootstrap_host, bootstrap_port, room, session)
        with self._lock:
            job = self._admitting.pop(slot).job
        admitted = job.result()  # raises the job's RemoteFetchError
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
        summaries = self.backend.summaries
        summaries.epoch[admitted.local_pages[admitted.cached_blocks :]] += 1  # these pages now hold other KV
        return True

    def _read_admission(
        self, slot: int, bootstrap_host: str, bootstrap_port: int, room: int, session: str | None,
        claim: _Claim,
    ) -> _Admitted | None:  # fmt: skip
        """The admission worker's job: the hand-off, then the admission blocks and summaries into the
        request's pages (allocated by SGLang, its alone until it is freed: ``release_slot`` waits once the
        job has claimed them)."""
        found = self._get_handoff(bootstrap_host, bootstrap_port, room, session)
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

    @staticmethod
    def _reachable(handoff: Handoff, bootstrap_host: str) -> Handoff:
        """The hand-off with its Mooncake sessions reachable from here (``reachable``)."""
        layout, draft = handoff.layout, handoff.draft
        return dataclasses.replace(
            handoff,
            layout=None if layout is None else dataclasses.replace(layout, session=reachable(layout.session, bootstrap_host)),
            draft=None if draft is None else dataclasses.replace(draft, session=reachable(draft.session, bootstrap_host)),
        )  # fmt: skip

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
        local = draft_pool()
        if handoff.draft is None or local is None:
            return 0
        if self._draft_fetcher is None:
            self._draft_fetcher = RemotePartialFetcher(
                self.endpoint, *pool_buffers(local), self.backend.block_size
            )
        fetcher = self._draft_fetcher
        everything = torch.ones((handoff.draft.num_layers, handoff.draft.num_pages), dtype=torch.bool)
        reads = fetcher.admit(slot, handoff.draft, local_pages, everything, cached_blocks, have_last=True)
        fetcher.release(slot)  # all present: nothing to read later
        return reads.admission_bytes

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
            pending = self._admitting.pop(slot, None)
        began = False  # its job had started: not a request that never began its admission here
        if pending is not None:
            began = not pending.job.cancel()
            if began and pending.claim.withdraw():  # its reads write into the slot's pages:
                try:  # wait for them before SGLang hands the pages on (a failed one released its room)
                    admitted = pending.job.result()
                except Exception:  # its error went to the request (``admission_error``, ``admit``)
                    admitted = None
                if admitted is not None:
                    staged = (pending.generation, admitted.url, admitted.room)
        self.fetcher.release(slot)
        release = None if staged is None else (staged[1], staged[2])
        if release is None and not began and bootstrap is not None:
            url = self._endpoints.get(bootstrap[:2])
            release = None if url is None else (url, bootstrap[2])
        if release is not None:
            try:
                self._releases.put_nowait(release)
            except queue.Full:
                logger.warning("oasis: %d hand-off releases pending; room %d expires by its TTL", RELEASE_QUEUE,
                               release[1])  # fmt: skip

    def _release_worker(self) -> None:
        while True:
            self._release_remote(*self._releases.get())

    @staticmethod
    def _release_remote(url: str, room: int) -> None:
        try:
            _open(f"{url}/handoff/{room}", "DELETE").read()
        except (urllib.error.URLError, OSError) as error:  # the prefill node is gone: nothing to release
            logger.info("oasis: releasing bootstrap room %d at %s failed: %s", room, url, error)
