"""``key_codes.candidate_mass`` on CPU: one pass over each candidate block's codes, no float keys.

The torch form (``key_codes.candidate_mass_torch``, the form CUDA runs) decodes every candidate key to
floats in memory, ``[batch, kv_heads, C x block, head_dim]``, then multiplies it by the query: on CPU the
decode is most of the time (at 4 rows x 3 KV heads x 192 blocks of 16: ~5 of ~7 ms) and the memory it
writes grows with the context. Here, per (row, KV head, candidate block), in numba:

    weight[g, d] = q[g, d] x (kmax[d] - kmin[d]) / LEVELS x scale       (the block's box folded into q)
    base[g]      = q[g] . kmin x scale
    logit[g, t]  = base[g] + sum_d weight[g, d] x level[t, d]           (level: the code, 0..LEVELS)

which is ``q . decode(code) x scale`` rearranged; the block's 16 x head_dim levels are unpacked once into
a small buffer that stays in cache and read by every query head of the group. Then, in the same call, each
(row, KV head, query head)'s softmax over its valid candidates' keys (fixed loop order: a row's masses
depend on its own inputs alone), summed per block over the group's query heads: ``candidate_mass_torch``'s
result to float32 rounding (tested against it and the float64 reference). At 4 rows x 3 KV heads x 192
blocks: 1.6 ms against the torch form's 7.5 (AMD EPYC, one thread; the softmax in torch after the kernel
took 1.2 ms in all, but a dozen ops more, and the eager pipeline's thread takes the GIL for each: the model's
thread waits for it).

Serial (the server's torch threads are its own; ``nogil``: the eager pipeline's thread runs beside the
model's). Boxes in float32 or bfloat16 (read as their bits: numba has no bfloat16); other dtypes take the
torch form. Registered as a torch custom op so that the captured decode step (``torch.compile``) calls it
as one opaque kernel.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

# float math that may reorder and contract; infinities and NaNs keep their meaning
FAST_MATH = {"nsz", "arcp", "contract", "reassoc"}
BITS = 2  # the codes this kernel reads (``key_codes.CODE_BITS``)
PER_BYTE = 8 // BITS


@njit(cache=True, fastmath=FAST_MATH, nogil=True, boundscheck=False)
def _coded_mass(codes, page, valid, kmin, kmax, bf16, query, scale, step, levels, mass):
    rows, heads, width = page.shape
    groups, dim = query.shape[2], query.shape[3]
    block, per_key = codes.shape[1], codes.shape[3]
    bits = np.empty(dim, np.uint32)
    as_float = bits.view(np.float32)
    low = np.empty(dim, np.float32)
    high = np.empty(dim, np.float32)
    step32, scale32 = np.float32(step), np.float32(scale)
    weight = np.empty((groups, dim), np.float32)
    base = np.empty(groups, np.float32)
    level = np.empty((block, dim), np.float32)
    logits = np.empty((groups, width, block), np.float32)  # one (row, KV head)'s, then their exps
    for r in range(rows):
        for h in range(heads):
            head_valid = h if valid.shape[1] > 1 else 0
            count = 0
            for c in range(width):
                mass[r, h, c] = 0.0
                if not valid[r, head_valid, c]:
                    continue  # no share of the softmax
                count += 1
                p = page[r, h, c]
                if bf16:  # bfloat16's bits are a float32's upper half
                    for d in range(dim):
                        bits[d] = np.uint32(kmin[p, h, d]) << 16
                    low[:] = as_float
                    for d in range(dim):
                        bits[d] = np.uint32(kmax[p, h, d]) << 16
                    high[:] = as_float
                else:
                    for d in range(dim):
                        low[d] = kmin[p, h, d]
                        high[d] = kmax[p, h, d]
                for g in range(groups):
                    acc = np.float32(0.0)
                    for d in range(dim):
                        weight[g, d] = query[r, h, g, d] * (high[d] - low[d]) * step32
                        acc += query[r, h, g, d] * low[d]
                    base[g] = acc * scale32
                for t in range(block):
                    for e in range(per_key):
                        byte = codes[p, t, h, e]
                        for j in range(PER_BYTE):  # a constant to numba: the copy unrolls
                            level[t, e * PER_BYTE + j] = levels[byte, j]
                for g in range(groups):
                    for t in range(block):
                        acc = np.float32(0.0)
                        for d in range(dim):
                            acc += weight[g, d] * level[t, d]
                        logits[g, c, t] = acc + base[g]
            if count == 0:
                continue
            # each query head's softmax over the valid candidates' keys, in a fixed order: a row's masses
            # depend on its own inputs alone (the same in any batch)
            for g in range(groups):
                top = np.float32(-np.inf)
                for c in range(width):
                    if valid[r, head_valid, c]:
                        for t in range(block):
                            top = max(top, logits[g, c, t])
                total = np.float32(0.0)
                for c in range(width):
                    if valid[r, head_valid, c]:
                        for t in range(block):
                            e = np.exp(logits[g, c, t] - top)
                            logits[g, c, t] = e
                            total += e
                inverse = np.float32(1.0) / total
                for c in range(width):
                    if valid[r, head_valid, c]:
                        acc = np.float32(0.0)
                        for t in range(block):
                            acc += logits[g, c, t]
                        mass[r, h, c] += acc * inverse


def level_table() -> np.ndarray:
    """``[256, PER_BYTE]`` float32: each byte's codes, lowest bits first, as levels."""
    shifts = np.arange(PER_BYTE) * BITS
    return ((np.arange(256)[:, None] >> shifts) & ((1 << BITS) - 1)).astype(np.float32)


LEVEL_TABLE = level_table()


def supports(query: torch.Tensor, kmin: torch.Tensor) -> bool:
    """Whether this form runs these inputs: CPU tensors, boxes in float32 or bfloat16."""
    return query.device.type == "cpu" and kmin.dtype in (torch.float32, torch.bfloat16)


@torch.library.custom_op("sgl_kernel_oasis::coded_mass_cpu", mutates_args=())
def coded_mass_cpu(
    query: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    codes: torch.Tensor,
    page: torch.Tensor,
    valid: torch.Tensor | None,
    scale: float,
    bits: int,
) -> torch.Tensor:
    """``key_codes.candidate_mass`` (its arguments, and the codes' ``bits`` per channel: ``BITS``) on CPU."""
    batch, heads, width = page.shape
    dim = query.shape[-1]
    assert supports(query, kmin) and kmax.dtype == kmin.dtype, (query.device, kmin.dtype, kmax.dtype)
    assert (
        codes.dtype == torch.uint8
        and codes.shape[2] == heads
        and codes.shape[3] * PER_BYTE == dim
        and bits == BITS
    ), (
        codes.shape,
        page.shape,
        dim,
    )
    assert kmin.shape == kmax.shape == (codes.shape[0], heads, dim), (kmin.shape, codes.shape)
    if valid is None:
        valid = torch.ones((batch, 1, width), dtype=torch.bool)
    assert valid.dtype == torch.bool and valid.shape in ((batch, heads, width), (batch, 1, width)), (
        valid.shape
    )
    read = page.masked_select(valid.expand(batch, heads, width))  # the kernel runs without bounds checks
    if read.numel() and not (int(read.min()) >= 0 and int(read.max()) < codes.shape[0]):
        raise IndexError(f"coded_mass_cpu: a valid candidate's page is outside the {codes.shape[0]} pages")
    bf16 = kmin.dtype == torch.bfloat16
    q = query.detach().float().reshape(batch, heads, -1, dim).contiguous()
    mass = torch.empty((batch, heads, width), dtype=torch.float32)
    _coded_mass(
        codes.detach().numpy(),
        page.detach().numpy(),
        valid.detach().numpy(),
        (kmin.view(torch.uint16) if bf16 else kmin).detach().numpy(),
        (kmax.view(torch.uint16) if bf16 else kmax).detach().numpy(),
        bf16,
        q.numpy(),
        float(scale),
        float(scale) / ((1 << BITS) - 1),
        LEVEL_TABLE,
        mass.numpy(),
    )
    return mass


@coded_mass_cpu.register_fake
def _(query, kmin, kmax, codes, page, valid, scale, bits):
    return page.new_empty(page.shape, dtype=torch.float32)
