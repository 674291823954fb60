"""Triton ``copy_blocks_to_slots``: one program per load, copying one block of K and V (B x D each) from
the pool (``page * B ...``, one KV head) into its working-set block row. On CUDA the pool may live in
pinned host memory: the kernel then reads it over the bus (zero-copy), so a whole transfer plan is one
launch instead of one copy per block."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_kernel(
    ws_k,
    ws_v,
    dst_rows,
    k_buffer,
    v_buffer,
    src_pages,
    heads,
    head_dim,
    stride_wr,
    stride_wt,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    j = tl.program_id(0)
    row = tl.load(dst_rows + j).to(tl.int64)
    page = tl.load(src_pages + j).to(tl.int64)
    head = tl.load(heads + j).to(tl.int64)
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    mask = (t < BLOCK)[:, None] & (d < head_dim)[None, :]
    token = page * BLOCK + t
    dst = row * stride_wr + t[:, None] * stride_wt + d[None, :]
    k = tl.load(k_buffer + token[:, None] * stride_kn + head * stride_kh + d[None, :], mask=mask)
    tl.store(ws_k + dst, k.to(ws_k.dtype.element_ty), mask=mask)
    v = tl.load(v_buffer + token[:, None] * stride_vn + head * stride_vh + d[None, :], mask=mask)
    tl.store(ws_v + dst, v.to(ws_v.dtype.element_ty), mask=mask)


def copy_blocks_to_slots(
    ws_k: torch.Tensor,
    ws_v: torch.Tensor,
    dst_rows: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    src_pages: torch.Tensor,
    heads: torch.Tensor,
) -> None:
    """Same contract as ``sgl_kernel_oasis.copy_blocks_to_slots``."""
    if dst_rows.numel() == 0:
        return
    block, head_dim = ws_k.shape[1], ws_k.shape[2]
    assert ws_k.stride() == ws_v.stride() and ws_k.stride(-1) == 1
    assert k_buffer.stride(-1) == 1 and v_buffer.stride(-1) == 1
    _copy_kernel[(dst_rows.numel(),)](
        ws_k, ws_v, dst_rows, k_buffer, v_buffer, src_pages, heads, head_dim,
        ws_k.stride(0), ws_k.stride(1), k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        BLOCK=block, BLOCK_T=triton.next_power_of_2(block), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
