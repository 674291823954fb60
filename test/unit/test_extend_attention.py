"""``extend_attention``: an extend after a cached prefix computes only the rows it returns, and its output
is bitwise SGLang's torch_native extend (which computes every row of the sequence)."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sglang_oasis.attention.extend_attention import MIN_ROWS, extend_attention, first_row

Q_HEADS, KV_HEADS, DIM = 9, 3, 64  # SmolLM2-135M's


def batch(seq_lens: list[int], prefixes: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A pool holding each request's sequence at shuffled locations, and the requests' new queries."""
    total = sum(seq_lens)
    k_cache, v_cache = (
        torch.randn(total + 7, KV_HEADS, DIM, dtype=dtype),
        torch.randn(total + 7, KV_HEADS, DIM, dtype=dtype),
    )
    locations = torch.randperm(total + 7)[:total]
    req_to_token = torch.zeros((len(seq_lens) + 2, max(seq_lens) + 5), dtype=torch.int32)
    reqs = torch.tensor([len(seq_lens) + 1 - i for i in range(len(seq_lens))])  # not 0..n-1
    at = 0
    for req, n in zip(reqs.tolist(), seq_lens, strict=True):
        req_to_token[req, :n] = locations[at : at + n]
        at += n
    new = torch.tensor(seq_lens) - torch.tensor(prefixes)
    query = torch.randn(int(new.sum()), Q_HEADS, DIM, dtype=dtype)
    return query, k_cache, v_cache, req_to_token, reqs, torch.tensor(seq_lens), torch.tensor(prefixes), new


CASES = {
    "window-after-2k": ([2000], [1968]),
    "one-token-after-513": ([513], [512]),
    "two-after-515": ([515], [513]),
    "uncached": ([700], [0]),
    "short": ([20], [9]),
    "mixed-batch": ([1037, 33, 4099, 300, 66], [1000, 0, 3800, 299, 2]),
    "block-edges": ([2049, 2050, 2051, 1025], [2048, 2016, 2047, 993]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_equals_sglangs_extend_bit_for_bit(case: str, dtype: torch.dtype) -> None:
    torch.manual_seed(sum(map(ord, case)))
    query, k_cache, v_cache, req_to_token, reqs, seq_lens, prefixes, new = batch(*CASES[case], dtype)
    expected = TorchNativeAttnBackend._run_sdpa_forward_extend(
        None, query, torch.zeros_like(query), k_cache, v_cache, req_to_token, reqs, seq_lens, prefixes, new,
        scaling=0.125, enable_gqa=True, causal=True,
    )  # fmt: skip
    got = extend_attention(query, torch.zeros_like(query), k_cache, v_cache, req_to_token, reqs, seq_lens,
                           prefixes, new, 0.125, True)  # fmt: skip
    assert torch.equal(got, expected)


def test_the_rows_computed_start_at_a_block_edge_and_are_never_too_few() -> None:
    assert first_row(1968, 2000) == 1952  # 48 rows: the window's 32 and the block's start
    assert first_row(2048, 2049) == 2016  # one new token: a block earlier, 33 rows
    assert first_row(10, 20) == 0  # nothing to save: computed as SGLang does
    assert first_row(1968, 2000, 64) == 1920  # half precision: 80 rows, the kernel packs as for all 2,000
    for prefix in range(0, 300, 7):
        for new in (1, 2, 3, 31, 32, 33):
            start = first_row(prefix, prefix + new)
            assert start % 32 == 0 and start <= prefix and (start == 0 or prefix + new - start >= MIN_ROWS)
            half = first_row(prefix, prefix + new, 64)
            assert half % 32 == 0 and half <= start and (half == 0 or prefix + new - half >= 64)
