"""sglang-oasis counters, shared between SGLang's scheduler processes (which count) and the HTTP process
(which serves ``GET /oasis/stats`` and Prometheus metrics).

The counters live in a small POSIX shared-memory block named after the server's port; the launcher
creates it before SGLang starts (and removes it at exit), the attention backend attaches to it. Under
tensor parallelism every rank's scheduler counts in its own row of the block (its KV heads' blocks and
bytes); ``snapshot`` aggregates the rows (``aggregate``: bytes and blocks summed, what every rank counts
alike taken once) and ``rank_snapshots`` gives each row.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from sglang_oasis.request_ledger import RequestLedger

logger = logging.getLogger(__name__)

# name -> help. Counters only grow; gauges are current values.
COUNTERS = {
    "requests": "requests admitted in sparse mode",
    "arrived_requests": "requests whose KV arrived from a prefill node (PD decode) rather than an extend here",
    "retracted_requests": "requests SGLang retracted whose selection state was kept",
    "resumed_requests": "retracted requests resumed with their kept selection state (no new admission)",
    "resumed_kv_tokens": "positions whose kept decode K and V a re-prefilled retracted request's extend put back "
    "in place of its recompute",
    "decode_steps": "decode forward passes",
    "captured_decode_passes": "decode passes whose sparse layers ran the compiled step (--oasis-decode-step captured)",
    "captured_compile_ms": "time the captured step's programs took to compile, before the server was ready "
    "(milliseconds; compile_ahead.py)",
    "captured_uncompiled_passes": "decode passes the captured step would have run but its program was not "
    "compiled for (a batch bucket above --cuda-graph-max-bs-decode, say): run eagerly, never a compile stall",
    "triton_extend_layers": "(extend pass, layer) attentions SGLang's Triton backend computed "
    "(--oasis-prefill-attention)",
    "selections": "(request, layer) block selections made",
    "selection_changes": "blocks newly selected into a working set (the sum over selections)",
    "window_selections": "(request, layer) first selections chosen by the prefill window's attention "
    "(--oasis-prefill-window) rather than the block summaries",
    "scored_selections": "(request, layer) selections that scored the block summaries (or the prefill "
    "window's attention) and ran top-K: the request had more blocks than its working set holds",
    "key_code_pages": "--oasis-selector codes: (layer, page) key codes written, each page's keys coded "
    "once a selection first needs them (and again after the page is reused)",
    "blocks_loaded": "blocks copied host -> device into working sets (one block of one KV head counts once)",
    "bytes_host_to_device": "every byte read from the host tier for device-side work: working-set loads "
    "and, at decode steps, active tails, dense layers and summary catch-ups",
    "decode_blocks_loaded": "blocks loaded host -> device at decode steps (admission excluded)",
    "decode_bytes_host_to_device": "bytes read from the host tier at decode steps (admission loads "
    "excluded): working-set loads, active tails, dense layers and summary catch-ups",
    "blocks_just_filled": "blocks that filled up since the last selection and joined a working set",
    "blocks_from_active": "of blocks_just_filled, those copied on the device from the active blocks (no "
    "host read; the others are counted in decode_blocks_loaded)",
    "tail_bytes_host_to_device": "bytes of K and V read from the host tier into the active blocks (the "
    "tokens after the covered blocks that the device does not hold: a PD arrival's prompt tail, and its "
    "whole context at a dense first step); zero in the steady state",
    "dense_layer_bytes_host_to_device": "bytes of K and V that dense layers (--oasis-dense-layers) read "
    "from the host tier at decode steps (every committed token)",
    "catch_up_bytes_host_to_device": "bytes of keys read back from the host tier to fold into the block "
    "summaries (a PD arrival's first step; accepted draft tokens the active blocks do not hold)",
    "blocks_deferred": "predicted blocks the fetch cap left for a later step (counted each step)",
    "foreground_wait_us": "time attention waited for the prefetch pipeline (microseconds)",
    "stage_select_us": "time in the pipeline's prediction and selection stage (microseconds)",
    "stage_transfer_us": "time in the pipeline's planning and transfer stage (microseconds)",
    "transfer_failures": "requests failed because a block transfer failed",
    "warm_starts": "requests whose first working sets started from another request's resident blocks",
    "blocks_reused": "resident blocks a warm start kept (no host transfer; one block of one KV head "
    "in one layer counts once)",
    "staged_requests": "PD prefill node: requests whose full KV was staged for remote partial fetching",
    "remote_requests": "PD decode node: requests admitted by remote partial fetching",
    "staging_whole_sends": "PD prefill node: requests sent whole because staging them would pass "
    "--oasis-remote-fetch-max-staged-mib",
    "staging_unknown_decoder_sends": "PD prefill node: requests sent whole because their decode node has "
    "not asked for a hand-off yet (plain SGLang, no remote fetching, or its first requests)",
    "remote_whole_requests": "PD decode node: requests whose prefill node sent them whole (over its "
    "--oasis-remote-fetch-max-staged-mib, or before it knew this node fetches) with their first "
    "selection, loaded from the KV that arrived",
    "remote_admission_bytes": "PD decode node: KV bytes read from prefill nodes at admission (the union "
    "over KV heads of each request's first selection)",
    "remote_admission_blocks": "PD decode node: (block, layer) pairs read at admission (K and V of every "
    "KV head)",
    "remote_summary_bytes": "PD decode node: block-summary bytes read from prefill nodes at admission",
    "remote_code_bytes": "PD decode node: key-code bytes read from prefill nodes at admission "
    "(--oasis-selector codes: every full block's, a 32nd of its K and V in float32)",
    "remote_miss_bytes": "PD decode node: KV bytes read from prefill nodes after admission (first use of "
    "a block by a working set)",
    "remote_completion_bytes": "PD decode node: KV bytes read from prefill nodes in the background so a "
    "request's KV is whole at its finish (decode radix cache on), or before a retracted request's backup",
    "remote_unshared_finishes": "PD decode node with the decode radix cache: requests that finished before "
    "all their KV arrived, so their KV was not inserted into the radix cache",
    "remote_draft_bytes": "PD decode node: bytes of the EAGLE-3 draft model's KV read from prefill nodes "
    "at admission (all of it: the draft attends every token)",
    "remote_cached_blocks": "PD decode node: (block, layer) pairs not read because the decode radix cache "
    "held them",
    "remote_failed_reads": "PD decode node: requests failed by a failed remote read after admission",
    "recall_samples": "(request, layer, KV head) recall samples taken (--oasis-recall-sample-every)",
    "recall_sum_ppm": "sum of the recall samples in millionths (over an interval: its delta over "
    "recall_samples' is the mean recall)",
    "lookahead_agreement_sum_ppm": "sum of the lookahead agreement samples in millionths (delta over "
    "recall_samples': the mean agreement)",
    "telemetry_bytes": "bytes of keys the recall telemetry read from the host tier (not in "
    "bytes_host_to_device)",
    "recall_below_target": "(request, layer) recall samples whose worst KV head fell below "
    "--oasis-recall-target",
    "recall_target_grows": "(request, layer) working sets the recall target doubled (at admission, by the "
    "prefill window's attention, or at a recall sample below target)",
    "recall_target_shrinks": "(request, layer) working sets the recall target halved back after samples "
    "well above it",
}
GAUGES = {
    "host_tokens_used": "tokens of the host KV tier in use",
    "host_tokens_capacity": "tokens the host KV tier holds",
    "device_working_set_tokens": "tokens resident in device working sets (summed over layers and KV heads)",
    "device_working_set_bytes": "bytes of the device tier's working sets (every request slot)",
    "device_summary_bytes": "bytes of block summaries in the device tier",
    "device_bytes_capacity": "bytes the device tier allocated (summaries, working sets, active blocks and "
    "their index tensors; at most --oasis-device-kv-tokens x KV bytes per token)",
    "device_bytes_budget": "bytes the device tier may allocate: --oasis-device-kv-tokens x KV bytes per token, "
    "or on CUDA, unset, the GPU memory SGLang would have given its KV pool",
    "device_bytes_used": "device-tier bytes in use: the summaries and the request slots of running requests",
    "device_request_slots": "requests the device tier holds working sets for (the running-request cap)",
    "running_requests": "requests holding a device request slot",
    "staged_bytes": "PD prefill node: bytes of staged KV and summaries held for decode nodes",
    "staged_bytes_peak": "PD prefill node: the most bytes of staged KV and summaries held at once "
    "(at most --oasis-remote-fetch-max-staged-mib)",
    # What a leak would leave behind once the server is idle (all 0 then, but kept_retractions: a retracted
    # request SGLang aborts while it waits is never resumed; its state stays, at most 4 per request slot).
    "held_handoffs": "PD prefill node: hand-offs kept for decode nodes (staged or sent whole)",
    "held_fetch_requests": "PD decode node: requests with remote-fetch state (fetcher, staged, arrivals)",
    "held_running_jobs": "selection and transfer jobs still running",
    "held_failures": "failed requests whose failure the scheduler has not taken yet",
    "held_kept_retractions": "retracted requests' kept selection states not resumed yet",
    "recall_target_extra_blocks": "blocks the recall target added to running requests' working sets "
    "above --oasis-top-k (summed over layers and KV heads)",
    "recall_mean_ppm": "mean recall (millionths) over the last recall samples: the exact attention mass "
    "decode attention saw (working set + active tail) out of the whole context, per KV head",
    "recall_p10_ppm": "10th percentile of recall (millionths) over the last recall samples",
    "lookahead_agreement_ppm": "mean share (millionths) of each sampled step's true top-K blocks that the "
    "blocks selected the step before held",
}
# Per layer (GET /oasis/stats reports them as recall_per_layer; Prometheus as the gauge
# sglang_oasis:recall_layer{layer="<id>"}, a fraction): the mean recall of the layer's last samples in
# millionths, plus one (0: never sampled).
MAX_RECALL_LAYERS = 256
LAYER_FIELDS = tuple(f"recall_layer_ppm_{layer}" for layer in range(MAX_RECALL_LAYERS))
FIELDS = (*COUNTERS, *GAUGES, *LAYER_FIELDS)
# How ``snapshot`` folds the ranks' rows (tensor parallelism: each rank holds its own KV heads). Summed
# unless named here: every rank counts these alike (requests, steps, (request, layer) selections: taken
# once, the largest), the slowest rank's time, the tokens every rank's host tier holds alike, the running
# cap (the smallest), and recall figures (the mean over the ranks that sampled, the lowest p10).
ONCE_PER_SERVER = frozenset({
    "requests", "arrived_requests", "retracted_requests", "resumed_requests", "resumed_kv_tokens", "decode_steps",
    "captured_decode_passes", "captured_compile_ms", "captured_uncompiled_passes", "triton_extend_layers", "selections", "window_selections", "scored_selections", "warm_starts",
    "staged_requests", "remote_requests", "staging_whole_sends", "staging_unknown_decoder_sends",
    "remote_whole_requests", "remote_unshared_finishes", "remote_failed_reads", "foreground_wait_us",
    "stage_select_us", "stage_transfer_us", "host_tokens_used", "host_tokens_capacity", "running_requests",
})  # fmt: skip
SMALLEST = frozenset({"device_request_slots", "recall_p10_ppm"})
MEAN_OF_SAMPLED = frozenset({"recall_mean_ppm", "lookahead_agreement_ppm", *LAYER_FIELDS})


def aggregate(rows: np.ndarray) -> dict[str, int]:
    """One value per field from ``[ranks, FIELDS]`` rows (see ``ONCE_PER_SERVER``). A recall gauge is 0
    where a rank never sampled (a layer field: 0, else its mean + 1): those ranks are left out."""
    out: dict[str, int] = {}
    for i, name in enumerate(FIELDS):
        column = rows[:, i]
        if name in ONCE_PER_SERVER:
            out[name] = int(column.max())
        elif name in SMALLEST:
            sampled = column[column > 0] if name == "recall_p10_ppm" else column
            out[name] = int(sampled.min()) if len(sampled) else 0
        elif name in MEAN_OF_SAMPLED:
            sampled = column[column > 0]
            if name in LAYER_FIELDS:  # mean + 1
                out[name] = 1 + round(float((sampled - 1).mean())) if len(sampled) else 0
            else:
                out[name] = round(float(sampled.mean())) if len(sampled) else 0
        else:
            out[name] = int(column.sum())
    return out


def tensor_parallel_rank() -> int:
    """This process's tensor-parallel rank (SGLang's runtime context; 0 where none is published)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        return int(get_parallel().tp_rank)
    except (RuntimeError, ValueError, AttributeError):
        return 0


INJECT_RANK_ENV = "SGLANG_OASIS_INJECT_ON_RANK"  # fault injection: only this tensor-parallel rank fails


def injects_here() -> bool:
    """Whether this process's tensor-parallel rank takes the faults tests inject (``INJECT_RANK_ENV``
    names one; unset: every rank)."""
    on_rank = os.environ.get(INJECT_RANK_ENV)
    return not on_rank or int(on_rank) == tensor_parallel_rank()


def _block_ranks(shm: shared_memory.SharedMemory) -> int:
    """The rank rows a counters' block holds (its header, written by ``OasisStats.create``)."""
    return int(np.ndarray((1,), dtype=np.int64, buffer=shm.buf)[0])


def shm_name(port: int) -> str:
    return f"sglang_oasis_stats_{port}"


class OasisStats:
    """Named int64 counters over a shared-memory block (or process-local memory when ``shm`` is None),
    and ``requests``: each running request's own figures (process-local, ``request_ledger.py``).

    The block holds the number of ranks, then one row of ``FIELDS`` per tensor-parallel rank; this
    object writes row ``rank``."""

    def __init__(
        self, shm: shared_memory.SharedMemory | None, owner: bool, rank: int = 0, ranks: int = 1
    ) -> None:
        self._shm = shm
        self._owner = owner
        if shm is not None:
            ranks = _block_ranks(shm)
        buffer = shm.buf if shm is not None else bytearray(8 * (1 + ranks * len(FIELDS)))
        self._rows = np.ndarray((ranks, len(FIELDS)), dtype=np.int64, buffer=buffer, offset=8)
        self.rank, self.ranks = rank, ranks
        self._values = self._rows[rank]
        self._index = {name: i for i, name in enumerate(FIELDS)}
        self._gauges: dict[str, Any] | None = None
        self._rank_gauges: dict[str, Any] | None = None  # per-rank figures, labelled by rank (ranks > 1)
        self._recall_layer_gauge: Any = None  # LAYER_FIELDS' Prometheus gauge, labelled by layer
        self.requests = RequestLedger()

    @classmethod
    def create(cls, port: int, ranks: int = 1) -> OasisStats:
        """The block of a server on ``port`` with ``ranks`` tensor-parallel ranks."""
        with contextlib.suppress(FileNotFoundError):  # a stale block from a killed server on this port
            stale = shared_memory.SharedMemory(name=shm_name(port))
            stale.close()
            stale.unlink()
        size = 8 * (1 + ranks * len(FIELDS))
        shm = shared_memory.SharedMemory(name=shm_name(port), create=True, size=size)
        header = np.ndarray((1 + ranks * len(FIELDS),), dtype=np.int64, buffer=shm.buf)
        header[:] = 0
        header[0] = ranks
        del header
        return cls(shm, owner=True)

    @classmethod
    def attach(cls, port: int, rank: int | None = None) -> OasisStats:
        """Attach to the launcher's block as ``rank`` (this process's tensor-parallel rank); falls back to local counters if there is none
        (offline Engine) or it has no row for this rank (logged)."""
        try:
            shm = shared_memory.SharedMemory(name=shm_name(port))
        except FileNotFoundError:
            return cls(None, owner=False)
        # Attaching registers the block with this process's resource tracker, which would unlink it when
        # this process exits; the launcher owns it.
        with contextlib.suppress(Exception):
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        ranks = _block_ranks(shm)
        rank = tensor_parallel_rank() if rank is None else rank
        if rank >= ranks:
            logger.warning(
                "oasis: the counters' block has %d rank(s); rank %d counts on its own", ranks, rank
            )
            shm.close()
            return cls(None, owner=False)
        return cls(shm, owner=False, rank=rank)

    def add(self, name: str, value: int = 1) -> None:
        self._values[self._index[name]] += value

    def add_loads(
        self, blocks: int, loads: Sequence[tuple[int, int, int]], bytes_per_block: int, at_decode: bool
    ) -> None:
        """``blocks`` working-set blocks loaded from the host tier, ``loads`` of them ``(request row,
        generation, blocks)``: at decode (a selection job's, a resumed retracted request's) or at admission
        (an extend's first working sets, a PD arrival's hand-off), in the server's counters and each
        request's own figures."""
        nbytes = blocks * bytes_per_block
        self.add("blocks_loaded", blocks)
        self.add("bytes_host_to_device", nbytes)
        if at_decode:
            self.add("decode_blocks_loaded", blocks)
            self.add("decode_bytes_host_to_device", nbytes)
        self.requests.add_loads(loads, bytes_per_block, admission=not at_decode)

    def set(self, name: str, value: int) -> None:
        self._values[self._index[name]] = value

    def snapshot(self) -> dict[str, int]:
        """Every rank's counters and gauges in one (``aggregate``)."""
        if self.ranks == 1:
            return {name: int(self._values[i]) for name, i in self._index.items()}
        return aggregate(np.array(self._rows))

    def rank_snapshots(self) -> list[dict[str, int]]:
        """Each rank's own counters and gauges, by rank."""
        return [dict(zip(FIELDS, (int(v) for v in row), strict=True)) for row in np.array(self._rows)]

    def publish_prometheus(self) -> None:
        """Copy the current values into Prometheus gauges ``sglang_oasis:<name>`` (with --enable-metrics):
        every rank's, aggregated; with more than one rank also this rank's own as
        ``sglang_oasis:rank_<name>{rank="<r>"}``.

        Called from SGLang's scheduler processes, where SGLang has set up prometheus_client's
        multiprocess directory; its ``/metrics`` endpoint then serves them beside SGLang's own.
        """
        if self._gauges is None:
            from prometheus_client import Gauge

            self._gauges = {
                name: Gauge(f"sglang_oasis:{name}", help_text, multiprocess_mode="mostrecent")
                for name, help_text in {**COUNTERS, **GAUGES}.items()
            }
            self._recall_layer_gauge = Gauge(
                "sglang_oasis:recall_layer",
                "mean recall (a fraction) of the layer's last recall samples; layers never sampled are absent",
                labelnames=["layer"],
                multiprocess_mode="mostrecent",
            )
        values = self.snapshot()
        for name, gauge in self._gauges.items():
            gauge.set(values[name])
        if self.ranks > 1:
            self._publish_rank()
        for layer, field in enumerate(LAYER_FIELDS):
            if values[field] > 0:
                self._recall_layer_gauge.labels(layer=str(layer)).set((values[field] - 1) / 1e6)

    def _publish_rank(self) -> None:
        if self._rank_gauges is None:
            from prometheus_client import Gauge

            self._rank_gauges = {
                name: Gauge(f"sglang_oasis:rank_{name}", f"one tensor-parallel rank's {name}: {help_text}",
                            labelnames=["rank"], multiprocess_mode="mostrecent")
                for name, help_text in {**COUNTERS, **GAUGES}.items()
            }  # fmt: skip
        for name, gauge in self._rank_gauges.items():
            gauge.labels(rank=str(self.rank)).set(int(self._values[self._index[name]]))

    def close(self) -> None:
        if self._shm is None:
            return
        del self._values, self._rows
        self._shm.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()
        self._shm = None
