"""sglang-oasis counters, shared between SGLang's scheduler process (which counts) and the HTTP process
(which serves ``GET /oasis/stats`` and Prometheus metrics).

The counters live in a small POSIX shared-memory block named after the server's port; the launcher
creates it before SGLang starts (and removes it at exit), the attention backend attaches to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import numpy as np

from sglang_oasis.attention.request_ledger import RequestLedger

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
    "selections": "(request, layer) block selections made",
    "selection_changes": "blocks newly selected into a working set (the sum over selections)",
    "window_selections": "(request, layer) first selections chosen by the prefill window's attention "
    "(--oasis-prefill-window) rather than the block summaries",
    "scored_selections": "(request, layer) selections that scored the block summaries (or the prefill "
    "window's attention) and ran top-K: the request had more blocks than its working set holds",
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
    "device_bytes_used": "device-tier bytes in use: the summaries and the request slots of running requests",
    "device_request_slots": "requests the device tier holds working sets for (the running-request cap)",
    "running_requests": "requests holding a device request slot",
    "staged_bytes": "PD prefill node: bytes of staged KV and summaries held for decode nodes",
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


def shm_name(port: int) -> str:
    return f"sglang_oasis_stats_{port}"


class OasisStats:
    """Named int64 counters over a shared-memory block (or process-local memory when ``name`` is None),
    and ``requests``: each running request's own figures (process-local, ``attention/request_ledger.py``)."""

    def __init__(self, shm: shared_memory.SharedMemory | None, owner: bool) -> None:
        self._shm = shm
        self._owner = owner
        buffer = shm.buf if shm is not None else bytearray(8 * len(FIELDS))
        self._values = np.ndarray((len(FIELDS),), dtype=np.int64, buffer=buffer)
        self._index = {name: i for i, name in enumerate(FIELDS)}
        self._gauges: dict[str, Any] | None = None
        self._recall_layer_gauge: Any = None  # LAYER_FIELDS' Prometheus gauge, labelled by layer
        self.requests = RequestLedger()

    @classmethod
    def create(cls, port: int) -> OasisStats:
        with contextlib.suppress(FileNotFoundError):  # a stale block from a killed server on this port
            stale = shared_memory.SharedMemory(name=shm_name(port))
            stale.close()
            stale.unlink()
        shm = shared_memory.SharedMemory(name=shm_name(port), create=True, size=8 * len(FIELDS))
        stats = cls(shm, owner=True)
        stats._values[:] = 0
        return stats

    @classmethod
    def attach(cls, port: int) -> OasisStats:
        """Attach to the launcher's block; falls back to local counters if there is none (offline Engine)."""
        try:
            shm = shared_memory.SharedMemory(name=shm_name(port))
        except FileNotFoundError:
            return cls(None, owner=False)
        # Attaching registers the block with this process's resource tracker, which would unlink it when
        # this process exits; the launcher owns it.
        with contextlib.suppress(Exception):
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        return cls(shm, owner=False)

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
        return {name: int(self._values[i]) for name, i in self._index.items()}

    def publish_prometheus(self) -> None:
        """Copy the current values into Prometheus gauges ``sglang_oasis:<name>`` (with --enable-metrics).

        Called from SGLang's scheduler process, where SGLang has set up prometheus_client's
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
        for layer, field in enumerate(LAYER_FIELDS):
            if values[field] > 0:
                self._recall_layer_gauge.labels(layer=str(layer)).set((values[field] - 1) / 1e6)

    def close(self) -> None:
        if self._shm is None:
            return
        del self._values
        self._shm.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()
        self._shm = None
