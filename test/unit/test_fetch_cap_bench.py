"""The pure pieces of benchmark/bench_fetch_cap.py (agreement with dense, per-step counter differences,
decode rate) and benchmark/bench_overhead.py (TPOT, the covering K), on constructed inputs with exact
expected values."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from bench_fetch_cap import (
    counter_deltas,
    decode_rate,
    mean_agreement,
    ordered,
    per_step,
    position_agreement,
    prefix_agreement,
    sparse_settings,
)
from bench_overhead import covering_top_k, tpot_s

DENSE = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.mark.parametrize(
    ("sparse", "prefix", "position"),
    [
        pytest.param(DENSE, 1.0, 1.0, id="identical"),
        pytest.param([5, 6, 7, 0, 9, 10, 11, 12], 3 / 8, 7 / 8, id="one-divergence-back-in-step"),
        pytest.param([0, 6, 7, 8, 9, 10, 11, 12], 0.0, 7 / 8, id="first-token-differs"),
        pytest.param([6, 7, 8, 9, 10, 11, 12, 13], 0.0, 0.0, id="shifted-by-one"),
        pytest.param([5, 6, 7, 8], 4 / 8, 4 / 8, id="short-output-missing-tokens-never-match"),
        pytest.param([5, 6, 7, 8, 9, 10, 11, 12, 1, 2], 1.0, 1.0, id="tokens-past-n-ignored"),
    ],
)
def test_agreements(sparse: list[int], prefix: float, position: float) -> None:
    assert prefix_agreement(sparse, DENSE, 8) == prefix
    assert position_agreement(sparse, DENSE, 8) == position


def test_agreement_over_the_first_n_only() -> None:
    assert prefix_agreement([5, 6, 0, 0], DENSE, 2) == 1.0
    assert position_agreement([5, 0, 7, 0], DENSE, 4) == 0.5


def test_mean_agreement_averages_the_prompts() -> None:
    other = [1, 2, 3, 4]
    result = mean_agreement([DENSE[:4], [1, 0, 3, 4]], [DENSE[:4], other], 4)
    assert result == {"prefix_agreement": (1.0 + 0.25) / 2, "position_agreement": (1.0 + 0.75) / 2}
    with pytest.raises(ValueError):
        mean_agreement([DENSE], [DENSE, DENSE], 8)


def stats(**values: int) -> dict[str, object]:
    base = dict.fromkeys(
        (
            "decode_steps", "decode_bytes_host_to_device", "decode_blocks_loaded", "blocks_deferred",
            "blocks_just_filled", "foreground_wait_us", "stage_select_us", "stage_transfer_us",
        ),
        0,
    )  # fmt: skip
    return {"mode": "sparse", **base, **values, "per_decode_step": {"bytes_host_to_device": 1.5}}


def test_counter_deltas_and_per_step() -> None:
    before = stats(
        decode_steps=10, decode_bytes_host_to_device=4096, blocks_deferred=7, foreground_wait_us=100
    )
    after = stats(
        decode_steps=50,
        decode_bytes_host_to_device=4096 + 40 * 8192,
        decode_blocks_loaded=160,
        blocks_deferred=7 + 20,
        foreground_wait_us=100 + 250_000,
        stage_select_us=33,
    )
    deltas = counter_deltas(before, after)
    assert deltas == {
        "decode_steps": 40,
        "decode_bytes_host_to_device": 40 * 8192,
        "decode_blocks_loaded": 160,
        "blocks_deferred": 20,
        "blocks_just_filled": 0,
        "foreground_wait_us": 250_000,
        "stage_select_us": 33,
        "stage_transfer_us": 0,
    }
    assert per_step(deltas, decode_wall_s=2.0) == {
        "bytes_per_step": 8192.0,
        "deferred_per_step": 0.5,
        "blocks_loaded_per_step": 4.0,
        "wait_share": 0.125,
    }


def test_per_step_without_steps_or_time_is_none() -> None:
    deltas = counter_deltas(stats(), stats())
    assert per_step(deltas, decode_wall_s=0.0) == {
        "bytes_per_step": None,
        "deferred_per_step": None,
        "blocks_loaded_per_step": None,
        "wait_share": None,
    }


def test_decode_rate_spans_first_first_token_to_last_token() -> None:
    # request A: tokens at 1.0, 1.5, 2.0; request B: at 1.25, 3.0 -> (2 + 1) tokens over 3.0 - 1.0 s
    assert decode_rate([[1.0, 1.5, 2.0], [1.25, 3.0]]) == (3, 2.0)
    assert decode_rate([[1.0, 2.0], []]) == (1, 1.0)  # a request without tokens does not count


def test_ordered_puts_the_given_keys_first() -> None:
    entry = {"a": 1, "b": 2, "c": 3}
    assert list(ordered(entry, ("c", "missing", "a"))) == ["c", "a", "b"]
    assert ordered(entry, ("c",)) == entry


def test_tpot_and_covering_k() -> None:
    assert tpot_s([10.0, 10.5, 11.0, 13.0]) == 1.0
    with pytest.raises(ValueError):
        tpot_s([1.0])
    assert covering_top_k(1024, 64, 16) == 68 + 1
    assert covering_top_k(1000, 1, 16) == 63 + 1  # 1001 tokens: 62 full blocks and a partial one


def test_sparse_settings_fixed_caps_then_adaptive_bounds() -> None:
    # K = 128: ceil(0.05 x 128) = 7, ceil(0.25 x 128) = 32, 1.0 = no cap; the adaptive cap at 0.05 runs
    # between ceil(0.05 x 128) = 7 and ceil(min(1, 0.2) x 128) = 26, at 0.3 between 39 and 128.
    assert sparse_settings([0.05, 0.25, 1.0], [0.05, 0.3], 128) == [
        ("ratios", 0.05, False, 7),
        ("ratios", 0.25, False, 32),
        ("ratios", 1.0, False, None),
        ("adaptive", 0.05, True, [7, 26]),
        ("adaptive", 0.3, True, [39, 128]),
    ]
    assert sparse_settings([0.01], [], 32) == [("ratios", 0.01, False, 1)]
