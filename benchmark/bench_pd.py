"""Served PD disaggregation: what moves to the decode node, and how fast, with and without remote partial
fetching, against SGLang's own (dense) PD in the same run.

Three ``launch_pd`` deployments in turn, each serving the same essay windows one request at a time
through SGLang's router (SmolLM2, float32, the embedded default model's first ``--num-layers`` layers):

- ``dense``: ``--oasis-mode dense``, plain SGLang PD (the whole prompt KV moves, over Mooncake);
- ``sparse-full``: sparse decode, ``--oasis-remote-fetch false`` (the whole prompt KV moves);
- ``sparse-rpf``: sparse decode with remote partial fetching (SGLang moves one page; the decode node
  reads the union of the first selection, the summaries, then each block its working sets first need).

Per context it records the bytes moved to the decode node (SGLang's ``sglang:kv_transfer_total_mb`` on the
prefill server plus the decode node's ``remote_*_bytes``), time to first token and end-to-end latency
through the router, and how many generated tokens equal dense PD's. Ratios are against ``dense``.

    python benchmark/bench_pd.py --json pd.json [--contexts 1024 2048 4096 --new-tokens 32 --top-k 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIGS = {
    "dense": ["--oasis-mode", "dense"],
    "sparse-full": ["--oasis-remote-fetch", "false"],
    "sparse-rpf": [],
}
REMOTE = ("remote_admission_bytes", "remote_summary_bytes", "remote_miss_bytes")


def serve(
    name: str, args: argparse.Namespace, model_dir: Path, prompts: list[list[int]], log_dir: Path
) -> list[dict]:
    from common import oasis_stats, stream_generate
    from sglang_oasis_testing.pd_launch import PDLaunch

    server_args = [
        "--model-path", str(model_dir), "--dtype", "float32", "--oasis-top-k", str(args.top_k),
        "--oasis-host-kv-tokens", "32768", "--oasis-device-kv-tokens", "65536",
        "--prefill-args=--enable-metrics", *CONFIGS[name],
    ]  # fmt: skip
    rows = []
    with PDLaunch(server_args, log_dir / name) as pd:
        router = pd.info["url"]
        stream_generate(router, prompts[0][:64], 4)  # warm-up
        for ids in prompts:
            sent_before = pd.transferred_mb()
            stats_before = oasis_stats(pd.info["decode"]["url"]) if name != "dense" else None
            started = time.monotonic()
            stream = stream_generate(router, ids, args.new_tokens)
            if stream.error:
                raise RuntimeError(f"{name}, {len(ids)} tokens: {stream.error}")
            deadline = time.monotonic() + 60
            while pd.transferred_mb()[1] == sent_before[1] and time.monotonic() < deadline:
                time.sleep(0.2)  # SGLang records the transfer once the prefill side sees it done
            sent = (pd.transferred_mb()[0] - sent_before[0]) * 2**20
            remote = 0
            if stats_before is not None:
                after = oasis_stats(pd.info["decode"]["url"])
                remote = sum(int(after[k]) - int(stats_before[k]) for k in REMOTE)
            rows.append(
                {
                    "config": name,
                    "context_tokens": len(ids),
                    "sglang_transfer_bytes": int(sent),
                    "remote_read_bytes": remote,
                    "moved_bytes": int(sent) + remote,
                    "ttft_s": stream.token_times[0] - started,
                    "e2e_s": stream.token_times[-1] - started,
                    "output_ids": stream.output_ids,
                }
            )
            print(f"{name} {len(ids)}: {rows[-1]['moved_bytes'] / 2**20:.1f} MiB moved", flush=True)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=32, help="blocks of 16 tokens per KV head")
    parser.add_argument("--num-layers", type=int, default=6, help="SmolLM2 layers served (30: all)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from common import essay_prompts, machine_info, print_table
    from sglang_oasis.models.default_model import prepare_default_model

    model_dir = prepare_default_model(num_layers=args.num_layers)
    prompts = [essay_prompts(model_dir, len(args.contexts), n)[i] for i, n in enumerate(args.contexts)]
    started = time.monotonic()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-pd-") as logs:
        for name in CONFIGS:
            rows += serve(name, args, model_dir, prompts, Path(logs))
    dense = {r["context_tokens"]: r for r in rows if r["config"] == "dense"}
    for r in rows:
        base = dense[r["context_tokens"]]
        r["moved_ratio"] = base["moved_bytes"] / max(1, r["moved_bytes"])
        r["ttft_ratio"] = r["ttft_s"] / base["ttft_s"]
        r["e2e_ratio"] = r["e2e_s"] / base["e2e_s"]
        same = sum(a == b for a, b in zip(r["output_ids"], base["output_ids"], strict=False))
        r["tokens_equal_to_dense"] = same / max(1, len(base["output_ids"]))
    mib = 2**20
    print_table(
        ["context", "config", "moved MiB", "less x", "TTFT s", "TTFT / dense", "e2e s", "e2e / dense", "= dense"],
        [[r["context_tokens"], r["config"], r["moved_bytes"] / mib, r["moved_ratio"], r["ttft_s"], r["ttft_ratio"],
          r["e2e_s"], r["e2e_ratio"], f"{100 * r['tokens_equal_to_dense']:.0f}%"] for r in rows],
    )  # fmt: skip
    longest = max(args.contexts)
    report = {
        "benchmark": "bench_pd",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "wall_s": time.monotonic() - started,
        "results": [{k: v for k, v in r.items() if k != "output_ids"} for r in rows],
        "longest_context": {
            r["config"]: {k: r[k] for k in ("moved_bytes", "moved_ratio", "ttft_ratio", "e2e_ratio")}
            for r in rows
            if r["context_tokens"] == longest
        },
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
