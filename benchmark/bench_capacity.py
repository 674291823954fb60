"""Capacity: dense and sparse servers given the same device KV budget, SmolLM2 on CPU, ~4K-token
contexts, rising concurrency.

Dense holds every request's full KV in its device pool (``--max-total-tokens`` = the budget); sparse
holds only working sets there (``--oasis-device-kv-tokens`` = the budget) and the full KV in the host
tier. For each concurrency level it records the peak number of running requests (SGLang's
``sglang:num_running_reqs`` gauge) and ``decode_tok_s``: generated tokens after each request's first,
divided by the time from the first request's first token to the last token (so prefill waves that a
smaller capacity forces are part of the cost), and ``steady_decode_tok_s``: the peak running count over
the median time between a request's consecutive tokens, i.e. the rate of a decode step of the saturated
batch with the steps that waited on a prefill left out. On CPU a 4K-token prefill costs as much as
hundreds of decode steps, so ``decode_tok_s`` mostly measures prefill there; ``steady_decode_tok_s``
measures what the device budget buys in decoding. ``--output-tokens`` sets how much of the window is
decoding: with 512 instead of 32 the dense server's waves of a few requests each pay hundreds of decode
steps, and ``decode_tok_s`` moves toward the steady ratio.

    python benchmark/bench_capacity.py --json capacity.json [--num-layers 6] [--output-tokens 32]
        [--concurrency 4,16,32]

Writes ``dense.max_running``, ``oasis.max_running``, ``dense.decode_tok_s``, ``oasis.decode_tok_s``
(at the highest concurrency), ``ratio_running``, ``ratio_decode_tok_s``, the same for
``steady_decode_tok_s`` and the per-level data.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import PeakSampler, essay_prompts, print_table, stream_generate
from sglang_oasis.models.default_model import prepare_default_model
from sglang_oasis.testing.server_process import ServerProcess


def median_token_gap(times: list[list[float]]) -> float:
    """The median time between a request's consecutive tokens, over every request: a decode step of the
    running batch, robust to the few steps that wait on another request's prefill."""
    gaps = [later - earlier for t in times for earlier, later in itertools.pairwise(t)]
    return statistics.median(gaps) if gaps else float("nan")


def run_level(server: ServerProcess, prompts: list[list[int]], output_tokens: int) -> dict[str, Any]:
    started = time.monotonic()
    with (
        PeakSampler(server.url, "sglang:num_running_reqs") as sampler,
        ThreadPoolExecutor(len(prompts)) as pool,
    ):
        streams = list(pool.map(lambda ids: stream_generate(server.url, ids, output_tokens), prompts))
    errors = [s.error for s in streams if s.error]
    times = [s.token_times for s in streams if s.token_times]
    first = min(t[0] for t in times)
    last = max(t[-1] for t in times)
    decode_tokens = sum(len(t) - 1 for t in times)
    step_s = median_token_gap(times)
    return {
        "concurrency": len(prompts),
        "max_running": int(sampler.peak),
        "decode_tok_s": decode_tokens / max(last - first, 1e-9),
        "median_token_gap_s": step_s,
        "steady_decode_tok_s": int(sampler.peak) / max(step_s, 1e-9),
        "wall_s": time.monotonic() - started,
        "errors": len(errors),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--context-tokens", type=int, default=4096)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--device-kv-tokens", type=int, default=16384, help="the device KV budget of both")
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--concurrency", default="4,16,32")
    parser.add_argument("--num-layers", type=int, default=None, help="truncate SmolLM2 (default: all 30)")
    args = parser.parse_args()

    levels = [int(c) for c in args.concurrency.split(",")]
    model = prepare_default_model(args.num_layers)
    prompts = essay_prompts(model, max(levels), args.context_tokens)
    host_tokens = max(levels) * (args.context_tokens + args.output_tokens + args.block_size) + 4096
    common = [
        "--model-path",
        str(model),
        "--enable-metrics",
        "--context-length",
        str(args.context_tokens + args.output_tokens + 512),
    ]
    configs = {
        "dense": [*common, "--oasis-mode", "dense", "--max-total-tokens", str(args.device_kv_tokens)],
        "oasis": [
            *common, "--oasis-top-k", str(args.top_k), "--oasis-block-size", str(args.block_size),
            "--oasis-device-kv-tokens", str(args.device_kv_tokens), "--oasis-host-kv-tokens", str(host_tokens),
        ],
    }  # fmt: skip
    results: dict[str, Any] = {
        "setting": {
            "context_tokens": args.context_tokens, "output_tokens": args.output_tokens,
            "device_kv_tokens": args.device_kv_tokens, "top_k": args.top_k, "block_size": args.block_size,
            "num_layers": args.num_layers or 30, "concurrency": levels,
        }
    }  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="bench-capacity-"))
    for name, server_args in configs.items():
        with ServerProcess(server_args, log_path=logs / f"{name}.log") as server:
            per_level = [run_level(server, prompts[:c], args.output_tokens) for c in levels]
        results[name] = {
            "max_running": max(level["max_running"] for level in per_level),
            "decode_tok_s": per_level[-1]["decode_tok_s"],
            "steady_decode_tok_s": per_level[-1]["steady_decode_tok_s"],
            "levels": per_level,
        }
    results["ratio_running"] = results["oasis"]["max_running"] / max(1, results["dense"]["max_running"])
    for metric in ("decode_tok_s", "steady_decode_tok_s"):
        results[f"ratio_{metric}"] = results["oasis"][metric] / results["dense"][metric]
    working_set = (args.top_k + 1) * args.block_size
    results["target_ratio_running"] = 0.9 * args.context_tokens / working_set

    rows = []
    for name in ("dense", "oasis"):
        for level in results[name]["levels"]:
            rows.append(
                [
                    name,
                    level["concurrency"],
                    level["max_running"],
                    level["decode_tok_s"],
                    level["steady_decode_tok_s"],
                    level["wall_s"],
                    level["errors"],
                ]
            )
    print_table(
        ["mode", "concurrency", "max_running", "decode_tok_s", "steady_decode_tok_s", "wall_s", "errors"],
        rows,
    )
    print(
        f"ratio_running {results['ratio_running']:.2f} (target >= {results['target_ratio_running']:.2f}), "
        f"ratio_decode_tok_s {results['ratio_decode_tok_s']:.2f}, "
        f"ratio_steady_decode_tok_s {results['ratio_steady_decode_tok_s']:.2f}"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
