"""Min/max key summaries per block and KV head (Quest-style), the input of block scoring.

Token layout of one request's keys and its blocks (block size B)::

    keys:     | t0 ... t(B-1) | tB ... t(2B-1) | ... | t(n-B') ... t(n-1) |
    blocks:   |    block 0    |    block 1     | ... |  active block (B'<=B) |

Each block's summary is the element-wise min and max over its (valid) tokens' keys, per KV head:
``kmin[b, h, :]`` and ``kmax[b, h, :]``. The active block's summary covers only the tokens it holds.
"""

from __future__ import annotations

import torch


def _check_keys(keys: torch.Tensor) -> None:
    assert keys.dim() == 3, f"keys must be [tokens, kv_heads, head_dim], got {tuple(keys.shape)}"


def build_block_summaries(keys: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Summaries of a whole sequence of keys.

    Args:
        keys: ``[num_tokens, num_kv_heads, head_dim]``.
        block_size: tokens per block (B).

    Returns:
        ``(kmin, kmax)``, each ``[ceil(num_tokens / B), num_kv_heads, head_dim]`` in the keys' dtype.
    """
    _check_keys(keys)
    assert block_size > 0
    num_tokens, num_heads, head_dim = keys.shape
    num_blocks = -(-num_tokens // block_size)
    padded = num_blocks * block_size
    # Pad the last block with +inf for the min and -inf for the max, so padding never wins.
    big = torch.finfo(keys.dtype).max if keys.dtype.is_floating_point else torch.iinfo(keys.dtype).max
    pad = padded - num_tokens
    low = torch.nn.functional.pad(keys, (0, 0, 0, 0, 0, pad), value=big)
    high = torch.nn.functional.pad(keys, (0, 0, 0, 0, 0, pad), value=-big)
    kmin = low.view(num_blocks, block_size, num_heads, head_dim).amin(dim=1)
    kmax = high.view(num_blocks, block_size, num_heads, head_dim).amax(dim=1)
    return kmin, kmax


def append_block_summaries(
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    num_tokens_before: int,
    new_keys: torch.Tensor,
    block_size: int,
) -> None:
    """Fold keys appended at decode time into the summaries, in place.

    Args:
        kmin, kmax: ``[capacity_blocks, num_kv_heads, head_dim]``; rows of blocks not yet started are
            ignored (they are overwritten when their first token arrives).
        num_tokens_before: tokens already summarised (the new keys start at this position).
        new_keys: ``[n, num_kv_heads, head_dim]`` for positions ``num_tokens_before ...``.
        block_size: tokens per block.
    """
    _check_keys(new_keys)
    assert kmin.shape == kmax.shape and kmin.shape[1:] == new_keys.shape[1:], (kmin.shape, new_keys.shape)
    first_block = num_tokens_before // block_size
    end = num_tokens_before + new_keys.shape[0]
    last_block = (end - 1) // block_size
    assert last_block < kmin.shape[0], f"summaries hold {kmin.shape[0]} blocks, need {last_block + 1}"
    offset = num_tokens_before % block_size
    if offset == 0:
        new_min, new_max = build_block_summaries(new_keys, block_size)
    else:
        # The first touched block already holds ``offset`` tokens: merge with its summary.
        new_min, new_max = _shifted_summaries(new_keys, offset, block_size)
        new_min[0] = torch.minimum(new_min[0], kmin[first_block])
        new_max[0] = torch.maximum(new_max[0], kmax[first_block])
    kmin[first_block : last_block + 1] = new_min
    kmax[first_block : last_block + 1] = new_max


def _shifted_summaries(
    new_keys: torch.Tensor, offset: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summaries of ``new_keys`` laid out as if they started ``offset`` tokens into a block."""
    head = new_keys[: block_size - offset]
    head_min, head_max = head.amin(dim=0, keepdim=True), head.amax(dim=0, keepdim=True)
    rest = new_keys[block_size - offset :]
    if rest.shape[0] == 0:
        return head_min, head_max
    rest_min, rest_max = build_block_summaries(rest, block_size)
    return torch.cat([head_min, rest_min]), torch.cat([head_max, rest_max])


def update_page_summaries(
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    locations: torch.Tensor,
    keys: torch.Tensor,
    block_size: int,
) -> None:
    """Fold keys just written to a paged KV pool into the summaries of their pages, in place.

    Pages are the blocks (page ``p`` holds pool locations ``p * B ... p * B + B - 1``). A page whose
    offset-0 token is among the new keys restarts (a recycled page never mixes with its previous
    owner's keys); the others merge the new keys into their summary.

    Args:
        kmin, kmax: ``[num_pages, num_kv_heads, head_dim]`` of one layer.
        locations: ``[n]`` pool locations of the new keys (distinct).
        keys: ``[n, num_kv_heads, head_dim]``.
        block_size: tokens per page (B).
    """
    if locations.numel() == 0:
        return
    locations = locations.to(torch.int64)
    pages = locations // block_size
    starts = pages[locations % block_size == 0]
    keys = keys.to(kmin.dtype)
    if starts.numel():
        kmin[starts] = torch.finfo(kmin.dtype).max
        kmax[starts] = torch.finfo(kmax.dtype).min
    flat_min = kmin.view(kmin.shape[0], -1)
    flat_max = kmax.view(kmax.shape[0], -1)
    index = pages[:, None].expand(-1, flat_min.shape[1])
    flat_keys = keys.reshape(keys.shape[0], -1)
    flat_min.scatter_reduce_(0, index, flat_keys, "amin", include_self=True)
    flat_max.scatter_reduce_(0, index, flat_keys, "amax", include_self=True)
