"""``BatchView``: the forward batch as the oasis backend's parts see it, built once per forward pass."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class BatchView(NamedTuple):
    reqs: list[int]  # SGLang's req pool indices
    req_index: torch.Tensor  # [bs] the same, as the index tensor SGLang's tables take
    slots: torch.Tensor  # [bs] their device request slots (-1: not admitted yet)
    generations: list[int]  # SGLang's generation of each request row (who owns it now)
    step: int  # decode steps so far
    # [bs] bool, rows whose selection is an admission (an extend's, or a PD arrival's dense first step):
    # not capped, sized afresh. A decode batch can mix them with ordinary rows (``Selector.select`` then
    # selects each part apart, so no ordinary row is admitted again).
    admitting: torch.Tensor
    # [bs] each request's own top-K (int64) and recall target (float): its ``custom_params`` (see
    # ``request_options.py``), else the server's; None: the server's for every row
    top_k: torch.Tensor | None = None
    target: torch.Tensor | None = None

    @property
    def admission(self) -> bool:
        """Every row is an admission (an extend, or a batch of PD arrivals' dense first steps)."""
        return bool(len(self.reqs)) and bool(self.admitting.all())

    @property
    def admits(self) -> bool:
        """Some row is an admission (host-tier reads of whole tails are expected this step)."""
        return bool(self.admitting.any())

    def subset(self, rows: torch.Tensor) -> BatchView:
        """The requests ``rows`` (``[bs]`` bool) marks, as a batch of their own."""
        keep = rows.tolist()
        return BatchView(
            [req for req, kept in zip(self.reqs, keep, strict=True) if kept],
            self.req_index[rows],
            self.slots[rows],
            [gen for gen, kept in zip(self.generations, keep, strict=True) if kept],
            self.step,
            self.admitting[rows],
            None if self.top_k is None else self.top_k[rows],
            None if self.target is None else self.target[rows],
        )

    def top_ks(self, default: int) -> torch.Tensor:
        """``[bs]`` each row's top-K (``default``: the server's)."""
        return torch.full((len(self.reqs),), default, dtype=torch.int64) if self.top_k is None else self.top_k

    def targets(self, default: float) -> torch.Tensor:
        """``[bs]`` each row's recall target (``default``: the server's; 0: none)."""
        return torch.full((len(self.reqs),), default) if self.target is None else self.target

    @classmethod
    def empty(cls) -> BatchView:
        none = torch.zeros(0, dtype=torch.int64)
        return cls([], none, none, [], 0, torch.zeros(0, dtype=torch.bool))


def extend_prefix_lens(forward_batch: ForwardBatch) -> list[int]:
    """Each request's cached prefix tokens in an extend batch (SGLang's ``ForwardBatch``)."""
    if forward_batch.extend_prefix_lens_cpu is not None:
        return [int(n) for n in forward_batch.extend_prefix_lens_cpu]
    if forward_batch.extend_prefix_lens is not None:
        return [int(n) for n in forward_batch.extend_prefix_lens.tolist()]
    return [0] * len(forward_batch.seq_lens)


def extend_seq_lens(forward_batch: ForwardBatch) -> list[int]:
    """Each request's new tokens in an extend batch (SGLang's ``ForwardBatch``): its rows of q, k and v."""
    if forward_batch.extend_seq_lens_cpu:
        return [int(n) for n in forward_batch.extend_seq_lens_cpu]
    assert forward_batch.extend_seq_lens is not None  # SGLang's ForwardBatch: None outside extends
    return [int(n) for n in forward_batch.extend_seq_lens.tolist()]


def host_ints(forward_batch: ForwardBatch, name: str) -> list[int]:
    """A per-request field of SGLang's ``ForwardBatch`` (``req_pool_indices``, ``seq_lens``) as host ints:
    from SGLang's host copy (``<name>_cpu``) where it keeps one, so a GPU's copy is not read back."""
    host = getattr(forward_batch, f"{name}_cpu", None)
    values = getattr(forward_batch, name) if host is None else host
    return [int(n) for n in values.tolist()]
