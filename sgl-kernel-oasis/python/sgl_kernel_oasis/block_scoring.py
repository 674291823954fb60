"""Score every block's summary with a query and pick each KV head's top-K blocks.

The score of block b for one query head is the Quest upper bound of ``q . k`` over any key inside the
block's element-wise [min, max] box::

    upper(q, b) = sum_d max(q_d * kmin[b, d], q_d * kmax[b, d])

With grouped-query attention, the G = num_q_heads / num_kv_heads query heads of a group share one KV
head and therefore one working set; their bounds are summed into the KV head's score. Query heads are
grouped contiguously (query head j uses KV head j // G), as in SGLang's and HF's models.
"""

from __future__ import annotations

import torch


def score_blocks(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Per-KV-head block scores.

    Args:
        query: ``[rows, num_q_heads, head_dim]`` (one row per query: the real token, a draft token...).
        kmin, kmax: ``[num_blocks, num_kv_heads, head_dim]``.

    Returns:
        ``[rows, num_kv_heads, num_blocks]`` float32 scores.
    """
    assert query.dim() == 3, f"query must be [rows, q_heads, head_dim], got {tuple(query.shape)}"
    assert kmin.shape == kmax.shape and kmin.dim() == 3, (kmin.shape, kmax.shape)
    rows, num_q_heads, head_dim = query.shape
    num_blocks, num_kv_heads, kv_dim = kmin.shape
    assert kv_dim == head_dim, (kv_dim, head_dim)
    assert num_q_heads % num_kv_heads == 0, f"{num_q_heads} query heads over {num_kv_heads} KV heads"
    group = num_q_heads // num_kv_heads
    q = query.float().view(rows, num_kv_heads, group, 1, head_dim)
    lo = kmin.float().permute(1, 0, 2).reshape(1, num_kv_heads, 1, num_blocks, head_dim)
    hi = kmax.float().permute(1, 0, 2).reshape(1, num_kv_heads, 1, num_blocks, head_dim)
    bound = torch.maximum(q * lo, q * hi).sum(dim=-1)  # [rows, kv_heads, group, blocks]
    return bound.sum(dim=2)


def score_blocks_batched(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """``score_blocks`` for a batch of requests with one query row each, as two batched matmuls.

    ``max(q_d * lo_d, q_d * hi_d)`` with ``lo <= hi`` is ``q_d * hi_d`` where ``q_d > 0`` and
    ``q_d * lo_d`` otherwise, so a query head's bound is ``relu(q) . kmax + min(q, 0) . kmin``, and the
    G heads of a group sum to ``(sum_g relu(q_g)) . kmax + (sum_g min(q_g, 0)) . kmin``: per KV head one
    positive and one negative query vector against the block summaries, no ``[blocks, dim]``
    intermediate per query head. Equal to ``score_blocks`` up to float rounding (tested); a request's
    scores do not depend on the batch it is in (tested bitwise).

    Args:
        query: ``[batch, num_q_heads, head_dim]``.
        kmin, kmax: ``[batch, num_blocks, num_kv_heads, head_dim]`` with ``kmin <= kmax`` (padding
            blocks score anything; callers mask them).

    Returns:
        ``[batch, num_kv_heads, num_blocks]`` float32 scores.
    """
    assert query.dim() == 3 and kmin.dim() == 4 and kmin.shape == kmax.shape, (query.shape, kmin.shape)
    batch, num_q_heads, head_dim = query.shape
    _, _, num_kv_heads, kv_dim = kmin.shape
    assert kv_dim == head_dim and num_q_heads % num_kv_heads == 0, (query.shape, kmin.shape)
    group = num_q_heads // num_kv_heads
    q = query.float().view(batch, num_kv_heads, group, head_dim)
    positive = q.clamp(min=0).sum(dim=2)  # [batch, kv_heads, dim]
    negative = q.clamp(max=0).sum(dim=2)
    hi = kmax.float().permute(0, 2, 1, 3)  # [batch, kv_heads, blocks, dim]
    lo = kmin.float().permute(0, 2, 1, 3)
    # A product and a sum over dim, not a matmul: each score is then reduced the same way whatever the
    # batch and its padding to the longest request (a matmul's tiling changes with them, and so does
    # the last bit of a score, enough to flip a top-K tie: greedy output would depend on other
    # requests). On CPU it is also faster than the matmul at decode shapes.
    return (hi * positive[:, :, None, :] + lo * negative[:, :, None, :]).sum(dim=-1)


def score_paged_blocks(
    query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor
) -> torch.Tensor:
    """Block scores of a batch read straight from a paged summary store, for one or more stacked
    query rows per request (the real token's, a draft token's).

    Args:
        query: ``[batch, rows, num_q_heads, head_dim]``.
        kmin, kmax: ``[num_pages, num_kv_heads, head_dim]``, one layer of the store.
        pages: ``[batch, num_blocks]`` int, the page of each request's logical block (padding entries
            must still be valid page ids; callers mask their scores).

    Returns:
        ``[batch, rows, num_kv_heads, num_blocks]`` float32: ``score_blocks`` of each row.
    """
    assert query.dim() == 4 and pages.dim() == 2 and query.shape[0] == pages.shape[0], (
        query.shape,
        pages.shape,
    )
    rows = query.shape[1]
    pages = pages.to(torch.int64)
    lo, hi = kmin[pages], kmax[pages]  # [batch, N, kv_heads, dim]
    out = [score_blocks_batched(query[:, r], lo, hi) for r in range(rows)]
    return torch.stack(out, dim=1)


def window_block_mass(
    queries: torch.Tensor, keys: torch.Tensor, block_size: int, scale: float
) -> torch.Tensor:
    """Exact attention mass each full block of a sequence receives from its last ``w`` queries (an
    observation window at the end of a prompt; SnapKV's signal), per KV head.

    Prefill attends densely, so the window's attention is known exactly; a first working set chosen by
    it does not depend on how well a min/max box bounds the block's keys. Plain torch on every device:
    it runs once per request and layer at prefill, ``w x tokens`` logits per query head.

    Args:
        queries: ``[w, num_q_heads, head_dim]``, the queries of the sequence's last ``w`` tokens (row i
            at position ``tokens - w + i``; causal: it sees keys up to its own position).
        keys: ``[tokens, num_kv_heads, head_dim]``, the whole sequence's keys.
        block_size: tokens per block; only the ``tokens // block_size`` full blocks are scored (the
            partial tail still takes its share of each softmax).
        scale: the attention's logit scale (``1 / sqrt(head_dim)`` for most models).

    Returns:
        ``[num_kv_heads, tokens // block_size]`` float32: softmax probability summed over the block's
        tokens, the group's query heads and the window's rows.
    """
    assert queries.dim() == 3 and keys.dim() == 3 and queries.shape[2] == keys.shape[2], (
        queries.shape,
        keys.shape,
    )
    window, num_q_heads, _ = queries.shape
    tokens, num_kv_heads, _ = keys.shape
    assert 0 < window <= tokens, (window, tokens)
    assert num_q_heads % num_kv_heads == 0, f"{num_q_heads} query heads over {num_kv_heads} KV heads"
    group = num_q_heads // num_kv_heads
    full = tokens // block_size
    position = torch.arange(tokens - window, tokens, device=keys.device)
    hidden = torch.arange(tokens, device=keys.device)[None, :] > position[:, None]  # [w, tokens]
    out = torch.empty((num_kv_heads, full), dtype=torch.float32, device=keys.device)
    for head in range(num_kv_heads):  # one KV head at a time: [group, w, tokens] logits, not [H, ...]
        q = queries[:, head * group : (head + 1) * group].float().transpose(0, 1)  # [group, w, dim]
        logits = torch.matmul(q, keys[:, head].float().t()) * scale
        probs = logits.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        out[head] = probs.sum(dim=(0, 1))[: full * block_size].view(full, block_size).sum(dim=-1)
    return out


def select_top_blocks(
    scores: torch.Tensor, k: int, always: torch.Tensor | None = None, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """The ``k`` best blocks per (row, KV head), plus blocks that must always be resident.

    Args:
        scores: ``[..., num_blocks]``.
        k: blocks to select by score.
        always: optional bool mask broadcastable to ``scores`` of blocks forced in (sink blocks); they
            do not count against ``k``.
        valid: optional bool mask broadcastable to ``scores``; invalid blocks (padding past a
            request's end) are never selected, even when forced.

    A row with fewer than ``k`` valid, unforced blocks gets all of them.

    Returns:
        bool mask shaped like ``scores``. Ties are broken arbitrarily; callers must not depend on which
        of two equal-score blocks wins.
    """
    excluded = torch.zeros_like(scores, dtype=torch.bool)
    if always is not None:
        excluded = excluded | always
    if valid is not None:
        excluded = excluded | ~valid
    take = min(k, scores.shape[-1])
    top = scores.masked_fill(excluded, float("-inf")).topk(take, dim=-1).indices
    selected = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)
    if always is not None:
        selected = selected | always
    if valid is not None:
        selected = selected & valid
    return selected
