"""The fetch cap's trade-off: how many blocks per step the host tier may send (``--oasis-fetch-ratio``)
against output quality and decode speed. SmolLM2 on CPU (``--num-layers`` truncates it), fixed K.

One dense server, then one sparse server per ratio R (cap = ceil(R x K) blocks per request, layer and KV
head per decode step; 1.0 = no cap), started one after another. On each, after a short warm-up:

(a) agreement with dense: 2 essay prompts of ``--context-tokens`` tokens, generated greedily and
    concurrently for ``--agreement-tokens`` (N) tokens (``ignore_eos``). Per prompt, with d the dense
    output ids and s the sparse ones:
      prefix agreement   = (length of the common prefix of s and d) / N   (1.0: no divergence at all)
      position agreement = (number of positions i < N with s[i] == d[i]) / N
    each averaged over the 2 prompts. Position agreement counts matches after a first divergence too
    (the outputs can fall back into step), so it is >= prefix agreement.
(b) ``decode_tok_s`` of that batch: generated tokens after each request's first, divided by the time from
    the first request's first token to the last token of either.
(c) per decode step, from ``/oasis/stats`` counter differences around (a): ``bytes_per_step`` = delta
    decode_bytes_host_to_device / delta decode_steps, ``deferred_per_step`` = delta blocks_deferred /
    delta decode_steps (one decode step is one batched forward pass, covering both requests).
(d) ``wait_share`` = delta foreground_wait_us / the decode wall time of (b) in microseconds: the share of
    decode time attention spent waiting for the prefetch pipeline.
(e) ``passkey_hits``: passkey retrieval at ~``--context-tokens`` tokens, one case per depth in
    ``--passkey-depths`` (seed = the depth's index), over /v1/chat/completions (temperature 0,
    max_tokens 12), all cases concurrently.

``--adaptive-ratios`` adds, for each ratio R listed, one more sparse server with
``--oasis-adaptive-cap true`` (the cap follows the measured drift between ceil(R x K) and
ceil(min(1, 4R) x K) blocks), measured the same way and written under ``adaptive.<r>``: with small
blocks the fixed cap falls behind the drift and the adaptive one catches up.

    python benchmark/bench_fetch_cap.py --json fetch_cap.json [--ratios 0.01,0.02,0.05,0.1,0.25,1.0]
        [--top-k 32] [--num-layers N] [--context-tokens 2048] [--agreement-tokens 256]
        [--passkey-depths 0.1,0.3,0.5,0.7,0.9] [--adaptive-ratios 0.05] [--block-size 16] [--dtype auto]
        [--plot PNG]

``--dtype`` goes to every server (SGLang's ``auto`` serves this float32 checkpoint in float16).

Writes ``ratios.<r>.{bytes_per_step, decode_tok_s, wait_share, deferred_per_step, prefix_agreement,
position_agreement, passkey_hits}`` (plus ``blocks_loaded_per_step``, ``decode_steps``, ``cap_blocks``),
``adaptive.<r>.{...}`` (the same, ``cap_blocks`` being the bounds), ``dense.{decode_tok_s, passkey_hits}``,
``settings``, ``date`` and ``machine``. A setting whose server or requests failed gets ``error`` (its
other numbers are those measured before the failure) and the run goes on; the exit code is 1 only when
nothing was measured. The plot (PNG, default: beside the JSON) shows
bytes per step and decode tok/s against the ratio (log x), with dense's tok/s as a line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from common import (
    BY_SUMMARIES,
    Stream,
    essay_prompts,
    machine_info,
    oasis_stats,
    print_table,
    stream_generate,
)
from sglang_oasis.config import OasisConfig
from sglang_oasis.evaluation.passkey import count_hits, essays_text, make_case
from sglang_oasis.models.default_model import prepare_default_model
from sglang_oasis.server_process import ServerProcess

AGREEMENT_PROMPTS = 2
ENTRY_ORDER = (
    "bytes_per_step", "decode_tok_s", "prefix_agreement", "position_agreement", "passkey_hits",
    "wait_share", "deferred_per_step",
)  # fmt: skip
DELTA_COUNTERS = (
    "decode_steps", "decode_bytes_host_to_device", "decode_blocks_loaded", "blocks_deferred",
    "blocks_just_filled", "foreground_wait_us", "stage_select_us", "stage_transfer_us",
)  # fmt: skip


# ------------------------------------------------------------------------------------------ pure pieces


def prefix_agreement(sparse: list[int], dense: list[int], n: int) -> float:
    """Length of the common prefix of the first ``n`` tokens of both, over ``n``."""
    common = 0
    for a, b in zip(sparse[:n], dense[:n], strict=False):
        if a != b:
            break
        common += 1
    return common / n


def position_agreement(sparse: list[int], dense: list[int], n: int) -> float:
    """Share of the ``n`` positions where both have the same token (a missing token never matches)."""
    return sum(a == b for a, b in zip(sparse[:n], dense[:n], strict=False)) / n


def mean_agreement(sparse: list[list[int]], dense: list[list[int]], n: int) -> dict[str, float]:
    """Both agreements, each averaged over the prompts."""
    pairs = list(zip(sparse, dense, strict=True))
    return {
        "prefix_agreement": sum(prefix_agreement(s, d, n) for s, d in pairs) / len(pairs),
        "position_agreement": sum(position_agreement(s, d, n) for s, d in pairs) / len(pairs),
    }


def sparse_settings(
    ratios: list[float], adaptive_ratios: list[float], top_k: int
) -> list[tuple[str, float, bool, int | list[int] | None]]:
    """(results section, ratio, adaptive, cap_blocks) of each sparse server, in run order: the fixed caps
    (ceil(R x K) blocks; None: no cap), then the adaptive ones (cap_blocks = its [low, high] bounds)."""
    settings: list[tuple[str, float, bool, int | list[int] | None]] = [
        ("ratios", r, False, OasisConfig(top_k=top_k, fetch_ratio=r).fetch_cap) for r in ratios
    ]
    for r in adaptive_ratios:
        settings.append(("adaptive", r, True, list(OasisConfig(top_k=top_k, fetch_ratio=r).fetch_cap_bounds)))
    return settings


def counter_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """``after - before`` of the raw ``/oasis/stats`` counters the benchmark uses."""
    return {name: int(after[name]) - int(before[name]) for name in DELTA_COUNTERS}


def per_step(deltas: dict[str, int], decode_wall_s: float) -> dict[str, float | None]:
    """Per-decode-step numbers of one run from its counter differences and its decode wall time."""
    steps = deltas["decode_steps"]
    return {
        "bytes_per_step": deltas["decode_bytes_host_to_device"] / steps if steps else None,
        "deferred_per_step": deltas["blocks_deferred"] / steps if steps else None,
        "blocks_loaded_per_step": deltas["decode_blocks_loaded"] / steps if steps else None,
        "wait_share": deltas["foreground_wait_us"] / (decode_wall_s * 1e6) if decode_wall_s > 0 else None,
    }


def ordered(entry: dict[str, Any], first: tuple[str, ...]) -> dict[str, Any]:
    """``entry`` with the keys of ``first`` (those present) first, the rest after in their order."""
    return {**{k: entry[k] for k in first if k in entry}, **entry}


def decode_rate(token_times: list[list[float]]) -> tuple[int, float]:
    """Tokens after each request's first, and the time from the first first-token to the last token."""
    times = [t for t in token_times if t]
    tokens = sum(len(t) - 1 for t in times)
    wall = max(t[-1] for t in times) - min(t[0] for t in times)
    return tokens, wall


# ------------------------------------------------------------------------------------------ server side


def generate_batch(url: str, prompts: list[list[int]], new_tokens: int) -> list[Stream]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        streams = list(pool.map(lambda ids: stream_generate(url, ids, new_tokens), prompts))
    errors = [s.error for s in streams if s.error]
    if errors:
        raise RuntimeError(f"generation failed: {errors[0]}")
    for s in streams:
        if len(s.output_ids) != new_tokens:
            raise RuntimeError(f"got {len(s.output_ids)} output ids for {new_tokens} tokens")
    return streams


def measure(
    server: ServerProcess,
    prompts: list[list[int]],
    new_tokens: int,
    cases: list[Any],
    out: dict[str, Any],
    sparse: bool,
) -> list[list[int]]:
    """Fills ``out`` as the numbers come (so a later failure keeps the earlier ones); returns the outputs."""
    warm = stream_generate(server.url, prompts[-1][-64:], 4)  # no prompt's prefix
    if warm.error:
        raise RuntimeError(f"warm-up request failed: {warm.error}")
    before = oasis_stats(server.url) if sparse else None
    streams = generate_batch(server.url, prompts, new_tokens)
    tokens, wall = decode_rate([s.token_times for s in streams])
    out["decode_tok_s"] = tokens / wall if wall > 0 else None
    if before is not None:
        deltas = counter_deltas(before, oasis_stats(server.url))
        out["decode_steps"] = deltas["decode_steps"]
        out.update(per_step(deltas, wall))
    outputs = [s.output_ids for s in streams]
    out["passkey_hits"] = count_hits(server.url, cases)
    return outputs


def sparse_args(
    ratio: float, adaptive: bool, args: argparse.Namespace, model_args: list[str], host_tokens: int
) -> list[str]:
    return [
        *model_args, "--oasis-mode", "sparse", *BY_SUMMARIES, "--oasis-top-k", str(args.top_k),
        "--oasis-block-size", str(args.block_size), "--oasis-fetch-ratio", str(ratio),
        "--oasis-adaptive-cap", str(adaptive).lower(), "--oasis-host-kv-tokens", str(host_tokens),
        "--oasis-device-kv-tokens", str(8 * args.top_k * args.block_size),
    ]  # fmt: skip


def plot(results: dict[str, Any], ratios: list[float], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    points = [(r, results["ratios"][str(r)]) for r in ratios]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    xs = [r for r, v in points if v.get("bytes_per_step") is not None]
    axes[0].plot(xs, [results["ratios"][str(r)]["bytes_per_step"] / 1024 for r in xs], "o-")
    axes[0].set(xscale="log", xlabel="fetch ratio", ylabel="KiB host -> device per decode step",
                title="bytes per step")  # fmt: skip
    xs = [r for r, v in points if v.get("decode_tok_s") is not None]
    axes[1].plot(xs, [results["ratios"][str(r)]["decode_tok_s"] for r in xs], "o-", label="sparse")
    adaptive = [(float(r), v) for r, v in results["adaptive"].items() if v.get("decode_tok_s") is not None]
    if adaptive:
        axes[0].plot([r for r, _ in adaptive], [v["bytes_per_step"] / 1024 for _, v in adaptive], "x",
                     markersize=9, label="adaptive cap")  # fmt: skip
        axes[0].legend()
        axes[1].plot([r for r, _ in adaptive], [v["decode_tok_s"] for _, v in adaptive], "x", markersize=9,
                     label="adaptive cap")  # fmt: skip
    dense = results["dense"].get("decode_tok_s")
    if dense is not None:
        axes[1].axhline(dense, color="gray", linestyle="--", label="dense")
    axes[1].set(xscale="log", xlabel="fetch ratio", ylabel="decode tok/s (batch of 2)", title="decode speed")
    axes[1].legend()
    fig.suptitle(
        f"fetch cap, K={results['settings']['top_k']}, blocks of {results['settings']['block_size']}, "
        f"~{results['settings']['context_tokens']} tokens"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--ratios", default="0.01,0.02,0.05,0.1,0.25,1.0")
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=None, help="truncate SmolLM2 (default: all 30)")
    parser.add_argument("--context-tokens", type=int, default=2048)
    parser.add_argument("--agreement-tokens", type=int, default=256)
    parser.add_argument("--passkey-depths", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--adaptive-ratios", default="", help="also run --oasis-adaptive-cap at these ratios")
    parser.add_argument("--dtype", default="auto", help="SGLang --dtype of every server")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default: beside the JSON)")
    args = parser.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    depths = [float(d) for d in args.passkey_depths.split(",")]
    adaptive_ratios = [float(r) for r in args.adaptive_ratios.split(",") if r]
    if any(not 0 < r <= 1 for r in ratios) or args.agreement_tokens < 2:
        parser.error("ratios must be in (0, 1] and --agreement-tokens >= 2")
    if any(not 0 < r < 1 for r in adaptive_ratios):
        parser.error("--adaptive-ratios must be in (0, 1) (1.0 has no cap to adapt)")

    from transformers import AutoTokenizer

    model = prepare_default_model(args.num_layers)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = essay_prompts(model, AGREEMENT_PROMPTS, args.context_tokens)
    text = essays_text()
    cases = [make_case(tokenizer, args.context_tokens, d, seed=i, text=text) for i, d in enumerate(depths)]
    longest = max(args.context_tokens + args.agreement_tokens, *(c.prompt_tokens + 12 for c in cases))
    context_length = longest + 64
    host_tokens = max(AGREEMENT_PROMPTS, len(cases)) * (context_length + args.block_size) + 4096
    model_args = ["--model-path", str(model), "--context-length", str(context_length), "--dtype", args.dtype]
    results: dict[str, Any] = {
        "settings": {
            "ratios": ratios, "adaptive_ratios": adaptive_ratios, "top_k": args.top_k, "block_size": args.block_size,
            "num_layers": args.num_layers or 30, "context_tokens": args.context_tokens,
            "agreement_tokens": args.agreement_tokens, "agreement_prompts": AGREEMENT_PROMPTS,
            "passkey_depths": depths, "passkey_cases": len(cases), "passkey_prompt_tokens": [c.prompt_tokens for c in cases],
            "host_kv_tokens": host_tokens, "dtype": args.dtype, "model": str(model),
        },
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "dense": {},
        "ratios": {},
        "adaptive": {},
    }  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="bench-fetch-cap-"))
    print(f"server logs in {logs}", flush=True)
    started = time.monotonic()

    dense_outputs: list[list[int]] | None = None
    print("[bench_fetch_cap] dense ...", flush=True)
    dense_args = [*model_args, "--oasis-mode", "dense", "--max-total-tokens", str(host_tokens)]
    try:
        with ServerProcess(dense_args, log_path=logs / "dense.log") as server:
            dense_outputs = measure(server, prompts, args.agreement_tokens, cases, results["dense"], False)
    except Exception as exc:  # a failed server or request: record it and go on
        results["dense"]["error"] = f"{type(exc).__name__}: {exc}"[:2000]

    for section, ratio, adaptive, cap_blocks in sparse_settings(ratios, adaptive_ratios, args.top_k):
        print(f"[bench_fetch_cap] ratio {ratio}{' adaptive' if adaptive else ''} ...", flush=True)
        entry: dict[str, Any] = {"cap_blocks": cap_blocks}
        results[section][str(ratio)] = entry
        argv = sparse_args(ratio, adaptive, args, model_args, host_tokens)
        try:
            with ServerProcess(argv, log_path=logs / f"{section}-{ratio}.log") as server:
                outputs = measure(server, prompts, args.agreement_tokens, cases, entry, True)
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
            continue
        if dense_outputs is not None:
            entry.update(mean_agreement(outputs, dense_outputs, args.agreement_tokens))
    results["wall_s"] = round(time.monotonic() - started, 1)

    def cell(value: Any, digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)

    rows = []
    named = [
        ("dense", results["dense"]),
        *((f"sparse {k}", v) for k, v in results["ratios"].items()),
        *((f"adaptive {k}", v) for k, v in results["adaptive"].items()),
    ]
    for name, r in named:
        kib = r.get("bytes_per_step")
        hits = f"{r['passkey_hits']}/{len(cases)}" if "passkey_hits" in r else "-"
        cap = r.get("cap_blocks")
        rows.append([
            name, "..".join(map(str, cap)) if isinstance(cap, list) else cell(cap), cell(None if kib is None else kib / 1024, 1),
            cell(r.get("deferred_per_step")), cell(r.get("decode_tok_s")), cell(r.get("wait_share"), 3),
            cell(r.get("prefix_agreement"), 3), cell(r.get("position_agreement"), 3), hits,
            (r.get("error") or "")[:60].replace("\n", " "),
        ])  # fmt: skip
    headers = ["setting", "cap", "KiB/step", "deferred/step", "tok/s", "wait_share", "prefix_agr",
               "position_agr", "passkey", "error"]  # fmt: skip
    print_table(headers, rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for section in ("ratios", "adaptive"):
        results[section] = {k: ordered(v, ENTRY_ORDER) for k, v in results[section].items()}
    # headline numbers first (run_all shows the first 8)
    results = ordered(results, ("dense", "ratios", "adaptive"))
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
    try:
        plot(results, ratios, args.plot or args.json.with_suffix(".png"))
    except Exception as exc:  # the numbers are written; a plot problem must not fail the run
        print(f"no plot: {type(exc).__name__}: {exc}")
    everything = (results["dense"], *results["ratios"].values(), *results["adaptive"].values())
    measured = [r for r in everything if "decode_tok_s" in r]
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
