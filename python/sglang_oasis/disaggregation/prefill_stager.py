"""The prefill node's side of remote partial fetching: stage each finished prefill's KV in registered host
memory and keep its hand-off until the decode node releases it (or the TTL expires it)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import torch

from sgl_kernel_oasis.key_codes import PER_BYTE
from sglang_oasis.disaggregation.handoff import Handoff, draft_kv_pool, pool_buffers
from sglang_oasis.disaggregation.send_plan import SendPlans
from sglang_oasis.disaggregation.side_channel import HandoffServer, register_handoffs
from sglang_oasis.disaggregation.staging import KVStagingArea, StagedKVLayout
from sglang_oasis.disaggregation.transfer_engine import MooncakeEndpoint
from sglang_oasis.stats import OasisStats

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

logger = logging.getLogger(__name__)

# Fault injection (tests, bench_pd): "<prompt tokens>:<seconds>": hand-offs of prompts that long are
# answered that late (a slow prefill node).
HANDOFF_DELAY_ENV = "SGLANG_OASIS_INJECT_HANDOFF_DELAY"


class StagingSource(Protocol):
    """What the prefill node's stager reads of the attention backend (``OasisAttnBackend``)."""

    block_size: int
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool  # the host tier
    stats: OasisStats

    def finish_pending(self) -> None: ...
    def admission_selection(self, req: int, num_tokens: int) -> torch.Tensor: ...
    def admission_pins(self, req: int, num_tokens: int) -> torch.Tensor | None: ...


class PrefillStager:
    """Prefill side: stages finished prefills and serves their hand-offs until the decode node is done."""

    def __init__(
        self,
        backend: StagingSource,
        host: str,
        bootstrap_port: int,
        engine_rank: int,
        ttl_s: float,
        max_bytes: int = 0,
        tp_size: int = 1,
        key_codes: bool = False,
    ) -> None:
        self.backend = backend
        self.key_codes = key_codes  # --oasis-selector codes: full blocks' key codes are staged too
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
        self.sends = SendPlans(self, backend.stats)  # what each request's send was decided to be
        self._server = HandoffServer(self, host)
        self.url = self._server.url
        # Requests are staged only once decode nodes can find the hand-offs; until then they go whole.
        self.ready = threading.Event()
        registration = (host, bootstrap_port, engine_rank, tp_size, self.url, self.ready)
        threading.Thread(
            target=register_handoffs, args=registration, name="oasis-handoff-register", daemon=True
        ).start()
        threading.Thread(target=self._sweep, name="oasis-staging-sweeper", daemon=True).start()

    def held(self) -> int:
        """Hand-offs kept for decode nodes (staged, or sent whole with their first selection)."""
        with self._lock:
            return len(self._handoffs)

    def staging_bytes(self, num_tokens: int) -> int:
        """What staging a ``num_tokens``-token prompt takes: its KV in whole blocks with its summaries
        (one block's worth per block) and key codes (``key_codes``: a 32nd of the K and V per token in
        float32), and the draft model's KV (no summaries) where there is one."""
        block = self.backend.block_size
        tokens = -(-num_tokens // block) * block

        def per_token(pool: MHATokenToKVPool) -> int:
            k_buffers, _ = pool_buffers(pool)
            return 2 * sum(buffer[0].numel() * buffer.element_size() for buffer in k_buffers)

        draft = draft_kv_pool(self.backend.req_to_token_pool)
        draft_bytes = 0 if draft is None else tokens * per_token(draft)
        target = self.backend.token_to_kv_pool
        k_buffers, _ = pool_buffers(target)
        codes = sum(buffer[0].numel() // PER_BYTE for buffer in k_buffers) if self.key_codes else 0
        return tokens * (per_token(target) * (block + 1) // block + codes) + draft_bytes

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
        self.sends.expire(self.ttl_s, now)
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
        self,
        room: int,
        slot: int,
        num_tokens: int,
        decode_prefix_len: int,
        layout: StagedKVLayout | None,
        draft: StagedKVLayout | None,
    ) -> None:
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

        layout = self.staging.stage(str(room), *gathered(backend.token_to_kv_pool), codes=self.key_codes)
        draft = draft_kv_pool(backend.req_to_token_pool)  # the draft shares the target's token locations
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
        self.sends.forget(room)
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

    def handoff_delay(self, room: int) -> float:
        """Seconds the hand-off server answers room ``room``'s GET late (``HANDOFF_DELAY_ENV``; else 0)."""
        with self._lock:
            delay = self._delay if room in self._slow_rooms else None
        return 0.0 if delay is None else delay[1]

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
