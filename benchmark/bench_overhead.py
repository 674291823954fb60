"""Overhead of the sparse path where it buys nothing: batch 1, K covering every block, no fetch cap.

Three servers, one after another, on SmolLM2 (``--num-layers`` truncates it): dense SGLang, sparse with
the asynchronous prefetch pipeline (``--oasis-prefetch async``) and sparse with inline transfers
(``--oasis-prefetch sync``). Sparse uses K = ceil((context + output) / block) + 1 blocks and
``--oasis-fetch-ratio 1.0``, so every block is in the working set and decode attention is the dense one
plus the sparse machinery (block selection, working-set bookkeeping, prefetch). Each server gets a
warm-up request, then ``--repeats`` streamed greedy generations of the same essay prompt, one at a time.
TPOT of a generation = (last token time - first token time) / (tokens - 1); a mode's TPOT is the median
over the repeats. The greedy output ids of every repeat are compared with dense's first: a sparse mode is
``identical_to_dense`` when all of its repeats match token for token. All servers run ``--dtype``
(default float32, where the sparse path with every block promises dense's exact greedy output; SGLang's
``auto`` would serve this float32 checkpoint in float16).

    python benchmark/bench_overhead.py --json overhead.json [--num-layers N] [--context-tokens 1024]
        [--output-tokens 64] [--repeats 3] [--dtype float32]

Writes ``dense.tpot_ms``, ``sparse_async.tpot_ms``, ``sparse_sync.tpot_ms`` (each mode also with
``tpot_ms_runs``, ``identical_to_dense``, ``decode_bytes_per_step`` from ``/oasis/stats`` and ``error``
when it failed), ``ratio_tpot`` (sparse_async / dense), ``ratio_tpot_sync`` (sparse_sync / dense),
``target_ratio_tpot`` (1.15), ``settings``, ``date`` and ``machine``. Exits 1 if any mode failed (the
JSON is written anyway).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import essay_prompts, machine_info, oasis_stats, print_table, stream_generate
from sglang_oasis.models.default_model import prepare_default_model
from sglang_oasis.testing.server_process import ServerProcess

MODES = ("dense", "sparse_async", "sparse_sync")
TARGET_RATIO_TPOT = 1.15


def tpot_s(token_times: list[float]) -> float:
    """Time per output token after the first: (last - first) / (tokens - 1)."""
    if len(token_times) < 2:
        raise ValueError(f"TPOT needs at least 2 tokens, got {len(token_times)}")
    return (token_times[-1] - token_times[0]) / (len(token_times) - 1)


def covering_top_k(context_tokens: int, output_tokens: int, block_size: int) -> int:
    """A K that covers every block a request of this size ever has (its active tail block included)."""
    return math.ceil((context_tokens + output_tokens) / block_size) + 1


def server_args(
    mode: str, model: Path, top_k: int, block_size: int, pool_tokens: int, context_length: int, dtype: str
) -> list[str]:
    common = ["--model-path", str(model), "--context-length", str(context_length), "--dtype", dtype]
    if mode == "dense":
        return [*common, "--oasis-mode", "dense", "--max-total-tokens", str(pool_tokens)]
    return [
        *common, "--oasis-mode", "sparse", "--oasis-top-k", str(top_k), "--oasis-block-size", str(block_size),
        "--oasis-fetch-ratio", "1.0", "--oasis-prefetch", mode.removeprefix("sparse_"),
        "--oasis-host-kv-tokens", str(pool_tokens), "--oasis-device-kv-tokens", str(4 * top_k * block_size),
    ]  # fmt: skip


def measure(server: ServerProcess, prompt: list[int], output_tokens: int, repeats: int) -> dict[str, Any]:
    warm = stream_generate(server.url, prompt, min(8, output_tokens))
    if warm.error:
        raise RuntimeError(f"warm-up request failed: {warm.error}")
    try:
        before: dict[str, Any] | None = oasis_stats(server.url)
    except Exception:
        before = None
    runs, outputs = [], []
    for _ in range(repeats):
        stream = stream_generate(server.url, prompt, output_tokens)
        if stream.error:
            raise RuntimeError(f"request failed: {stream.error}")
        if len(stream.output_ids) != output_tokens:
            raise RuntimeError(f"got {len(stream.output_ids)} output ids for {output_tokens} tokens")
        runs.append(tpot_s(stream.token_times) * 1000)
        outputs.append(stream.output_ids)
    result: dict[str, Any] = {"tpot_ms": statistics.median(runs), "tpot_ms_runs": runs, "outputs": outputs}
    if before is not None and before.get("mode") == "sparse":
        after = oasis_stats(server.url)
        steps = after["decode_steps"] - before["decode_steps"]
        moved = after["decode_bytes_host_to_device"] - before["decode_bytes_host_to_device"]
        result["decode_steps"] = steps
        result["decode_bytes_per_step"] = moved / steps if steps else None
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--num-layers", type=int, default=None, help="truncate SmolLM2 (default: all 30)")
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32", help="SGLang --dtype of every server")
    args = parser.parse_args()
    if args.output_tokens < 2 or args.repeats < 1:
        parser.error("--output-tokens must be >= 2 and --repeats >= 1")

    model = prepare_default_model(args.num_layers)
    prompt = essay_prompts(model, 1, args.context_tokens)[0]
    top_k = covering_top_k(args.context_tokens, args.output_tokens, args.block_size)
    context_length = args.context_tokens + args.output_tokens + 256
    pool_tokens = 2 * context_length + 4096
    results: dict[str, Any] = {
        "settings": {
            "context_tokens": args.context_tokens, "output_tokens": args.output_tokens,
            "repeats": args.repeats, "num_layers": args.num_layers or 30, "top_k": top_k,
            "block_size": args.block_size, "fetch_ratio": 1.0, "batch": 1, "dtype": args.dtype,
            "model": str(model),
        },
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    print(f"server logs in {logs}", flush=True)
    for mode in MODES:
        print(f"[bench_overhead] {mode} ...", flush=True)
        argv = server_args(mode, model, top_k, args.block_size, pool_tokens, context_length, args.dtype)
        try:
            with ServerProcess(argv, log_path=logs / f"{mode}.log") as server:
                results[mode] = measure(server, prompt, args.output_tokens, args.repeats)
        except Exception as exc:  # a failed server or request: record it and go on
            results[mode] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}

    reference = results["dense"].get("outputs", [None])[0]
    for mode in MODES:
        outputs = results[mode].pop("outputs", None)
        if outputs is not None and mode != "dense":
            same = all(o == reference for o in outputs)
            results[mode]["identical_to_dense"] = same if reference is not None else None  # None: no dense
    dense_ms = results["dense"].get("tpot_ms")
    for key, mode in (("ratio_tpot", "sparse_async"), ("ratio_tpot_sync", "sparse_sync")):
        mode_ms = results[mode].get("tpot_ms")
        results[key] = mode_ms / dense_ms if dense_ms and mode_ms else None
    results["target_ratio_tpot"] = TARGET_RATIO_TPOT

    rows = []
    for mode in MODES:
        r = results[mode]
        tpot = r.get("tpot_ms", "-")
        ratio = tpot / dense_ms if isinstance(tpot, float) and dense_ms else "-"
        runs = " ".join(f"{t:.1f}" for t in r.get("tpot_ms_runs", [])) or "-"
        rows.append(
            [
                mode,
                tpot,
                ratio,
                runs,
                r.get("identical_to_dense", "-"),
                r.get("error", "")[:80].replace("\n", " "),
            ]
        )
    print_table(["mode", "tpot_ms", "vs_dense", "runs_ms", "identical_to_dense", "error"], rows)
    ratio = results["ratio_tpot"]
    print(
        f"ratio_tpot {ratio:.3f}" if ratio is not None else "ratio_tpot -",
        f"(target <= {TARGET_RATIO_TPOT}), K={top_k}, {args.context_tokens}+{args.output_tokens} tokens",
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    first = ("ratio_tpot", "ratio_tpot_sync", "target_ratio_tpot", *MODES)  # run_all shows the first 8
    results = {**{key: results[key] for key in first}, **results}
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 1 if any("error" in results[mode] for mode in MODES) else 0


if __name__ == "__main__":
    sys.exit(main())
