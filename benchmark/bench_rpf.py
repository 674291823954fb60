"""Remote partial fetching (RPF) against full KV transfer: bytes a decode node receives, at admission and
in total, and the host memory it holds per request, with real SmolLM2 queries and real Mooncake reads
(TCP on 127.0.0.1) from a prefill-side staging area.

For each context (a window of essay text, greedy continuation):

1. The target (float32, run layer by layer: ``bench_lookahead.CachedLlama``) prefills the context and
   decodes ``--steps`` tokens, keeping every step's post-RoPE queries.
2. The prefill side stages the context's KV and block summaries (``KVStagingArea``); the full transfer
   moves all of it: ``full_bytes`` = every page of K and V in every layer.
3. The decode side (``RemotePartialFetcher`` over a pool shaped like SGLang's) admits the request with the
   union over KV heads of the first decode step's top-K per layer, the last (active) block and the
   summaries (``rpf_admission_bytes``). Then, step by step, the working sets follow the server's own
   planner (``WorkingSetPool.plan_selections``: step t's query selects step t+1's blocks, delta against
   the resident set, at most ``ratio * K`` new blocks per KV head and step): a block a working set loads
   for the first time is read remotely, once (``rpf_total_bytes`` adds these misses). Blocks made of
   decoded tokens are local.
4. The same with the first ``--prefix-share`` of the context already cached at the decode node (its radix
   cache): neither transfer moves those blocks.

    python benchmark/bench_rpf.py --json rpf.json [--contexts 2048 4096 7680 --steps 64 --top-k 32
        --fetch-ratios 0.05 0.25 1.0 --prefix-share 0.5 --num-layers 30 --plot rpf.png]

The paper (Qwen3-8B, K = 128 blocks, 24K-32K contexts) reports 6.5x and 9.7x fewer bytes at admission,
2.2x fewer in total with a 0.05 cap and 2.2-2.6x less decode host memory. Selection here is made with the
step's own query ("previous"; the draft-token query predicts better, see bench_lookahead.py).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from sgl_kernel_oasis import build_block_summaries, score_blocks_batched, select_top_blocks
from sglang_oasis.disaggregation.remote_fetch import RemotePartialFetcher
from sglang_oasis.disaggregation.staging import KVStagingArea, StagedKVLayout
from sglang_oasis.disaggregation.transfer_engine import MooncakeEndpoint
from sglang_oasis.memory.working_set import WorkingSetPool


def prefill_and_decode(runner: Any, context: list[int], steps: int, chunk: int = 1024) -> torch.Tensor:
    """Prefills ``context`` in chunks and decodes ``steps + 1`` greedy tokens; returns each decode step's
    queries ``[steps + 1, layers, q_heads, dim]`` (the runner's cache then holds every position)."""
    from bench_lookahead import causal

    n = len(context)
    ids = torch.tensor(context)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        logits, _, _, _ = runner.forward(
            ids[start:end], torch.arange(start, end), causal(end - start, end), start
        )
    token = int(logits[-1].argmax())
    queries = []
    for t in range(n, n + steps + 1):
        logits, step_queries, _, _ = runner.forward(
            torch.tensor([token]), torch.tensor([t]), torch.ones(1, t + 1, dtype=torch.bool), t
        )
        queries.append(torch.stack([q[0] for q in step_queries]))
        token = int(logits[0].argmax())
    return torch.stack(queries)


def selections(
    queries: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, full: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's selection for every layer: ``queries`` ``[layers, q_heads, dim]``, summaries
    ``[layers, blocks, kv_heads, dim]`` (first ``full`` blocks used) -> (bool ``[layers, kv_heads, full]``,
    scores alike)."""
    scores = score_blocks_batched(queries, kmin[:, :full], kmax[:, :full])
    return select_top_blocks(scores, top_k), scores


def simulate(
    fetcher: RemotePartialFetcher,
    layout: StagedKVLayout,
    queries: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    top_k: int,
    cap: int | None,
    cached_blocks: int,
) -> dict[str, int]:
    """Admission and decode of one request on the decode node; returns its byte and block counts."""
    steps, layers = queries.shape[0] - 1, queries.shape[1]
    block, n = layout.block_size, layout.num_tokens
    heads = kmin.shape[2]
    working = WorkingSetPool(1, layers, heads, 1, top_k, block, torch.float32, "cpu")
    working.claim(0, 0)
    req = torch.zeros(1, dtype=torch.int64)
    # admission: the first decode step's query (the prefill node's extra step), union over heads
    full = (n + 1) // block
    chosen, _ = selections(queries[0], kmin, kmax, full, top_k)
    union = torch.zeros(layers, layout.num_pages, dtype=torch.bool)
    union[:, :full] = chosen.any(dim=1)
    fetcher.admit(0, layout, torch.arange(layout.num_pages), union, cached_blocks)
    for layer in range(layers):
        working.plan_selections(req, layer, chosen[layer][None], 0)
    for step in range(1, steps + 1):  # step t's query selects step t+1's blocks
        full = (n + step + 1) // block
        chosen, scores = selections(queries[step], kmin, kmax, full, top_k)
        for layer in range(layers):
            plan = working.plan_selections(
                req, layer, chosen[layer][None], step, cap, None, scores[layer][None]
            )
            staged = plan.blocks[plan.blocks < layout.num_pages]  # later blocks hold decoded tokens: local
            failed = fetcher.ensure(layer, {0: staged})
            if failed:
                raise RuntimeError(failed[0])
    counters = fetcher.counters
    result = {
        "rpf_admission_bytes": counters.admission_bytes + counters.summary_bytes,
        "rpf_total_bytes": counters.total_bytes,
        "summary_bytes": counters.summary_bytes,
        "admission_blocks": counters.admission_blocks,
        "miss_blocks": counters.miss_blocks,
        "rpf_host_bytes": fetcher.host_bytes(0),
    }
    fetcher.release(0)
    return result


def run_context(
    runner: Any,
    context: list[int],
    args: argparse.Namespace,
    staging: KVStagingArea,
    decode: MooncakeEndpoint,
) -> list[dict[str, Any]]:
    n, block = len(context), args.block_size
    queries = prefill_and_decode(runner, context, args.steps)
    layers = queries.shape[1]
    total = n + args.steps + 1
    keys, values = runner.keys[:, :n].clone(), runner.values[:, :n].clone()
    layout = staging.stage(f"ctx{n}", keys, values)
    summaries = [build_block_summaries(runner.keys[layer, :total], block) for layer in range(layers)]
    kmin = torch.stack([s[0] for s in summaries])
    kmax = torch.stack([s[1] for s in summaries])
    pool = [torch.zeros(layout.num_pages * block, *keys.shape[2:]) for _ in range(2 * layers)]
    local_kmin = torch.zeros(layers, layout.num_pages, *keys.shape[2:])
    local_kmax = torch.zeros_like(local_kmin)
    rows = []
    prefix_blocks = sorted({0, int(args.prefix_share * n) // block})
    for cached_blocks in prefix_blocks:
        # the full transfer moves every page not already cached, summaries not needed
        full_bytes = layers * 2 * (layout.num_pages - cached_blocks) * layout.block_bytes
        for ratio in args.fetch_ratios:
            cap = None if ratio >= 1 else math.ceil(ratio * args.top_k)
            fetcher = RemotePartialFetcher(
                decode, pool[:layers], pool[layers:], block, local_kmin, local_kmax
            )
            started = time.perf_counter()
            counts = simulate(fetcher, layout, queries, kmin, kmax, args.top_k, cap, cached_blocks)
            rows.append(
                {
                    "context_tokens": n,
                    "cached_prefix_tokens": cached_blocks * block,
                    "fetch_ratio": ratio,
                    "full_bytes": full_bytes,
                    **counts,
                    "admission_ratio": full_bytes / counts["rpf_admission_bytes"],
                    "total_ratio": full_bytes / counts["rpf_total_bytes"],
                    "host_memory_ratio": layers * 2 * layout.num_pages * layout.block_bytes / counts["rpf_host_bytes"],
                    "seconds": round(time.perf_counter() - started, 2),
                }
            )  # fmt: skip
    staging.release(f"ctx{n}")
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 7680])
    parser.add_argument("--steps", type=int, default=64, help="decode steps per context")
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--fetch-ratios", type=float, nargs="+", default=[0.05, 0.25, 1.0])
    parser.add_argument("--prefix-share", type=float, default=0.5, help="context share cached at decode")
    parser.add_argument(
        "--num-layers", type=int, default=None, help="the model's first N layers (default all)"
    )
    parser.add_argument("--plot", type=Path, default=None, help="optional PNG (needs matplotlib)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM

    from bench_lookahead import CachedLlama
    from common import essay_prompts, print_table
    from sglang_oasis.models.default_model import prepare_default_model

    started = time.monotonic()
    model_dir = prepare_default_model(num_layers=args.num_layers)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = CachedLlama(model, max(args.contexts) + args.steps + 2, [0])
    staging_endpoint, decode = MooncakeEndpoint(), MooncakeEndpoint()
    staging = KVStagingArea(staging_endpoint, args.block_size)
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for n in args.contexts:
            context = essay_prompts(model_dir, 1, n)[0]
            rows += run_context(runner, context, args, staging, decode)
            print(f"context {n} done ({time.monotonic() - started:.0f} s)", flush=True)

    mib = 2**20
    print_table(
        ["context", "cached", "ratio", "full MiB", "adm MiB", "total MiB", "adm x", "total x", "host x"],
        [
            [r["context_tokens"], r["cached_prefix_tokens"], r["fetch_ratio"], r["full_bytes"] / mib,
             r["rpf_admission_bytes"] / mib, r["rpf_total_bytes"] / mib, r["admission_ratio"],
             r["total_ratio"], r["host_memory_ratio"]]
            for r in rows
        ],
    )  # fmt: skip
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "settings": {
            "model": model_dir.name,
            "num_layers": model.config.num_hidden_layers,
            "steps": args.steps,
            "top_k": args.top_k,
            "block_size": args.block_size,
            "dtype": "float32",
            "transfer": "Mooncake transfer engine, TCP, 127.0.0.1",
            "selection_query": "previous (the step's own query)",
            "seconds": round(time.monotonic() - started, 1),
        },
        "longest_context": headline(rows),
        "results": rows,
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    if args.plot is not None:
        plot(rows, args.plot)
    return report


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The longest context without a cached prefix: its ratios per fetch ratio."""
    longest = max(r["context_tokens"] for r in rows)
    cold = [r for r in rows if r["context_tokens"] == longest and r["cached_prefix_tokens"] == 0]
    out: dict[str, Any] = {"context_tokens": longest, "admission_ratio": cold[0]["admission_ratio"]}
    for r in cold:
        out[f"total_ratio_fetch_{r['fetch_ratio']}"] = r["total_ratio"]
        out[f"host_memory_ratio_fetch_{r['fetch_ratio']}"] = r["host_memory_ratio"]
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    cold = [r for r in rows if r["cached_prefix_tokens"] == 0]
    contexts = sorted({r["context_tokens"] for r in cold})
    first = [next(r for r in cold if r["context_tokens"] == c) for c in contexts]
    ax.plot(contexts, [r["admission_ratio"] for r in first], marker="o", label="admission")
    for ratio in sorted({r["fetch_ratio"] for r in cold}):
        ax.plot(contexts, [next(r["total_ratio"] for r in cold if r["context_tokens"] == c and
                                r["fetch_ratio"] == ratio) for c in contexts],
                marker="s", label=f"total, fetch ratio {ratio}")  # fmt: skip
    ax.set(xlabel="context tokens", ylabel="full transfer / RPF bytes", title="bytes saved by RPF")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
