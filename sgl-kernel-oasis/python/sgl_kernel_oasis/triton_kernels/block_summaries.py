"""Triton ``update_page_summaries``: one program per (new key, KV head); the first key of each page's
run does the page's work.

The new keys are sorted by location, so each page's keys form one contiguous run (at most B keys) and
no two writing programs share a summary row::

    sorted locations: | p0: 3 keys | p1: B keys | p7: 1 key | ...      (run = same page)
    program (i, head): if key i leads its run: min/max over the run's keys, merged with the page's old
                       summary unless the run holds the page's offset-0 token (then the page restarts)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _update_kernel(
    kmin,
    kmax,
    keys,
    order,
    sorted_locs,
    num_keys,
    head_dim,
    stride_sp,
    stride_sh,
    stride_kn,
    stride_kh,
    BLOCK: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0)
    head = tl.program_id(1)
    loc = tl.load(sorted_locs + i)
    page = loc // BLOCK
    previous = tl.load(sorted_locs + i - 1, mask=i > 0, other=-BLOCK)
    leads = (previous // BLOCK) != page  # only the first key of each page's run writes
    t = tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    # The run: the following sorted keys in the same page (at most B, contiguous once sorted).
    run_locs = tl.load(sorted_locs + i + t, mask=(t < BLOCK) & (i + t < num_keys), other=-1)
    t_ok = (run_locs >= 0) & (run_locs // BLOCK == page)
    token = tl.load(order + i + t, mask=t_ok, other=0).to(tl.int64)
    mask = t_ok[:, None] & d_ok[None, :]
    k = tl.load(keys + token[:, None] * stride_kn + head * stride_kh + d[None, :], mask=mask, other=0.0)
    k = k.to(kmin.dtype.element_ty).to(tl.float32)
    low = tl.min(tl.where(mask, k, float("inf")), axis=0)
    high = tl.max(tl.where(mask, k, float("-inf")), axis=0)
    row = page.to(tl.int64) * stride_sp + head * stride_sh + d
    write = d_ok & leads
    old_low = tl.load(kmin + row, mask=write, other=0.0).to(tl.float32)
    old_high = tl.load(kmax + row, mask=write, other=0.0).to(tl.float32)
    restart = loc % BLOCK == 0  # the run holds the page's first token: the page starts over
    low = tl.where(restart, low, tl.minimum(low, old_low))
    high = tl.where(restart, high, tl.maximum(high, old_high))
    tl.store(kmin + row, low.to(kmin.dtype.element_ty), mask=write)
    tl.store(kmax + row, high.to(kmax.dtype.element_ty), mask=write)


def update_page_summaries(
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    locations: torch.Tensor,
    keys: torch.Tensor,
    block_size: int,
) -> None:
    """Same contract as ``sgl_kernel_oasis.update_page_summaries``. No host synchronisation (it can be
    captured in a CUDA graph)."""
    if locations.numel() == 0:
        return
    assert kmin.stride(-1) == 1 and kmax.stride() == kmin.stride() and keys.stride(-1) == 1
    num_heads, head_dim = kmin.shape[1], kmin.shape[2]
    sorted_locs, order = locations.to(torch.int64).sort()
    _update_kernel[(locations.numel(), num_heads)](
        kmin, kmax, keys, order, sorted_locs, locations.numel(), head_dim,
        kmin.stride(0), kmin.stride(1), keys.stride(0), keys.stride(1),
        BLOCK=block_size, BLOCK_T=triton.next_power_of_2(block_size), BLOCK_D=triton.next_power_of_2(head_dim),
    )  # fmt: skip
