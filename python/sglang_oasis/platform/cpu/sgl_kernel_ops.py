"""Pure-torch implementations of the ``sgl_kernel`` operations SGLang's CPU engine calls.

Each function keeps the signature SGLang calls it with. They are plain, vectorised torch: no custom
ops, no compiled code. ``test/unit/test_cpu_standin.py`` checks each against a per-element loop.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "reconstruct_indices_from_tree_mask",
    "verify_tree_greedy_cpu",
]


def _ranges(
    req_pool_indices: torch.Tensor, start_offset: torch.Tensor, end_offset: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, cols)`` of every cell in ``req_to_token[req_i, start_i:end_i]``, requests back to back."""
    lengths = (end_offset - start_offset).to(torch.int64)
    rows = torch.repeat_interleave(req_pool_indices.to(torch.int64), lengths)
    first = torch.cumsum(lengths, 0) - lengths  # position of each request's first cell
    within = torch.arange(int(lengths.sum()), dtype=torch.int64) - torch.repeat_interleave(first, lengths)
    cols = torch.repeat_interleave(start_offset.to(torch.int64), lengths) + within
    return rows, cols


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV locations into its row of the request-to-token table.

    Request i owns the row ``req_to_token[req_pool_indices[i]]``; its new tokens occupy columns
    ``[start_offset[i], end_offset[i])``. ``out_cache_loc`` holds the locations of all requests
    back to back, in batch order::

        out_cache_loc: | req 0: end0-start0 | req 1: end1-start1 | ...
        req_to_token[req_pool_indices[i], start_i:end_i] = that request's slice
    """
    assert req_to_token.dim() == 2 and req_to_token.shape[1] == pool_len, (req_to_token.shape, pool_len)
    rows, cols = _ranges(req_pool_indices, start_offset, end_offset)
    if rows.numel() == 0:
        return
    assert rows.numel() <= out_cache_loc.numel(), "out_cache_loc shorter than the ranges"
    req_to_token[rows, cols] = out_cache_loc[: rows.numel()].to(req_to_token.dtype)


def _byte_rows(base_ptr: int, row_bytes: int, num_rows: int) -> torch.Tensor:
    """A ``[num_rows, row_bytes]`` uint8 view of memory owned by an existing CPU tensor."""
    buffer = (ctypes.c_uint8 * (row_bytes * num_rows)).from_address(base_ptr)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(num_rows, row_bytes)


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every KV buffer (base pointer, row stride in bytes), copy row ``src_loc[j]`` to ``tgt_loc[j]``.

    All source rows are read before any target row is written, so overlapping moves are safe. The
    buffers are SGLang's own CPU tensors (``data_ptrs`` are their ``data_ptr()``), so the views made
    here never outlive them.
    """
    assert data_ptrs.shape == strides.shape, (data_ptrs.shape, strides.shape)
    assert tgt_loc.shape == src_loc.shape, (tgt_loc.shape, src_loc.shape)
    if tgt_loc.numel() == 0:
        return
    src = src_loc.to(torch.int64)
    tgt = tgt_loc.to(torch.int64)
    num_rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for base_ptr, row_bytes in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        rows = _byte_rows(int(base_ptr), int(row_bytes), num_rows)
        rows[tgt] = rows[src]  # advanced indexing gathers a copy before the scatter


# --- speculative decoding (EAGLE / NGRAM verification on the CPU engine) ----------------------------
#
# Layout shared by these helpers, for a batch of ``bs`` requests with ``n`` verify tokens each (token 0
# is the last verified token, 1..n-1 the draft tree in the order the drafter selected them)::
#
#   candidates / retrieve_*: [bs, n]     flattened token index of request b's token i = b * n + i
#   retrieve_next_token[b, i]            first child of token i in the tree (-1: a leaf)
#   retrieve_next_sibling[b, i]          next sibling of token i (-1: the last one)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """The reverse of ``assign_req_to_token_pool_cpu``: read each request's ``[start, end)`` locations
    out of its row of the table into ``out_cache_loc``, requests back to back."""
    assert req_to_token.dim() == 2 and req_to_token.shape[1] == pool_len, (req_to_token.shape, pool_len)
    rows, cols = _ranges(req_pool_indices, start_offset, end_offset)
    out_cache_loc[: rows.numel()] = req_to_token[rows, cols].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_cols: int,
) -> None:
    """Request i's ``topk * num_cols`` locations from column ``seq_lens[i]`` on go to
    ``out_cache_loc[i * topk * num_cols :][: topk * num_cols]``."""
    width = topk * num_cols
    starts = seq_lens.to(torch.int64)
    rows, cols = _ranges(req_pool_indices, starts, starts + width)
    assert req_to_token.shape[1] == pool_len, (req_to_token.shape, pool_len)
    out_cache_loc[: rows.numel()] = req_to_token[rows, cols].to(out_cache_loc.dtype)


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor, accept_stride: int
) -> None:
    """``bonus_tokens[i]`` = the last accepted token of request i (``accept_lens`` counts the bonus)."""
    index = (
        torch.arange(accept_lens.numel(), dtype=torch.int64) * accept_stride + accept_lens.to(torch.int64) - 1
    )
    bonus_tokens.copy_(accept_tokens.reshape(-1)[index].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor
) -> None:
    """Compact the locations of accepted tokens: ``accept_index`` (flattened, -1 = rejected) picks rows
    of ``out_cache_loc``; the picked locations are written to the front of ``accept_out_cache_loc`` in
    order."""
    index = accept_index.reshape(-1).to(torch.int64)
    kept = index[index != -1]
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """Link the drafter's selected tokens into a tree and write its mask, positions and links.

    ``selected_index[b, i - 1]`` names draft token i in the drafter's beam layout; its parent's beam
    slot is ``selected_index // topk`` (0: the verified token), whose token is
    ``parent_list[b, slot]``; the parent's position among the selected tokens is found by value. Each
    request's tree mask row i marks token i, its ancestors and token 0:

    - mode 0 (full): per request a ``[n, seq_len + n]`` block, prefix columns left as the caller set them;
    - mode 1 (qlen only): per request a ``[n, n]`` block.

    ``positions[b, i]`` = ``seq_len + depth of token i``. Children are linked newest first (a token
    found later becomes the first child and points to the previous first child as its sibling).
    """
    if int(tree_mask_mode) not in (0, 1):
        raise NotImplementedError(f"tree mask mode {int(tree_mask_mode)} has no CPU stand-in")
    n = draft_token_num
    seq_lens = verified_seq_len.to(torch.int64).tolist()
    selected = selected_index.reshape(len(seq_lens), -1).tolist()
    parents = parent_list.reshape(len(seq_lens), -1).tolist() if parent_list.numel() else []
    next_token = retrieve_next_token.view(len(seq_lens), n)
    next_sibling = retrieve_next_sibling.view(len(seq_lens), n)
    prefix_sum = 0
    for b, seq_len in enumerate(seq_lens):
        parent_position = _parent_finder(selected[b], parents[b] if parents else [], topk, n)
        retrieve_index.view(len(seq_lens), n)[b] = torch.arange(b * n, (b + 1) * n)
        for i in range(n - 1, 0, -1):
            parent = parent_position(i)
            if parent is None:
                continue
            previous_first = int(next_token[b, parent])
            next_token[b, parent] = i
            if previous_first != -1:
                next_sibling[b, i] = previous_first
        if int(tree_mask_mode) == 0:
            base, row_width, offset = prefix_sum * n + n * n * b, seq_len + n, seq_len
        else:
            base, row_width, offset = n * n * b, n, 0
        for i in range(n):
            level = _mark_ancestors(tree_mask, base + row_width * i + offset, i, n, depth, parent_position)
            positions[b * n + i] = seq_len + level
        prefix_sum += seq_len


def _parent_finder(selected: list[int], parents: list[int], topk: int, n: int) -> Callable[[int], int | None]:
    """One request's ``parent_position(i)``: the index (1-based, 0 = verified token) of draft token i's
    parent, None if not found."""

    def parent_position(i: int) -> int | None:
        slot = selected[i - 1] // topk
        if slot == 0:
            return 0
        token = parents[slot]
        for pp in range(n - 1):
            if selected[pp] == token:
                return pp + 1
        return None

    return parent_position


def _mark_ancestors(
    tree_mask: torch.Tensor,
    row: int,
    i: int,
    n: int,
    depth: int,
    parent_position: Callable[[int], int | None],
) -> int:
    """Token i's mask row (from ``row``): itself, its ancestors (up to ``depth``) and the verified token;
    returns its depth."""
    tree_mask[row : row + n] = False
    tree_mask[row] = True  # the verified token
    level, node = 0, i
    while node > 0 and level < depth:
        tree_mask[row + node] = True
        level += 1
        parent = parent_position(node)
        if parent is None:
            break
        node = parent
    return level


def verify_tree_greedy_cpu(
    *,
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree verification: walk down from token 0, at each level taking the child whose draft
    token equals the target's prediction at the current node; stop when none does.

    Writes ``accept_index[b, :k + 1]`` (flattened token indices of the accepted path, token 0 first),
    ``accept_token_num[b] = k`` (accepted draft tokens) and ``predicts`` at every node on the path (the
    target's prediction there; the last one is the bonus token).
    """
    batch = candidates.shape[0]
    max_accept = accept_index.shape[1]
    cand = candidates.tolist()
    index = retrive_index.tolist()
    first_child = retrive_next_token.tolist()
    sibling = retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    for b in range(batch):
        node, flat = 0, index[b][0]
        accept_index[b, 0] = flat
        accepted = 0
        for _ in range(1, max_accept):
            want = target[flat]
            child = first_child[b][node]
            while child != -1 and cand[b][child] != want:
                child = sibling[b][child]
            if child == -1:
                break
            predicts[flat] = want
            node, flat = child, index[b][child]
            accepted += 1
            accept_index[b, accepted] = flat
        accept_token_num[b] = accepted
        predicts[flat] = target[flat]


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """NGRAM's verify metadata from its tree mask (``[bs, n, n]`` flat; ``mask[b, i, j]``: node j is an
    ancestor of node i, or i itself). With ``anc[i, j] = mask[i, j] and j < i``:

    - ``positions[b, i] = verified_seq_len[b] + #anc[i, :]``; ``retrieve_index[b, i] = b * n + i``;
    - ``parent[i]`` = the largest j with ``anc[i, j]`` (-1: none);
    - ``retrieve_next_token[b, i]`` = the smallest k with ``anc[k, i]`` (first descendant; -1: none);
    - ``retrieve_next_sibling[b, i]`` = the smallest k > i with ``parent[k] == parent[i]`` (-1: none, or
      i has no parent).
    """
    n = draft_token_num
    if batch_size == 0:
        return
    mask = tree_mask.reshape(batch_size, n, n).to(torch.bool)
    index = torch.arange(n)
    below = index[None, :] < index[:, None]  # [i, j]: j < i
    anc = mask & below
    positions.view(batch_size, n).copy_(anc.sum(2) + verified_seq_len.to(torch.int64)[:, None])
    retrieve_index.view(batch_size, n).copy_(torch.arange(batch_size * n).view(batch_size, n))
    parent = torch.where(anc, index, -1).amax(2)  # [bs, i]
    first_child = torch.where(anc, index[None, :, None], n).amin(1)  # over k, per column i
    retrieve_next_token.view(batch_size, n).copy_(torch.where(first_child < n, first_child, -1))
    same = (parent[:, :, None] == parent[:, None, :]) & below[None]  # [b, k, i]: k > i, same parent
    sibling = torch.where(same, index[None, :, None], n).amin(1)
    has = (parent >= 0) & (sibling < n)
    retrieve_next_sibling.view(batch_size, n).copy_(torch.where(has, sibling, -1))
