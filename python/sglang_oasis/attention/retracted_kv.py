"""The K and V a retracted request's decode steps computed, kept for its re-prefill (``retraction.py``).

Outside PD, SGLang frees a retracted request's KV and later re-prefills it: an extend over its prompt and
output. That extend would compute the output positions' K and V by dense attention, where the request's
decode steps computed them by sparse attention over their working sets; from there the request's path
differs from the same request served without a retraction. So at the retraction the K and V of those
positions (the prompt's length on) are copied, every layer, and at the re-prefill they replace the
extend's own rows before the layer writes, summarises or attends them. The extend's rows for those
positions are then only a means to the last row (the redone step), which attends sparsely
(``Retractions.attend_resumed``) over exactly the K and V it would have had.

Bounded: ``SAVED_KV_BYTES`` for all kept requests together (beyond it a request is re-prefilled from the
recompute, as before, with a warning). A re-prefill split into chunks gets them back at every chunk
(each writes the rows of its own positions); positions the radix cache matched are in the extend's
prefix and are not rewritten (a cached output position holds what an earlier request put there).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_oasis.attention.batch_view import BatchView

logger = logging.getLogger(__name__)

SAVED_KV_BYTES = 256 << 20  # decode-computed K and V kept for retracted requests, all together


class SavedKV(NamedTuple):
    start: int  # the first position kept (the prompt's length)
    keys: list[torch.Tensor]  # per layer [positions, kv_heads, head_dim]
    values: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys) + sum(t.nbytes for t in self.values)

    @classmethod
    def of(
        cls, kv_pool: MHATokenToKVPool, row: torch.Tensor, start: int, end: int, kept: int, rid: str
    ) -> SavedKV | None:
        """Copies of positions ``[start, end)`` of a request (``row``: its req-to-token row) at every layer
        of ``kv_pool``; None when there are none, or when they and the ``kept`` bytes exceed
        ``SAVED_KV_BYTES``."""
        if end <= start:
            return None
        locs = row[start:end].to(torch.int64)
        layers = range(int(kv_pool.layer_num))
        size = len(locs) * sum(
            kv_pool.get_key_buffer(layer)[0].nbytes + kv_pool.get_value_buffer(layer)[0].nbytes
            for layer in layers
        )
        if kept + size > SAVED_KV_BYTES:
            logger.warning("oasis: retracted request %s's decode KV (%d bytes) not kept: over %d bytes in all; "
                           "its re-prefill recomputes it", rid, size, SAVED_KV_BYTES)  # fmt: skip
            return None
        keys = [kv_pool.get_key_buffer(layer)[locs] for layer in layers]  # copies (an index tensor)
        return cls(start, keys, [kv_pool.get_value_buffer(layer)[locs] for layer in layers])


def put_back(
    saved: Mapping[tuple[int, int], SavedKV], batch: BatchView, layer_id: int, prefix_lens: list[int],
    extend_lens: list[int], k: torch.Tensor | None, v: torch.Tensor | None, kv_heads: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None, int]:  # fmt: skip
    """An extend's new K and V at ``layer_id`` (rows: each request's ``extend_lens`` new tokens after its
    ``prefix_lens``; ``batch``: its ``reqs`` and ``generations``), with the ``saved`` K and V of the
    requests (row, generation) that have them in their positions' rows: copies, and the positions put
    back (``k`` and ``v`` themselves and 0 when there are none)."""
    if not saved or k is None or v is None:
        return k, v, 0
    rows, sources = [], []
    first_row = 0
    for req, generation, prefix, new in zip(
        batch.reqs, batch.generations, prefix_lens, extend_lens, strict=True
    ):
        kv = saved.get((req, generation))
        if kv is not None:
            lo, hi = max(kv.start, prefix), min(kv.start + len(kv.keys[layer_id]), prefix + new)
            if lo < hi:
                rows.append(torch.arange(first_row + lo - prefix, first_row + hi - prefix))
                sources.append((kv, lo - kv.start, hi - kv.start))
        first_row += new
    if not rows:
        return k, v, 0
    k, v = k.clone(memory_format=torch.contiguous_format), v.clone(memory_format=torch.contiguous_format)
    k_rows, v_rows = k.view(k.shape[0], kv_heads, -1), v.view(v.shape[0], kv_heads, -1)
    for at, (kv, lo, hi) in zip(rows, sources, strict=True):
        k_rows[at] = kv.keys[layer_id][lo:hi].to(k.dtype)
        v_rows[at] = kv.values[layer_id][lo:hi].to(v.dtype)
    return k, v, sum(len(at) for at in rows)
