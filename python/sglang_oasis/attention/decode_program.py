"""The captured sparse decode step: one sparse layer of a plain decode batch on fixed shapes, no host sync.

The eager step (``sparse_attention.py``, ``selector.py``, ``block_prefetcher.py``) sizes its tensors by
the data (blocks that changed, slots occupied) and asks the host what to do next (``.item()``,
``nonzero``, Python loops over the batch's K values): a CUDA graph cannot capture it and on CPU every
small op pays its dispatch. Here the same step is split as SGLang's graph runners split a backend's
work (and as FlashInfer's ``plan``/``run``)::

    StepPlan.build (host, once per batch; may sync)      decode_layer (per layer; no sync, fixed shapes)
    -----------------------------------------------      -----------------------------------------------
    rows padded to a batch bucket, pages padded to a     the new token into the host tier, its page's
    block bucket, each row's request slot (padding       summary and the active blocks; attention over
    rows: the tier's padding slot), position, host       each KV head's working set (its S slots, on CPU
    location, the step number as a tensor; on CPU the    the ``held`` ones; empty ones masked) + the
    slots held (``held``)                                active tail; scores, top-K
                                                         per row, the capped delta plan and its copies
                                                         (at most ``copies`` per KV head, the rest
                                                         masked into the padding slot)

Shapes: ``bs`` rows (a bucket), ``H`` KV heads, ``S`` working-set slots per head, ``N`` blocks (a bucket
above every row's full blocks), ``B`` tokens per block, ``M`` copies per head and step.

**Who writes what.** During a captured step this program is the only writer of one layer's working sets
(``k``, ``v``, ``slot_block``, ``last_selected``), ``covered``, active blocks and summaries, for the
batch's slots, and with a recall target ``top_k`` and the probe's ``recall_streak`` and ``recall``
(``recall_program.py``: the probe's decisions, which the host makes on the eager step); ``pinned`` it only
reads (the host side sets it, and ``top_k``, at admission and retraction, between steps). No thread
runs beside it: the next step's blocks are copied inside the step (``copy_blocks``: on CPU within one
memory; on CUDA from pinned host memory, on a side stream).

It is the eager step's decision over the padded shape (the same selection, the same plan as
``WorkingSetPool.plan_selections``, the same attention up to the summation order over masked slots), but it
always plans where the eager step skips planning when nothing changed (tested: it then changes nothing).
A recall sample is in it (another graph per bucket: a plain pass pays nothing for it). What it does
not cover runs eagerly (``CapturedStep.prepare``): admissions (PD arrivals), rows whose KV is still partly
on the prefill node, fault injection, the adaptive cap, strict mode, tails the active blocks do not hold.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_kernel_oasis import ops
from sglang_oasis.attention import recall_program
from sglang_oasis.attention.coded_selection import code_blocks, coded_scores
from sglang_oasis.attention.decode_ops import INT64_MAX, Copies, at_most, attend, copy_blocks, fold_summaries
from sglang_oasis.attention.layer_state import LayerState
from sglang_oasis.attention.step_plan import StepPlan, StepShape
from sglang_oasis.memory.working_set import BLOCK_ID_SPAN, EMPTY, stable_ranks

__all__ = ["COUNTS", "LayerState", "StepPlan", "StepShape", "attend_and_plan", "decode_layer"]

# Per row, what ``decode_layer`` returns in its counts (columns); the last three: a recall target's
# decisions (``recall_program.py``)
COUNTS = ("loads", "fresh", "from_active", "deferred", "scored", "overflow", "below_target", "target_grows",
          "target_shrinks")  # fmt: skip


def decode_layer(
    shape: StepShape, state: LayerState, plan: StepPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One sparse layer's decode step for ``bs`` rows: ``q`` ``[bs, q_heads, D]``, ``k``, ``v`` ``[bs, H,
    D]`` (this step's token). Returns the attention output ``[bs, q_heads, D]`` and per-row counts ``[bs,
    len(COUNTS)]`` of the copies it made for the next step. Writes the layer's state in place.

    A verify pass (``plan.tree``): ``q`` ``[bs, R, q_heads, D]``, ``k``, ``v`` ``[bs, R, H, D]``, output
    ``[bs, R, q_heads, D]``. Row 0 (the real token, committed whatever the verification decides) is this
    step's token above; the drafts' tokens go to the host tier and, uncommitted, into the active blocks'
    ring after it (where the next pass finds an accepted one, ``KVIntake.catch_up``)::

        keys per request and KV head: | working set | active tail (< position) | row 0 | row 1 | ...
        row r sees:                   |     all     |          all             | tree[r] (rows 0..r)

    and the last row's query (the draft's: the lookahead) selects the next step's blocks."""
    out, counts, copies = attend_and_plan(shape, state, plan, q, k, v, scale)
    copy_blocks(state, copies)
    return out, counts


def attend_and_plan(
    shape: StepShape, state: LayerState, plan: StepPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, Copies]:  # fmt: skip
    """``decode_layer`` but its copies, which it returns."""
    layer = LayerPass(shape, state, plan)
    k_rows, v_rows = (k[:, None], v[:, None]) if plan.tree is None else (k, v)  # [bs, R, H, D]
    ring = store_token(layer, k_rows, v_rows)
    held = Held(state.slot_block[plan.slots], state.covered[plan.slots])  # before the plan changes them
    out = attend_working_sets(layer, q, held, ring, scale)
    query = q if plan.tree is None else q[:, -1]  # the selection's (a verify pass: the last draft row's)
    recall = probe_recall(layer, q, held, scale)
    choice = select_blocks(layer, query, scale)
    delta = plan_delta(layer, held, choice)
    copies, counts = plan_copies(layer, held, ring, choice, delta)
    return out, torch.cat([counts, recall], dim=1), copies


class LayerPass(NamedTuple):
    """What every section of a layer's step reads: the compile-time shape, the layer's state, the pass's
    plan."""

    shape: StepShape
    state: LayerState
    plan: StepPlan


class Held(NamedTuple):
    """The batch's working sets as the pass found them: each slot's blocks ``[bs, H, S]`` (EMPTY where
    free) and full blocks covered by the last selection ``[bs]``."""

    blocks: torch.Tensor
    covered: torch.Tensor


class Ring(NamedTuple):
    """Where a pass's tokens went in the active blocks' ring: their ring rows ``[bs, R]`` and each row's
    active range ``[start, end)`` after them."""

    rows: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor


class Choice(NamedTuple):
    """A selection for the next step: the blocks each KV head should hold ``[bs, H, N]``, their load
    priority, which rows had more full blocks than their working sets hold ``[bs, 1, 1]``, their full
    blocks ``[bs]`` and K ``[bs]``."""

    selected: torch.Tensor
    priority: torch.Tensor
    over: torch.Tensor
    full: torch.Tensor
    top_k: torch.Tensor


class Delta(NamedTuple):
    """``plan_delta``'s answer: per head, which ranks take a load ``[bs, H, ranks]``, into which
    working-set slot and of which block; the loads deferred by the cap ``[bs]`` and the blocks missing per
    head ``[bs, H, 1]``."""

    take: torch.Tensor
    dest: torch.Tensor
    new_blocks: torch.Tensor
    deferred: torch.Tensor
    missing: torch.Tensor


def store_token(layer: LayerPass, k_rows: torch.Tensor, v_rows: torch.Tensor) -> Ring:
    """1. This step's token (a verify pass: row 0's): the host tier, its page's summary (restarted at the
    page's first token), with codes the blocks' codes, the active blocks' ring; a verify pass's drafts:
    the host tier, the ring."""
    shape, state, plan = layer
    block, span, slots, locs = shape.block_size, shape.span, plan.slots, plan.locs
    position, rows = plan.seq_lens - 1, k_rows.shape[1]
    state.host_k.index_put_((locs,), k_rows[:, 0].to(state.host_k.dtype))
    state.host_v.index_put_((locs,), v_rows[:, 0].to(state.host_v.dtype))
    if plan.draft_locs is not None:
        drafts = plan.draft_locs.flatten()
        state.host_k.index_put_((drafts,), k_rows[:, 1:].flatten(0, 1).to(state.host_k.dtype))
        state.host_v.index_put_((drafts,), v_rows[:, 1:].flatten(0, 1).to(state.host_v.dtype))
    fold_summaries(state, locs, k_rows[:, 0].to(state.kmin.dtype), block)
    if state.codes is not None:  # --oasis-selector codes: the rows' last two full blocks coded
        code_blocks(state, plan, block)
    new_rows = slots[:, None] * span + (position[:, None] + torch.arange(rows, device=slots.device)) % span
    state.active_k.index_put_((new_rows.flatten(),), k_rows.flatten(0, 1).to(state.active_k.dtype))
    state.active_v.index_put_((new_rows.flatten(),), v_rows.flatten(0, 1).to(state.active_v.dtype))
    start, end = state.active_start[slots], state.active_end[slots]
    joins = (position >= start) & (position <= end)
    stored = position + rows  # ``ActiveBlocks.store`` of positions position .. position + R - 1
    end = torch.where(joins, torch.maximum(end, stored), stored)
    start = torch.maximum(torch.where(joins, start, position), end - span)
    state.active_start.index_put_((slots,), start)
    state.active_end.index_put_((slots,), end)
    return Ring(new_rows, start, end)


def attend_working_sets(
    layer: LayerPass, q: torch.Tensor, held: Held, ring: Ring, scale: float
) -> torch.Tensor:
    """2. Attention: every slot of each KV head's working set (in block order, empty ones masked; on CPU
    only the plan's ``held`` slots, below which every block is), the active tail (positions covered * B ..
    position), this step's token (a verify pass: the tree's rows)."""
    shape, state, plan = layer
    (blocks, covered), block, span = held, shape.block_size, shape.span
    slots, tree = plan.slots, plan.tree
    bs, device, position = slots.shape[0], slots.device, plan.seq_lens - 1
    tail_positions = (covered * block)[:, None] + torch.arange(span - 1, device=device)
    tail_rows = torch.cat([slots[:, None] * span + tail_positions % span, ring.rows], dim=1)
    committed = tail_positions < position[:, None]
    if tree is None:
        tail_valid = torch.cat([committed, torch.ones((bs, 1), dtype=torch.bool, device=device)], dim=1)
    else:  # [bs, R, T + R]
        tail_valid = torch.cat([committed[:, None, :].expand(-1, tree.shape[1], -1), tree], dim=2)
    width = None if plan.held is None else plan.held.shape[0]
    return attend(state, q, slots, blocks, tail_rows, tail_valid, scale, width)


def probe_recall(layer: LayerPass, q: torch.Tensor, held: Held, scale: float) -> torch.Tensor:
    """2b. The recall probe, before the selection takes its K: a sample (the real token's query), and a
    target's growth as blocks fill up (``recall_program.py``); ``[bs, 3]``, COUNTS' last three."""
    (shape, state, plan), (blocks, covered) = layer, held
    recall = torch.zeros((plan.slots.shape[0], 3), dtype=torch.int64, device=plan.slots.device)
    if plan.sampled is not None:
        real = q if plan.tree is None else q[:, 0]
        recall = recall_program.sample(shape, state, plan, real, blocks, covered, scale)
    if plan.target is not None:  # its growths count with the sample's (column 1)
        recall[:, 1] += recall_program.keep_holding_every_block(shape, state, plan, blocks, covered)
    return recall


def select_blocks(layer: LayerPass, query: torch.Tensor, scale: float) -> Choice:
    """3. Selection for the next step (``BlockPrefetcher._choose``): rows with more full blocks than their
    working sets hold keep their sinks, their pinned blocks and their top-K by score (the summaries'
    bound, or with codes the candidates' coded attention mass)."""
    shape, state, plan = layer
    slots, device = plan.slots, plan.slots.device
    bs, heads, num_blocks = slots.shape[0], state.kmin.shape[1], plan.pages.shape[1]
    index = torch.arange(num_blocks, device=device)
    full = plan.seq_lens // shape.block_size
    in_range = (index[None, :] < full[:, None])[:, None, :].expand(-1, heads, -1)  # [bs, H, N]
    top_k = state.top_k[slots]
    over = (full > top_k + shape.sink_blocks)[:, None, None]
    if shape.code_candidates == 0:  # --oasis-selector codes on every full block: their coded attention mass
        scores = coded_scores(shape, state, plan.pages, query, None, in_range, top_k, scale)
    else:  # the summaries' bound: Triton's kernel on CUDA (in the graph; no sync), the reference on CPU
        bound = ops.score_paged_blocks(query[:, None], state.kmin, state.kmax, plan.pages)  # [bs, 1, H, N]
        scores = bound[:, 0]
        if shape.code_candidates is not None:  # codes on the bound's best m x K: their coded attention mass
            scores = coded_scores(shape, state, plan.pages, query, scores, in_range, top_k, scale)
    pins = state.pinned[slots]
    pinned = torch.zeros((bs, heads, num_blocks + 1), dtype=torch.bool, device=device)
    pinned = pinned.scatter(-1, torch.where(pins >= 0, pins, num_blocks), True)[..., :num_blocks]
    scores = scores.masked_fill(pinned, float("inf"))
    sinks = (index < shape.sink_blocks)[None, None, :]
    width = at_most(shape.max_top_k, num_blocks)
    best = scores.masked_fill(sinks | ~in_range, float("-inf")).topk(width, dim=-1).indices
    within_k = (torch.arange(width, device=device)[None, :] < top_k[:, None])[:, None, :].expand(
        -1, heads, -1
    )
    chosen = torch.zeros((bs, heads, num_blocks), dtype=torch.bool, device=device).scatter(-1, best, within_k)
    selected = torch.where(over, (chosen | sinks) & in_range, in_range)
    priority = torch.where(over, scores.masked_fill(sinks, float("inf")), 0.0)
    return Choice(selected, priority, over, full, top_k)


def plan_delta(layer: LayerPass, held: Held, choice: Choice) -> Delta:
    """4. The capped delta plan (``WorkingSetPool.plan_selections``, fixed shapes: every rank kept, the
    ones past each head's count masked); writes the working sets' tables."""
    (shape, state, plan), (blocks, covered) = layer, held
    slots, selected, device = plan.slots, choice.selected, plan.slots.device
    bs, heads, num_blocks = selected.shape
    index = torch.arange(num_blocks, device=device)
    last = state.last_selected[slots]
    occupied = blocks != EMPTY
    holds_selected = occupied & selected.gather(-1, blocks.clamp(0, num_blocks - 1))
    resident = torch.zeros((bs, heads, num_blocks + 1), dtype=torch.bool, device=device)
    resident = resident.scatter(-1, torch.where(occupied, blocks, num_blocks), True)[..., :num_blocks]
    missing = selected & ~resident
    fresh = index[None, None, :] >= covered[:, None, None]  # filled up since the last selection
    capped = missing & ~fresh
    rank = stable_ranks(torch.where(capped, -choice.priority, float("inf")))
    admitted = capped & (rank < _fetch_cap(shape, choice.top_k)[:, None, None])
    deferred = (capped & ~admitted).sum(dim=(1, 2))
    missing = missing & (fresh | admitted)
    victim_key = torch.where(occupied, last * BLOCK_ID_SPAN + blocks, -1)
    victims = torch.where(holds_selected, INT64_MAX, victim_key).sort(dim=-1, stable=True).indices
    missing_first = (~missing).to(torch.int8).sort(dim=-1, stable=True).indices  # missing ids, ascending
    ranks = at_most(blocks.shape[-1], num_blocks)
    count = missing.sum(dim=-1, keepdim=True)
    take = torch.arange(ranks, device=device) < count  # [bs, H, ranks]
    dest, new_blocks = victims[..., :ranks], missing_first[..., :ranks]
    blocks = blocks.scatter(-1, dest, torch.where(take, new_blocks, blocks.gather(-1, dest)))
    now_selected = (blocks != EMPTY) & selected.gather(-1, blocks.clamp(0, num_blocks - 1))
    spare = (blocks != EMPTY) & ~now_selected  # a working set shrunk below its slots gives them back
    capacity = choice.top_k + shape.sink_blocks
    excess = (blocks != EMPTY).sum(dim=-1, keepdim=True) - capacity[:, None, None]
    dropped = spare & (stable_ranks(torch.where(spare, last * BLOCK_ID_SPAN + blocks, INT64_MAX)) < excess)
    blocks = blocks.masked_fill(dropped, EMPTY)
    last = last.masked_fill(dropped, EMPTY)
    state.slot_block.index_put_((slots,), blocks)
    state.last_selected.index_put_((slots,), torch.where(now_selected, plan.step, last))
    state.covered.index_put_((slots,), choice.full)
    return Delta(take, dest, new_blocks, deferred, count)


def plan_copies(
    layer: LayerPass, held: Held, ring: Ring, choice: Choice, delta: Delta
) -> tuple[Copies, torch.Tensor]:
    """5. The copies: the first M ranks of each head (the cap keeps a decode step's loads below M); a block
    that just filled up comes from the active blocks, the others from the host tier. Returns them and
    COUNTS' first six per row."""
    shape, plan, covered = layer.shape, layer.plan, held.covered
    block, slots, device = shape.block_size, plan.slots, plan.slots.device
    bs, heads = choice.selected.shape[:2]
    copies = min(shape.copies, delta.take.shape[-1])
    take, dest, new_blocks = (
        delta.take[..., :copies],
        delta.dest[..., :copies],
        delta.new_blocks[..., :copies],
    )
    row = torch.arange(bs, device=device)[:, None, None]
    head = torch.arange(heads, device=device)[None, :, None]
    offsets = torch.arange(block, device=device)
    host_tokens = (plan.pages[row, new_blocks] * block)[..., None] + offsets  # [bs, H, M, B]
    per_slot = shape.span // block
    ring_tokens = ((slots[:, None, None] * per_slot + new_blocks % per_slot) * block)[..., None] + offsets
    just_filled = new_blocks >= covered[:, None, None]
    in_ring = (ring.start[:, None, None] <= new_blocks * block) & (
        (new_blocks + 1) * block <= ring.end[:, None, None]
    )
    from_active = take & just_filled & in_ring
    planned = Copies(
        torch.where(take, slots[:, None, None], shape.padding_slot), head.expand(bs, -1, copies),
        torch.where(take, dest, torch.arange(copies, device=device)), from_active, host_tokens, ring_tokens,
        shape.padding_slot,
    )  # fmt: skip
    per_row = (take, take & just_filled, from_active)  # COUNTS' order
    counts = torch.stack([*(c.sum(dim=(1, 2)) for c in per_row), delta.deferred,
                          choice.over[:, 0, 0].to(torch.int64), (delta.missing.squeeze(-1) > copies).sum(dim=1)],
                         dim=1)  # fmt: skip
    return planned, counts


def _fetch_cap(shape: StepShape, top_k: torch.Tensor) -> torch.Tensor:
    """``[bs]`` blocks per head a row may load besides those that just filled up: ``OasisConfig.fetch_cap_for``
    of its K (the same double-precision ceil), or every slot without a cap."""
    if shape.fetch_ratio >= 1:
        return torch.full_like(top_k, INT64_MAX)
    return torch.ceil(top_k.to(torch.float64) * shape.fetch_ratio).to(torch.int64)
