"""The device tier's index tables, on the device for the decode program and mirrored on the host for the
host plan.

    slot_block, last_selected   [request slots, layers, KV heads, slots per head]   (``working_set.py``)
    covered, top_k              [request slots, layers]
    pinned                      [request slots, layers, KV heads, window blocks]
    active_start, active_end    [request slots, layers]                             (``active_blocks.py``)
    recall_streak               [request slots, layers]                             (``recall_probe.py``)
    recall                      [request slots, layers, 2, KV heads] float32

Two kinds of code use them. The decode program (``decode_program.py``: a CUDA graph replay, or the step
compiled on CPU) reads and writes ``device``'s, and never syncs. Everything else (the host plan: the eager
step, admissions, warm starts, retractions, the recall probe, the counters) reads and writes ``host``'s,
plain CPU tensors whose values it may read at will. On CPU the two are the same tensors. On CUDA they are
kept equal by two copies per pass the program runs, of the batch's rows only, each one packed copy:

    upload(slots)             host -> device, after the host plan's writes, before the program
    download(slots, counts)   device -> host, after the program, with the pass's counts: the pass's one sync

so between passes the host mirror holds the truth, and a pass that runs eagerly needs no copy at all (the
next program pass uploads the rows it wrote). Rows of slots outside the batch are never copied: the
program reads and writes only its batch's rows (and the padding slot's, which nobody reads).
"""

from __future__ import annotations

import torch

TABLES = (
    "slot_block", "last_selected", "covered", "top_k", "pinned", "active_start", "active_end", "recall_streak",
    "recall",
)  # fmt: skip


class TierTables:
    def __init__(self, host: dict[str, torch.Tensor], device: torch.device | str) -> None:
        if sorted(host) != sorted(TABLES):
            raise ValueError(f"tier tables {sorted(host)}, expected {sorted(TABLES)}")
        self.host = host
        self.device_type = torch.device(device).type
        self.mirrored = self.device_type != "cpu"
        self.device = {name: t.to(device) for name, t in host.items()} if self.mirrored else host
        # bytes per request slot row of each table, in TABLES order (every row is a multiple of 8 bytes)
        self._row_bytes = [t[0].numel() * t.element_size() for t in (host[name] for name in TABLES)]
        if any(n % 8 for n in self._row_bytes):
            raise ValueError(f"tier table rows of {self._row_bytes} bytes: not whole int64 words")

    @property
    def row_bytes(self) -> int:
        """Bytes one request slot's rows take in every table (what a pass copies per row, each way)."""
        return sum(self._row_bytes)

    def upload(self, slots: torch.Tensor) -> None:
        """The host's rows of request ``slots`` (``[n]`` int64, host) into the device's (non-blocking)."""
        if not self.mirrored or not len(slots):
            return
        packed = self._pack(self.host, slots)
        device = self.device["covered"].device
        index = slots.to(device, non_blocking=True)
        for name, rows in zip(TABLES, self._unpack(packed.to(device, non_blocking=True)), strict=True):
            self.device[name].index_copy_(0, index, rows)

    def download(self, slots: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor | None:
        """The device's rows of request ``slots`` (``[n]`` int64, host) into the host's, with ``counts``
        (``[n, c]`` int64 on the device, or None) in the same copy; returns the counts on the host."""
        if not self.mirrored:
            return counts
        if not len(slots):
            return None if counts is None else counts.cpu()
        device = self.device["covered"].device
        packed = self._pack(self.device, slots.to(device, non_blocking=True), counts)
        host = packed.cpu()  # the sync: the program's results, read once
        for name, rows in zip(TABLES, self._unpack(host), strict=True):
            self.host[name][slots] = rows
        return None if counts is None else host[:, self.row_bytes // 8 :]

    def _pack(
        self, tables: dict[str, torch.Tensor], slots: torch.Tensor, counts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[n, words]`` int64: each table's rows of ``slots`` as raw words, then ``counts``."""
        parts = [tables[name][slots].reshape(len(slots), -1).view(torch.int64) for name in TABLES]
        return torch.cat([*parts, counts] if counts is not None else parts, dim=1)

    def _unpack(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """``_pack``'s tables back, each ``[n, *row shape]`` in its dtype (views of ``packed``)."""
        rows, at = [], 0
        for name, nbytes in zip(TABLES, self._row_bytes, strict=True):
            table = self.host[name]
            words = packed[:, at : at + nbytes // 8]
            rows.append(words.contiguous().view(table.dtype).view(len(packed), *table.shape[1:]))
            at += nbytes // 8
        return rows
