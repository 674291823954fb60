"""The hot-path ops as the runtime calls them: the Triton kernel for CUDA tensors, the torch reference
otherwise (the CPU path, and any machine without Triton).

``SGL_KERNEL_OASIS_IMPL=torch`` forces the references everywhere (to compare a GPU run against them).
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

import torch

from sgl_kernel_oasis import block_copy, block_scoring, block_summaries, sparse_attention

IMPL_ENV = "SGL_KERNEL_OASIS_IMPL"


@functools.cache
def _triton() -> ModuleType | None:
    if os.environ.get(IMPL_ENV, "auto") == "torch":
        return None
    try:
        from sgl_kernel_oasis import triton_kernels
    except ImportError:
        return None
    return triton_kernels


def uses_triton(tensor: torch.Tensor) -> bool:
    """Whether ops on ``tensor``'s device run the Triton kernels."""
    return tensor.is_cuda and _triton() is not None


def _impl(tensor: torch.Tensor) -> Any:
    return _triton() if uses_triton(tensor) else None


def update_page_summaries(
    kmin: torch.Tensor, kmax: torch.Tensor, locations: torch.Tensor, keys: torch.Tensor, block_size: int
) -> None:
    impl = _impl(kmin) or block_summaries
    impl.update_page_summaries(kmin, kmax, locations, keys, block_size)


def score_paged_blocks(
    query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, pages: torch.Tensor
) -> torch.Tensor:
    impl = _impl(kmin) or block_scoring
    return impl.score_paged_blocks(query, kmin, kmax, pages)


def headwise_decode_attention(
    query: torch.Tensor,
    ws_k: torch.Tensor,
    ws_v: torch.Tensor,
    slot_rows: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_locs: torch.Tensor,
    tail_valid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    impl = _impl(query) or sparse_attention
    return impl.headwise_decode_attention(
        query, ws_k, ws_v, slot_rows, tail_k, tail_v, tail_locs, tail_valid, scale
    )


def copy_blocks_to_slots(
    ws_k: torch.Tensor,
    ws_v: torch.Tensor,
    dst_rows: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    src_pages: torch.Tensor,
    heads: torch.Tensor,
) -> None:
    impl = _impl(ws_k) or block_copy
    impl.copy_blocks_to_slots(ws_k, ws_v, dst_rows, k_buffer, v_buffer, src_pages, heads)
