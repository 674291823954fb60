"""The oasis backend's gauges: set once (capacities), and refreshed by a background thread, since they
change when requests finish, which no forward pass sees while the server is idle. The thread only reads
and publishes; it releases nothing (remote staging is released from SGLang's request lifecycle,
``sglang_hooks.release_freed_rows``)."""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Protocol

from sglang_oasis.attention.request_slots import RequestSlots
from sglang_oasis.stats import OasisStats

if TYPE_CHECKING:
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_oasis.attention.pd_node import PDNode
    from sglang_oasis.attention.retraction import Retractions
    from sglang_oasis.attention.selector import Selector
    from sglang_oasis.attention.transfer_failures import TransferFailures

logger = logging.getLogger(__name__)


class Gauges:
    _running: ClassVar[weakref.WeakSet[Gauges]] = weakref.WeakSet()

    def __init__(
        self, slots: RequestSlots, kv_pool: MHATokenToKVPool, allocator: BaseTokenToKVPoolAllocator | None,
        stats: OasisStats, export: bool, held: Callable[[], dict[str, int]] | None = None,
    ) -> None:  # fmt: skip
        self.slots = slots
        self.held = held  # the held_* gauges: what a leak would leave once the server is idle
        self.tier = slots.tier
        self.kv_pool = kv_pool
        self.allocator = allocator  # SGLang's token allocator of the host tier (None: not known)
        self.stats = stats
        self.export = export  # --enable-metrics: publish to Prometheus too
        tier = self.tier
        for name, value in (
            ("host_tokens_capacity", int(kv_pool.size)),
            ("device_working_set_bytes", tier.working_sets.nbytes),
            ("device_summary_bytes", tier.summaries.nbytes),
            ("device_bytes_budget", tier.layout.budget_bytes),
            ("device_bytes_capacity", tier.nbytes),
            ("device_request_slots", tier.num_request_slots),
        ):
            stats.set(name, value)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="oasis-gauges", daemon=True)
        self._thread.start()
        Gauges._running.add(self)

    def stop(self) -> None:
        """End the refresh thread (a process that outlives this backend, or exits cleanly, calls it)."""
        self._stopped.set()
        self._thread.join(timeout=5)
        Gauges._running.discard(self)

    @classmethod
    def stop_all(cls) -> None:
        """Stop every refresh thread still running. An interpreter that made backends in-process (the
        unit tests) calls it before it exits: a daemon thread inside a torch op while the interpreter
        tears down aborts the process ("terminate called without an active exception")."""
        for gauges in list(cls._running):
            gauges.stop()

    def refresh(self) -> None:
        live = self.tier.live_slots(self.slots.finished())
        self.stats.set("running_requests", len(live))
        self.stats.set("device_bytes_used", self.tier.used_bytes(len(live)))
        block = self.tier.working_sets.block_size
        self.stats.set("device_working_set_tokens", self.tier.working_sets.resident_blocks(live) * block)
        self.stats.set("recall_target_extra_blocks", self.tier.working_sets.extra_blocks(live))
        if self.allocator is not None:
            self.stats.set("host_tokens_used", int(self.kv_pool.size - self.allocator.available_size()))
        for name, value in (self.held() if self.held is not None else {}).items():
            self.stats.set(name, value)
        if self.export:
            self.stats.publish_prometheus()

    def _run(self, period_s: float = 0.5) -> None:
        while not self._stopped.is_set():
            try:
                self.refresh()
            except Exception:  # a gauge is not worth a crash; read again next period
                logger.debug("oasis gauge refresh failed", exc_info=True)
            self._stopped.wait(period_s)


class HoldingParts(Protocol):
    """The oasis backend's parts that hold something per request (``OasisAttnBackend``, which imports this
    file)."""

    pd: PDNode
    selector: Selector
    failures: TransferFailures
    retractions: Retractions


def held_by(backend: HoldingParts) -> dict[str, int]:
    """The ``held_*`` gauges of an oasis backend's parts (read from the gauges thread: sizes only)."""
    pd, pipeline = backend.pd, backend.selector.pipeline
    return {
        "held_handoffs": 0 if pd.stager is None else pd.stager.held(),
        "held_fetch_requests": 0 if pd.remote is None else pd.remote.held(),
        "held_running_jobs": pipeline.running(),
        "held_failures": backend.failures.held(),
        "held_kept_retractions": backend.retractions.held(),
    }
