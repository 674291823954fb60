"""The prefill window (``--oasis-prefill-window``): a request's first working sets chosen from the exact
attention of its prompt's last queries, which only the extend computes, and the best of those blocks kept
selected for the whole request (``--oasis-window-keep``; beyond the OasisKV paper, as SnapKV's
observation window)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sgl_kernel_oasis import window_block_mass
from sglang_oasis.attention.batch_view import BatchView
from sglang_oasis.config import OasisConfig
from sglang_oasis.stats import OasisStats

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


class PrefillWindow:
    """The window's scores of a prompt's blocks (``prior``) and the pins they choose (``pins``);
    ``pin_shape``: a request's pins per layer, ``[kv_heads, pin slots]``."""

    def __init__(
        self,
        config: OasisConfig,
        kv_pool: MHATokenToKVPool,
        req_to_token_pool: ReqToTokenPool,
        pin_shape: torch.Size,
        stats: OasisStats,
    ) -> None:
        self.config = config
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        self.num_kv_heads, self.pin_slots = int(pin_shape[0]), int(pin_shape[1])
        self.stats = stats

    def prior(
        self,
        batch: BatchView,
        layer: RadixAttention,
        q_rows: torch.Tensor,
        last_rows: list[int],
        extend_lens: list[int],
        seq_lens: list[int],
    ) -> torch.Tensor | None:
        """``[bs, kv_heads, N]`` scores for the first working sets: each full block's share of the exact
        attention of the last (up to) ``window`` new tokens' queries (a fraction of the KV head's total,
        partial tail included); None when the window is off or every request keeps all its blocks
        anyway."""
        window, block = self.config.prefill_window, self.config.block_size
        full = [n // block for n in seq_lens]
        holds = [k + self.config.sink_blocks for k in batch.top_ks(self.config.top_k).tolist()]
        if window == 0 or all(n <= held for n, held in zip(full, holds, strict=True)):
            return None
        keys = self.kv_pool.get_key_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        prior = torch.zeros((len(seq_lens), self.num_kv_heads, max(full)))
        for row, (req, last, new, total) in enumerate(
            zip(batch.reqs, last_rows, extend_lens, seq_lens, strict=True)
        ):
            if full[row] <= holds[row] or not bool(batch.admitting[row]):
                continue  # keeps every block: nothing to rank (or a resumed request: no admission)
            rows = min(window, new)
            locs = req_to_token[req, :total].to(torch.int64)
            mass = window_block_mass(q_rows[last - rows + 1 : last + 1], keys[locs], block, layer.scaling)
            group = q_rows.shape[1] // self.num_kv_heads  # query heads per KV head
            prior[row, :, : full[row]] = mass.cpu() / (rows * group)
            self.stats.add("window_selections")
        return prior

    def pins(self, prior: torch.Tensor | None, full: torch.Tensor, own_k: torch.Tensor) -> torch.Tensor:
        """``[bs, kv_heads, pin slots]`` block ids the window keeps selected (-1: none): the best
        ``window_blocks_for(K)`` by ``prior`` (``own_k``: each request's K) for requests with more blocks
        than their working sets hold."""
        pins = torch.full((len(full), self.num_kv_heads, self.pin_slots), -1, dtype=torch.int64)
        if prior is None:
            return pins
        over = full > own_k + self.config.sink_blocks  # only these have a prior; they have more blocks
        counts = torch.tensor([self.config.window_blocks_for(k) for k in own_k.tolist()])
        width = min(pins.shape[-1], prior.shape[-1])
        valid = torch.arange(prior.shape[-1])[None, None, :] < full[:, None, None]
        best = prior.masked_fill(~valid, float("-inf")).topk(width, dim=-1).indices
        best = best.masked_fill(torch.arange(width)[None, None, :] >= counts[:, None, None], -1)
        pins[over, :, :width] = best[over]
        return pins
