"""Pure-torch implementations of the ``sgl_kernel`` operations SGLang's CPU engine calls.

Each function keeps the signature SGLang calls it with. They are plain, vectorised torch: no custom
ops, no compiled code. ``test/unit/test_cpu_standin.py`` checks each against a per-element loop.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu"]


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
    lengths = (end_offset - start_offset).to(torch.int64)
    if lengths.numel() == 0 or int(lengths.sum()) == 0:
        return
    assert int(lengths.sum()) <= out_cache_loc.numel(), "out_cache_loc shorter than the ranges"
    rows = torch.repeat_interleave(req_pool_indices.to(torch.int64), lengths)
    first = torch.cumsum(lengths, 0) - lengths  # position of each request's first token
    within = torch.arange(int(lengths.sum()), dtype=torch.int64) - torch.repeat_interleave(first, lengths)
    cols = torch.repeat_interleave(start_offset.to(torch.int64), lengths) + within
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


# Names SGLang imports unconditionally on its CPU path (speculative-decoding helpers in
# sglang.kernels.ops.speculative) but never calls when serving without speculative decoding. They
# import as placeholders that raise a clear NotImplementedError if called.
IMPORT_ONLY: frozenset[str] = frozenset(
    {
        "assign_draft_cache_locs_contiguous_cpu",
        "assign_extend_cache_locs_cpu",
        "build_tree_kernel_efficient_cpu",
        "fill_accept_out_cache_loc_cpu",
        "fill_bonus_tokens_cpu",
        "verify_tree_greedy_cpu",
    }
)
