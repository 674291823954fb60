"""The pure pieces of benchmark/bench_overhead.py: the K < N check, the TPOT ratios against dense, the
agreement with dense's output, the per-step counter rates and the "never scored" error, on constructed
inputs with exact expected values."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from bench_overhead import (
    LOOKAHEAD_MODES,
    MODES,
    agreement_with_dense,
    check_sparse_top_k,
    common_prefix,
    covering_top_k,
    per_step_counters,
    ratio,
    server_args,
    tpot_ratios,
    unscored_error,
)

DENSE = [5, 6, 7, 8, 9, 10, 11, 12]


@pytest.mark.parametrize(
    ("top_k", "context", "block", "full"),
    [
        pytest.param(16, 1024, 16, 64, id="default-16-of-64"),
        pytest.param(63, 1024, 16, 64, id="one-below-n"),
        pytest.param(1, 1000, 16, 62, id="partial-tail-not-counted"),
    ],
)
def test_sparse_top_k_below_the_full_blocks(top_k: int, context: int, block: int, full: int) -> None:
    assert check_sparse_top_k(top_k, context, block) == full


@pytest.mark.parametrize(
    ("top_k", "context", "block"),
    [
        pytest.param(64, 1024, 16, id="k-equals-n"),
        pytest.param(62 + 1, 1000, 16, id="k-counts-the-partial-tail"),  # 1000 tokens: 62 full blocks
        pytest.param(69, 1024, 16, id="covering-k"),
        pytest.param(0, 1024, 16, id="zero"),
        pytest.param(4, 32, 16, id="short-context"),
    ],
)
def test_sparse_top_k_at_or_above_n_is_rejected(top_k: int, context: int, block: int) -> None:
    with pytest.raises(ValueError, match="--sparse-top-k"):
        check_sparse_top_k(top_k, context, block)


def test_covering_k_is_never_a_sparse_k() -> None:
    for context in (100, 1000, 1024, 4096):
        with pytest.raises(ValueError):
            check_sparse_top_k(covering_top_k(context, 2, 16), context, 16)


def test_ratio() -> None:
    assert ratio(60.0, 50.0) == 1.2
    assert ratio(None, 50.0) is None  # the mode failed
    assert ratio(60.0, None) is None  # dense failed
    assert ratio(60.0, 0.0) is None


def test_tpot_ratios_divide_each_mode_by_dense() -> None:
    results = {
        "dense": {"tpot_ms": 50.0},
        "sparse_async": {"tpot_ms": 55.0},
        "sparse_sync": {"tpot_ms": 60.0},
        "sparse_k_sparse": {"tpot_ms": 40.0},
        "sparse_captured": {"tpot_ms": 45.0},
        "sparse_k_sparse_captured": {"tpot_ms": 30.0},
        "sparse_k_sparse_ngram": {"tpot_ms": 70.0},
        "sparse_k_sparse_ngram_captured": {"tpot_ms": 35.0},
    }
    assert tpot_ratios(results) == {
        "ratio_k_covering": 1.1,
        "ratio_k_sparse": 0.8,
        "ratio_tpot": 1.1,
        "ratio_tpot_sync": 1.2,
        "ratio_k_covering_captured": 0.9,
        "ratio_k_sparse_captured": 0.6,
        "ratio_k_sparse_ngram": 1.4,
        "ratio_k_sparse_ngram_captured": 0.7,
    }


def test_tpot_ratios_of_a_failed_mode_are_none() -> None:
    results = {
        "dense": {"tpot_ms": 50.0},
        "sparse_async": {"tpot_ms": 75.0},
        "sparse_sync": {"error": "RuntimeError: boom"},
        "sparse_k_sparse": {"error": "RuntimeError: boom"},
    }
    assert tpot_ratios(results) == {
        "ratio_k_covering": 1.5,
        "ratio_k_sparse": None,
        "ratio_tpot": 1.5,
        "ratio_tpot_sync": None,
        "ratio_k_covering_captured": None,
        "ratio_k_sparse_captured": None,
        "ratio_k_sparse_ngram": None,
        "ratio_k_sparse_ngram_captured": None,
    }
    no_dense = {"dense": {"error": "x"}, "sparse_async": {"tpot_ms": 75.0}}
    assert set(tpot_ratios(no_dense).values()) == {None}


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [
        pytest.param(DENSE, DENSE, 8, id="identical"),
        pytest.param([5, 6, 7, 0, 9], DENSE, 3, id="diverges-then-back-in-step"),
        pytest.param([0, *DENSE[1:]], DENSE, 0, id="first-differs"),
        pytest.param(DENSE[:4], DENSE, 4, id="shorter"),
        pytest.param([], DENSE, 0, id="empty"),
    ],
)
def test_common_prefix(a: list[int], b: list[int], n: int) -> None:
    assert common_prefix(a, b) == n
    assert common_prefix(b, a) == n


def test_agreement_with_dense() -> None:
    assert agreement_with_dense([DENSE, DENSE], DENSE) == {
        "identical_to_dense": True,
        "prefix_agreement": 1.0,
    }
    # the first repeat diverges at token 3: prefix 3 of 8; the second one differs at the end
    first = [5, 6, 7, 0, 9, 10, 11, 12]
    assert agreement_with_dense([first, DENSE], DENSE) == {
        "identical_to_dense": False,
        "prefix_agreement": 3 / 8,
    }
    # only the first repeat sets the prefix agreement, every repeat decides identical_to_dense
    assert agreement_with_dense([DENSE, [*DENSE[:7], 0]], DENSE) == {
        "identical_to_dense": False,
        "prefix_agreement": 1.0,
    }
    assert agreement_with_dense([DENSE], None) == {"identical_to_dense": None, "prefix_agreement": None}


def stats(**values: int) -> dict[str, object]:
    counters = ("decode_steps", "decode_bytes_host_to_device", "bytes_host_to_device", "scored_selections")
    return {"mode": "sparse", **dict.fromkeys(counters, 0), **values}


def test_per_step_counters() -> None:
    before = stats(
        decode_steps=7, decode_bytes_host_to_device=100, bytes_host_to_device=5000, scored_selections=30
    )
    after = stats(
        decode_steps=7 + 64,
        decode_bytes_host_to_device=100 + 64 * 2048,
        bytes_host_to_device=5000 + 64 * 2048 + 32 * 4096,  # plus the repeats' admissions
        scored_selections=30 + 64 * 6,  # 6 layers scored at every step
    )
    assert per_step_counters(before, after) == {
        "decode_steps": 64,
        "decode_bytes_per_step": 2048.0,
        "bytes_per_step": 2048.0 + 2048.0,
        "scored_selections_per_step": 6.0,
    }


def test_per_step_counters_missing_counter_or_no_steps_is_none() -> None:
    before, after = stats(decode_steps=3), stats(decode_steps=13, bytes_host_to_device=40)
    del before["scored_selections"], after["scored_selections"]  # a runtime without the counter
    assert per_step_counters(before, after) == {
        "decode_steps": 10,
        "decode_bytes_per_step": 0.0,
        "bytes_per_step": 4.0,
        "scored_selections_per_step": None,
    }
    idle = per_step_counters(stats(decode_steps=5, scored_selections=9), stats(decode_steps=5))
    assert idle == {
        "decode_steps": 0,
        "decode_bytes_per_step": None,
        "bytes_per_step": None,
        "scored_selections_per_step": None,
    }


def test_k_sparse_that_never_scored_is_an_error() -> None:
    assert unscored_error({"decode_steps": 64, "scored_selections_per_step": 6.0}) is None
    shortcut = unscored_error({"decode_steps": 64, "scored_selections_per_step": 0.0})
    assert shortcut is not None and shortcut.startswith("K < N mode never scored:")
    assert "unchanged shortcut" in shortcut
    missing = unscored_error({"decode_steps": 64, "scored_selections_per_step": None})
    assert missing is not None and "scored_selections" in missing and "missing" in missing
    no_stats = unscored_error({"tpot_ms": 50.0})  # /oasis/stats could not be read
    assert no_stats is not None and no_stats.startswith("K < N mode never scored:")


def test_server_args_k_sparse_keeps_the_default_fetch_ratio() -> None:
    model = Path("/models/smollm2")
    argv = {mode: server_args(mode, model, 16, 16, 8192, 1344, "float32") for mode in MODES}
    assert "--oasis-fetch-ratio" not in argv["sparse_k_sparse"]
    assert "--oasis-fetch-ratio" not in argv["sparse_k_sparse_captured"]
    assert "--oasis-fetch-ratio" not in argv["sparse_captured"]  # K covering: the cap never binds
    for mode in ("sparse_async", "sparse_sync"):
        assert argv[mode][argv[mode].index("--oasis-fetch-ratio") + 1] == "1.0"
    prefetch = {mode: argv[mode][argv[mode].index("--oasis-prefetch") + 1] for mode in MODES[1:]}
    assert prefetch == {"sparse_async": "async", "sparse_sync": "sync", "sparse_k_sparse": "async",
                        "sparse_captured": "async", "sparse_k_sparse_captured": "async"}  # fmt: skip
    # every sparse mode names its step (the launcher's CPU default is captured)
    steps = {mode: argv[mode][argv[mode].index("--oasis-decode-step") + 1] for mode in MODES[1:]}
    assert steps == {"sparse_async": "eager", "sparse_sync": "eager", "sparse_k_sparse": "eager",
                     "sparse_captured": "captured", "sparse_k_sparse_captured": "captured"}  # fmt: skip
    captured = [a if a != "captured" else "eager" for a in argv["sparse_k_sparse_captured"]]
    assert captured == argv["sparse_k_sparse"]
    batch8 = server_args("sparse_k_sparse", model, 16, 16, 8192, 1344, "float32", batch=8)
    assert batch8[batch8.index("--oasis-device-kv-tokens") + 1] == str(11 * 18 * 16 + 8192 // 4)
    k_sparse = argv["sparse_k_sparse"]
    assert k_sparse[k_sparse.index("--oasis-top-k") + 1] == "16"
    assert k_sparse[k_sparse.index("--oasis-mode") + 1] == "sparse"
    assert "--oasis-top-k" not in argv["dense"]


def test_the_recall_modes_are_their_twins_with_the_telemetry_on() -> None:
    """sparse_k_sparse_recall[_captured] differ from sparse_k_sparse[_captured] only by the telemetry's
    period; every other sparse mode runs without telemetry."""
    from bench_overhead import RECALL_MODES, server_args

    for mode, twin in RECALL_MODES.items():
        args = server_args(mode, Path("m"), 16, 16, 4096, 2048, "float32", recall_every=8)
        plain = server_args(twin, Path("m"), 16, 16, 4096, 2048, "float32", recall_every=8)
        assert args[:2] == ["--oasis-recall-sample-every", "8"] and args[2:] == plain[2:]
        assert plain[:2] == ["--oasis-recall-sample-every", "0"] and "--oasis-fetch-ratio" not in plain
    assert set(RECALL_MODES.values()) == {"sparse_k_sparse", "sparse_k_sparse_captured"}


def test_lookahead_modes_add_the_ngram_drafter_to_k_sparse() -> None:
    """The opt-in lookahead modes are sparse_k_sparse (and its captured twin) with the NGRAM drafter and
    normal acceptance: nothing else differs, so their TPOTs compare the verify step's two forms."""
    model = Path("/models/smollm2")
    lookahead = ["--oasis-lookahead", "ngram", "--oasis-draft-policy", "verify"]
    for mode, plain in zip(LOOKAHEAD_MODES, ("sparse_k_sparse", "sparse_k_sparse_captured"), strict=True):
        argv = server_args(mode, model, 16, 16, 8192, 1344, "float32")
        at = argv.index("--oasis-lookahead")
        assert argv[at : at + 4] == lookahead
        assert argv[:at] + argv[at + 4 :] == server_args(plain, model, 16, 16, 8192, 1344, "float32")


def test_a_covering_k_below_the_requests_blocks_stops_the_run_naming_it() -> None:
    """``--covering-top-k`` below the blocks a request has would not cover it: refused before any model
    or server starts."""
    script = Path(__file__).resolve().parents[2] / "benchmark" / "bench_overhead.py"
    command = [sys.executable, str(script), "--json", "/dev/null", "--covering-top-k", "40"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--covering-top-k 40 must be >= 69" in done.stderr, done.stderr
