"""Dense extend attention after a cached prefix, computing only the rows it returns.

SGLang's torch_native backend (which the oasis backend extends) computes an extend of ``n`` new tokens
after ``p`` cached ones as a causal attention over all ``p + n`` query rows, the first ``p`` of them
uninitialised, and keeps the last ``n``: ``(p + n)^2`` work for ``n (p + n)`` useful. Every radix-cache
hit pays it (a new turn of a conversation; in sparse mode each request that finds its prompt cached still
recomputes the prefill window's last tokens, hook 5), as does each chunk of a chunked prefill: 32 new
tokens after 2K cached take 87 ms per layer where 3.7 ms suffice (2 CPU cores, float32, SmolLM2's 9
query / 3 KV heads).

``extend_attention`` computes rows ``a .. p + n`` only, with the causal mask shifted by ``a``, and
returns the last ``n``. The result is bitwise SGLang's: PyTorch's CPU flash kernel reduces each query row
the same way whatever rows it is batched with, except that its blocks of query rows start at multiples of
32, a block of fewer than 4 rows takes another path, and in bfloat16/float16 on CPUs that pack their
GEMM operands (AMX) fewer than 64 query rows skip the packing (1-ulp differences seen on an Intel Xeon with
AMX); so ``a`` is ``p`` rounded down to a multiple of 32, a block earlier while that would leave fewer
than ``MIN_ROWS`` rows (``MIN_ROWS_REDUCED`` in half precision) (``test_extend_attention.py``
compares the two bit for bit on awkward lengths, float32 and bfloat16). Where ``a`` would be 0 the
request goes SGLang's way (nothing to save).
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

ROW_BLOCK = 32  # PyTorch's CPU flash attention: query blocks start at multiples of this
MIN_ROWS = 32  # at least this many query rows (a block of under 4 rows reduces differently)
MIN_ROWS_REDUCED = 64  # bfloat16 / float16: below 64 query rows the kernel does not pack (AMX CPUs)


def first_row(prefix_len: int, seq_len: int, min_rows: int = MIN_ROWS) -> int:
    """The first query row computed for an extend of ``seq_len - prefix_len`` tokens after ``prefix_len``."""
    start = prefix_len // ROW_BLOCK * ROW_BLOCK
    while start > 0 and seq_len - start < min_rows:
        start -= ROW_BLOCK
    return max(0, start)


def extend_attention(
    query: torch.Tensor,
    output: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    scaling: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """Causal attention of each request's new tokens (``query``/``output`` ``[tokens, q_heads, dim]``,
    requests one after another) over its whole sequence in the pool (``k_cache``/``v_cache``
    ``[pool, kv_heads, dim]`` at ``req_to_token[req, :seq_len]``)."""
    queries = query.movedim(0, 1)  # [q_heads, tokens, dim]
    start_q = 0
    for req, seq_len, prefix, new in zip(
        req_pool_indices.tolist(), seq_lens.tolist(), extend_prefix_lens.tolist(), extend_seq_lens.tolist(),
        strict=True,
    ):  # fmt: skip
        first = first_row(prefix, seq_len, MIN_ROWS_REDUCED if query.element_size() == 2 else MIN_ROWS)
        rows = queries.new_zeros((queries.shape[0], seq_len - first, queries.shape[2]))
        rows[:, prefix - first :] = queries[:, start_q : start_q + new]
        tokens = req_to_token[req, :seq_len]
        keys, values = k_cache[tokens].movedim(0, 1), v_cache[tokens].movedim(0, 1)
        if keys.dtype != rows.dtype:
            keys, values = keys.to(rows.dtype), values.to(rows.dtype)
        mask: torch.Tensor | None = None
        if first:
            mask = (
                torch.arange(seq_len, device=rows.device)[None, :]
                <= torch.arange(first, seq_len, device=rows.device)[:, None]
            )
        out = scaled_dot_product_attention(
            rows[None], keys[None], values[None], attn_mask=mask, scale=scaling, is_causal=not first,
            enable_gqa=enable_gqa,
        )[0]  # fmt: skip
        output[start_q : start_q + new] = out[:, prefix - first :].movedim(0, 1)
        start_q += new
    return output


class CachedPrefixExtend:
    """Mixin for a ``TorchNativeAttnBackend`` subclass: its dense extends compute only the rows they
    return (``extend_attention``); cross-attention, encoder and sliding-window layers go SGLang's way.
    Overrides SGLang's ``_run_sdpa_forward_extend`` (its parameters are checked in
    ``test_sglang_hooks.py``)."""

    def _run_sdpa_forward_extend(
        self, query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
        extend_prefix_lens: torch.Tensor, extend_seq_lens: torch.Tensor, encoder_lens: torch.Tensor | None = None,
        scaling: float | None = None, enable_gqa: bool = False, causal: bool = False, is_cross_attn: bool = False,
        sliding_window_size: int | None = None,
    ) -> torch.Tensor:  # fmt: skip
        windowed = sliding_window_size is not None and sliding_window_size > -1
        if encoder_lens is not None or is_cross_attn or not causal or windowed:
            return super()._run_sdpa_forward_extend(  # type: ignore[misc]
                query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
                extend_seq_lens, encoder_lens, scaling, enable_gqa, causal, is_cross_attn, sliding_window_size,
            )  # fmt: skip
        return extend_attention(
            query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, extend_prefix_lens,
            extend_seq_lens, scaling, enable_gqa,
        )  # fmt: skip
