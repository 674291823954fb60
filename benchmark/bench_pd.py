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

With ``--handoff-delay-s S`` it measures instead whether a slow prefill node holds up the decode node: in
one ``sparse-rpf`` deployment whose prefill node answers the hand-offs of one prompt length S seconds late
(``SGLANG_OASIS_INJECT_HANDOFF_DELAY``), a request decodes alone, then again while such a slow arrival
waits for its hand-off; the ratio is its TPOT over the tokens decoded in the wait against the same tokens
alone (goal: at most 1.2; an arrival's network I/O runs off the scheduler thread).

    python benchmark/bench_pd.py --json pd.json [--contexts 1024 2048 4096 --new-tokens 32 --top-k 32]
    python benchmark/bench_pd.py --json pd_slow.json --handoff-delay-s 5
    python benchmark/bench_pd.py --json pd_tp3.json --tp-size 3   (both nodes; SmolLM2 has 3 KV heads)

With ``--tp-size N`` every deployment runs N ranks on each node (dense at the same TP); a sparse decode
rank reads its own KV heads from the prefill rank of its number, and each row lists the remote bytes each
rank read.
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
REMOTE = ("remote_admission_bytes", "remote_summary_bytes", "remote_miss_bytes", "remote_completion_bytes")


def serve(
    name: str, args: argparse.Namespace, model_dir: Path, prompts: list[list[int]], log_dir: Path
) -> list[dict]:
    from common import BY_SUMMARIES, oasis_stats, stream_generate
    from sglang_oasis_testing.pd_launch import PDLaunch

    server_args = [
        "--model-path", str(model_dir), "--dtype", "float32", "--oasis-top-k", str(args.top_k),
        *BY_SUMMARIES,
        "--oasis-host-kv-tokens", "32768", "--oasis-device-kv-tokens", "65536",
        "--prefill-args=--enable-metrics", "--tp-size", str(args.tp_size), *CONFIGS[name],
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
            remote, per_rank = 0, []
            if stats_before is not None:
                after = oasis_stats(pd.info["decode"]["url"])
                remote = sum(int(after[k]) - int(stats_before[k]) for k in REMOTE)
                per_rank = [
                    sum(int(now[k]) - int(then[k]) for k in REMOTE)
                    for now, then in zip(after.get("ranks", []), stats_before.get("ranks", []), strict=True)
                ]
            rows.append(
                {
                    "config": name,
                    "context_tokens": len(ids),
                    "sglang_transfer_bytes": int(sent),
                    "remote_read_bytes": remote,
                    "remote_read_bytes_per_rank": per_rank,
                    "moved_bytes": int(sent) + remote,
                    "ttft_s": stream.token_times[0] - started,
                    "e2e_s": stream.token_times[-1] - started,
                    "output_ids": stream.output_ids,
                }
            )
            print(f"{name} {len(ids)}: {rows[-1]['moved_bytes'] / 2**20:.1f} MiB moved", flush=True)
    return rows


def slow_handoff(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]], log_dir: Path) -> dict:
    """TPOT of a running request alone, and while an arrival waits ``args.handoff_delay_s`` for its
    hand-off (the tokens it decoded inside that wait, against the same token indices alone)."""
    import threading

    from common import BY_SUMMARIES, oasis_stats, stream_generate
    from sglang_oasis.disaggregation.prefill_stager import HANDOFF_DELAY_ENV
    from sglang_oasis_testing.pd_launch import PDLaunch

    running, slow = prompts[0], prompts[-1][: len(prompts[-1]) - 1]  # a length no other prompt has
    new_tokens = 256  # long enough to decode through the whole wait
    server_args = [
        "--model-path", str(model_dir), "--dtype", "float32", "--oasis-top-k", str(args.top_k),
        *BY_SUMMARIES,
        "--oasis-host-kv-tokens", "32768", "--oasis-device-kv-tokens", "65536", "--tp-size", str(args.tp_size),
    ]  # fmt: skip
    env = {HANDOFF_DELAY_ENV: f"{len(slow)}:{args.handoff_delay_s}"}
    with PDLaunch(server_args, log_dir / "slow-handoff", env=env) as pd:
        router, prefill = pd.info["url"], pd.info["prefill"]["url"]
        stream_generate(router, running[:64], 4)  # warm-up
        alone = stream_generate(router, running, new_tokens)
        arrival: dict[str, Any] = {}
        during: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: during.update(stream=stream_generate(router, running, new_tokens))
        )
        thread.start()
        time.sleep(1.0)  # the running request is decoding
        staged = oasis_stats(prefill)["staged_requests"]
        slow_thread = threading.Thread(target=lambda: arrival.update(stream=stream_generate(router, slow, 4)))
        slow_thread.start()
        while oasis_stats(prefill)["staged_requests"] == staged:
            time.sleep(0.02)
        waiting_from = time.monotonic()  # prefilled and staged: from here on it only waits for its hand-off
        slow_thread.join()
        thread.join()
        waiting_to = arrival["stream"].token_times[0]
    stream = during["stream"]
    started = stream.token_times[0]
    until = min(waiting_to, waiting_from + args.handoff_delay_s)
    inside = [i for i, t in enumerate(stream.token_times) if waiting_from < t < until]
    if len(inside) < 2:
        raise RuntimeError(
            f"the running request decoded {len(inside)} tokens during the wait: use more tokens"
        )
    first, last = inside[0], inside[-1]
    tpot_during = (stream.token_times[last] - stream.token_times[first]) / (last - first)
    tpot_alone = (alone.token_times[last] - alone.token_times[first]) / (last - first)
    return {
        "handoff_delay_s": args.handoff_delay_s,
        "running_context_tokens": len(running),
        "slow_context_tokens": len(slow),
        "tokens_during_wait": len(inside),
        "tpot_alone_ms": 1000 * tpot_alone,
        "tpot_during_wait_ms": 1000 * tpot_during,
        "tpot_ratio": tpot_during / tpot_alone,
        "slow_request_ttft_s": waiting_to - started,
        "same_output": stream.output_ids == alone.output_ids,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=32, help="blocks of 16 tokens per KV head")
    parser.add_argument("--num-layers", type=int, default=6, help="SmolLM2 layers served (30: all)")
    parser.add_argument("--tp-size", type=int, default=1, help="tensor-parallel ranks on each node")
    parser.add_argument("--handoff-delay-s", type=float, default=0.0,
                        help="measure a slow prefill node's effect on running requests instead (see above)")  # fmt: skip
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from common import essay_prompts, machine_info, print_table
    from sglang_oasis.models.default_model import prepare_default_model

    model_dir = prepare_default_model(num_layers=args.num_layers)
    prompts = [essay_prompts(model_dir, len(args.contexts), n)[i] for i, n in enumerate(args.contexts)]
    started = time.monotonic()
    if args.handoff_delay_s > 0:
        with tempfile.TemporaryDirectory(prefix="bench-pd-") as logs:
            result = slow_handoff(args, model_dir, prompts, Path(logs))
        print_table(list(result), [list(result.values())])
        report = {"benchmark": "bench_pd", "date": time.strftime("%Y-%m-%d"), "machine": machine_info(),
                  "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  "wall_s": time.monotonic() - started, "slow_handoff": result}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        return report
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
