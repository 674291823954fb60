"""Radix sharing and warm starts: SGLang's prefix cache stays on in sparse mode, and a new request whose
cached prefix another request's working sets already cover starts from them.

Shared prefixes cost nothing extra in either tier: the host tier is SGLang's KV pool (a radix hit maps
the same pages) and summaries are keyed by page (``memory/summary_store.py``), so a shared prefix is
stored and summarised once. A page's epoch changes when SGLang reuses the page, so a record made before
the reuse no longer matches. What SGLang needs changed for this is in ``sglang_hooks.py`` (a request
whose transfer failed is never inserted into the radix cache).

``PrefixRecords`` keeps, per device request slot, the host page and page epoch of each full block as of
the slot's last selection at the recording layer. A new request's cached prefix is matched against
them (``donor``); ``RequestSlots.admit`` then starts it from the donor's resident blocks below the
shared length (the donor slot itself when its request has finished, else a copy).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglang_oasis.memory.device_tier import DeviceTier


class PrefixRecords:
    def __init__(self, tier: DeviceTier, req_to_token: torch.Tensor, block_size: int) -> None:
        self.tier = tier
        self.req_to_token = req_to_token
        self.block_size = block_size
        max_blocks = req_to_token.shape[1] // block_size + 1
        # -1 past a slot's recorded blocks
        self.pages = torch.full((tier.num_request_slots, max_blocks), -1, dtype=torch.int64)
        self.epochs = torch.zeros((tier.num_request_slots, max_blocks), dtype=torch.int64)

    def forget(self, slot: int) -> None:
        self.pages[slot] = -1

    def record(
        self, slots: torch.Tensor, pages: torch.Tensor, full: torch.Tensor, epoch: torch.Tensor
    ) -> None:
        """After a selection at the recording layer: the batch's slots (``[bs]``) hold blocks of these
        host ``pages`` (``[bs, N]``; ``full`` ``[bs]`` of them are full) at their current epochs."""
        num_blocks = pages.shape[1]
        host_pages = pages.cpu()
        self.pages[slots] = -1
        self.pages[slots, :num_blocks] = torch.where(torch.arange(num_blocks) < full[:, None], host_pages, -1)
        self.epochs[slots, :num_blocks] = epoch[host_pages]

    def donor(
        self, req: int, prefix: int, epoch: torch.Tensor, failed: Callable[[int, int], bool]
    ) -> tuple[int, int] | None:
        """``(donor slot, shared blocks)``: the slot whose recorded leading pages match the most of
        ``req``'s cached prefix blocks (same pages, unchanged epochs); None if none matches. A slot
        whose request's transfer failed (``failed(req, generation)``) may map blocks that never arrived
        and donates nothing."""
        block = self.block_size
        shared_max = prefix // block
        if shared_max == 0:
            return None
        pages = self.req_to_token[req, 0 : shared_max * block : block].cpu().to(torch.int64) // block
        epochs = epoch[pages]
        # Candidates first by their first block (cheap), then the shared length over those only.
        first = ((self.pages[:, 0] == pages[0]) & (self.epochs[:, 0] == epochs[0])).nonzero().flatten()
        candidates = []
        for slot in first.tolist():
            owner = self.tier.owner(slot)
            if owner is not None and not failed(*owner):
                candidates.append(slot)
        if not candidates:
            return None
        index = torch.tensor(candidates, dtype=torch.int64)
        same = (self.pages[index, :shared_max] == pages) & (self.epochs[index, :shared_max] == epochs)
        shared = same.to(torch.int64).cumprod(dim=1).sum(dim=1)
        best = int(shared.argmax())
        return candidates[best], int(shared[best])
