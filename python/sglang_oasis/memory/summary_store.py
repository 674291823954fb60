"""Min/max key summaries of every host block, per layer and KV head, kept in device memory.

In sparse mode SGLang's KV pool is the host tier and its pages are the blocks (page size = block size),
so a block is named by its page id: ``page = token_location // block_size``. Keying summaries by page
rather than by request means a prefix shared through the radix cache is summarised once.

    kmin[layer, page, head, :] = element-wise min of the keys written to that page so far
    kmax[layer, page, head, :] = element-wise max

A page's summary restarts when its first token (offset 0) is written, so a recycled page never mixes
with its previous owner's keys.
"""

from __future__ import annotations

import torch


class BlockSummaryStore:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.block_size = block_size
        shape = (num_layers, num_pages, num_kv_heads, head_dim)
        self.kmin = torch.zeros(shape, dtype=dtype, device=device)
        self.kmax = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.kmin.numel() * self.kmin.element_size() * 2

    def update(self, layer: int, locations: torch.Tensor, keys: torch.Tensor) -> None:
        """Fold newly written keys (``[n, kv_heads, head_dim]`` at pool ``locations`` ``[n]``) in."""
        if locations.numel() == 0:
            return
        locations = locations.to(torch.int64)
        pages = locations // self.block_size
        starts = pages[locations % self.block_size == 0]
        kmin, kmax = self.kmin[layer], self.kmax[layer]
        keys = keys.to(kmin.dtype)
        if starts.numel():
            kmin[starts] = torch.finfo(kmin.dtype).max
            kmax[starts] = torch.finfo(kmax.dtype).min
        flat_min = kmin.view(kmin.shape[0], -1)
        flat_max = kmax.view(kmax.shape[0], -1)
        index = pages[:, None].expand(-1, flat_min.shape[1])
        flat_keys = keys.reshape(keys.shape[0], -1)
        flat_min.scatter_reduce_(0, index, flat_keys, "amin", include_self=True)
        flat_max.scatter_reduce_(0, index, flat_keys, "amax", include_self=True)

    def lookup(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kmin, kmax)`` of the given pages: each ``[len(pages), kv_heads, head_dim]``."""
        return self.kmin[layer, pages], self.kmax[layer, pages]
