"""benchmark/bench_cpu_serving.py's arithmetic: the all-decoding rate, the ratios and the batch prompts."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from bench_cpu_serving import SUFFIX_TOKENS, all_decoding_rate, batch_prompts, ratios


def test_the_rate_counts_only_steps_where_every_stream_decodes() -> None:
    # Two streams decoding in 0.1 s steps; the second starts 1 s late (its prefill), the first ends early.
    first = [0.1 * i for i in range(20)]  # 0.0 .. 1.9
    second = [1.0 + 0.1 * i for i in range(20)]  # 1.0 .. 2.9
    # In (1.0, 1.9]: 9 tokens of each stream -> 18 tokens over 0.9 s = 20 tok/s, two streams at 10 each.
    assert math.isclose(all_decoding_rate([first, second]), 20.0, rel_tol=1e-9)
    # A stream that started long before (a prefill before the interval) changes nothing.
    assert math.isclose(all_decoding_rate([[-5.0, *first], second]), 20.0, rel_tol=1e-9)


def test_no_common_decoding_interval_falls_back_to_the_whole_span() -> None:
    assert math.isclose(all_decoding_rate([[0.0, 1.0], [2.0, 3.0]]), 2 / 3.0, rel_tol=1e-9)
    assert math.isnan(all_decoding_rate([[1.0], [1.0]]))


def test_ratios_divide_each_server_rate_by_transformers() -> None:
    rates = {
        "hf": {"prefill_tok_s": {"1024": 100.0}, "decode_tok_s": {"1024": {"1": 10.0, "8": 40.0}}},
        "dense": {"prefill_tok_s": {"1024": 120.0}, "decode_tok_s": {"1024": {"1": 5.0, "8": 80.0}}},
        "sparse": {"prefill_tok_s": {"1024": 90.0}, "decode_tok_s": {"1024": {"1": 4.0, "8": 60.0}}},
    }
    out = ratios(rates)
    assert out["prefill_vs_hf"] == {"dense": {"1024": 1.2}, "sparse": {"1024": 0.9}}
    assert out["decode_vs_hf"]["dense"] == {"1024": {"1": 0.5, "8": 2.0}}
    assert out["sparse_vs_dense_decode"] == {"1024": {"1": 0.8, "8": 0.75}}
    failed = ratios({**rates, "sparse": {"error": "boom"}})
    assert failed["prefill_vs_hf"]["sparse"] == {} and failed["sparse_vs_dense_decode"] == {}


def test_batch_prompts_share_the_context_and_differ_after_it() -> None:
    context = list(range(1000, 1100))
    prompts = batch_prompts(context, 4)
    assert all(p[: len(context)] == context and len(p) == len(context) + SUFFIX_TOKENS for p in prompts)
    assert len({tuple(p[len(context) :]) for p in prompts}) == 4
