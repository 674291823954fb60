"""The replay report on constructed timings: percentiles, throughput, cache share, errors, files, --compare."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_oasis.replay.client import Result
from sglang_oasis.replay.report import build_report, compare, percentile, summarize, write_json, write_plots

REPO = Path(__file__).resolve().parents[2]


def finished(
    index: int, sent: float, ttft: float, tpot: float, tokens: int, prompt: int = 100, cached: int = 0
) -> Result:
    first = sent + ttft
    end = first + tpot * (tokens - 1)
    step = (end - first) / max(1, tokens - 1)
    times = [(first + i * step, 1) for i in range(tokens)]
    return Result(
        line=index + 1, conversation=index, turn=0, scheduled_s=sent, max_new_tokens=tokens,
        input_tokens=prompt, sent_s=sent, first_token_s=first, end_s=end, prompt_tokens=prompt,
        cached_tokens=cached, completion_tokens=tokens, token_times=times,
    )  # fmt: skip


def failed(index: int, message: str) -> Result:
    return Result(
        line=index + 1, conversation=index, turn=0, scheduled_s=0.0, max_new_tokens=4, error=message
    )


def test_percentiles_interpolate_between_order_statistics() -> None:
    values = [float(v) for v in range(1, 102)]  # 1 .. 101
    random.Random(0).shuffle(values)
    assert percentile(values, 50) == 51.0
    assert percentile(values, 90) == 91.0
    assert percentile(values, 99) == 100.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([3.0], 99) == 3.0
    assert summarize(values)["mean"] == 51.0
    assert summarize([]) == {"p50": None, "p90": None, "p99": None, "mean": None, "count": 0}
    with pytest.raises(ValueError):
        percentile([], 50)


def test_report_summary_from_constructed_timings() -> None:
    # 10 requests: TTFT 0.1 .. 1.0 s, TPOT 0.01 .. 0.10 s, 11 tokens each, sent one second apart
    ok = [
        finished(
            i,
            sent=float(i),
            ttft=0.1 * (i + 1),
            tpot=0.01 * (i + 1),
            tokens=11,
            prompt=200,
            cached=50 * (i % 2),
        )
        for i in range(10)
    ]
    results = [*ok, failed(10, "HTTP 500: boom"), failed(11, "connect: refused")]
    report = build_report(results, {"url": "http://x"}, "2026-01-01T00:00:00+00:00")
    s = report["summary"]
    assert (s["requests"], s["completed"], s["errors"]) == (12, 10, 2)
    assert s["ttft_s"]["p50"] == pytest.approx(0.55)
    assert s["ttft_s"]["p90"] == pytest.approx(0.91)
    assert s["ttft_s"]["mean"] == pytest.approx(0.55)
    assert s["tpot_s"]["p99"] == pytest.approx(0.0991)
    # e2e = ttft + 10 * tpot = 0.2 (i + 1)
    assert s["e2e_s"]["p50"] == pytest.approx(1.1)
    last_end = 9 + 0.2 * 10
    assert s["duration_s"] == pytest.approx(last_end)
    assert s["requests_per_s"] == pytest.approx(10 / last_end)
    assert s["output_tokens_per_s"] == pytest.approx(110 / last_end)
    assert s["cached_share"] == pytest.approx(250 / 2000)
    assert report["errors"] == {"count": 2, "first": ["line 11: HTTP 500: boom", "line 12: connect: refused"]}
    assert len(report["requests"]) == 12 and report["requests"][3]["ttft_s"] == pytest.approx(0.4)
    assert report["started_at"] == "2026-01-01T00:00:00+00:00"
    json.dumps(report)  # serialisable as is


def test_report_of_only_failures_has_no_rates() -> None:
    report = build_report([failed(0, "x")], {}, "now")
    assert report["summary"]["requests_per_s"] is None
    assert report["summary"]["cached_share"] is None
    assert report["summary"]["ttft_s"]["count"] == 0


def test_write_json_replaces_atomically(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    write_json(out, {"n": 1})
    with pytest.raises(TypeError):
        write_json(out, {"n": object()})  # fails while serialising
    assert json.loads(out.read_text()) == {"n": 1}  # the old report is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temporary file left


def test_plots_are_png_files_beside_the_report(tmp_path: Path) -> None:
    results = [finished(i, float(i), 0.2, 0.05, 8) for i in range(6)]
    paths = write_plots(tmp_path / "run.json", results)
    assert set(paths) == {"latency_cdf", "throughput"}
    for path in paths.values():
        assert Path(path).parent == tmp_path
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _report(ttft: float, tokens_per_s: float, errors: int) -> dict:
    results = [finished(i, float(i), ttft, 0.02, 5) for i in range(4)] + [failed(9, "x")] * errors
    report = build_report(results, {"url": "u", "trace": "t"}, "now")
    report["summary"]["output_tokens_per_s"] = tokens_per_s
    return report


def test_compare_prints_both_runs_and_ratios(tmp_path: Path) -> None:
    a, b = _report(0.2, 50.0, 0), _report(0.4, 25.0, 1)
    table = compare(a, b)
    rows = {line.split("  ")[0].strip(): line.split() for line in table.splitlines()}
    assert rows["TTFT p50 (s)"][-3:] == ["0.2", "0.4", "2.000"]
    assert rows["output tokens/s"][-3:] == ["50", "25", "0.500"]
    assert rows["errors"][-3:] == ["0", "1", "-"]  # no ratio against zero

    write_json(tmp_path / "a.json", a)
    write_json(tmp_path / "b.json", b)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable,
        "-m",
        "sglang_oasis.replay",
        "--compare",
        str(tmp_path / "a.json"),
        str(tmp_path / "b.json"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert table in done.stdout and str(tmp_path / "b.json") in done.stdout

    (tmp_path / "bad.json").write_text('{"something": "else"}')
    command[-1] = str(tmp_path / "bad.json")
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and "bad.json: not a replay report" in done.stderr
