"""Sparse mode through SGLang's own load generator: ``python -m sglang.bench_serving`` against a dense
server and sparse servers, one after another, and their TPOT ratios.

Each server (SmolLM2, ``--num-layers`` truncates it; ``--dtype``, float32 by default) gets SGLang's
``bench_serving --backend sglang --dataset-name random-ids`` with ``--num-prompts`` prompts of exactly
``--input-len`` random token ids and ``--output-len`` output tokens (EOS ignored), ``--concurrency`` at once,
on a fresh server first (``cold``: what a user meets first, the server's start and warm-up before it; the
captured step compiles every program before the server is ready), then after ``--warmup-runs`` untimed
runs of the same shape with other prompts (default 1; the figures at the top level, ``warm``). Modes:

- ``dense``: dense SGLang, the baseline;
- ``sparse_eager``: sparse, K = ``--top-k`` (default 32) blocks of 16, the eager decode step;
- ``sparse_captured``: the same with ``--oasis-decode-step captured``;
- ``sparse_codes``: ``sparse_eager`` with ``--oasis-selector codes`` (blocks ranked by their 2-bit key
  codes' attention mass; not in the default ``--modes``);
- ``sparse_codes_prefilter``: ``sparse_codes`` scoring only each KV head's ``--code-candidates`` (4) x K
  best blocks by the summaries' bound (``--oasis-code-candidates``; not in the default ``--modes``);
- ``sparse_codes_captured``: ``sparse_codes_prefilter`` on the captured step (not in the default);
- ``dense_floor``: the dense server with ``--floor-input-len`` (16) token prompts: a step with almost no
  context to attend, i.e. what every mode's step costs besides attention (projections, MLP, sampling,
  the scheduler). No attention can make a step cheaper than this; ``attention_ratio_<mode>`` = (its TPOT
  - the floor) / (dense's TPOT - the floor) is the part of dense's attention time the mode still spends.

The sparse servers keep the product's defaults otherwise (fetch cap, prefill window, recall telemetry).
Reads each run's ``--output-file`` (SGLang's JSON line) and reports ``mean_tpot_ms``, ``median_tpot_ms``,
``mean_ttft_ms`` and ``output_throughput`` per mode, and ``tpot_ratio_<mode>`` = its mean TPOT / dense's;
``cold`` holds the cold run's figures (and ``tpot_ratio_cold_<mode>``), ``ready_s`` the server's start to
ready, ``captured_compile_ms`` its compiles (at ready, and ``_after`` the runs: a compile while serving).

    python benchmark/bench_sglang_serving.py --json serving.json [--input-len 3000] [--output-len 128]
        [--num-prompts 4] [--concurrency 4] [--top-k 32] [--num-layers N] [--modes dense,sparse_eager,...]

Prints a table and writes JSON (``modes.<mode>``, the ratios, ``settings``, ``date``, ``machine``). Exits 1
if a mode failed (the JSON is written anyway). About 10 minutes on 2 cores at the defaults.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import machine_info, print_table
from sglang_oasis.models.default_model import prepare_default_model
from sglang_oasis.server_process import ServerProcess, child_env

MODES = (
    "dense",
    "sparse_eager",
    "sparse_captured",
    "sparse_codes",
    "sparse_codes_prefilter",
    "sparse_codes_captured",
    "dense_floor",
)
FIELDS = ("mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms", "output_throughput", "completed")


def prompt_tokens(input_len: int) -> int:
    """The most tokens a prompt of ``input_len`` random ids may reach: SGLang's bench_serving decodes them
    to text and the server tokenizes it again (~6% more seen at 7,000; beyond the context the request
    fails)."""
    return input_len * 11 // 10 + 256


def server_args(mode: str, model: Path, args: argparse.Namespace) -> list[str]:
    tokens = args.num_prompts * (prompt_tokens(args.input_len) + args.output_len) + 4096
    context = prompt_tokens(args.input_len) + args.output_len
    common = ["--model-path", str(model), "--dtype", args.dtype, "--context-length", str(context)]
    if mode in ("dense", "dense_floor"):
        return [*common, "--oasis-mode", "dense", "--max-total-tokens", str(tokens)]
    step = "captured" if mode in ("sparse_captured", "sparse_codes_captured") else "eager"
    codes = ["--oasis-selector", "codes" if mode.startswith("sparse_codes") else "summaries"]
    if mode in ("sparse_codes_prefilter", "sparse_codes_captured"):
        codes += ["--oasis-code-candidates", str(args.code_candidates)]
    return [*common, "--oasis-top-k", str(args.top_k), "--oasis-host-kv-tokens", str(tokens),
            "--oasis-decode-step", step, *codes]  # fmt: skip


def server_groups(modes: list[str]) -> list[list[str]]:
    """The modes by the server they run on, in order: ``dense_floor`` shares ``dense``'s (the same
    arguments, short prompts), so a run starts the dense server once."""
    groups: dict[str, list[str]] = {}
    for mode in modes:
        groups.setdefault("dense" if mode == "dense_floor" else mode, []).append(mode)
    return list(groups.values())


def bench(
    server: ServerProcess, model: Path, args: argparse.Namespace, out: Path, seed: int = 1, input_len: int = 0
) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", server.url,
        "--model", str(model), "--tokenizer", str(model), "--dataset-name", "random-ids",
        "--random-input-len", str(input_len or args.input_len), "--random-output-len", str(args.output_len),
        "--random-range-ratio", "1", "--num-prompts", str(args.num_prompts), "--max-concurrency",
        str(args.concurrency), "--warmup-requests", "1", "--seed", str(seed), "--disable-tqdm", "--output-file", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, env=child_env({"HF_HUB_OFFLINE": "1"}), capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench_serving exited {done.returncode}: {done.stderr[-1500:]}")
    line = out.read_text().strip().splitlines()[-1]
    result = json.loads(line)
    check_generated(result)
    return {name: result.get(name) for name in FIELDS}


def check_generated(result: dict[str, Any]) -> None:
    """Raise unless bench_serving's requests generated their tokens: a request the server rejects (a
    prompt past the context) still counts as ``completed`` there, with ``output_len`` tokens and no
    text (a TPOT of ~1 ms)."""
    text, counted = result.get("total_output_tokens_retokenized") or 0, result.get("total_output_tokens") or 0
    if text < counted // 2:
        raise RuntimeError(
            f"bench_serving's requests generated {text} tokens of text for {counted} counted: rejected by the "
            "server (see its log)"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--input-len", type=int, default=3000)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--modes", default=",".join(mode for mode in MODES if not mode.startswith("sparse_codes"))
    )
    parser.add_argument("--code-candidates", type=int, default=4, help="sparse_codes_prefilter's m (m x K)")
    parser.add_argument("--warmup-runs", type=int, default=1, help="untimed runs first (other prompts)")
    parser.add_argument("--floor-input-len", type=int, default=16, help="dense_floor's prompt length")
    args = parser.parse_args()
    modes = [mode for mode in MODES if mode in args.modes.split(",")]
    model = prepare_default_model(args.num_layers)
    logs = Path(tempfile.mkdtemp(prefix="bench-sglang-serving-"))
    print(f"server logs in {logs}", flush=True)
    results: dict[str, Any] = {"modes": {}}
    for group in server_groups(modes):  # dense and dense_floor: one server, started once
        print(f"[bench_sglang_serving] {', '.join(group)} ...", flush=True)
        argv, log = server_args(group[0], model, args), logs / f"{group[0]}.log"
        try:
            started = time.monotonic()
            with ServerProcess(argv, log_path=log, ready_timeout_s=1800) as server:
                ready_s, at_ready = time.monotonic() - started, server.oasis_stats()
                for mode in group:
                    length = args.floor_input_len if mode == "dense_floor" else args.input_len
                    cold = bench(server, model, args, logs / f"{mode}-cold.jsonl", 200, length)
                    for run in range(args.warmup_runs):  # other prompts, the same shapes
                        bench(server, model, args, logs / f"{mode}-warmup{run}.jsonl", 100 + run, length)
                    out = logs / f"{mode}.jsonl"
                    warm = bench(server, model, args, out, input_len=length)
                    results["modes"][mode] = {**warm, "cold": cold, "ready_s": round(ready_s, 1)}
                    if mode.startswith("sparse"):
                        stats = server.oasis_stats()
                        for name in ("captured_decode_passes", "decode_steps", "captured_uncompiled_passes"):
                            results["modes"][mode][name] = stats.get(name)
                        results["modes"][mode]["captured_compile_ms"] = at_ready.get("captured_compile_ms")
                        results["modes"][mode]["captured_compile_ms_after"] = stats.get("captured_compile_ms")
        except Exception as exc:  # a failed server or run: record it (its group's modes not done) and go on
            for mode in group:
                results["modes"].setdefault(mode, {"error": f"{type(exc).__name__}: {exc}"[:2000]})
    dense = results["modes"].get("dense", {}).get("mean_tpot_ms")
    floor = results["modes"].get("dense_floor", {}).get("mean_tpot_ms")
    dense_cold = results["modes"].get("dense", {}).get("cold", {}).get("mean_tpot_ms")
    for mode in modes[1:]:
        tpot = results["modes"][mode].get("mean_tpot_ms")
        results[f"tpot_ratio_{mode}"] = tpot / dense if tpot and dense else None
        cold_tpot = results["modes"][mode].get("cold", {}).get("mean_tpot_ms")
        results[f"tpot_ratio_cold_{mode}"] = cold_tpot / dense_cold if cold_tpot and dense_cold else None
        if mode.startswith("sparse") and tpot and dense and floor and dense > floor:
            results[f"attention_ratio_{mode}"] = (tpot - floor) / (dense - floor)
    rows = []
    for mode in modes:
        for run in ("cold", "warm"):
            r = results["modes"][mode]
            r = r.get("cold", {}) if run == "cold" else r
            ratio = results.get(
                f"tpot_ratio_{'cold_' if run == 'cold' else ''}{mode}", 1.0 if mode == "dense" else None
            )
            rows.append([mode, run, *(r.get(name, "-") for name in FIELDS), "-" if ratio is None else f"{ratio:.2f}",
                         results["modes"][mode].get("ready_s", "-"), results["modes"][mode].get("error", "")[:60]])  # fmt: skip
    print_table(["mode", "run", *FIELDS, "tpot_vs_dense", "ready_s", "error"], rows)
    results["settings"] = {
        "input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
        "concurrency": args.concurrency, "top_k": args.top_k, "num_layers": args.num_layers or 30, "dtype": args.dtype,
        "warmup_runs": args.warmup_runs, "floor_input_len": args.floor_input_len,
    }  # fmt: skip
    results["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    results["machine"] = machine_info()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 1 if any("error" in results["modes"][mode] for mode in modes) else 0


if __name__ == "__main__":
    sys.exit(main())
