"""``BatchView``: the forward batch as the oasis backend's parts see it, built once per forward pass."""

from __future__ import annotations

from typing import NamedTuple

import torch


class BatchView(NamedTuple):
    reqs: list[int]  # SGLang's req pool indices
    req_index: torch.Tensor  # [bs] the same, as the index tensor SGLang's tables take
    slots: torch.Tensor  # [bs] their device request slots (-1: not admitted yet)
    generations: list[int]  # SGLang's generation of each request row (who owns it now)
    step: int  # decode steps so far
    admission: bool  # an extend, or the dense first step of PD arrivals: selections are not capped

    def subset(self, rows: torch.Tensor) -> BatchView:
        """The requests ``rows`` (``[bs]`` bool) marks, as a batch of their own."""
        keep = rows.tolist()
        return BatchView(
            [req for req, kept in zip(self.reqs, keep, strict=True) if kept],
            self.req_index[rows],
            self.slots[rows],
            [gen for gen, kept in zip(self.generations, keep, strict=True) if kept],
            self.step,
            self.admission,
        )

    @classmethod
    def empty(cls) -> BatchView:
        none = torch.zeros(0, dtype=torch.int64)
        return cls([], none, none, [], 0, False)
