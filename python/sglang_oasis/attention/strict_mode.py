"""Strict device mode, for tests: proof that decode attention reads only the device tier.

``SGLANG_OASIS_STRICT_DEVICE=1`` (read once, when the backend is built):

- decode attention raises when it is given a tensor that is not the device tier's, or when a decode step
  would read an active tail from the host tier (admission steps aside);
- after each sparse layer's decode attention, the host tier's K and V of every block resident in the
  batch's working sets (that layer, that KV head) are overwritten with garbage. A greedy output that
  stays the same proves nothing read them back. Meant for K covering every block: with K < N an evicted
  block selected again is reloaded from the host tier, garbage and all.

The deliberately broken decode attention that proves the garbage reaches anything reading the host
tier is test code (``sglang_oasis_testing/broken_variant.py``, not shipped).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from sglang_oasis.attention.batch_view import BatchView
from sglang_oasis.memory.working_set import EMPTY, WorkingSetPool

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

STRICT_ENV = "SGLANG_OASIS_STRICT_DEVICE"
GARBAGE = 100.0  # large keys dominate any softmax that reads them; large values move any output


class StrictMode:
    @classmethod
    def from_env(cls) -> StrictMode | None:
        value = os.environ.get(STRICT_ENV, "")
        if value in ("", "0"):
            return None
        if value != "1":
            raise ValueError(f"{STRICT_ENV}={value!r}: expected 1 (or 0, off)")
        return cls()

    @staticmethod
    def poison_resident_blocks(
        working_sets: WorkingSetPool,
        req_to_token: torch.Tensor,
        kv_pool: MHATokenToKVPool,
        batch: BatchView,
        layer_id: int,
    ) -> int:
        """Overwrite the host tier's K and V of the blocks resident in the batch's working sets at
        ``layer_id`` (per KV head) with garbage; returns the number of (block, head) pairs overwritten."""
        block = working_sets.block_size
        blocks = working_sets.slot_block[batch.slots, layer_id]  # [bs, H, S]
        rows, heads, slots = (blocks != EMPTY).nonzero(as_tuple=True)
        if not len(rows):
            return 0
        first = blocks[rows, heads, slots] * block
        pages = req_to_token[batch.req_index[rows], first].to(torch.int64) // block
        tokens = pages[:, None] * block + torch.arange(block)  # [n, B]
        heads = heads[:, None]
        for buffer in (kv_pool.get_key_buffer(layer_id), kv_pool.get_value_buffer(layer_id)):
            buffer[tokens.to(buffer.device), heads.to(buffer.device)] = GARBAGE
        return len(rows)
