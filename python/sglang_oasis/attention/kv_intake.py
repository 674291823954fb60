"""Where each forward pass's new keys and values go besides the host tier: the block summaries and the
active blocks, both in the device tier.

An extend folds its new keys into the summaries and stores its last tokens in the active blocks; a
decode step its token (``SparseAttention.advance`` stores it in the active blocks); a verify step its
real row, and the drafts once accepted (``catch_up``). ``summarised[req, layer]`` is the position up to
which a request's keys are in the summaries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang_oasis.attention.batch_view import BatchView
from sglang_oasis.attention.sparse_attention import SparseAttention
from sglang_oasis.memory.active_blocks import concat_ranges
from sglang_oasis.memory.device_tier import DeviceTier

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool


class KVIntake:
    def __init__(
        self, tier: DeviceTier, attention: SparseAttention, kv_pool: MHATokenToKVPool, request_rows: int
    ) -> None:
        self.summaries = tier.summaries
        self.codes = tier.codes  # --oasis-selector codes
        self.active = tier.active
        self.attention = attention
        self.kv_pool = kv_pool
        self.num_kv_heads = int(kv_pool.head_num)
        # Per request (SGLang's req pool row) and layer: positions whose keys are in the summaries
        # (speculative verify commits drafts only after the forward pass that wrote them).
        self.summarised = torch.zeros((request_rows, int(kv_pool.layer_num)), dtype=torch.int64)

    def summarise(self, batch: BatchView, layer_id: int, locations: torch.Tensor, keys: torch.Tensor,
                  upto: torch.Tensor) -> None:  # fmt: skip
        """Fold the keys at host ``locations`` in; the batch's requests are summarised up to ``upto``."""
        self.summaries.update(layer_id, locations, keys.reshape(len(locations), self.num_kv_heads, -1))
        self.mark(batch.req_index, layer_id, upto)

    def mark(self, reqs: torch.Tensor, layers: int | list[int], upto: torch.Tensor) -> None:
        """Request rows ``reqs`` are summarised up to ``upto`` (a position each) at ``layers``."""
        if isinstance(layers, int):
            self.summarised[reqs, layers] = upto
        else:
            self.summarised[reqs[:, None], torch.tensor(layers)] = upto[:, None]

    def restart(self, req: int, position: int = 0) -> None:
        """Request row ``req``'s keys from ``position`` on are not summarised at any layer (its next
        ``catch_up`` folds them in)."""
        self.summarised[req] = position

    def extend(
        self, batch: BatchView, layer_id: int, seq_lens: torch.Tensor, extend_lens: list[int], locations: torch.Tensor,
        k: torch.Tensor, v: torch.Tensor,
    ) -> None:  # fmt: skip
        """An extend's new tokens (``k``, ``v``: every request's, in order, at host ``locations``): into
        the summaries, and each request's last (up to ``active.span``) into its active blocks."""
        self.summarise(batch, layer_id, locations, k, seq_lens)
        heads, active = self.num_kv_heads, self.active
        new = torch.tensor(extend_lens, dtype=torch.int64)
        first = torch.maximum(seq_lens - new, seq_lens - active.span)
        offsets = torch.cumsum(new, 0) - new  # each request's first new token in k
        tokens = concat_ranges(offsets + first - (seq_lens - new), offsets + new).to(k.device)
        keys = k.reshape(len(locations), heads, -1)[tokens]
        values = v.reshape(len(locations), heads, -1)[tokens]
        active.store(layer_id, batch.slots, first, seq_lens, keys, values)

    def catch_up_layers(self, batch: BatchView, layers: list[int], seq_lens: torch.Tensor) -> None:
        """``catch_up`` at every one of ``layers`` (a captured pass's, before its program); the usual pass,
        nothing to catch up, costs one check, not one per layer."""
        if bool((self.summarised[batch.req_index][:, layers] < seq_lens[:, None]).any()):
            for layer in layers:
                self.catch_up(batch, layer, seq_lens)

    def catch_up(self, batch: BatchView, layer_id: int, seq_lens: torch.Tensor) -> None:
        """Fold in the keys committed since the last summary update, positions ``[summarised, seq_len)``
        of each request: accepted drafts, from the active blocks; an arrival's whole prompt, read back
        from the host tier (counted)."""
        reqs, slots, active = batch.req_index, batch.slots, self.active
        starts = self.summarised[reqs, layer_id]
        if int((seq_lens - starts).clamp(min=0).sum()) == 0:
            return
        held = active.holds(slots, layer_id, starts, seq_lens)
        for rows in (held.nonzero().flatten(), (~held).nonzero().flatten()):
            locations = self.attention.pool_locs(reqs[rows], starts[rows], seq_lens[rows])
            if not len(locations):
                continue
            if bool(held[rows[0]]):
                ring = active.range_rows(slots[rows], starts[rows], seq_lens[rows])
                keys = active.k[layer_id][ring.to(active.k.device)]
            else:
                self.attention.count_host_read(
                    "catch_up_bytes_host_to_device",
                    reqs[rows],
                    (seq_lens[rows] - starts[rows]).clamp(min=0),
                    keys_only=True,
                )
                keys = self.kv_pool.get_key_buffer(layer_id)[locations]
            self.summaries.update(layer_id, locations, keys)
        if self.codes is not None:  # the full blocks folded in late, coded now: a captured step codes only
            block = self.summaries.block_size  # the blocks its own tokens fill
            full = seq_lens // block * block
            locations = self.attention.pool_locs(reqs, starts // block * block, full)
            self.codes.ensure(layer_id, locations[::block] // block, self.kv_pool)
