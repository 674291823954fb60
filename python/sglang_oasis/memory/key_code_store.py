"""Key codes of every full host block, per layer and KV head, kept in device memory beside the
summaries (``--oasis-selector codes``; ``sgl_kernel_oasis.key_codes``).

    codes[layer, page, token, head, :] = the page's token's key, 2 bits per channel within the page's
                                          min/max box (``head_dim / 4`` bytes)

A page is coded once it is full (its keys and its box no longer change): by every selection of its
request (``ensure``: its keys read from the host tier, its box from the summaries), by a catch-up that
folds its keys in late (``KVIntake.catch_up``), and in a captured step by the program that filled it
(``coded_selection.py``: codes only, a full page's codes being what ``ensure`` would write).
``coded[layer, page]`` is the summaries' epoch of the page when ``ensure`` coded it (-1: never): a
recycled page (a new epoch, ``summary_store.py``) is coded again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sgl_kernel_oasis.key_codes import PER_BYTE, coded_block_mass, encode_key_codes
from sglang_oasis.memory.summary_store import BlockSummaryStore

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool


class KeyCodeStore:
    def __init__(
        self,
        summaries: BlockSummaryStore,
        num_layers: int,
        num_pages: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
    ) -> None:
        if head_dim % PER_BYTE:
            raise ValueError(
                f"--oasis-selector codes: head_dim {head_dim} is not a multiple of {PER_BYTE} "
                "(--oasis-selector summaries serves any head_dim)"
            )
        self.summaries = summaries
        self.block_size = summaries.block_size
        shape = (num_layers, num_pages, self.block_size, num_kv_heads, head_dim // PER_BYTE)
        self.codes = torch.zeros(shape, dtype=torch.uint8, device=device)
        self.coded = torch.full((num_layers, num_pages), -1, dtype=torch.int64)  # host: the job's plan

    def ensure(self, layer: int, pages: torch.Tensor, kv_pool: MHATokenToKVPool) -> int:
        """Code the full ``pages`` (host page ids, any shape, on any device) not coded at their current
        epoch; returns how many were coded."""
        pages = pages.flatten().to("cpu", torch.int64).unique()  # the plan is the host's (``coded``)
        epochs = self.summaries.epoch[pages]
        changed = self.coded[layer, pages] != epochs
        stale = pages[changed]
        if not len(stale):
            return 0
        block = self.block_size
        tokens = (stale[:, None] * block + torch.arange(block)).flatten()
        buffer = kv_pool.get_key_buffer(layer)
        device = self.codes.device
        keys = buffer[tokens.to(buffer.device)].to(device).view(len(stale), block, *buffer.shape[1:])
        on_device = stale.to(device)
        kmin, kmax = self.summaries.lookup(layer, on_device)
        self.codes[layer, on_device] = encode_key_codes(keys, kmin, kmax)
        self.coded[layer, stale] = epochs[changed]
        return len(stale)

    def arrived(self, pages: torch.Tensor) -> None:
        """Full ``pages`` whose codes of every layer were written from elsewhere (a PD decode node reads
        them from the prefill node with their summaries, after the summaries recycled their epochs): coded
        at their current epochs, so ``ensure`` never codes them from keys not read yet."""
        pages = pages.to(torch.int64).cpu()
        self.coded[:, pages] = self.summaries.epoch[pages]

    def block_mass(
        self,
        layer: int,
        queries: torch.Tensor,
        pages: torch.Tensor,
        full: torch.Tensor,
        scale: float,
        candidates: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[bs, kv_heads, N]``: each request's full blocks' (or each KV head's ``candidates``') attention
        mass for its query ``[bs, q_heads, dim]`` over their decoded keys (``coded_block_mass``); blocks
        beyond ``full`` and outside the candidates score 0."""
        summaries, device = self.summaries, self.codes.device
        return coded_block_mass(
            queries.to(device),
            summaries.kmin[layer],
            summaries.kmax[layer],
            self.codes[layer],
            pages.to(device),
            full,
            scale,
            None if candidates is None else candidates.to(device),
        )
