"""Key codes: every key of a block known to 2 bits per channel within the block's min/max box.

The min/max summaries bound a block's keys (Quest's upper bound ranks blocks by the best key any box
could hold); at K = 32 blocks of 16 that bound holds 0.93-0.96 of the attention mass the best K blocks
hold, and the difference decides retrieval answers (docs/results.md, bench_selection). A block's keys
coded to ``CODE_BITS`` bits per channel between the block's own min and max::

    code[t, d]  = round((k[t, d] - kmin[d]) / (kmax[d] - kmin[d]) x (2^bits - 1))
    k^[t, d]    = kmin[d] + code[t, d] / (2^bits - 1) x (kmax[d] - kmin[d])

give every key back to within a quarter of the box's width per channel at 2 bits; a query's softmax over
the decoded keys of its context then estimates each block's exact attention mass (the oracle's
measure, not a bound). Offline at 4K and K = 32 it holds 0.985 of the best K's mass where the bound
holds 0.955, and answers as dense does on the suite's samples (bench_selection ``codes2``).

Codes are packed 4 per byte along the channel (``head_dim / 4`` bytes per key and KV head: 16 bytes for
64 channels, as many as the min/max summaries' share per token in bf16 at blocks of 16). Only full
blocks are coded (a full block's keys and box no longer change).
"""

from __future__ import annotations

import torch

from sgl_kernel_oasis import key_codes_cpu

CODE_BITS = 2
LEVELS = (1 << CODE_BITS) - 1
PER_BYTE = 8 // CODE_BITS


def encode_key_codes(keys: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Pack full blocks' keys into codes.

    Args:
        keys: ``[blocks, block_size, kv_heads, head_dim]``.
        kmin, kmax: ``[blocks, kv_heads, head_dim]``, the blocks' element-wise bounds of ``keys``.

    Returns:
        ``[blocks, block_size, kv_heads, head_dim // 4]`` uint8.
    """
    assert keys.dim() == 4 and kmin.shape == kmax.shape == (keys.shape[0], *keys.shape[2:]), (
        keys.shape,
        kmin.shape,
    )
    assert keys.shape[-1] % PER_BYTE == 0, f"head_dim {keys.shape[-1]} is not a multiple of {PER_BYTE}"
    lo, hi = kmin.float()[:, None], kmax.float()[:, None]
    span = hi - lo
    scaled = torch.where(span > 0, (keys.float() - lo) / span.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    codes = (scaled.clamp(0, 1) * LEVELS).round().to(torch.uint8)  # [blocks, B, H, D]
    grouped = codes.view(*codes.shape[:-1], -1, PER_BYTE)
    shifts = torch.arange(PER_BYTE, dtype=torch.uint8, device=codes.device) * CODE_BITS
    return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)


def decode_key_codes(codes: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """``[blocks, block_size, kv_heads, head_dim]`` float32 keys back from ``encode_key_codes``'s codes
    and the same bounds."""
    shifts = torch.arange(PER_BYTE, dtype=torch.uint8, device=codes.device) * CODE_BITS
    levels = (codes[..., None] >> shifts) & LEVELS  # [blocks, B, H, D / 4, 4]
    levels = levels.reshape(*codes.shape[:-1], -1).float()
    lo, hi = kmin.float()[:, None], kmax.float()[:, None]
    return lo + levels * ((hi - lo) / LEVELS)


def coded_block_mass(
    query: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    codes: torch.Tensor,
    pages: torch.Tensor,
    full: torch.Tensor,
    scale: float,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each full block's share of a query's attention over the decoded keys of its request's full
    blocks (or of each KV head's ``candidates`` alone), summed over each KV head's query heads.

    Args:
        query: ``[batch, num_q_heads, head_dim]``.
        kmin, kmax: ``[num_pages, kv_heads, head_dim]``, one layer of the summary store.
        codes: ``[num_pages, block_size, kv_heads, head_dim // 4]`` uint8, one layer's codes.
        pages: ``[batch, N]``: the page of each request's logical block.
        full: ``[batch]``: each request's full blocks (at most N; its blocks beyond score 0).
        scale: the attention's logit scale.
        candidates: ``[batch, kv_heads, C]`` logical blocks (below ``full``; -1 pads a row, by as many
            for every head): each KV head's softmax runs over its candidates' keys alone and its other
            blocks score 0. None: every full block is every head's candidate.

    Returns:
        ``[batch, kv_heads, N]`` float32 (each row's masses sum to the group size over its candidates).

    Each request is computed on its own blocks alone, so its scores do not depend on the batch (the same
    greedy output in any batch): on CPU in one call of the kernel for the whole batch (its loops compute
    each row's softmax over that row's keys alone, and the eager pipeline's thread holds the GIL for a
    few ops per layer rather than a few dozen per request, each of which the model's thread waited for:
    the default served step at 4 x 3K: 235 ms with the loop, 213 with one call), elsewhere row by row.
    """
    batch, num_kv_heads = query.shape[0], kmin.shape[1]
    if key_codes_cpu.supports(query, kmin):  # candidates marked valid, all rows at once
        pages = pages.to(torch.int64)
        if candidates is None:  # every full block, in place
            valid = (torch.arange(pages.shape[1]) < full.to(torch.int64)[:, None])[:, None]  # [batch, 1, N]
            page = pages[:, None].expand(batch, num_kv_heads, pages.shape[1])
            return candidate_mass(query, kmin, kmax, codes, page, valid, scale)
        chosen = candidates.to(torch.int64).clamp(min=0)  # [batch, H, C]; -1 pads every head alike
        page = pages.gather(1, chosen.flatten(1)).view_as(chosen)
        mass = candidate_mass(query, kmin, kmax, codes, page, candidates[:, :1] >= 0, scale)  # 0: not valid
        out = torch.zeros((batch, num_kv_heads, pages.shape[1]), dtype=torch.float32)
        return out.scatter_add_(2, chosen, mass)  # each valid block once per head; a pad adds 0
    out = torch.zeros((batch, num_kv_heads, pages.shape[1]), dtype=torch.float32, device=query.device)
    for row in range(batch):
        n = int(full[row])
        if candidates is None:
            chosen = torch.arange(n, device=query.device).expand(num_kv_heads, n)
        else:
            chosen = candidates[row, :, : int((candidates[row, 0] >= 0).sum())].to(torch.int64)
        if chosen.shape[1] == 0:
            continue
        page = pages[row].to(torch.int64)[chosen][None]  # [1, H, C]
        mass = candidate_mass(query[row : row + 1], kmin, kmax, codes, page, None, scale)  # all count
        out[row].scatter_(1, chosen, mass[0])
    return out


def candidate_mass(
    query: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    codes: torch.Tensor,
    page: torch.Tensor,
    valid: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """``[batch, kv_heads, C]``: each candidate block's share of ``query``'s attention over its KV head's
    valid candidates' decoded keys, summed over the head's query heads; invalid candidates score 0. Fixed
    shapes, no host sync: ``coded_block_mass`` runs it per request, the captured decode step on the
    whole batch (``attention/coded_selection.py``). On CPU (boxes in float32 or bfloat16) the fused
    kernel of ``key_codes_cpu.py``, elsewhere ``candidate_mass_torch``.

    Args:
        query: ``[batch, num_q_heads, head_dim]``; kmin, kmax, codes: one layer's, as ``coded_block_mass``.
        page: ``[batch, kv_heads, C]`` int64, each KV head's candidates' pages.
        valid: ``[batch, kv_heads or 1, C]`` bool, which candidates count (None: all of them, unmasked).
    """
    if key_codes_cpu.supports(query, kmin):
        return torch.ops.sgl_kernel_oasis.coded_mass_cpu(
            query, kmin, kmax, codes, page, valid, scale, CODE_BITS
        )
    return candidate_mass_torch(query, kmin, kmax, codes, page, valid, scale)


def candidate_mass_torch(
    query: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    codes: torch.Tensor,
    page: torch.Tensor,
    valid: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """``candidate_mass`` in torch ops (CUDA's form): the candidates' keys decoded to floats, then the
    query's softmax over them."""
    batch, heads, width = page.shape
    dim = query.shape[-1]
    head = torch.arange(heads, device=page.device)[None, :, None]
    blocks = batch * heads * width  # each (row, head, candidate) a one-head block
    keys = decode_key_codes(
        codes[page, :, head].view(blocks, -1, 1, codes.shape[-1]),
        kmin[page, head].view(blocks, 1, dim),
        kmax[page, head].view(blocks, 1, dim),
    ).view(batch, heads, -1, dim)  # [batch, H, C * B, D]
    q = query.float().view(batch, heads, -1, dim)  # [batch, H, G, D]
    logits = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [batch, H, G, C * B]
    if valid is not None:
        per_key = valid[..., None].expand(-1, -1, -1, codes.shape[1]).flatten(2)[:, :, None, :]
        logits = logits.masked_fill(~per_key, torch.finfo(torch.float32).min)
    mass = logits.softmax(dim=-1).view(batch, heads, q.shape[2], width, -1).sum(dim=(2, 4))
    return mass if valid is None else mass.masked_fill(~valid, 0.0)


def coded_block_mass_reference(
    query: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    keys: torch.Tensor,
    pages: torch.Tensor,
    full: torch.Tensor,
    scale: float,
    candidates: torch.Tensor | None = None,
) -> torch.Tensor:
    """``coded_block_mass`` from the uncoded ``keys`` (``[num_pages, block_size, kv_heads, head_dim]``),
    rounding each channel to its level in plain arithmetic: the definition, one query head at a time
    (a head's softmax over its candidate blocks' keys alone when ``candidates`` is given)."""
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = kmin.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros((batch, num_kv_heads, pages.shape[1]), dtype=torch.float32)
    for row in range(batch):
        n = int(full[row])
        if n == 0:
            continue
        page = pages[row, :n].long()
        lo, hi = kmin[page].double()[:, None], kmax[page].double()[:, None]  # [n, 1, H, D]
        width = hi - lo
        level = torch.where(
            width > 0, torch.round((keys[page].double() - lo) / width.clamp(min=1e-300) * LEVELS), 0
        )
        decoded = lo + level * width / LEVELS  # [n, B, H, D]
        for head in range(num_q_heads):
            kv = head // group
            blocks = list(range(n)) if candidates is None else candidates[row, kv].tolist()
            blocks = [block for block in blocks if block >= 0]
            flat = decoded[blocks, :, kv].reshape(-1, head_dim)  # [C * B, D]
            weights = torch.softmax(flat @ query[row, head].double() * scale, dim=0)
            out[row, kv, blocks] += weights.view(len(blocks), -1).sum(dim=1).float()
    return out
