"""Overhead of the sparse path against dense SGLang at batch 1 (or ``--batch``): with K covering every
block (where sparsity buys nothing) and with K < N (where block scoring and top-K run at every decode step).

Four servers, one after another, on SmolLM2 (``--num-layers`` truncates it):

- ``dense``: dense SGLang, the baseline.
- ``sparse_async`` and ``sparse_sync``: sparse with the asynchronous prefetch pipeline
  (``--oasis-prefetch async``) and with inline transfers (``--oasis-prefetch sync``), both with
  K = ceil((context + output) / block) + 1 blocks and ``--oasis-fetch-ratio 1.0``, so every block is in
  the working set and decode attention is the dense one plus the sparse machinery. Here the selection
  sees that every block is already resident and takes its "unchanged" shortcut: no block is scored.
- ``sparse_k_sparse``: sparse with the asynchronous pipeline, K = ``--sparse-top-k`` (default 16) below
  the context's N full blocks (64 for 1,024 tokens of 16) and the product's default fetch ratio, so every
  decode step scores the block summaries and runs top-K in every layer. Its output may differ from
  dense's; that does not fail the run.
- ``sparse_k_sparse_ngram`` and ``sparse_k_sparse_ngram_captured`` (opt-in, ``--modes``):
  ``sparse_k_sparse`` and ``sparse_k_sparse_captured`` with SGLang's NGRAM drafter and normal acceptance
  (``--oasis-lookahead ngram --oasis-draft-policy verify``): the verify step eager and captured.
- ``sparse_captured`` and ``sparse_k_sparse_captured``: ``sparse_async`` and ``sparse_k_sparse`` with
  ``--oasis-decode-step captured`` (the compiled decode step; it always scores and plans, no shortcut).
  ``sparse_captured`` keeps the default fetch ratio: a fixed-shape step has room for as many copies per
  step as the cap allows (every slot without a cap, copied or not), and with K covering every block the
  cap never binds (admission and blocks that just filled up are not capped), so it loads what
  ``sparse_async`` loads.

Each server gets a warm-up request (a whole generation: the captured modes compile there), then ``--repeats`` streamed greedy generations of the same essay
prompt, one at a time (``--batch B``: B at once, the same prompt; a repeat's TPOT is the median of its B
generations', and its output the first one's). TPOT of a generation = (last token time - first token
time) / (tokens - 1); a mode's TPOT is the median over the repeats. The greedy output ids of every repeat are compared with
dense's first: a sparse mode is ``identical_to_dense`` when all of its repeats match token for token, and
its ``prefix_agreement`` is the common prefix of its first repeat's output and dense's over the output
length. All servers run ``--dtype`` (default float32, where the sparse path with every block promises
dense's exact greedy output; SGLang's ``auto`` would serve this float32 checkpoint in float16).

Around the timed repeats of a sparse server the ``/oasis/stats`` counters are read; per decode step
(one forward pass; batch 1 here):
  decode_bytes_per_step      = delta decode_bytes_host_to_device / delta decode_steps
  bytes_per_step             = delta bytes_host_to_device / delta decode_steps (admissions included)
  scored_selections_per_step = delta scored_selections / delta decode_steps ((request, layer)
                               selections that scored the block summaries and ran top-K)
each None when a counter is missing or no decode step ran. ``sparse_k_sparse`` fails (``error``) unless
its ``scored_selections_per_step`` is > 0: otherwise its ratio would not include the scoring it claims
to; with K covering every block it is expected to be 0.

    python benchmark/bench_overhead.py --json overhead.json [--num-layers N] [--context-tokens 1024]
        [--output-tokens 64] [--repeats 3] [--sparse-top-k 16] [--block-size 16] [--dtype float32]
        [--recall-sample-every N] [--tp-size N] [--batch 1] [--covering-top-k K]

Every other sparse mode runs with the recall telemetry off (``--oasis-recall-sample-every 0``). With ``--recall-sample-every N`` two
more servers, ``sparse_k_sparse_recall`` and ``sparse_k_sparse_recall_captured``, are ``sparse_k_sparse``
and ``sparse_k_sparse_captured`` with the telemetry on (``--oasis-recall-sample-every N``; captured: the
sample inside the compiled step); ``recall_cost_ratio`` and ``recall_cost_ratio_captured`` = their TPOT
over their twin's (the telemetry's cost), and each records ``recall_mean``, ``recall_p10``,
``lookahead_agreement`` and ``recall_samples`` as the server reports them after its repeats.

Writes ``ratio_k_covering`` (sparse_async TPOT / dense TPOT, K covering every block), ``ratio_k_sparse``
(sparse_k_sparse / dense, K < N), ``ratio_k_covering_captured`` and ``ratio_k_sparse_captured`` (the
captured modes / dense), ``ratio_tpot`` (the same as ``ratio_k_covering``, kept for
continuity), ``ratio_tpot_sync`` (sparse_sync / dense), ``target_ratio_tpot`` (1.15, for the K covering
ratio), one section per mode (``dense``, ``sparse_async``, ``sparse_sync``, ``sparse_k_sparse``) with
``tpot_ms``, ``tpot_ms_runs`` and ``error`` when it failed, the sparse ones also with ``top_k``,
``identical_to_dense``, ``prefix_agreement``, ``decode_steps``, ``decode_bytes_per_step``,
``bytes_per_step`` and ``scored_selections_per_step``; then ``settings``, ``date`` and ``machine``. Exits 1
if any mode failed (the JSON is written anyway).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import (
    BY_SUMMARIES,
    common_prefix,
    essay_prompts,
    machine_info,
    oasis_stats,
    print_table,
    stream_generate,
)
from sglang_oasis.config import OasisConfig
from sglang_oasis.models.default_model import prepare_default_model
from sglang_oasis.server_process import ServerProcess

MODES = (
    "dense",
    "sparse_async",
    "sparse_sync",
    "sparse_k_sparse",
    "sparse_captured",
    "sparse_k_sparse_captured",
)
# Opt-in (not in the default --modes): sparse_k_sparse with SGLang's NGRAM drafter and normal acceptance
# (--oasis-lookahead ngram --oasis-draft-policy verify), its verify passes eager or captured.
LOOKAHEAD_MODES = ("sparse_k_sparse_ngram", "sparse_k_sparse_ngram_captured")
COVERING_MODES = ("sparse_async", "sparse_sync", "sparse_captured")  # K covering every block, no fetch cap
# sparse_k_sparse and its captured twin with recall telemetry (--recall-sample-every N): mode -> twin
RECALL_MODES = {
    "sparse_k_sparse_recall": "sparse_k_sparse",
    "sparse_k_sparse_recall_captured": "sparse_k_sparse_captured",
}
TARGET_RATIO_TPOT = 1.15
# ratio key -> the sparse mode whose TPOT it divides by dense's
RATIOS = {
    "ratio_k_covering": "sparse_async",
    "ratio_k_sparse": "sparse_k_sparse",
    "ratio_tpot": "sparse_async",
    "ratio_tpot_sync": "sparse_sync",
    "ratio_k_covering_captured": "sparse_captured",
    "ratio_k_sparse_captured": "sparse_k_sparse_captured",
    "ratio_k_sparse_ngram": "sparse_k_sparse_ngram",
    "ratio_k_sparse_ngram_captured": "sparse_k_sparse_ngram_captured",
}


# ------------------------------------------------------------------------------------------ pure pieces


def tpot_s(token_times: list[float]) -> float:
    """Time per output token after the first: (last - first) / (tokens - 1)."""
    if len(token_times) < 2:
        raise ValueError(f"TPOT needs at least 2 tokens, got {len(token_times)}")
    return (token_times[-1] - token_times[0]) / (len(token_times) - 1)


def covering_top_k(context_tokens: int, output_tokens: int, block_size: int) -> int:
    """A K that covers every block a request of this size ever has (its active tail block included)."""
    return math.ceil((context_tokens + output_tokens) / block_size) + 1


def check_sparse_top_k(top_k: int, context_tokens: int, block_size: int) -> int:
    """The number N of full blocks of the context; ValueError unless 0 < ``top_k`` < N (with K >= N every
    block is selected and the selection never scores)."""
    full_blocks = context_tokens // block_size
    if not 0 < top_k < full_blocks:
        raise ValueError(
            f"--sparse-top-k {top_k} must be in [1, {full_blocks}): a {context_tokens}-token context has "
            f"{full_blocks} full blocks of {block_size}, and with K >= N every block is selected without "
            "scoring; lower --sparse-top-k or raise --context-tokens"
        )
    return full_blocks


def device_tokens(top_k: int, block_size: int, batch: int, pool_tokens: int) -> int:
    """A device budget that runs ``batch`` requests and more (working sets, active blocks, the captured
    step's padding slot) beside the summaries of a ``pool_tokens`` host tier (a page's min/max keys are one
    token's K and V: 1/block of its tokens' bytes; a quarter given, for block sizes down to 4)."""
    return (batch + 3) * (top_k + 2) * block_size + pool_tokens // 4


def ratio(mode_ms: float | None, dense_ms: float | None) -> float | None:
    """``mode_ms / dense_ms``; None when either is missing (a failed mode) or dense's is 0."""
    return mode_ms / dense_ms if dense_ms and mode_ms is not None else None


def tpot_ratios(results: dict[str, Any]) -> dict[str, float | None]:
    """Every key of ``RATIOS``: its sparse mode's ``tpot_ms`` over dense's."""
    dense_ms = results.get("dense", {}).get("tpot_ms")
    return {key: ratio(results.get(mode, {}).get("tpot_ms"), dense_ms) for key, mode in RATIOS.items()}


def agreement_with_dense(outputs: list[list[int]], reference: list[int] | None) -> dict[str, Any]:
    """``identical_to_dense`` (every repeat equals dense's output) and ``prefix_agreement`` (the common
    prefix of the first repeat and dense's, over the first repeat's length); both None without dense."""
    if reference is None or not outputs:
        return {"identical_to_dense": None, "prefix_agreement": None}
    first = outputs[0]
    return {
        "identical_to_dense": all(o == reference for o in outputs),
        "prefix_agreement": common_prefix(first, reference) / len(first) if first else None,
    }


def per_step_counters(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """``decode_steps`` between two ``/oasis/stats`` snapshots and the per-step rates of the counters
    (None where a snapshot lacks the counter or no decode step ran)."""
    steps = int(after["decode_steps"]) - int(before["decode_steps"])

    def rate(name: str) -> float | None:
        if name not in before or name not in after or steps <= 0:
            return None
        return (int(after[name]) - int(before[name])) / steps

    return {
        "decode_steps": steps,
        "decode_bytes_per_step": rate("decode_bytes_host_to_device"),
        "bytes_per_step": rate("bytes_host_to_device"),
        "scored_selections_per_step": rate("scored_selections"),
    }


def unscored_error(entry: dict[str, Any]) -> str | None:
    """The error of a K < N mode whose selections never scored (None if they did)."""
    scored = entry.get("scored_selections_per_step")
    if scored is not None and scored > 0:
        return None
    why = (
        "the /oasis/stats counter scored_selections is missing (or no stats were read)"
        if scored is None
        else "every selection took the unchanged shortcut"
    )
    return (
        f"K < N mode never scored: scored_selections_per_step = {scored} over "
        f"{entry.get('decode_steps')} decode steps ({why})"
    )


def _or_dash(value: float | None) -> float | str:
    return "-" if value is None else value


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


# ----------------------------------------------------------------------------------------- measurement


def server_args(
    mode: str, model: Path, top_k: int, block_size: int, pool_tokens: int, context_length: int, dtype: str,
    recall_every: int = 0, batch: int = 1,
) -> list[str]:  # fmt: skip
    common = ["--model-path", str(model), "--context-length", str(context_length), "--dtype", dtype]
    if mode == "dense":
        return [*common, "--oasis-mode", "dense", "--max-total-tokens", str(pool_tokens)]
    # K < N keeps the product's default fetch ratio; K covering loads every block at once (the captured
    # step keeps the default: a fixed-shape step copies as many blocks per step as the cap allows, every
    # slot without one; with K covering the cap never binds, admission and filled-up blocks are uncapped)
    uncapped = not mode.startswith("sparse_k_sparse") and not mode.endswith("_captured")
    fetch = ["--oasis-fetch-ratio", "1.0"] if uncapped else []
    recall = ["--oasis-recall-sample-every", str(recall_every if mode in RECALL_MODES else 0)]
    # every mode names its decode step (the launcher's CPU default is the captured one)
    step = ["--oasis-decode-step", "captured" if mode.endswith("_captured") else "eager"]
    if "_ngram" in mode:
        step += ["--oasis-lookahead", "ngram", "--oasis-draft-policy", "verify"]
    return [*recall, *step,
        *common, "--oasis-mode", "sparse", *BY_SUMMARIES, "--oasis-top-k", str(top_k), "--oasis-block-size", str(block_size),
        *fetch, "--oasis-prefetch", "sync" if mode == "sparse_sync" else "async",
        "--oasis-host-kv-tokens", str(pool_tokens), "--oasis-device-kv-tokens", str(device_tokens(top_k, block_size, batch, pool_tokens)),
    ]  # fmt: skip


def measure(
    server: ServerProcess, prompt: list[int], output_tokens: int, repeats: int, batch: int = 1
) -> dict[str, Any]:
    def generations() -> list[Any]:  # ``batch`` streams at once
        with ThreadPoolExecutor(batch) as pool:
            return list(pool.map(lambda _: stream_generate(server.url, prompt, output_tokens), range(batch)))

    # a whole generation: a captured step compiles each shape the timed ones meet (a block bucket crossed)
    for warm in generations():
        if warm.error:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
    try:
        before: dict[str, Any] | None = oasis_stats(server.url)
    except Exception:
        before = None
    runs, outputs = [], []
    for _ in range(repeats):
        streams = generations()
        for stream in streams:
            if stream.error:
                raise RuntimeError(f"request failed: {stream.error}")
            if len(stream.output_ids) != output_tokens:
                raise RuntimeError(f"got {len(stream.output_ids)} output ids for {output_tokens} tokens")
        runs.append(statistics.median(tpot_s(stream.token_times) for stream in streams) * 1000)
        outputs.append(streams[0].output_ids)
    result: dict[str, Any] = {"tpot_ms": statistics.median(runs), "tpot_ms_runs": runs, "outputs": outputs}
    if before is not None and before.get("mode") == "sparse":
        result.update(per_step_counters(before, oasis_stats(server.url)))
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
    parser.add_argument(
        "--sparse-top-k",
        type=int,
        default=16,
        help="K of sparse_k_sparse; below the context's full blocks (default: 16)",
    )
    parser.add_argument(
        "--recall-sample-every",
        type=int,
        default=0,
        help="N > 0: also run sparse_k_sparse and sparse_k_sparse_captured with --oasis-recall-sample-every N "
        "(their cost: recall_cost_ratio, recall_cost_ratio_captured); other modes run with none",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--modes", default=",".join(MODES), help="the modes to run (dense always runs)")
    parser.add_argument("--dtype", default="float32", help="SGLang --dtype of every server")
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks of every server")
    parser.add_argument("--batch", type=int, default=1, help="generations at once (the same prompt)")
    parser.add_argument(
        "--covering-top-k",
        type=int,
        default=None,
        help="the K covering modes run (at least the context's blocks + 1; default: exactly that): a K well "
        "above the context's blocks is what the CPU step's held slots make cheap",
    )
    args = parser.parse_args()
    if args.output_tokens < 2 or args.repeats < 1 or args.batch < 1:
        parser.error("--output-tokens must be >= 2, --repeats and --batch >= 1")
    try:
        full_blocks = check_sparse_top_k(args.sparse_top_k, args.context_tokens, args.block_size)
    except ValueError as exc:
        parser.error(str(exc))

    top_k = covering_top_k(args.context_tokens, args.output_tokens, args.block_size)
    if args.covering_top_k is not None:
        if args.covering_top_k < top_k:
            parser.error(
                f"--covering-top-k {args.covering_top_k} must be >= {top_k}, the blocks a request has"
            )
        top_k = args.covering_top_k

    model = prepare_default_model(args.num_layers)
    prompt = essay_prompts(model, 1, args.context_tokens)[0]
    context_length = args.context_tokens + args.output_tokens + 256
    pool_tokens = (args.batch + 1) * context_length + 4096
    results: dict[str, Any] = {
        "settings": {
            "context_tokens": args.context_tokens, "output_tokens": args.output_tokens,
            "repeats": args.repeats, "num_layers": args.num_layers or 30, "top_k": top_k,
            "block_size": args.block_size, "fetch_ratio": 1.0, "sparse_top_k": args.sparse_top_k,
            "sparse_fetch_ratio": OasisConfig().fetch_ratio, "context_full_blocks": full_blocks,
            "batch": args.batch, "dtype": args.dtype, "model": str(model), "tp_size": args.tp_size,
        },
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    print(f"server logs in {logs}", flush=True)
    chosen = {"dense", *args.modes.split(",")}
    unknown = chosen - set(MODES) - set(LOOKAHEAD_MODES)
    if unknown:
        known = ", ".join((*MODES, *LOOKAHEAD_MODES))
        parser.error(f"--modes: unknown {', '.join(sorted(unknown))}; choose from {known}")
    modes = tuple(mode for mode in (*MODES, *LOOKAHEAD_MODES) if mode in chosen)
    modes = (*modes, *RECALL_MODES) if args.recall_sample_every > 0 else modes
    results["settings"]["recall_sample_every"] = args.recall_sample_every
    for mode in modes:
        print(f"[bench_overhead] {mode} ...", flush=True)
        mode_k = args.sparse_top_k if mode.startswith("sparse_k_sparse") else top_k
        argv = server_args(
            mode,
            model,
            mode_k,
            args.block_size,
            pool_tokens,
            context_length,
            args.dtype,
            args.recall_sample_every,
            args.batch,
        )
        if args.tp_size > 1:  # every server, dense too: ratios at the same tensor parallelism
            argv += ["--tp-size", str(args.tp_size)]
        try:
            with ServerProcess(argv, log_path=logs / f"{mode}.log") as server:
                results[mode] = measure(server, prompt, args.output_tokens, args.repeats, args.batch)
                if mode in RECALL_MODES:
                    stats = oasis_stats(server.url)
                    for name in ("recall_mean", "recall_p10", "lookahead_agreement", "recall_samples"):
                        results[mode][name] = stats.get(name)
        except Exception as exc:  # a failed server or request: record it and go on
            results[mode] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        if mode != "dense":
            results[mode]["top_k"] = mode_k
        if mode.startswith("sparse_k_sparse") and "error" not in results[mode]:
            error = unscored_error(results[mode])
            if error is not None:
                results[mode]["error"] = error

    reference = results["dense"].get("outputs", [None])[0]
    for mode in modes:
        outputs = results[mode].pop("outputs", None)
        if outputs is not None and mode != "dense":
            results[mode].update(agreement_with_dense(outputs, reference))
    results.update(tpot_ratios(results))
    results["target_ratio_tpot"] = TARGET_RATIO_TPOT
    for mode, twin in RECALL_MODES.items():  # the telemetry's cost: the same server with and without it
        if mode in results and twin in results:
            key = "recall_cost_ratio" + mode.removeprefix("sparse_k_sparse_recall")
            results[key] = ratio(results[mode].get("tpot_ms"), results[twin].get("tpot_ms"))

    dense_ms = results["dense"].get("tpot_ms")
    rows = []
    for mode in modes:
        r = results[mode]
        runs = " ".join(f"{t:.1f}" for t in r.get("tpot_ms_runs", [])) or "-"
        bytes_per_step = r.get("decode_bytes_per_step")
        rows.append(
            [
                mode,
                r.get("top_k", "-"),
                r.get("tpot_ms", "-"),
                _or_dash(ratio(r.get("tpot_ms"), dense_ms)),
                runs,
                r.get("identical_to_dense", "-"),
                _or_dash(r.get("prefix_agreement")),
                _or_dash(r.get("scored_selections_per_step")),
                _or_dash(bytes_per_step / 1024 if bytes_per_step is not None else None),
                r.get("error", "")[:80].replace("\n", " "),
            ]
        )
    headers = [
        "mode", "top_k", "tpot_ms", "vs_dense", "runs_ms", "identical_to_dense", "prefix_agreement",
        "scored_per_step", "decode_KiB_per_step", "error",
    ]  # fmt: skip
    print_table(headers, rows)
    print(
        f"ratio_k_covering {_fmt(results['ratio_k_covering'])} (target <= {TARGET_RATIO_TPOT}, K={top_k}),",
        f"ratio_k_sparse {_fmt(results['ratio_k_sparse'])} (K={args.sparse_top_k} of {full_blocks} blocks),",
        f"{args.context_tokens}+{args.output_tokens} tokens",
    )
    for mode in RECALL_MODES:
        if mode in results:
            r, key = results[mode], "recall_cost_ratio" + mode.removeprefix("sparse_k_sparse_recall")
            print(
                f"{key} {_fmt(results.get(key))} (every {args.recall_sample_every} steps):",
                f"recall_mean {_fmt(r.get('recall_mean'))}, recall_p10 {_fmt(r.get('recall_p10'))},",
                f"lookahead_agreement {_fmt(r.get('lookahead_agreement'))}",
            )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    first = (*RATIOS, "target_ratio_tpot", *modes)  # run_all shows the first 8 numbers
    results = {**{key: results[key] for key in first}, **results}
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 1 if any("error" in results[mode] for mode in modes) else 0


if __name__ == "__main__":
    sys.exit(main())
