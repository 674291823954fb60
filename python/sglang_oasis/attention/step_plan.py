"""What the captured decode step (``decode_program.py``) is compiled for and what it reads per pass: the
step's compile-time shape (``StepShape``) and the host-built plan of one batch (``StepPlan``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch

from sglang_oasis.memory.working_set import EMPTY

if TYPE_CHECKING:
    from sglang_oasis.config import OasisConfig
    from sglang_oasis.memory.device_tier import DeviceTier

HELD_STEP = 8  # the attended slots' width grows by this (at least 2: torch specializes a size of one)


class StepShape(NamedTuple):
    """The compile-time constants of a captured step (the batch and block dimensions are symbolic:
    ``StepPlan.mark_symbolic``)."""

    block_size: int
    span: int  # active-block ring positions per request slot (``ActiveBlocks.span``)
    sink_blocks: int
    max_top_k: int  # the largest K a row may have (``--oasis-recall-max-top-k``): the top-K width
    fetch_ratio: float  # per-head cap = ceil(ratio x the row's K); >= 1: no cap
    copies: int  # M: the copies per KV head and step the graph has room for
    padding_slot: int  # request slot padding rows (and masked copies) write into
    # --oasis-selector codes: each head's m x K best blocks by the bound are scored by their coded keys
    # (m = --oasis-code-candidates; 0: every full block); None: the bound alone (the summaries selector)
    code_candidates: int | None = None

    @classmethod
    def of(cls, config: OasisConfig, span: int, slots_per_head: int, padding_slot: int) -> StepShape:
        """From ``OasisConfig``: ``copies`` = the largest fetch cap + 1 (a decode step fills at most one
        block per request), or every slot without a cap."""
        if config.fetch_ratio >= 1:
            copies = slots_per_head
        else:
            copies = min(slots_per_head, math.ceil(config.fetch_ratio * config.max_top_k) + 1)
        codes = config.code_candidates if config.selector == "codes" else None
        return cls(config.block_size, span, config.sink_blocks, config.max_top_k, float(config.fetch_ratio),
                   copies, padding_slot, codes)  # fmt: skip


class StepPlan(NamedTuple):
    """One decode batch as every layer's captured step reads it (host-built; rows padded to ``bs``)."""

    slots: torch.Tensor  # [bs] int64 request slots (padding rows: the padding slot)
    seq_lens: torch.Tensor  # [bs] int64 tokens including this step's (padding rows: 1)
    locs: torch.Tensor  # [bs] int64 host-tier location of this step's token (padding rows: 0)
    pages: torch.Tensor  # [bs, N] int64 host page of each logical block (padding: 0)
    step: torch.Tensor  # [] int64 the decode step (a tensor: a new step is not a new graph)
    # A verify pass (R query rows per request: the real token, then R - 1 draft tokens): the drafts'
    # host-tier locations [bs, R - 1] and which rows each row sees [bs, R, R] bool. None: plain decode.
    draft_locs: torch.Tensor | None = None
    tree: torch.Tensor | None = None
    # The recall probe's (``recall_program.py``): each row's own top-K [bs] int64 and recall target [bs]
    # float64 (0: none; None: neither, as in a plan built without the probe), and on a recall-sample pass
    # the rows sampled [bs] bool.
    own_k: torch.Tensor | None = None
    target: torch.Tensor | None = None
    sampled: torch.Tensor | None = None
    # On CPU, the working-set slots attention reads, ``arange(W)`` (``held_slots``): every
    # slot the batch holds a block in is below W, a symbolic size (None: all S slots)
    held: torch.Tensor | None = None

    def to(self, device: torch.device) -> StepPlan:
        """The plan on ``device`` (itself on CPU): what the program reads there."""
        if device.type == "cpu":
            return self
        return self._replace(
            **{name: t.to(device, non_blocking=True) for name, t in self._asdict().items() if t is not None}
        )

    def mark_symbolic(self) -> None:
        """Mark the batch dimension of the plan's tensors and the block dimension of ``pages`` symbolic for
        ``torch.compile``: with the layer's inputs marked too (``symbolic_rows``), one graph serves a kind
        of pass at every batch bucket above one row (torch specializes a dimension of one: a second graph)
        and every block bucket."""
        symbolic_rows(*(t for t in self if t is not None and t.dim() > 0))
        torch._dynamo.maybe_mark_dynamic(self.pages, 1)

    @classmethod
    def build(
        cls, slots: torch.Tensor, seq_lens: torch.Tensor, locs: torch.Tensor, req_to_token: torch.Tensor,
        reqs: torch.Tensor, step: int, shape: StepShape, batch_bucket: int, block_bucket: int,
        draft_locs: torch.Tensor | None = None, tree: torch.Tensor | None = None,
        recall: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    ) -> StepPlan:  # fmt: skip
        """Pad ``bs`` live rows (request ``slots``, SGLang's ``reqs`` rows, ``seq_lens`` with this step's
        token at ``locs``; a verify pass: its ``draft_locs`` and ``tree``; ``recall``: the rows' own K,
        targets and sampled rows (None: not a sample pass)) to ``batch_bucket`` rows and their pages to
        ``block_bucket`` blocks."""
        live, block = len(slots), shape.block_size
        if live > batch_bucket:
            raise ValueError(f"{live} rows do not fit a batch bucket of {batch_bucket}")
        pad = batch_bucket - live
        full = int(seq_lens.max()) // block if live else 0
        if full > block_bucket:
            raise ValueError(f"{full} full blocks do not fit a block bucket of {block_bucket}")
        pages = torch.zeros((batch_bucket, block_bucket), dtype=torch.int64)
        if full:
            pages[:live, :full] = req_to_token[reqs, 0 : full * block : block].to(torch.int64) // block

        def padded(values: torch.Tensor, fill: int) -> torch.Tensor:
            return torch.cat([values.to(torch.int64), torch.full((pad,), fill, dtype=torch.int64)])

        plan = cls(padded(slots, shape.padding_slot), padded(seq_lens, 1), padded(locs, 0), pages,
                   torch.tensor(step, dtype=torch.int64))  # fmt: skip
        if recall is not None:
            own_k, target, sampled = recall
            plan = plan._replace(
                own_k=padded(own_k, 1), target=torch.cat([target.double(), torch.zeros(pad, dtype=torch.float64)]),
                sampled=None if sampled is None else torch.cat([sampled, torch.zeros(pad, dtype=torch.bool)]),
            )  # fmt: skip
        if draft_locs is None or tree is None:
            return plan
        chain = torch.ones(tree.shape[1:], dtype=torch.bool).tril().expand(pad, -1, -1)  # padding rows
        pad_locs = torch.zeros((pad, draft_locs.shape[1]), dtype=torch.int64)
        return plan._replace(draft_locs=torch.cat([draft_locs.to(torch.int64), pad_locs]),
                             tree=torch.cat([tree.to(torch.bool), chain]))  # fmt: skip


def symbolic_rows(*inputs: torch.Tensor) -> None:
    """Mark the batch dimension (the first) of a captured pass's ``inputs`` symbolic: every input of the
    batch's size must be, or the one left static pins the batch size again (a graph per bucket)."""
    for t in inputs:
        torch._dynamo.maybe_mark_dynamic(t, 0)


def held_slots(tier: DeviceTier, slots: torch.Tensor | None) -> torch.Tensor | None:
    """On CPU, the working-set slots a pass's attention reads (``StepPlan.held``): ``arange(W)``, W one past
    the highest slot the batch's request ``slots`` hold a block in (any layer or head), rounded up to
    ``HELD_STEP`` and at most S (``slots`` None: all S, a plan compiled ahead). A working set fills its
    lowest free slots first, so a short context's blocks are all below W. Elsewhere None (every slot): a
    CUDA graph's shapes are fixed, and the Triton form skips empty slots itself."""
    if tier.device.type != "cpu":
        return None
    num_slots = tier.working_sets.num_slots
    width = num_slots
    if slots is not None:
        held = (tier.tables.host["slot_block"][slots] != EMPTY).flatten(0, -2).any(dim=0)  # [S]
        highest = int(held.nonzero().max()) + 1 if bool(held.any()) else 0
        width = min(num_slots, max(HELD_STEP, -(-highest // HELD_STEP) * HELD_STEP))
    return torch.arange(width)


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest of ``buckets`` that holds ``n`` (the last one if none does: the caller refuses)."""
    return next((b for b in buckets if b >= n), buckets[-1])


def powers_of_two(low: int, high: int) -> tuple[int, ...]:
    """``low, 2 low, 4 low, ...`` up to the first at least ``high``."""
    out = [low]
    while out[-1] < high:
        out.append(out[-1] * 2)
    return tuple(out)


def steps_of(low: int, high: int, step: int) -> tuple[int, ...]:
    """``low``, then the multiples of ``step`` above it, up to the first at least ``high``."""
    out = [low]
    while out[-1] < high:
        out.append((out[-1] // step + 1) * step)
    return tuple(out)
