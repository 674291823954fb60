"""The recall probe inside the captured decode step (``decode_program.py``): a recall sample and a recall
target's decisions on fixed shapes, no host sync.

``RecallProbe`` (``recall_probe.py``) measures a sampled request eagerly: its queries attend its whole
context exactly, the recall is the mass on what decode attention saw, and with a target a (request,
layer) whose worst KV head falls below it doubles its top-K, or halves it after ``SHRINK_AFTER`` samples
in a row well above. Here the same figures and decisions are tensors over the plan's padded rows:

- ``sample`` (a recall-sample pass: ``plan.sampled``): every row's queries over every position of the
  plan's pages (the block bucket, plus the partial block), masked past each row's position; the sampled
  rows' figures go to the tier's ``recall`` (the host reads them after the pass, ``RecallProbe.fold``),
  their streaks and top-K are updated in place (``recall_streak``, ``top_k``). The host chooses the rows
  (``RecallProbe.begin``); the graph of a sample pass is another graph per bucket, so a plain pass pays
  nothing for it.
- ``keep_holding_every_block`` (any pass with a target): ``Selector._keep_holding_every_block``.

Both run after the layer's attention and before its selection, where the eager step runs them, so the
selection takes the K they leave.
"""

from __future__ import annotations

import torch

from sglang_oasis.attention.decode_ops import at_most
from sglang_oasis.attention.layer_state import LayerState
from sglang_oasis.attention.recall_probe import SHRINK_AFTER, on_ladder
from sglang_oasis.attention.step_plan import StepPlan, StepShape
from sglang_oasis.memory.working_set import EMPTY


def sample(
    shape: StepShape, state: LayerState, plan: StepPlan, query: torch.Tensor, blocks: torch.Tensor,
    covered: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """The sampled rows' recall and lookahead agreement at this layer (``query`` ``[bs, q_heads, D]``, the
    step's real token's; ``blocks`` ``[bs, H, S]`` and ``covered`` ``[bs]`` what the attention saw), into
    ``state.recall``; with a target, its decision. Returns ``[bs, 3]`` counts: below target, grown,
    shrunk (``RecallProbe.hold_target``'s counters)."""
    assert plan.sampled is not None and plan.own_k is not None and plan.target is not None
    assert state.recall is not None and state.recall_streak is not None
    block, slots, seq_lens, pages = shape.block_size, plan.slots, plan.seq_lens, plan.pages
    bs, num_blocks = pages.shape
    heads, device = state.kmin.shape[1], slots.device
    position, full = seq_lens - 1, seq_lens // block

    # Every position 0 .. position of each row (its pages; the partial block is the step's token's page;
    # the step's token at its own location, as a verify pass's committed row is).
    index = torch.arange(num_blocks + 1, device=device)
    page = torch.cat([pages, torch.zeros((bs, 1), dtype=pages.dtype, device=device)], dim=1)
    page = torch.where(index[None, :] < full[:, None], page, (plan.locs // block)[:, None])
    positions = torch.arange((num_blocks + 1) * block, device=device)
    tokens = ((page * block)[..., None] + torch.arange(block, device=device)).flatten(1)  # [bs, T]
    tokens = torch.where(positions[None, :] == position[:, None], plan.locs[:, None], tokens)
    valid = positions[None, :] <= position[:, None]
    keys = state.host_k[tokens].float()  # [bs, T, H, D]
    q = query.float().view(bs, heads, -1, keys.shape[-1])  # [bs, H, G, D]
    logits = torch.einsum("bhgd,bthd->bhgt", q, keys) * scale
    # sums over every position in double: a float sum over more than 4,096 elements makes inductor guard
    # on the length (its accumulation helper), so one graph would not serve every block bucket
    valid_logits = logits.double().masked_fill(~valid[:, None, None, :], float("-inf"))
    mass = torch.softmax(valid_logits, dim=-1).mean(dim=2)

    # What decode attention saw: the working set's blocks, and every block from the covered ones on.
    held = torch.where((blocks != EMPTY) & (blocks < full[:, None, None]), blocks, num_blocks)
    seen = torch.zeros((bs, heads, num_blocks + 1), dtype=torch.bool, device=device).scatter(-1, held, True)
    seen = seen | (index[None, None, :] >= torch.minimum(covered, full)[:, None, None])
    token_block = torch.minimum(positions[None, :] // block, full[:, None])  # [bs, T]
    recall = (
        (mass * seen.gather(-1, token_block[:, None, :].expand(-1, heads, -1))).sum(dim=-1).float()
    )  # [bs, H]

    # Lookahead agreement: the share of the step's true top own-K blocks (by exact mass) it saw.
    block_mass = mass[..., : num_blocks * block].float().reshape(bs, heads, num_blocks, block).sum(dim=-1)
    block_mass = block_mass.masked_fill(index[None, None, :num_blocks] >= full[:, None, None], float("-inf"))
    width = at_most(shape.max_top_k, num_blocks)
    top = block_mass.topk(width, dim=-1).indices
    ranked = torch.minimum(plan.own_k, full)  # [bs]
    within = torch.arange(width, device=device)[None, None, :] < ranked[:, None, None]
    agreed = (seen.gather(-1, top) & within).sum(dim=-1) / ranked.clamp(min=1)[:, None]
    agreement = torch.where((full > 0)[:, None], agreed, 1.0).to(torch.float32)
    state.recall.index_put_((slots,), torch.stack([recall, agreement], dim=1))
    return hold_target(shape, state, plan, recall)


def hold_target(shape: StepShape, state: LayerState, plan: StepPlan, recall: torch.Tensor) -> torch.Tensor:
    """The recall target's decision from the sampled rows' ``recall`` ``[bs, H]`` (``RecallProbe.hold_target``,
    in double as the host compares): each layer's top-K grown, shrunk or kept; ``[bs, 3]`` counts."""
    assert plan.sampled is not None and plan.own_k is not None and plan.target is not None
    assert state.recall_streak is not None
    slots = plan.slots
    targeted = plan.sampled & (plan.target > 0)
    worst = recall.amin(dim=-1).double()
    current, streak = state.top_k[slots], state.recall_streak[slots]
    below = targeted & (worst < plan.target)
    grown = below & (current < shape.max_top_k)
    well = targeted & ~below & (worst >= 1.0 - (1.0 - plan.target) / 4) & (current > plan.own_k)
    streak = torch.where(well, streak + 1, torch.where(targeted, 0, streak))
    shrunk = well & (streak >= SHRINK_AFTER)
    state.recall_streak.index_put_((slots,), torch.where(shrunk, 0, streak))
    top_k = torch.where(grown, (2 * current).clamp(max=shape.max_top_k), current)
    state.top_k.index_put_((slots,), torch.where(shrunk, torch.maximum(plan.own_k, current // 2), top_k))
    return torch.stack([below, grown, shrunk], dim=1).to(torch.int64)


def keep_holding_every_block(
    shape: StepShape, state: LayerState, plan: StepPlan, blocks: torch.Tensor, covered: torch.Tensor
) -> torch.Tensor:
    """``Selector._keep_holding_every_block``: a targeted row whose working set a target grew past its own
    K and that held every block at its last selection grows (up the ladder) to hold the blocks that filled
    up since. Returns ``[bs]`` int64: 1 where it grew."""
    assert plan.own_k is not None and plan.target is not None
    slots, own_k, sinks = plan.slots, plan.own_k, shape.sink_blocks
    full, current = plan.seq_lens // shape.block_size, state.top_k[slots]
    held = (blocks != EMPTY).sum(dim=-1).amin(dim=-1)
    outgrew = (held >= covered) & (plan.target > 0) & (current > own_k) & (full > current + sinks)
    outgrew = outgrew & (current < shape.max_top_k)
    grown = on_ladder(full - sinks, own_k, shape.max_top_k)
    state.top_k.index_put_((slots,), torch.where(outgrew, grown, current))
    return outgrew.to(torch.int64)
