"""Min/max key summaries of every host block, per layer and KV head, kept in device memory.

In sparse mode SGLang's KV pool is the host tier and its pages are the blocks (page size = block size),
so a block is named by its page id: ``page = token_location // block_size``. Keying summaries by page
rather than by request means a prefix shared through the radix cache is summarised once.

    kmin[layer, page, head, :] = element-wise min of the keys written to that page so far
    kmax[layer, page, head, :] = element-wise max

A page's summary restarts when its first token (offset 0) is written, so a recycled page never mixes
with its previous owner's keys. Each restart also bumps the page's ``epoch`` (counted at one layer,
``epoch_layer``): a page holds the same KV for as long as its epoch is unchanged, which is what lets a
working set that copied the page earlier be reused by another request (warm start). The epochs are the
host plan's bookkeeping (warm starts read them): a host tensor whatever the device, never read by the
decode program.
"""

from __future__ import annotations

import torch

from sgl_kernel_oasis import ops


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
        epoch_layer: int = 0,
    ) -> None:
        self.block_size = block_size
        shape = (num_layers, num_pages, num_kv_heads, head_dim)
        self.kmin = torch.zeros(shape, dtype=dtype, device=device)
        self.kmax = torch.zeros(shape, dtype=dtype, device=device)
        self.epoch = torch.zeros(num_pages, dtype=torch.int64)
        self.epoch_layer = epoch_layer  # the first sparse layer (-1: none; every layer dense)

    @property
    def nbytes(self) -> int:
        return self.kmin.numel() * self.kmin.element_size() * 2

    def update(self, layer: int, locations: torch.Tensor, keys: torch.Tensor) -> None:
        """Fold newly written keys (``[n, kv_heads, head_dim]`` at pool ``locations`` ``[n]``) in."""
        if layer == self.epoch_layer:
            self.restart_epochs(locations)
        ops.update_page_summaries(self.kmin[layer], self.kmax[layer], locations, keys, self.block_size)

    def restart_epochs(self, locations: torch.Tensor) -> None:
        """Bump the epoch of every page whose first token is among the written ``locations``."""
        if locations.numel():
            locations = locations.cpu().to(torch.int64)  # an eager step's (a captured pass's: host already)
            self.epoch[locations[locations % self.block_size == 0] // self.block_size] += 1

    def recycle(self, pages: torch.Tensor) -> None:
        """``pages`` now hold other KV, written without ``update`` (a PD arrival's pages, read from the
        prefill node): bump their epochs, so records made of them before no longer match."""
        self.epoch[pages] += 1

    def lookup(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kmin, kmax)`` of the given pages: each ``[len(pages), kv_heads, head_dim]``."""
        return self.kmin[layer, pages], self.kmax[layer, pages]
