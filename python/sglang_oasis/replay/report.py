"""The replay report: latency percentiles, throughput, cache share, errors; JSON, PNG plots, comparison.

Percentiles interpolate linearly between order statistics (rank ``p/100 * (n - 1)``, as numpy's
default). TTFT is send to first token; TPOT is (last token - first token) / (output tokens - 1); E2E is
send to last chunk; all over successful requests. ``send_delay_s`` is how late requests were sent
against their schedule (waiting for ``max_concurrency`` or for the client itself). Throughput divides by the run's duration (first send
to last finish). Files are written to a temporary name beside the target and renamed into place, so a
report is either complete or absent.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sglang_oasis.replay.client import Result

REPORT_VERSION = 1
LATENCIES = ("ttft_s", "tpot_s", "e2e_s")
MAX_ERROR_MESSAGES = 5


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (0-100) of a non-empty sequence, linear interpolation."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "count": 0}
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "mean": sum(values) / len(values),
        "count": len(values),
    }


def _record(result: Result) -> dict[str, Any]:
    return {
        "line": result.line,
        "conversation": result.conversation,
        "turn": result.turn,
        "scheduled_s": result.scheduled_s,
        "sent_s": result.sent_s,
        "input_tokens": result.input_tokens,
        "max_new_tokens": result.max_new_tokens,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "completion_tokens": result.completion_tokens,
        "ttft_s": result.ttft_s,
        "tpot_s": result.tpot_s,
        "e2e_s": result.e2e_s,
        "end_s": result.end_s,
        "error": result.error,
    }


def build_report(results: Sequence[Result], settings: dict[str, Any], started_at: str) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    failed = [r for r in results if r.error is not None]
    sent = [r.sent_s for r in results if r.sent_s is not None]
    ends = [r.end_s for r in results if r.end_s is not None]
    duration = (max(ends) - min(sent)) if sent and ends else 0.0
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached_tokens = sum(r.cached_tokens for r in ok)
    output_tokens = sum(r.completion_tokens for r in ok)
    latency = {name: summarize([v for r in ok if (v := getattr(r, name)) is not None]) for name in LATENCIES}
    delays = [r.sent_s - r.scheduled_s for r in results if r.sent_s is not None]
    summary = {
        "requests": len(results),
        "completed": len(ok),
        "errors": len(failed),
        "duration_s": duration,
        "requests_per_s": len(ok) / duration if duration > 0 else None,
        "output_tokens_per_s": output_tokens / duration if duration > 0 else None,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "cached_share": cached_tokens / prompt_tokens if prompt_tokens else None,
        "output_tokens": output_tokens,
        **latency,
        "send_delay_s": summarize(delays),
    }
    return {
        "tool": "sglang_oasis.replay",
        "version": REPORT_VERSION,
        "started_at": started_at,
        "settings": settings,
        "summary": summary,
        "errors": {
            "count": len(failed),
            "first": [f"line {r.line}: {r.error}" for r in failed][:MAX_ERROR_MESSAGES],
        },
        "requests": [_record(r) for r in results],
    }


@contextmanager
def _atomic(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it into place only if the block succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(handle)
    try:
        yield Path(temp)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def write_json(path: Path, report: dict[str, Any]) -> None:
    with _atomic(path) as temp:
        temp.write_text(json.dumps(report, indent=2) + "\n")


def plot_paths(out: Path) -> dict[str, Path]:
    return {
        "latency_cdf": out.with_name(f"{out.stem}_latency_cdf.png"),
        "throughput": out.with_name(f"{out.stem}_throughput.png"),
    }


def write_plots(out: Path, results: Sequence[Result]) -> dict[str, str]:
    """Latency CDFs and output throughput over time, PNG files beside ``out``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = plot_paths(out)
    ok = [r for r in results if r.error is None]

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, name, title in zip(axes, LATENCIES, ("TTFT", "TPOT", "end-to-end"), strict=True):
        values = sorted(v for r in ok if (v := getattr(r, name)) is not None)
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], drawstyle="steps-post")
        ax.set_title(f"{title} ({len(values)} requests)")
        ax.set_xlabel("seconds")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    _save(fig, paths["latency_cdf"], plt.close)

    fig, ax = plt.subplots(figsize=(8, 3.6))
    arrivals = [(t, n) for r in ok for t, n in r.token_times]
    if arrivals:
        end = max(t for t, _ in arrivals)
        width = max(end / 60, 0.5)  # about 60 bins, at least half a second each
        bins = [0.0] * (int(end / width) + 1)
        for t, n in arrivals:
            bins[int(t / width)] += n
        ax.plot([i * width for i in range(len(bins))], [b / width for b in bins], drawstyle="steps-post")
        ax2 = ax.twinx()
        finished = sorted(r.end_s for r in ok if r.end_s is not None)
        ax2.plot(finished, range(1, len(finished) + 1), color="tab:orange", alpha=0.7)
        ax2.set_ylabel("requests finished", color="tab:orange")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tokens / s")
    ax.set_title("throughput over time")
    ax.grid(alpha=0.3)
    _save(fig, paths["throughput"], plt.close)
    return {name: str(path) for name, path in paths.items()}


def _save(fig: Any, path: Path, close: Callable[[Any], None]) -> None:
    try:
        fig.tight_layout()
        with _atomic(path) as temp:
            fig.savefig(temp, format="png", dpi=110)
    finally:
        close(fig)


# --compare

COMPARED: tuple[tuple[str, str], ...] = (
    ("requests", "requests"),
    ("completed", "completed"),
    ("errors", "errors"),
    ("duration_s", "duration (s)"),
    ("requests_per_s", "requests/s"),
    ("output_tokens_per_s", "output tokens/s"),
    ("cached_share", "cached share"),
    *(
        (f"{name}.{stat}", f"{name[:-2].upper()} {stat} (s)")
        for name in LATENCIES
        for stat in ("p50", "p90", "p99", "mean")
    ),
)


def read_report(path: Path) -> dict[str, Any]:
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable replay report ({exc})") from exc
    if not isinstance(report, dict) or report.get("tool") != "sglang_oasis.replay" or "summary" not in report:
        raise ValueError(f"{path}: not a replay report (no 'tool': 'sglang_oasis.replay' and 'summary')")
    return report


def _lookup(summary: dict[str, Any], key: str) -> float | None:
    value: Any = summary
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value if isinstance(value, int | float) and not isinstance(value, bool) else None


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def compare(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str] = ("A", "B")) -> str:
    """A plain-text table of two reports' summaries with the ratio B/A (second over first)."""
    rows = [("metric", names[0], names[1], f"{names[1]}/{names[0]}")]
    for key, label in COMPARED:
        va, vb = _lookup(a["summary"], key), _lookup(b["summary"], key)
        ratio = vb / va if va is not None and vb is not None and va != 0 else None
        rows.append((label, _cell(va), _cell(vb), "-" if ratio is None else f"{ratio:.3f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
