"""Every benchmark of the project at CPU scale, in one run, with one summary (markdown + JSON).

    python benchmark/run_all.py --out-dir results/ [--quick]

Three parts, each compared against the dense baseline in the same run:

1. the ``benchmark/bench_*.py`` scripts that exist (known ones are run with CPU-sized arguments, a
   script that is not there yet is listed as skipped), each in its own process with a timeout;
2. passkey retrieval (``sglang_oasis.evaluation.passkey``) on the default model, dense against sparse
   (K = 32 blocks), at ~1K/2K/4K/7K tokens, fixed seeds (``--quick``: 1K and 2K, 2 depths);
3. a replay of the first requests of the Mooncake conversation trace (``sglang_oasis.replay``) on the
   same two servers, with their side-by-side comparison.

Writes ``summary.md`` and ``summary.json`` (date, machine, every part's numbers and failures), and each
part's own files (benchmark JSON and logs, replay reports and plots) under ``--out-dir``. A part that
fails is recorded with its error and the others still run; the exit code is 1 if any part failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import BY_SUMMARIES
from sglang_oasis.evaluation.passkey import count_hits, essays_text, make_case
from sglang_oasis.models.default_model import prepare_default_model
from sglang_oasis.replay import ReplayConfig, run_replay
from sglang_oasis.replay.report import compare
from sglang_oasis.server_process import ServerProcess

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_TRACE = REPO / "data" / "traces" / "mooncake_conversation_trace.head2000.jsonl"
TOP_K = 32
HEADLINE_NUMBERS = 8  # per benchmark in the summary table; the JSON has them all


@dataclass(frozen=True)
class Scale:
    """How big each part is: ``--quick`` or the default."""

    bench_args: dict[str, list[str]]
    bench_timeout_s: float
    passkey_contexts: tuple[int, ...]
    passkey_depths: tuple[float, ...]
    replay_requests: int
    replay_length_scale: float
    replay_speedup: float
    replay_concurrency: int


# Arguments per benchmark script besides ``--json``; a script not listed here gets ``--quick`` in quick
# mode if its --help offers it. Any script offering ``--plot`` gets a PNG beside its JSON.
KNOWN_BENCHMARKS = (
    "bench_capacity",
    "bench_lookahead",
    "bench_fetch_cap",
    "bench_overhead",
    "bench_prefix",
    "bench_rpf",
    "bench_pd",
    "bench_acceptance",
    "bench_soak",
    "bench_sglang_serving",
)
FULL = Scale(
    bench_args={
        "bench_capacity": ["--num-layers", "6"],
        "bench_lookahead": [],
        "bench_overhead": [],
        "bench_fetch_cap": ["--adaptive-ratios", "0.05"],
        "bench_prefix": ["--num-layers", "6"],
        "bench_rpf": [],
        "bench_pd": [],
        "bench_acceptance": ["--pd"],
        "bench_soak": [],
        "bench_sglang_serving": [],
    },
    bench_timeout_s=3 * 3600,
    passkey_contexts=(1000, 2000, 4000, 7000),
    passkey_depths=(0.1, 0.3, 0.5, 0.7, 0.9),
    replay_requests=200,
    replay_length_scale=0.05,
    replay_speedup=10.0,
    replay_concurrency=8,
)
QUICK_CAPACITY = ["--num-layers", "6", "--context-tokens", "1024", "--output-tokens", "8", "--concurrency", "2,4"]  # fmt: skip
QUICK_FETCH_CAP = [
    "--num-layers", "6", "--context-tokens", "1024", "--agreement-tokens", "64", "--ratios", "0.05,0.25,1.0",
    "--passkey-depths", "0.3,0.7",
]  # fmt: skip
QUICK_SERVING = [
    "--num-layers", "6", "--input-len", "1024", "--output-len", "32", "--num-prompts", "2", "--concurrency", "2",
]  # fmt: skip
QUICK = Scale(
    bench_args={
        "bench_capacity": [*QUICK_CAPACITY, "--device-kv-tokens", "4096"],
        "bench_lookahead": ["--contexts", "1", "--context-tokens", "1024", "--steps", "20"],
        "bench_overhead": ["--num-layers", "6", "--output-tokens", "32", "--repeats", "2"],
        "bench_fetch_cap": QUICK_FETCH_CAP,
        "bench_prefix": ["--num-layers", "6", "--groups", "2", "--questions", "2", "--prefix-tokens", "1024"],
        "bench_rpf": ["--num-layers", "6", "--contexts", "1024", "2048", "--steps", "16"],
        "bench_pd": ["--contexts", "1024", "2048", "--new-tokens", "16"],
        "bench_acceptance": ["--prompts", "8", "--max-new-tokens", "64", "--modes", "dense,eagle3"],
        "bench_soak": [
            "--modes",
            "dense,sparse",
            "--requests",
            "24",
            "--prompt-tokens",
            "100,400",
            "--new-tokens",
            "8,24",
        ],
        "bench_sglang_serving": QUICK_SERVING,
    },
    bench_timeout_s=900,
    passkey_contexts=(1000, 2000),
    passkey_depths=(0.3, 0.7),
    replay_requests=10,
    replay_length_scale=0.05,  # 26-token blocks: a shared block covers at least one 16-token page
    replay_speedup=0.0,
    replay_concurrency=4,
)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory_gib = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    except Exception as exc:  # report what we can; the machine section must not stop the run
        gpu = f"unknown ({type(exc).__name__})"
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "gpu": gpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "commit": (commit.stdout.strip() or "unknown")
        + (" (with local changes)" if dirty.stdout.strip() else ""),
    }


# 1. benchmark scripts


def _help(script: Path) -> str:
    try:
        done = subprocess.run(
            [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return ""
    return done.stdout


def _scalars(result: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """The numbers of a benchmark's JSON, nested keys joined with dots, settings left out."""
    for key, value in result.items():
        if isinstance(value, dict) and key not in ("setting", "settings"):
            yield from _scalars(value, f"{prefix}{key}.")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            yield f"{prefix}{key}", value


def run_benchmark(name: str, scale: Scale, quick: bool, out_dir: Path) -> dict[str, Any]:
    script = HERE / f"{name}.py"
    if not script.exists():
        return {"name": name, "status": "skipped", "note": f"benchmark/{name}.py does not exist yet"}
    args = list(scale.bench_args.get(name, []))
    offered = _help(script)
    if quick and name not in scale.bench_args and "--quick" in offered:
        args.append("--quick")
    if "--plot" in offered:
        args += ["--plot", str(out_dir / f"{name}.png")]
    result_path = out_dir / f"{name}.json"
    log_path = out_dir / "logs" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(script), "--json", str(result_path), *args]
    started = time.monotonic()
    entry: dict[str, Any] = {"name": name, "command": " ".join(command[1:]), "log": str(log_path)}
    with log_path.open("w") as log:
        try:
            done = subprocess.run(
                command, stdout=log, stderr=subprocess.STDOUT, timeout=scale.bench_timeout_s, cwd=REPO
            )
            entry["status"] = "ok" if done.returncode == 0 else f"failed (exit {done.returncode})"
        except subprocess.TimeoutExpired:
            entry["status"] = f"failed (timeout {scale.bench_timeout_s:.0f} s)"
    entry["wall_s"] = round(time.monotonic() - started, 1)
    if entry["status"] == "ok" and result_path.exists():
        result = json.loads(result_path.read_text())
        entry["json"] = str(result_path)
        entry["headline"] = dict(list(_scalars(result))[:HEADLINE_NUMBERS])
    elif entry["status"] != "ok":
        entry["note"] = log_path.read_text(errors="replace")[-600:].strip()
    return entry


# 2 and 3: passkey and replay on one dense and one sparse server


def server_args(model: Path, mode: str) -> list[str]:
    common = ["--model-path", str(model), "--max-total-tokens", "32768"]
    if mode == "dense":
        return [*common, "--oasis-mode", "dense"]
    return [
        "--model-path", str(model), *BY_SUMMARIES, "--oasis-top-k", str(TOP_K),
        "--oasis-host-kv-tokens", "32768", "--oasis-device-kv-tokens", "8192",
    ]  # fmt: skip


@contextmanager
def serving(model: Path, mode: str, out_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(server_args(model, mode), log_path=out_dir / "logs" / f"server-{mode}.log")
    with server:
        yield server


def passkey_hits(url: str, tokenizer: Any, text: str, scale: Scale) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for context in scale.passkey_contexts:
        cases = [
            make_case(tokenizer, context, depth, seed=i, text=text)
            for i, depth in enumerate(scale.passkey_depths)
        ]
        out[str(context)] = {
            "hits": count_hits(url, cases),
            "cases": len(cases),
            "prompt_tokens": [case.prompt_tokens for case in cases],
        }
    return out


def replay_trace(url: str, model: Path, trace: Path, scale: Scale, out: Path) -> dict[str, Any]:
    config = ReplayConfig(
        trace=trace, url=url, out=out, tokenizer=str(model), speedup=scale.replay_speedup,
        max_requests=scale.replay_requests, max_concurrency=scale.replay_concurrency,
        length_scale=scale.replay_length_scale, progress=False,
    )  # fmt: skip
    return run_replay(config)


def dense_vs_sparse(trace: Path | None, scale: Scale, out_dir: Path) -> dict[str, Any]:
    from transformers import AutoTokenizer

    model = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    text = essays_text()
    passkey: dict[str, Any] = {}
    replay: dict[str, Any] = {}
    for mode in ("dense", "sparse"):
        try:
            with serving(model, mode, out_dir) as server:
                try:
                    passkey[mode] = passkey_hits(server.url, tokenizer, text, scale)
                except Exception as exc:
                    passkey[mode] = {"error": f"{type(exc).__name__}: {exc}"}
                if trace is not None:
                    try:
                        report = replay_trace(
                            server.url, model, trace, scale, out_dir / f"replay_{mode}.json"
                        )
                        replay[mode] = {
                            "report": str(out_dir / f"replay_{mode}.json"),
                            "summary": report["summary"],
                        }
                    except Exception as exc:
                        replay[mode] = {"error": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # the server did not start
            passkey[mode] = replay[mode] = {"error": f"{type(exc).__name__}: {exc}"}
    settings = {
        "model": str(model), "top_k": TOP_K, "passkey_depths": list(scale.passkey_depths),
        "replay_trace": str(trace) if trace else None, "replay_requests": scale.replay_requests,
        "replay_length_scale": scale.replay_length_scale, "replay_speedup": scale.replay_speedup,
        "replay_concurrency": scale.replay_concurrency,
    }  # fmt: skip
    result: dict[str, Any] = {"settings": settings, "passkey": passkey, "replay": replay}
    if all("summary" in replay.get(mode, {}) for mode in ("dense", "sparse")):
        a, b = ({"summary": replay[m]["summary"]} for m in ("dense", "sparse"))
        result["replay_comparison"] = compare(a, b, names=("dense", "sparse"))
    return result


# summary


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown(summary: dict[str, Any]) -> str:
    m = summary["machine"]
    lines = [
        f"# sglang-oasis benchmarks ({'quick' if summary['quick'] else 'full'})",
        "",
        f"- date: {summary['date']} (took {summary['wall_s'] / 60:.1f} min)",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, GPU: {m['gpu'] or 'none'}",
        f"- {m['platform']}, Python {m['python']}, commit {m['commit']}",
        "",
        "## Benchmark scripts",
        "",
        "| benchmark | status | wall (s) | headline numbers |",
        "| --- | --- | --- | --- |",
    ]
    for b in summary["benchmarks"]:
        headline = ", ".join(f"{k} {_fmt(v)}" for k, v in b.get("headline", {}).items()) or b.get("note", "")
        headline = headline.replace("\n", " ").replace("|", "/")[:300]
        lines.append(f"| {b['name']} | {b['status']} | {b.get('wall_s', '-')} | {headline} |")
    dvs = summary["dense_vs_sparse"]
    passkey = dvs.get("passkey", {})
    depths = len(dvs.get("settings", {}).get("passkey_depths", []))
    lines += ["", f"## Passkey retrieval (default model, {depths} depths, fixed seeds, sparse K={TOP_K})", ""]
    lines += ["| context | dense | sparse |", "| --- | --- | --- |"]
    contexts = sorted({c for mode in passkey.values() if "error" not in mode for c in mode}, key=int)
    for context in contexts:
        cells = []
        for mode in ("dense", "sparse"):
            entry = passkey.get(mode, {}).get(context)
            cells.append(f"{entry['hits']}/{entry['cases']}" if entry else "-")
        lines.append(f"| ~{int(context) // 1000}K tokens | {cells[0]} | {cells[1]} |")
    for mode in ("dense", "sparse"):
        if "error" in passkey.get(mode, {}):
            lines.append(f"\n{mode}: {passkey[mode]['error']}")
    s = dvs.get("settings", {})
    lines += [
        "",
        f"## Trace replay (first {s.get('replay_requests')} Mooncake conversation requests, length scale "
        f"{s.get('replay_length_scale')}, speedup {s.get('replay_speedup')}, concurrency {s.get('replay_concurrency')})",
        "",
    ]
    if "replay_comparison" in dvs:
        lines += ["```", dvs["replay_comparison"], "```"]
    else:
        replay = dvs.get("replay", {})
        lines.append(
            "; ".join(f"{mode}: {v.get('error', 'no result')}" for mode, v in replay.items()) or "skipped"
        )
    failures = summary["failures"]
    lines += ["", f"Failures: {', '.join(failures) if failures else 'none'}", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="smallest sizes: checks that everything runs")
    parser.add_argument(
        "--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake trace for the replay part"
    )
    parser.add_argument(
        "--skip", default="", help="comma-separated parts to skip: benchmarks, passkey-replay"
    )
    args = parser.parse_args()
    scale = QUICK if args.quick else FULL
    skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    summary: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick,
        "machine": machine(),
    }
    present = sorted(p.stem for p in HERE.glob("bench_*.py"))
    names = [*KNOWN_BENCHMARKS, *(n for n in present if n not in KNOWN_BENCHMARKS)]
    if "benchmarks" in skip:
        summary["benchmarks"] = [{"name": n, "status": "skipped", "note": "--skip benchmarks"} for n in names]
    else:
        summary["benchmarks"] = []
        for name in names:
            print(f"[run_all] {name} ...", flush=True)
            summary["benchmarks"].append(run_benchmark(name, scale, args.quick, args.out_dir))
    trace = args.trace if args.trace.exists() else None
    if "passkey-replay" in skip:
        summary["dense_vs_sparse"] = {"settings": {}, "passkey": {}, "replay": {}}
    else:
        print("[run_all] passkey and trace replay, dense then sparse ...", flush=True)
        summary["dense_vs_sparse"] = dense_vs_sparse(trace, scale, args.out_dir)
        if trace is None:
            summary["dense_vs_sparse"]["replay"] = {"skipped": {"error": f"no trace at {args.trace}"}}
    failures = [b["name"] for b in summary["benchmarks"] if b["status"].startswith("failed")]
    for part in ("passkey", "replay"):
        failures += [
            f"{part} {mode}"
            for mode, v in summary["dense_vs_sparse"][part].items()
            if "error" in v and mode != "skipped"
        ]
    summary["failures"] = failures
    summary["wall_s"] = round(time.monotonic() - started, 1)
    text = markdown(summary)
    (args.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out_dir / "summary.md").write_text(text)
    print(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
