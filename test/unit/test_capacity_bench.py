"""benchmark/bench_capacity.py's steady decode rate: the median gap between a request's consecutive
tokens leaves out the steps that waited on a prefill."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from bench_capacity import median_token_gap


def test_prefill_pauses_do_not_move_the_median_step() -> None:
    # Three requests decoding in 0.1 s steps; request 1 arrives late, and two steps of everyone wait
    # 5 s on its and another prefill: the step is still 0.1 s (the window rate would be far lower).
    steps = [0.1 * i for i in range(12)]
    paused = [t + (5.0 if i >= 4 else 0.0) + (5.0 if i >= 8 else 0.0) for i, t in enumerate(steps)]
    times = [paused, paused[4:], paused]
    assert math.isclose(median_token_gap(times), 0.1, rel_tol=1e-9)
    assert math.isclose(3 / median_token_gap(times), 30.0, rel_tol=1e-9)


def test_no_second_token_gives_nan() -> None:
    assert math.isnan(median_token_gap([[1.0], [2.0]]))
