"""Capacity at iso-memory: how many requests a dense and a sparse server run at once in the same device
bytes, and how fast they decode, SmolLM2 on CPU, ~4K and ~7.5K ("8K") token contexts.

Iso-memory. Per context the sparse server starts first, with ``--oasis-device-kv-tokens N``: its device
tier (``sglang_oasis/memory/device_tier.py``) takes at most the bytes a dense KV pool of N tokens would,
and allocates in them the block summaries of the whole host tier plus as many request slots (K blocks of
B tokens per layer and KV head and the active blocks, K and V, and their maps) as fit. ``GET /oasis/stats`` reports what it
allocated (``device_bytes_capacity``) and the slots (``device_request_slots``). The dense server is then
given exactly those bytes as its KV pool: ``--max-total-tokens`` = device_bytes_capacity // KV bytes per
token (the served model, ``--dtype``), so the two differ by less than one token's KV; the run checks, from
the dense server's ``/server_info``, that the pool it built is within one block's bytes of the sparse
server's. The host tier (``--oasis-host-kv-tokens``) holds the full KV of the requests the sparse server
runs; its summaries take one token's KV bytes per block out of the device bytes, so it is sized for no
more requests than the device tier can then run (at most the highest concurrency):
``R = (N*B - B) // ((K+1)*B*B + P)`` with ``P = (ceil((context + output) / B) + 1) * B`` tokens per request,
``host = R*P + B``.

Both running counts are measured: the peak of each server's ``sglang:num_running_reqs`` gauge. The bound
computed from bytes is ``bound_ratio_running`` = min(concurrency, device_request_slots) / min(concurrency,
dense pool tokens // (context + output)), ``ratio_running`` = sparse peak / dense peak, and
``ratio_running_vs_bound`` their quotient (1: the sparse server runs every request its device bytes hold).
With the defaults (6 layers, float32: 9,216 KV bytes per token) that is about 20 / 3 = 6.7 at 4K and
16 / 2 = 8 at 7.5K.

Decode rates, from the client's streamed token arrival times:

- ``decode_tok_s`` (end to end): tokens after each request's first over the time from the first request's
  first token to the last token; the prefill waves a smaller capacity forces are part of the cost.
- ``steady_decode_tok_s``: tokens of decode-only forward steps over the time those steps took. Arrivals
  closer than half the median gap between a request's consecutive tokens are one forward step; a step
  that carries some request's first token is a prefill (first tokens come from prefill forwards); a
  decode-only step lasts from the previous step's first arrival to its own. On CPU a 4K-token prefill
  costs as much as hundreds of decode steps, so ``decode_tok_s`` mostly measures prefill there and
  ``steady_decode_tok_s`` what the device bytes buy in decoding.

    python benchmark/bench_capacity.py --json capacity.json --num-layers 6 [--context-tokens 4096,7680]
        [--concurrency 32] [--output-tokens 32] [--device-kv-tokens 16384] [--top-k 32] [--dtype float32]
        [--tp-size N]

About 20 minutes on 2 CPU cores with ``--num-layers 6`` (4 servers at ~30 s to start; 32 prefills per
server at ~3.5 s for 4K and ~8-10 s for 7.5K tokens; decoding is a small share); about five times the
prefill time with all 30 layers. SmolLM2 has 8192 positions: context + output must fit.

JSON: ``setting`` (options, ``kv_bytes_per_token``, ``device_bytes_budget``); ``contexts.<context>``:
``bound_ratio_running``, ``ratio_running``, ``ratio_running_vs_bound``, ``ratio_decode_tok_s``,
``ratio_steady_decode_tok_s``, and per mode (``dense``, ``oasis``) ``device_bytes``, ``bound_running``,
``max_running`` (peak over the levels), ``decode_tok_s`` and ``steady_decode_tok_s`` (at the highest
concurrency), ``levels`` (per concurrency: those, ``wall_s``, ``errors``, ``first_error``); dense also
``max_total_tokens`` (as the server reports it), oasis ``device_request_slots`` and ``host_kv_tokens``;
``date``, ``machine``. A rate or ratio that is undefined is null. Exits 1 if any request errored (the
JSON is written first, after each context).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from itertools import pairwise
from pathlib import Path
from typing import Any, NamedTuple

import requests

from common import (
    BY_SUMMARIES,
    PeakSampler,
    essay_prompts,
    machine_info,
    oasis_stats,
    print_table,
    stream_generate,
)
from sglang_oasis.memory.host_tier import kv_footprint, model_config
from sglang_oasis.models.default_model import prepare_default_model
from sglang_oasis.server_process import ServerProcess

WARMUP_IDS = list(range(1000, 1064))  # no essay prompt starts with these: no prefix-cache hit later
STEP_GAP_FRACTION = 0.5  # of the median gap between a request's tokens: arrivals closer are one step


# --- sizes from bytes ----------------------------------------------------------------------------------


def iso_memory_tokens(device_bytes: int, bytes_per_token: int) -> int:
    """Tokens of a dense KV pool that fit in ``device_bytes`` (less than one token's bytes left over)."""
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
    return device_bytes // bytes_per_token


def check_iso_memory(dense_bytes: int, oasis_bytes: int, block_bytes: int) -> None:
    """Raise unless the dense pool and the sparse device tier are within one block's bytes."""
    if abs(dense_bytes - oasis_bytes) >= block_bytes:
        raise RuntimeError(
            f"not iso-memory: the dense KV pool takes {dense_bytes} bytes, the sparse device tier "
            f"{oasis_bytes}; they differ by a block ({block_bytes} bytes) or more"
        )


class HostTier(NamedTuple):
    requests: int  # requests the sparse server can run in the device bytes with this host tier
    tokens: int  # --oasis-host-kv-tokens: their full KV, in whole blocks, plus SGLang's padding block


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def host_tier(
    device_kv_tokens: int, context: int, output: int, top_k: int, block_size: int, concurrency: int,
    codes_per_token: float = 0.0,
) -> HostTier:  # fmt: skip
    """The sparse server's host tier for as many requests as its device tier can run with it (at most
    ``concurrency``, at least one): the summaries take one token's KV bytes per host block, the key codes
    (``--oasis-selector codes``) ``codes_per_token`` tokens' KV bytes per host token, and each request's
    working sets and active blocks ``(top_k + 1) x block_size`` tokens' worth (their index maps, <1%, are
    left out, so the device tier may run one request fewer, never more)."""
    per_request = (-(-(context + output) // block_size) + 1) * block_size
    per_host_token = 1 + codes_per_token * block_size  # in 1 / block_size tokens' KV
    fits = int(
        (device_kv_tokens * block_size - block_size * per_host_token)
        // ((top_k + 1) * block_size**2 + per_request * per_host_token)
    )
    count = max(1, min(concurrency, fits))
    return HostTier(count, count * per_request + block_size)


class RunningBound(NamedTuple):
    """Requests each server can run at once by its device bytes, at the offered concurrency."""

    oasis: int  # min(concurrency, device request slots)
    dense: int  # min(concurrency, dense pool tokens // (context + output))

    @property
    def ratio(self) -> float | None:
        return ratio(self.oasis, self.dense)


def running_bound(
    concurrency: int, request_slots: int, dense_tokens: int, context: int, output: int
) -> RunningBound:
    return RunningBound(min(concurrency, request_slots), min(concurrency, dense_tokens // (context + output)))


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``; None when either is None or the denominator is zero."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


# --- decode rates from streamed token times --------------------------------------------------------------


class Step(NamedTuple):
    """One forward step as the client saw it: the tokens that arrived together."""

    start: float  # arrival of its first token
    tokens: int
    prefill: bool  # it carries some request's first token


def forward_steps(times: list[list[float]], gap_s: float) -> list[Step]:
    """Every token arrival of every request (``times[r]``: request r's arrivals, its first token first),
    in time order, grouped into steps: an arrival within ``gap_s`` of the previous one joins its step."""
    events = sorted((t, i == 0) for stream in times for i, t in enumerate(stream))
    steps: list[Step] = []
    previous = -math.inf
    for t, first in events:
        if steps and t - previous <= gap_s:
            step = steps[-1]
            steps[-1] = Step(step.start, step.tokens + 1, step.prefill or first)
        else:
            steps.append(Step(t, 1, first))
        previous = t
    return steps


def step_gap_s(times: list[list[float]], fraction: float = STEP_GAP_FRACTION) -> float | None:
    """``fraction`` x the median positive gap between a request's consecutive tokens (tokens streamed in
    one chunk arrive together: their zero gaps are left out); None without one."""
    gaps = [later - earlier for stream in times for earlier, later in pairwise(stream) if later > earlier]
    return fraction * statistics.median(gaps) if gaps else None


def steady_decode_tok_s(times: list[list[float]], gap_fraction: float = STEP_GAP_FRACTION) -> float | None:
    """Tokens of decode-only steps over the time they took; a step's time runs from the previous step's
    start to its own. Steps are ``forward_steps`` at ``step_gap_s(times, gap_fraction)``. None without a
    decode step."""
    gap = step_gap_s(times, gap_fraction)
    if gap is None:
        return None
    steps = forward_steps(times, gap)
    decode = [
        (step.tokens, step.start - before.start) for before, step in pairwise(steps) if not step.prefill
    ]
    seconds = sum(duration for _, duration in decode)
    return sum(tokens for tokens, _ in decode) / seconds if seconds > 0 else None


def window_decode_tok_s(times: list[list[float]]) -> float | None:
    """Tokens after each request's first over the time from the first first token to the last token."""
    streams = [stream for stream in times if stream]
    if not streams:
        return None
    span = max(stream[-1] for stream in streams) - min(stream[0] for stream in streams)
    return sum(len(stream) - 1 for stream in streams) / span if span > 0 else None


# --- the servers -----------------------------------------------------------------------------------------


def served_pool_tokens(url: str) -> int:
    """The KV pool SGLang built, in tokens (``max_total_num_tokens`` of ``/server_info``)."""
    response = requests.get(url + "/server_info", timeout=30)
    response.raise_for_status()
    return int(response.json()["max_total_num_tokens"])


def device_tier_stats(url: str) -> tuple[int, int]:
    """``(device_bytes_capacity, device_request_slots)`` of a sparse server's ``/oasis/stats``."""
    stats = oasis_stats(url)
    missing = [key for key in ("device_bytes_capacity", "device_request_slots") if key not in stats]
    if missing:
        raise RuntimeError(f"the sparse server's /oasis/stats lacks {', '.join(missing)}")
    return int(stats["device_bytes_capacity"]), int(stats["device_request_slots"])


def run_level(url: str, prompts: list[list[int]], output_tokens: int) -> dict[str, Any]:
    started = time.monotonic()
    with (
        PeakSampler(url, "sglang:num_running_reqs") as sampler,
        ThreadPoolExecutor(len(prompts)) as pool,
    ):
        streams = list(pool.map(lambda ids: stream_generate(url, ids, output_tokens), prompts))
    times = [s.token_times for s in streams if s.token_times]
    return {
        "concurrency": len(prompts),
        "max_running": int(sampler.peak),
        "decode_tok_s": window_decode_tok_s(times),
        "steady_decode_tok_s": steady_decode_tok_s(times),
        "wall_s": time.monotonic() - started,
        "errors": sum(1 for s in streams if s.error),
        "first_error": next((s.error for s in streams if s.error), None),
    }


def measure(
    server: ServerProcess, prompts: list[list[int]], levels: list[int], output: int
) -> dict[str, Any]:
    """A warm-up request, then every concurrency level; the peak running count over the levels and the
    rates at the highest."""
    server.generate(WARMUP_IDS, 2)
    per_level = [run_level(server.url, prompts[:c], output) for c in levels]
    return {
        "max_running": max(level["max_running"] for level in per_level),
        "decode_tok_s": per_level[-1]["decode_tok_s"],
        "steady_decode_tok_s": per_level[-1]["steady_decode_tok_s"],
        "levels": per_level,
    }


def run_context(
    args: argparse.Namespace, model: Path, bytes_per_token: int, context: int, positions: int, logs: Path
) -> dict[str, Any]:
    """The sparse server, then the dense one in the bytes the sparse server's device tier took."""
    levels, output = args.concurrency, args.output_tokens
    prompts = essay_prompts(model, max(levels), context)
    common = [
        "--model-path", str(model), "--dtype", args.dtype, "--enable-metrics",
        "--context-length", str(min(positions, context + output + 512)),
        *(["--tp-size", str(args.tp_size)] if args.tp_size > 1 else []),
    ]  # fmt: skip
    # key codes: head_dim / 4 bytes per token and KV head, against 2 x head_dim x the dtype's bytes of KV
    codes, per_token = list(BY_SUMMARIES), 0.0
    if args.code_candidates is not None:
        codes = ["--oasis-selector", "codes", "--oasis-code-candidates", str(args.code_candidates)]
        per_token = 1 / (8 * DTYPE_BYTES[args.dtype])
    host = host_tier(
        args.device_kv_tokens, context, output, args.top_k, args.block_size, max(levels), per_token
    )
    oasis_args = [
        *common, "--oasis-top-k", str(args.top_k), "--oasis-block-size", str(args.block_size),
        "--oasis-device-kv-tokens", str(args.device_kv_tokens), "--oasis-host-kv-tokens", str(host.tokens),
        *codes,
    ]  # fmt: skip
    print(f"[bench_capacity] {context}: sparse server, host tier {host.tokens} tokens ...", flush=True)
    with ServerProcess(oasis_args, log_path=logs / f"oasis-{context}.log") as server:
        oasis_bytes, slots = device_tier_stats(server.url)
        oasis = measure(server, prompts, levels, output)

    pool_tokens = iso_memory_tokens(oasis_bytes, bytes_per_token)
    dense_args = [*common, "--oasis-mode", "dense", "--max-total-tokens", str(pool_tokens)]
    print(f"[bench_capacity] {context}: dense server, {pool_tokens} tokens ...", flush=True)
    with ServerProcess(dense_args, log_path=logs / f"dense-{context}.log") as server:
        served_tokens = served_pool_tokens(server.url)
        dense_bytes = served_tokens * bytes_per_token
        check_iso_memory(dense_bytes, oasis_bytes, args.block_size * bytes_per_token)
        dense = measure(server, prompts, levels, output)

    bound = running_bound(max(levels), slots, served_tokens, context, output)
    ratio_running = ratio(oasis["max_running"], dense["max_running"])
    return {
        "bound_ratio_running": bound.ratio,
        "ratio_running": ratio_running,
        "ratio_running_vs_bound": ratio(ratio_running, bound.ratio),
        "ratio_decode_tok_s": ratio(oasis["decode_tok_s"], dense["decode_tok_s"]),
        "ratio_steady_decode_tok_s": ratio(oasis["steady_decode_tok_s"], dense["steady_decode_tok_s"]),
        "dense": {
            "device_bytes": dense_bytes, "max_total_tokens": served_tokens,
            "bound_running": bound.dense, **dense,
        },
        "oasis": {
            "device_bytes": oasis_bytes, "device_request_slots": slots, "host_kv_tokens": host.tokens,
            "bound_running": bound.oasis, **oasis,
        },
    }  # fmt: skip


def report(results: dict[str, Any]) -> None:
    """One row per context and mode, then one line of ratios per context."""
    rows = []
    for context, entry in results["contexts"].items():
        for mode in ("dense", "oasis"):
            r = entry[mode]
            held = (
                f"{r['max_total_tokens']} tokens" if mode == "dense" else f"{r['device_request_slots']} slots"
            )
            rows.append(
                [
                    context, mode, r["device_bytes"] / 2**20, held, r["bound_running"], r["max_running"],
                    r["decode_tok_s"], r["steady_decode_tok_s"], sum(lv["wall_s"] for lv in r["levels"]),
                    sum(lv["errors"] for lv in r["levels"]),
                ]
            )  # fmt: skip
    headers = ["context", "mode", "device MiB", "holds", "bound running", "max running", "decode tok/s",
               "steady decode tok/s", "wall s", "errors"]  # fmt: skip
    print_table(headers, rows)

    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for context, entry in results["contexts"].items():
        print(
            f"{context}: ratio_running {fmt(entry['ratio_running'])} (bound from bytes "
            f"{fmt(entry['bound_ratio_running'])}, {fmt(entry['ratio_running_vs_bound'])} of it), "
            f"ratio_decode_tok_s {fmt(entry['ratio_decode_tok_s'])}, "
            f"ratio_steady_decode_tok_s {fmt(entry['ratio_steady_decode_tok_s'])}"
        )


def int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",")]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument(
        "--context-tokens", type=int_list, default="4096,7680", help="prompt lengths, a,b,..."
    )
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument(
        "--device-kv-tokens", type=int, default=16384, help="the sparse server's device budget, in tokens"
    )
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument(
        "--code-candidates", type=int, default=None,
        help="the sparse server selects with --oasis-selector codes and --oasis-code-candidates this; "
        "its host tier is sized with the codes' device bytes counted",
    )  # fmt: skip
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--concurrency",
        type=int_list,
        default="32",
        help="requests sent at once, a level per number: a,b,...",
    )
    parser.add_argument("--dtype", default="float32", help="--dtype of both servers (sets the KV bytes)")
    parser.add_argument(
        "--tp-size", type=int, default=1,
        help="tensor-parallel ranks of both servers: each rank's device tier (or KV pool) holds its KV heads' "
        "share of the bytes; device bytes are summed over the ranks",
    )  # fmt: skip
    parser.add_argument("--num-layers", type=int, default=None, help="truncate SmolLM2 (default: all 30)")
    args = parser.parse_args()

    contexts, levels = args.context_tokens, args.concurrency
    model = prepare_default_model(args.num_layers)
    footprint = kv_footprint(model, args.dtype, "auto")
    assert footprint is not None, f"{model} has no config.json"
    positions = int((model_config(model) or {}).get("max_position_embeddings", 1 << 30))
    too_long = [c for c in contexts if c + args.output_tokens > positions]
    if too_long:
        parser.error(
            f"--context-tokens {too_long} + --output-tokens exceed the model's {positions} positions"
        )
    logs = Path(tempfile.mkdtemp(prefix="bench-capacity-"))
    print(f"server logs in {logs}", flush=True)
    results: dict[str, Any] = {
        "setting": {
            "context_tokens": contexts, "output_tokens": args.output_tokens, "concurrency": levels,
            "device_kv_tokens": args.device_kv_tokens, "top_k": args.top_k, "block_size": args.block_size,
            "num_layers": args.num_layers or 30, "dtype": args.dtype, "tp_size": args.tp_size,
            "kv_bytes_per_token": footprint.bytes_per_token,
            "device_bytes_budget": args.device_kv_tokens * footprint.bytes_per_token,
        },
        "contexts": {},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for context in contexts:
        entry = run_context(args, model, footprint.bytes_per_token, context, positions, logs)
        results["contexts"][str(context)] = entry
        args.json.write_text(json.dumps(results, indent=2) + "\n")  # what is done so far survives a failure
    report(results)
    print(f"wrote {args.json}")
    errors = [
        level["first_error"]
        for entry in results["contexts"].values()
        for mode in ("dense", "oasis")
        for level in entry[mode]["levels"]
        if level["errors"]
    ]
    for error in errors:
        print(f"request error: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
