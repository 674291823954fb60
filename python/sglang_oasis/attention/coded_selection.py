"""``--oasis-selector codes`` inside the captured decode step (``decode_program.py``): fixed shapes, no
host sync; the eager step's forms are ``KeyCodeStore.ensure`` and ``BlockPrefetcher._coded_mass``.

- ``code_blocks``: every step codes each row's last two full blocks (this step's token may have filled
  the last; a verify pass's accepted drafts the one before), from the host tier's keys and the
  summaries' boxes. A full block's codes never change (the same keys in the same box), so coding it
  again writes what is there. Every eager selection, admissions included, codes its rows' full blocks
  not coded at their epoch (``KeyCodeStore.ensure``), so between the two every full block is coded.
- ``coded_scores``: each KV head's candidates (its ``m x K`` best blocks by the bound, every full block
  in place with m = 0: no bound, no ranking) scored by the query's softmax over their decoded keys; the
  other blocks score 0.
"""

from __future__ import annotations

import torch

from sgl_kernel_oasis.key_codes import candidate_mass, encode_key_codes
from sglang_oasis.attention.decode_ops import at_most
from sglang_oasis.attention.layer_state import LayerState
from sglang_oasis.attention.step_plan import StepPlan, StepShape


def code_blocks(state: LayerState, plan: StepPlan, block: int) -> None:
    """Write the codes of each row's last two full blocks (after this step's key joined its page's
    summary; a row with fewer codes its first page, SGLang's padding page for padding rows)."""
    codes = state.codes
    assert codes is not None
    bs, device = plan.slots.shape[0], plan.slots.device
    last = plan.seq_lens // block - 1
    logical = torch.stack([last, last - 1], dim=1).clamp(min=0)  # [bs, 2]
    pages = plan.pages.gather(1, logical).flatten()  # [bs * 2]
    tokens = (pages[:, None] * block + torch.arange(block, device=device)).flatten()
    keys = state.host_k[tokens].view(bs * 2, block, *state.host_k.shape[1:])
    kmin, kmax = state.kmin[pages], state.kmax[pages]
    codes.index_put_((pages,), encode_key_codes(keys, kmin, kmax))


def coded_scores(
    shape: StepShape,
    state: LayerState,
    pages: torch.Tensor,
    query: torch.Tensor,
    bound: torch.Tensor | None,
    in_range: torch.Tensor,
    top_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``[bs, H, N]``: the blocks' coded attention mass for ``query`` ``[bs, q_heads, D]`` over each KV
    head's candidates among the full blocks (``in_range`` ``[bs, H, N]``): with m = 0 all of them (no
    ``bound``), else each row's ``min(full, m x its K)`` best by ``bound`` ``[bs, H, N]``, as
    ``BlockPrefetcher._candidates`` gives them."""
    codes = state.codes
    m = shape.code_candidates
    assert codes is not None and m is not None
    bs, heads, num_blocks = in_range.shape
    if m == 0:
        page = pages[:, None].expand(bs, heads, num_blocks)
        return candidate_mass(query, state.kmin, state.kmax, codes, page, in_range, scale)
    assert bound is not None
    full = in_range[:, 0].sum(dim=-1)  # [bs]
    width = at_most(m * shape.max_top_k, num_blocks)
    ranked = bound.masked_fill(~in_range, float("-inf")).topk(width, dim=-1).indices  # [bs, H, W]
    valid = torch.arange(width, device=bound.device) < torch.minimum(full, m * top_k)[:, None, None]
    page = pages.gather(1, ranked.flatten(1)).view(bs, heads, width)
    mass = candidate_mass(query, state.kmin, state.kmax, codes, page, valid, scale)  # [bs, H, W]
    scores = torch.zeros((bs, heads, num_blocks), dtype=torch.float32, device=bound.device)
    return scores.scatter(-1, ranked, mass)
