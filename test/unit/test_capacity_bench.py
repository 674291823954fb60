"""benchmark/bench_capacity.py's pure parts: the steady decode rate from streamed token times (decode-only
forward steps), the running-count bound from bytes, and the iso-memory sizes (the dense pool from the
sparse device tier's bytes, the sparse host tier)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from bench_capacity import (
    Step,
    check_iso_memory,
    forward_steps,
    host_tier,
    iso_memory_tokens,
    running_bound,
    steady_decode_tok_s,
    step_gap_s,
    window_decode_tok_s,
)

PREFILL_S, STEP_S, JITTER_S = 5.0, 0.1, 0.002  # a 4K prefill, a decode step, delivery spread per stream


def interleaved_timeline() -> list[list[float]]:
    """Request A prefilled at 5 s, B at 10 s; A and B decode 3 steps; C prefilled 5 s later; A, B and C
    decode 4 steps. A request's decode tokens reach the client ``JITTER_S`` x its index after request A's."""
    a, b = [5.0], [10.0]
    for step in range(1, 4):
        a.append(10.0 + step * STEP_S)
        b.append(10.0 + step * STEP_S + JITTER_S)
    c = [b[-1] - JITTER_S + PREFILL_S]
    for step in range(1, 5):
        t = c[0] + step * STEP_S
        a.append(t)
        b.append(t + JITTER_S)
        c.append(t + 2 * JITTER_S)
    return [a, b, c]


def test_forward_steps_group_one_forward_and_mark_first_tokens() -> None:
    steps = forward_steps(interleaved_timeline(), gap_s=0.05)
    assert [(s.tokens, s.prefill) for s in steps] == [
        (1, True), (1, True), (2, False), (2, False), (2, False), (1, True),
        (3, False), (3, False), (3, False), (3, False),
    ]  # fmt: skip
    assert steps[0] == Step(5.0, 1, True)
    assert math.isclose(steps[6].start - steps[5].start, STEP_S)


def test_steady_rate_counts_only_decode_steps_and_their_time() -> None:
    times = interleaved_timeline()
    # 3 steps of 2 tokens and 4 of 3 in 7 steps of 0.1 s; the window (5 s to 15.7 s) holds the prefills.
    steady = steady_decode_tok_s(times)
    assert steady is not None and math.isclose(steady, 18 / 0.7, rel_tol=1e-9)
    window = window_decode_tok_s(times)
    assert window is not None and math.isclose(window, 18 / (times[2][-1] - 5.0), rel_tol=1e-9)
    assert steady > 10 * window
    # Not the peak batch over the median step (3 / 0.1 = 30): the 2-request steps count as they ran.
    assert not math.isclose(steady, 3 / STEP_S, rel_tol=0.05)


def test_a_forward_mixing_a_prefill_with_decoding_is_not_decode_only() -> None:
    # A and B decode in 0.1 s steps; the third forward also prefills C (a short prompt, mixed in) and
    # takes 0.5 s: its tokens and its time are left out, C's first token arriving with A's and B's.
    a = [0.0, 0.1, 0.2, 0.7, 0.8, 0.9]
    b = [0.0, 0.1, 0.2, 0.7, 0.8, 0.9]
    c = [0.7, 0.8, 0.9]
    steady = steady_decode_tok_s([a, b, c])
    assert steady is not None and math.isclose(steady, (2 + 2 + 3 + 3) / 0.4, rel_tol=1e-9)
    # The grouping is what leaves it out: with C's first token a microsecond after A's and B's tokens and
    # a gap shorter than that, A's and B's tokens of the mixed forward would count as a 0.5 s decode step.
    c_late = [0.700001, 0.8, 0.9]
    split = steady_decode_tok_s([a, b, c_late], gap_fraction=1e-6)
    assert split is not None and not math.isclose(split, steady, rel_tol=0.05)


def test_tokens_streamed_in_one_chunk_do_not_shrink_the_step_gap() -> None:
    # B's tokens come four per chunk (same arrival time): most of its gaps are zero, yet the gap stays
    # half the 0.1 s step, so A's and B's arrivals 2 ms apart are one step.
    a = [0.0, 0.1, 0.2]
    b = [0.002, *[0.102] * 4, *[0.202] * 4]
    gap = step_gap_s([a, b])
    assert gap is not None and math.isclose(gap, 0.05, rel_tol=1e-9)
    assert step_gap_s([a, b], fraction=0.25) == pytest.approx(0.025)
    assert [s.tokens for s in forward_steps([a, b], gap)] == [2, 5, 5]
    steady = steady_decode_tok_s([a, b])
    assert steady is not None and math.isclose(steady, 10 / 0.2, rel_tol=1e-9)


def test_no_decode_step_gives_none() -> None:
    assert steady_decode_tok_s([[1.0], [2.0]]) is None
    assert step_gap_s([[1.0, 1.0]]) is None
    assert window_decode_tok_s([]) is None


def test_running_bound_is_capped_by_concurrency_and_bytes() -> None:
    # 21 device request slots; a dense pool of 16,218 tokens holds 3 requests of 4,096 + 32 tokens.
    bound = running_bound(concurrency=32, request_slots=21, dense_tokens=16218, context=4096, output=32)
    assert (bound.oasis, bound.dense) == (21, 3)
    assert bound.ratio == 7.0
    assert running_bound(8, 21, 16218, 4096, 32).ratio == 8 / 3
    assert running_bound(2, 21, 16218, 4096, 32).ratio == 1.0
    # One token fewer than 2 x 7,712: 1 dense request at 7.5K.
    assert running_bound(32, 16, 2 * 7712 - 1, 7680, 32) == (16, 1)
    assert running_bound(32, 16, 7711, 7680, 32).ratio is None  # dense holds none: undefined


def test_dense_pool_takes_the_device_tiers_bytes() -> None:
    per_token = 6 * 3 * 64 * 2 * 4  # SmolLM2, 6 layers, float32
    device_bytes = 5443 * per_token + 21 * (512 * per_token + 10_416)  # summaries + 21 request slots
    tokens = iso_memory_tokens(device_bytes, per_token)
    assert tokens == 16_218
    assert 0 <= device_bytes - tokens * per_token < per_token
    assert iso_memory_tokens(16_384 * per_token, per_token) == 16_384
    with pytest.raises(ValueError):
        iso_memory_tokens(device_bytes, 0)


def test_iso_memory_check_allows_less_than_a_block() -> None:
    block = 16 * 9216
    check_iso_memory(16_216 * 9216, 16_216 * 9216 + 9215, block)
    check_iso_memory(16_216 * 9216, 16_216 * 9216 + block - 1, block)
    with pytest.raises(RuntimeError, match="not iso-memory"):
        check_iso_memory(16_200 * 9216, 16_216 * 9216, block)  # SGLang built a pool a block smaller


@pytest.mark.parametrize(
    ("device", "context", "concurrency", "requests"),
    [(16384, 4096, 32, 20), (16384, 7680, 32, 16), (16384, 4096, 8, 8), (15740, 4096, 32, 19)],
    ids=["4K", "7.5K", "4K-capped-by-concurrency", "4K-padding-block-tips-it"],
)
def test_host_tier_holds_what_the_device_tier_can_run(
    device: int, context: int, concurrency: int, requests: int
) -> None:
    top_k, block = 32, 16
    per_request = (-(-(context + 32) // block) + 1) * block  # 4,144 at 4K, 7,728 at 7.5K
    host = host_tier(device, context, 32, top_k, block, concurrency)
    assert host == (requests, requests * per_request + block)

    def fits(count: int) -> bool:  # summaries (a token's KV per host block) + working sets and active
        return (count * per_request + block) / block + count * (top_k + 1) * block <= device  # blocks

    assert fits(requests)
    assert requests == concurrency or not fits(requests + 1)


def test_host_tier_counts_the_key_codes_device_bytes() -> None:
    """``--code-candidates``: float32 codes take 1/32 of a token's KV per host token (16 of 512 bytes per
    KV head), half a token per block of 16, beside the summaries' one: fewer requests fit."""
    context, block, top_k, device = 4096, 16, 16, 16384
    per_request = (-(-(context + 32) // block) + 1) * block
    host = host_tier(device, context, 32, top_k, block, 64, 1 / 32)

    def fits(count: int) -> bool:
        host_tokens = count * per_request + block
        return host_tokens / block * 1.5 + count * (top_k + 1) * block <= device

    assert fits(host.requests) and not fits(host.requests + 1)
    assert host.requests < host_tier(device, context, 32, top_k, block, 64).requests


def test_host_tier_gives_one_request_when_none_fits() -> None:
    assert host_tier(512, 4096, 32, 32, 16, 32) == (1, 4144 + 16)
