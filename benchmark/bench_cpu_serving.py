"""Is CPU serving as fast as it can be? Prefill and decode through the server beside plain transformers.

For each thread count (``--threads``; default: the launcher's choice, every usable core), one after
another: plain ``transformers`` in this process (the same model, dtype, prompts and intra-op thread
count: the floor any serving stack should reach), then a dense and a sparse ``sglang_oasis.launch_server``
(``OMP_NUM_THREADS`` = the thread count). Measured per context (``--contexts``, essay windows):

- prefill tokens/s: context / time to the first token of one streamed request after a flush of the
  prefix cache (transformers: one forward over the prompt, logits of the last position only);
- decode tokens/s at each batch size (``--batches``): batch 1 is that same request's tokens after the
  first; batch B > 1 sends B requests at once, each the same context plus its own 16-token suffix (the
  context is a prefix-cache hit, so the B prefills are short), and counts the tokens all B streams
  produced while all of them were decoding (from the last first token to the first last token), over
  that interval. Transformers: the prompt's cache repeated to B rows, then ``--decode-tokens`` greedy
  steps of B rows.

Sparse mode runs K = 128 blocks of 16 by the summaries (``--oasis-selector summaries``: the defaults when
results.md's rows were measured), otherwise the server's defaults (the fetch cap, the prefill window):
contexts up to 2K fit in K, longer ones select. ``--chat-dtypes`` also times the README's chat request
with a ~3.4K-token prompt (essay text and a question) on the default server (sparse, no options but
``--dtype``) once per listed ``DTYPE[:THREADS]`` (``auto``: the launcher's choice; ``float16:1`` is the
default before the launcher chose: SGLang's ``auto`` dtype and one thread), and records each answer.

    python benchmark/bench_cpu_serving.py --json cpu.json [--threads 1,2] [--contexts 1024,4096]
        [--batches 1,8] [--decode-tokens 32] [--num-layers N] [--dtype auto] [--chat-dtypes float16:1,auto]

Writes, for the first thread count, ``prefill_vs_hf.<mode>.<context>``, ``decode_vs_hf.<mode>.<context>.
<batch>`` (server / transformers) and ``sparse_vs_dense_decode.<context>.<batch>``; every thread count's
rates under ``threads.<n>.<hf|dense|sparse>`` (``prefill_tok_s.<context>``, ``decode_tok_s.<context>.
<batch>``) and its ratios under ``threads.<n>.ratios``; ``chat.<dtype>:<threads>`` (``seconds``, ``answer``,
``prompt_tokens``); ``settings``, ``date``, ``machine``. Exits 1 if a server failed (JSON written anyway).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import requests

from common import BY_SUMMARIES, essay_prompts, machine_info, print_table, stream_generate
from sglang_oasis.config import OasisConfig
from sglang_oasis.models.default_model import prepare_default_model
from sglang_oasis.platform.cpu.capabilities import cpu_flags, fastest_dtype, intra_op_threads, usable_cores
from sglang_oasis.server_process import ServerProcess

MODES = ("dense", "sparse")
SUFFIX_TOKENS = 16  # each batch request's own tokens after the shared context: one block
CHAT_PROMPT_TOKENS = 3400
CHAT_QUESTION = "What is the main point of the essay above? Answer in one sentence."
CHAT_MAX_TOKENS = 48


def all_decoding_rate(token_times: list[list[float]]) -> float:
    """Tokens per second while every stream was decoding: tokens timed in [last first token, first last
    token] (the first of them excluded: it closes a gap that began before the interval) over its length.
    Falls back to all tokens after each stream's first over the whole span when that interval is empty."""
    start = max(times[0] for times in token_times)
    end = min(times[-1] for times in token_times)
    if end > start:
        count = sum(sum(1 for t in times if start < t <= end) for times in token_times)
        return count / (end - start)
    later = sum(len(times) - 1 for times in token_times)
    span = max(times[-1] for times in token_times) - min(times[0] for times in token_times)
    return later / span if span > 0 else float("nan")


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def ratios(rates: dict[str, Any]) -> dict[str, Any]:
    """``prefill_vs_hf``, ``decode_vs_hf`` (per server mode) and ``sparse_vs_dense_decode`` from the
    rates of one thread count (missing rates give None)."""
    hf = rates.get("hf", {})
    out: dict[str, Any] = {"prefill_vs_hf": {}, "decode_vs_hf": {}, "sparse_vs_dense_decode": {}}
    for mode in MODES:
        mine = rates.get(mode, {})
        out["prefill_vs_hf"][mode] = {
            ctx: ratio(tok_s, hf.get("prefill_tok_s", {}).get(ctx))
            for ctx, tok_s in mine.get("prefill_tok_s", {}).items()
        }
        out["decode_vs_hf"][mode] = {
            ctx: {b: ratio(tok_s, hf.get("decode_tok_s", {}).get(ctx, {}).get(b)) for b, tok_s in row.items()}
            for ctx, row in mine.get("decode_tok_s", {}).items()
        }
    dense = rates.get("dense", {}).get("decode_tok_s", {})
    out["sparse_vs_dense_decode"] = {
        ctx: {b: ratio(tok_s, dense.get(ctx, {}).get(b)) for b, tok_s in row.items()}
        for ctx, row in rates.get("sparse", {}).get("decode_tok_s", {}).items()
    }
    return out


def batch_prompts(context: list[int], batch: int) -> list[list[int]]:
    """``batch`` prompts: the context, then a distinct suffix each (ids taken from the context itself)."""
    return [context + context[i * SUFFIX_TOKENS :][:SUFFIX_TOKENS] for i in range(batch)]


def measure_hf(
    model_dir: Path, dtype: str, threads: int, contexts: dict[int, list[int]], batches: list[int], steps: int
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        prefill: dict[str, float] = {}
        decode: dict[str, dict[str, float]] = {}
        with torch.inference_mode():
            model(torch.tensor([contexts[min(contexts)][:64]]))  # warm-up
            for size, ids in contexts.items():
                start = time.perf_counter()
                out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
                prefill[str(size)] = size / (time.perf_counter() - start)
                decode[str(size)] = {}
                for batch in batches:
                    cache = copy.deepcopy(out.past_key_values)  # decoding appends to it
                    if batch > 1:
                        cache.batch_repeat_interleave(batch)
                    token = torch.full((batch, 1), int(out.logits[0, -1].argmax()))
                    start = time.perf_counter()
                    for _ in range(steps):
                        logits = model(token, past_key_values=cache, use_cache=True).logits
                        token = logits[:, -1:].argmax(-1)
                    decode[str(size)][str(batch)] = batch * steps / (time.perf_counter() - start)
        del model
        return {"prefill_tok_s": prefill, "decode_tok_s": decode}
    finally:
        torch.set_num_threads(previous)


def flush_cache(url: str) -> None:
    requests.post(url + "/flush_cache", timeout=60).raise_for_status()


def timed_stream(url: str, ids: list[int], tokens: int) -> tuple[float, list[float]]:
    """(send time, token arrival times) of one streamed greedy request of exactly ``tokens`` tokens."""
    sent = time.monotonic()
    stream = stream_generate(url, ids, tokens)
    if stream.error or len(stream.token_times) != tokens:
        raise RuntimeError(
            f"request failed: {stream.error or f'{len(stream.token_times)} of {tokens} tokens'}"
        )
    return sent, stream.token_times


def measure_server(
    url: str, contexts: dict[int, list[int]], batches: list[int], steps: int
) -> dict[str, Any]:
    timed_stream(url, contexts[min(contexts)][:64], 4)  # warm-up
    prefill: dict[str, float] = {}
    decode: dict[str, dict[str, float]] = {}
    for size, ids in contexts.items():
        flush_cache(url)
        sent, times = timed_stream(url, ids, steps + 1)
        prefill[str(size)] = size / (times[0] - sent)
        decode[str(size)] = {}
        for batch in batches:
            if batch == 1:
                decode[str(size)]["1"] = steps / (times[-1] - times[0])
                continue
            with ThreadPoolExecutor(batch) as pool:
                runs = list(pool.map(lambda p: timed_stream(url, p, steps + 1), batch_prompts(ids, batch)))
            decode[str(size)][str(batch)] = all_decoding_rate([run_times for _, run_times in runs])
    return {"prefill_tok_s": prefill, "decode_tok_s": decode}


def server_args(
    mode: str, model: Path, dtype: str, context_length: int, pool_tokens: int, batch: int
) -> list[str]:
    common = ["--model-path", str(model), "--dtype", dtype, "--context-length", str(context_length)]
    if mode == "dense":
        return [*common, "--oasis-mode", "dense", "--max-total-tokens", str(pool_tokens)]
    # K = 128 with the summaries (the defaults when results.md's rows were measured), the working-set
    # budget cut to the largest batch (memory; speed is the same).
    budget = max(batch, 1) * OasisConfig(top_k=128).working_set_tokens
    pinned = [*BY_SUMMARIES, "--oasis-top-k", "128"]
    return [
        *common,
        *pinned,
        "--oasis-host-kv-tokens",
        str(pool_tokens),
        "--oasis-device-kv-tokens",
        str(budget),
    ]


def chat_messages(model_dir: Path) -> list[dict[str, str]]:
    """The README's chat request with a ~3.4K-token prompt: essay text, then a question."""
    from transformers import AutoTokenizer

    from sglang_oasis.evaluation.passkey import essays_text

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.encode(essays_text(), add_special_tokens=False)[:CHAT_PROMPT_TOKENS]
    return [{"role": "user", "content": tokenizer.decode(ids) + "\n\n" + CHAT_QUESTION}]


def time_chat(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": "default", "messages": messages, "temperature": 0, "max_tokens": CHAT_MAX_TOKENS}
    start = time.monotonic()
    response = requests.post(url + "/v1/chat/completions", json=body, timeout=3600)
    seconds = time.monotonic() - start
    response.raise_for_status()
    reply = response.json()
    return {
        "seconds": seconds,
        "answer": reply["choices"][0]["message"]["content"],
        "prompt_tokens": reply["usage"]["prompt_tokens"],
        "completion_tokens": reply["usage"]["completion_tokens"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument(
        "--threads", default=None, help="comma-separated thread counts (default: the launcher's)"
    )
    parser.add_argument("--contexts", default="1024,4096", help="comma-separated context lengths in tokens")
    parser.add_argument("--batches", default="1,8", help="comma-separated decode batch sizes")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--num-layers", type=int, default=None, help="truncate SmolLM2 (default: all 30)")
    parser.add_argument("--model-path", type=Path, default=None, help="another HF model (default: SmolLM2)")
    parser.add_argument("--dtype", default="auto", help="dtype of every run; auto: the launcher's CPU choice")
    parser.add_argument(
        "--chat-dtypes", default="auto", help="dtypes to time the chat request in ('' : none)"
    )
    args = parser.parse_args()
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be >= 2")

    choice = fastest_dtype(cpu_flags())
    dtype = choice.dtype if args.dtype == "auto" else args.dtype
    threads = (
        [int(t) for t in args.threads.split(",")] if args.threads else [intra_op_threads(usable_cores())]
    )
    sizes = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    model = args.model_path or prepare_default_model(args.num_layers)
    windows = essay_prompts(model, len(sizes), max(sizes))
    contexts = {size: window[:size] for size, window in zip(sizes, windows, strict=True)}
    context_length = max(sizes) + SUFFIX_TOKENS + args.decode_tokens + 64
    pool_tokens = 16 * -(-(2 * max(sizes) + max(batches) * (SUFFIX_TOKENS + args.decode_tokens + 64)) // 16)
    results: dict[str, Any] = {
        "settings": {
            "threads": threads, "contexts": sizes, "batches": batches, "decode_tokens": args.decode_tokens,
            "dtype": dtype, "dtype_reason": choice.reason if args.dtype == "auto" else "--dtype",
            "num_layers": args.num_layers, "model": str(model), "pool_tokens": pool_tokens,
        },
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "threads": {},
    }  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="bench-cpu-serving-"))
    print(f"server logs in {logs}", flush=True)
    failed = False
    for count in threads:
        print(f"[bench_cpu_serving] {count} thread(s): transformers ...", flush=True)
        rates: dict[str, Any] = {"hf": measure_hf(model, dtype, count, contexts, batches, args.decode_tokens)}
        for mode in MODES:
            print(f"[bench_cpu_serving] {count} thread(s): {mode} server ...", flush=True)
            argv = server_args(mode, model, dtype, context_length, pool_tokens, max(batches))
            try:
                with ServerProcess(
                    argv, logs / f"{mode}-{count}.log", {"OMP_NUM_THREADS": str(count)}
                ) as server:
                    rates[mode] = measure_server(server.url, contexts, batches, args.decode_tokens)
            except Exception as exc:  # a failed server or request: record it and go on
                rates[mode] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                failed = True
        rates["ratios"] = ratios(rates)
        results["threads"][str(count)] = rates

    chat_dtypes = [d for d in args.chat_dtypes.split(",") if d]
    if chat_dtypes:
        messages = chat_messages(model)
        results["chat"] = {}
        for entry in chat_dtypes:
            chat_dtype, _, chat_threads = entry.partition(":")
            name = choice.dtype if chat_dtype == "auto" else chat_dtype
            count = int(chat_threads) if chat_threads else threads[0]
            key = f"{name}:{count}"
            print(f"[bench_cpu_serving] chat request on the default server, {key} ...", flush=True)
            argv = ["--model-path", str(model), "--dtype", name]
            try:
                env = {"OMP_NUM_THREADS": str(count)}
                with ServerProcess(argv, logs / f"chat-{name}-{count}.log", env) as server:
                    results["chat"][key] = time_chat(server.url, messages)
            except Exception as exc:
                results["chat"][key] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                failed = True

    headline = results["threads"][str(threads[0])]["ratios"]
    results = {**headline, **results}
    report(results)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 1 if failed else 0


def report(results: dict[str, Any]) -> None:
    """One row per thread count, run and context; the server rows show the ratios ``ratios`` computed."""
    rows = []
    for count, rates in results["threads"].items():
        for mode in ("hf", *MODES):
            if "error" in rates[mode]:
                rows.append([count, mode, "-", "-", "-", "-", rates[mode]["error"][:60]])
                continue
            for ctx, prefill in rates[mode]["prefill_tok_s"].items():
                decode = rates[mode]["decode_tok_s"][ctx]
                cells = " ".join(f"b{b}={v:.1f}" for b, v in decode.items())
                vs_hf, dec_vs = "-", "-"
                if mode != "hf":
                    prefill_ratio = rates["ratios"]["prefill_vs_hf"][mode][ctx]
                    vs_hf = f"{prefill_ratio:.2f}" if prefill_ratio else "-"
                    decode_ratios = rates["ratios"]["decode_vs_hf"][mode][ctx]
                    dec_vs = " ".join(f"b{b}={r or 0:.2f}" for b, r in decode_ratios.items())
                rows.append([count, mode, ctx, prefill, vs_hf, cells, dec_vs])
    print_table(["threads", "run", "context", "prefill tok/s", "vs hf", "decode tok/s", "decode vs hf"], rows)
    for name, chat in results.get("chat", {}).items():
        if "error" in chat:
            print(f"chat {name}: {chat['error'][:200]}")
        else:
            print(
                f"chat {name}: {chat['seconds']:.1f} s, {chat['prompt_tokens']} prompt tokens: {chat['answer']!r}"
            )


if __name__ == "__main__":
    sys.exit(main())
