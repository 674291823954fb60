"""Shared prefixes in sparse mode: a generated shared-prefix, two-turn workload against dense SGLang,
sparse with SGLang's radix cache, the same without warm starts (``--oasis-warm-start false``: every
first working set loads from the host tier), and sparse with the radix cache disabled (what SGLang's
own sparse offload, HiSparse, has to do).

Workload (SGLang's generated-shared-prefix pattern, with a second turn): ``--groups`` system prefixes of
``--prefix-tokens`` essay tokens; each has ``--questions`` conversations; turn 1 = prefix + a question
of ``--question-tokens`` tokens (another essay window), turn 2 = turn 1's prompt + its generated reply +
a new question. Every turn generates ``--output-tokens`` greedy tokens. Conversations run concurrently
(at most ``--concurrency`` in flight), each turn 2 after its own turn 1.

Per mode: ``ttft_p50_s`` / ``ttft_mean_s`` (streamed), ``output_tok_s`` (all generated tokens / wall
time), ``cached_share`` (SGLang's ``cached_tokens`` / prompt tokens), ``kv_tokens_per_request``
(sum of ``sglang:num_used_tokens`` over sum of ``sglang:num_running_reqs``, sampled every 0.2 s while
requests run: the KV pool tokens, the host tier in sparse mode, held per running request, a prefix
shared through the radix cache counted once however many requests hold it) and ``peak_running``;
sparse modes add ``admission_blocks_per_request`` (blocks loaded host -> device for first working sets,
per turn; one block of one KV head in one layer counts once), ``warm_starts`` and ``blocks_reused``
(from ``/oasis/stats``); ``ratios`` against dense.

    python benchmark/bench_prefix.py --json prefix.json [--num-layers N] [--groups 4] [--questions 4]
        [--prefix-tokens 1536] [--question-tokens 48] [--output-tokens 32] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import requests

from common import BY_SUMMARIES, essay_prompts, machine_info, oasis_stats, print_table, scrape_metric
from sglang_oasis.models.default_model import prepare_default_model
from sglang_oasis.server_process import ServerProcess

MODES = ("dense", "sparse", "sparse_cold", "sparse_no_radix")
OASIS_COUNTERS = ("requests", "blocks_loaded", "decode_blocks_loaded", "warm_starts", "blocks_reused")


def conversations(
    model: Path, groups: int, questions: int, prefix_tokens: int, question_tokens: int
) -> list[tuple[list[int], list[int], list[int]]]:
    """``(prefix, question 1, question 2)`` per conversation, token ids, every window distinct."""
    windows = essay_prompts(model, groups + 2 * groups * questions, max(prefix_tokens, question_tokens))
    prefixes = [w[:prefix_tokens] for w in windows[:groups]]
    asks = [w[:question_tokens] for w in windows[groups:]]
    return [
        (prefixes[g], asks[2 * (g * questions + q)], asks[2 * (g * questions + q) + 1])
        for g in range(groups)
        for q in range(questions)
    ]


def stream_turn(url: str, input_ids: list[int], output_tokens: int) -> dict[str, Any]:
    """One streamed greedy generation: TTFT, output ids, prompt and cached tokens."""
    body = {
        "input_ids": input_ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": output_tokens, "temperature": 0, "ignore_eos": True},
    }
    started = time.monotonic()
    first: float | None = None
    chunk: dict[str, Any] = {}
    with requests.post(url + "/generate", json=body, stream=True, timeout=3600) as response:
        if response.status_code != 200:
            return {"error": response.text[:300]}
        for line in response.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if first is None and chunk["meta_info"]["completion_tokens"] > 0:
                first = time.monotonic()
    meta = chunk.get("meta_info", {})
    return {
        "ttft_s": (first or time.monotonic()) - started,
        "output_ids": chunk.get("output_ids", []),
        "prompt_tokens": int(meta.get("prompt_tokens", len(input_ids))),
        "cached_tokens": int(meta.get("cached_tokens", 0)),
        "completion_tokens": int(meta.get("completion_tokens", 0)),
    }


class KvPerRequestSampler:
    """Samples ``num_used_tokens`` (the pool minus free and evictable tokens: what running requests hold,
    a shared locked prefix once) and ``num_running_reqs`` in the background; ``per_request`` is their
    ratio summed over the samples (a time average that transients between the two gauges do not
    dominate)."""

    def __init__(self, url: str, period_s: float = 0.2) -> None:
        self.url, self.period_s = url, period_s
        self.per_request = 0.0
        self.peak_running = 0
        self._used = self._running = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            running = scrape_metric(self.url, "sglang:num_running_reqs")
            used = scrape_metric(self.url, "sglang:num_used_tokens")
            if running and used is not None:
                self._used += used
                self._running += running
                self.per_request = self._used / self._running
                self.peak_running = max(self.peak_running, int(running))
            self._stop.wait(self.period_s)

    def __enter__(self) -> KvPerRequestSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run_mode(
    url: str, convs: list[tuple[list[int], list[int], list[int]]], args: argparse.Namespace, sparse: bool
) -> dict:
    def conversation(conv: tuple[list[int], list[int], list[int]]) -> list[dict[str, Any]]:
        prefix, ask1, ask2 = conv
        turn1 = stream_turn(url, [*prefix, *ask1], args.output_tokens)
        if "error" in turn1:
            return [turn1]
        prompt2 = [*prefix, *ask1, *turn1["output_ids"], *ask2]
        return [turn1, stream_turn(url, prompt2, args.output_tokens)]

    stream_turn(url, convs[0][0][:64], 4)  # warm-up, no shared prefix with the workload's turns
    before = oasis_stats(url) if sparse else {}
    started = time.monotonic()
    with KvPerRequestSampler(url) as sampler, ThreadPoolExecutor(args.concurrency) as pool:
        turns = [turn for conv_turns in pool.map(conversation, convs) for turn in conv_turns]
    wall = time.monotonic() - started
    ok = [t for t in turns if "error" not in t]
    ttfts = [t["ttft_s"] for t in ok]
    oasis: dict[str, Any] = {}
    if sparse:
        after = oasis_stats(url)
        delta = {key: after[key] - before[key] for key in OASIS_COUNTERS}
        admission = delta["blocks_loaded"] - delta["decode_blocks_loaded"]
        oasis = {
            "admission_blocks_per_request": admission / max(1, delta["requests"]),
            "warm_starts": delta["warm_starts"],
            "blocks_reused": delta["blocks_reused"],
        }
    return {
        "turns": len(turns),
        "errors": len(turns) - len(ok),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "output_tok_s": sum(t["completion_tokens"] for t in ok) / wall,
        "cached_share": sum(t["cached_tokens"] for t in ok) / max(1, sum(t["prompt_tokens"] for t in ok)),
        "kv_tokens_per_request": sampler.per_request,
        "peak_running": sampler.peak_running,
        "wall_s": wall,
        **oasis,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--num-layers", type=int, default=None, help="truncate SmolLM2 (default: all 30)")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--prefix-tokens", type=int, default=1536)
    parser.add_argument("--question-tokens", type=int, default=48)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--pool-tokens", type=int, default=65536, help="KV pool (host tier) of every mode")
    args = parser.parse_args()

    model = prepare_default_model(args.num_layers)
    convs = conversations(model, args.groups, args.questions, args.prefix_tokens, args.question_tokens)
    common = ["--model-path", str(model), "--enable-metrics"]
    selection = [*BY_SUMMARIES, "--oasis-top-k", str(args.top_k)]  # results.md's rows
    sparse = [*common, *selection, "--oasis-host-kv-tokens", str(args.pool_tokens)]
    configs = {
        "dense": [*common, "--oasis-mode", "dense", "--max-total-tokens", str(args.pool_tokens)],
        "sparse": sparse,
        "sparse_cold": [*sparse, "--oasis-warm-start", "false"],
        "sparse_no_radix": [*sparse, "--disable-radix-cache"],
    }
    results: dict[str, Any] = {
        "settings": {k: v for k, v in vars(args).items() if k != "json"}
        | {"num_layers": args.num_layers or 30},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    logs = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    print(f"server logs in {logs}")
    for mode, server_args in configs.items():
        print(f"[bench_prefix] {mode} ...", flush=True)
        try:
            with ServerProcess(server_args, log_path=logs / f"{mode}.log") as server:
                results[mode] = run_mode(server.url, convs, args, sparse=mode != "dense")
        except Exception as exc:  # one mode failing still reports the others
            results[mode] = {"error": f"{type(exc).__name__}: {exc}"}
    dense = results["dense"]
    results["ratios"] = {
        mode: {
            key: results[mode][key] / dense[key]
            for key in ("ttft_p50_s", "output_tok_s", "kv_tokens_per_request")
            if results[mode].get(key) and dense.get(key)
        }
        for mode in MODES[1:]
    }
    keys = [
        "ttft_p50_s",
        "ttft_mean_s",
        "output_tok_s",
        "cached_share",
        "kv_tokens_per_request",
        "peak_running",
        "admission_blocks_per_request",
        "warm_starts",
    ]
    rows = [
        [mode, *(results[mode].get(k, "-") for k in keys), results[mode].get("error", "")] for mode in MODES
    ]
    print_table(["mode", *keys, "error"], rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
