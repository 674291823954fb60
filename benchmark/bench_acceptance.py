"""Speculative acceptance of the draft sources, served: how many tokens per verify step SGLang's
speculative worker accepts on chat prompts when sglang-oasis runs it with ``--oasis-draft-policy
verify``, next to dense SGLang without speculation in the same run.

Three servers, one after another, on the default model (SmolLM2-135M-Instruct, all 30 layers; the
EAGLE-3 head reads layers 2, 15 and 27): dense SGLang (``--oasis-mode dense``, no speculation), sparse
with ``--oasis-lookahead eagle3`` (the shipped head, or ``--head``) and sparse with ``--oasis-lookahead
ngram``, both ``--oasis-draft-policy verify`` and K = 128 blocks (by the summaries), which covers every chat
here, so attention is dense's and acceptance is plain SGLang EAGLE3/NGRAM acceptance with one draft step,
top-k 1 and two verify tokens (launch_server's lookahead shape). Each chat prompt (``CHAT_PROMPTS``:
everyday requests, none from the head's training prompts) goes in the model's chat template as one
greedy request at a time, up to ``--max-new-tokens``. With ``--pd`` a fourth deployment, ``eagle3_pd``,
serves the eagle3 configuration disaggregated (``launch_pd``: prefill and decode servers, remote partial
fetching over Mooncake on 127.0.0.1): its acceptance equals the non-disaggregated one only if the decode
node's draft model sees the same KV (the prefill node's draft KV is read with the request's).

Acceptance is SGLang's own ``spec_accept_length`` (``completion_tokens / spec_verify_ct``) summed over
the prompts: total completion tokens / total verify steps (1.0 = no draft ever accepted, 2.0 = every
draft accepted). Also per prompt, the decode speed of each server (completion tokens / request time)
and whether the greedy text equals dense's.

    python benchmark/bench_acceptance.py --json acceptance.json [--head DIR] [--prompts 24]
        [--max-new-tokens 128] [--dtype auto] [--modes dense,eagle3,ngram] [--pd]

Writes ``eagle3.acceptance``, ``ngram.acceptance``, ``target_acceptance`` (1.3, issue 4's goal for the
head), per mode ``tokens``, ``verify_steps``, ``tok_s``, ``ratio_tok_s`` (vs dense), ``same_as_dense``
(prompts whose text equals dense's), ``per_prompt`` and ``error`` when it failed, plus ``settings``,
``date`` and ``machine``. Exits 1 if a server failed (the JSON is written anyway).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import requests

from common import BY_SUMMARIES, machine_info, print_table
from sglang_oasis.evaluation.chat_prompts import CHAT_PROMPTS
from sglang_oasis.models.default_model import prepare_default_model
from sglang_oasis.server_process import ServerProcess
from sglang_oasis_testing.pd_launch import PDLaunch

MODES = ("dense", "eagle3", "ngram")
TARGET_ACCEPTANCE = 1.3


def server_args(mode: str, head: Path | None, dtype: str) -> list[str]:
    common = ["--dtype", dtype, "--context-length", "2048"]
    if mode == "dense":
        return [*common, "--oasis-mode", "dense"]
    source = mode.removesuffix("_pd")
    args = [*common, *BY_SUMMARIES, "--oasis-top-k", "128"]  # covers every chat here
    args += ["--oasis-lookahead", source, "--oasis-draft-policy", "verify"]
    if source == "eagle3" and head is not None:
        args += ["--speculative-draft-model-path", str(head)]
    return args


def chat_texts(model: Path, count: int) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
        )
        for p in CHAT_PROMPTS[:count]
    ]


def measure(url: str, texts: list[str], max_new_tokens: int) -> dict[str, Any]:
    per_prompt, tokens, verify_steps, seconds = [], 0, 0, 0.0
    warm = {"text": texts[0], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    requests.post(url + "/generate", json=warm, timeout=600).raise_for_status()
    for text in texts:
        body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        started = time.monotonic()
        response = requests.post(url + "/generate", json=body, timeout=600)
        elapsed = time.monotonic() - started
        if response.status_code != 200:
            raise RuntimeError(f"request failed ({response.status_code}): {response.text[:300]}")
        result = response.json()
        meta = result["meta_info"]
        completion, verify = int(meta["completion_tokens"]), int(meta.get("spec_verify_ct") or 0)
        tokens, verify_steps, seconds = tokens + completion, verify_steps + verify, seconds + elapsed
        per_prompt.append(
            {
                "tokens": completion,
                "verify_steps": verify,
                "acceptance": completion / verify if verify else None,
                "seconds": round(elapsed, 3),
                "text": result["text"],
            }
        )
    return {
        "acceptance": tokens / verify_steps if verify_steps else None,
        "tokens": tokens,
        "verify_steps": verify_steps,
        "tok_s": tokens / seconds,
        "per_prompt": per_prompt,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--head", type=Path, default=None, help="EAGLE-3 head (default: the shipped one)")
    parser.add_argument("--prompts", type=int, default=len(CHAT_PROMPTS), help="the first N chat prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="auto", help="SGLang --dtype of every server")
    parser.add_argument("--pd", action="store_true", help="also serve eagle3 disaggregated (eagle3_pd)")
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)} (dense first)"
    )
    args = parser.parse_args()
    modes = tuple(args.modes.split(",")) + (("eagle3_pd",) if args.pd else ())
    if modes[0] != "dense" or not set(modes) <= {*MODES, "eagle3_pd"}:
        parser.error(f"--modes: dense first, then any of {', '.join(MODES[1:])}")
    if not 1 <= args.prompts <= len(CHAT_PROMPTS):
        parser.error(f"--prompts must be 1..{len(CHAT_PROMPTS)}")

    model = prepare_default_model()
    texts = chat_texts(model, args.prompts)
    results: dict[str, Any] = {
        "settings": {
            "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "dtype": args.dtype,
            "head": str(args.head) if args.head else "shipped", "model": str(model),
            "speculative": "1 draft step, top-k 1, 2 verify tokens", "batch": 1,
        },
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="bench-acceptance-"))
    print(f"server logs in {logs}", flush=True)
    for mode in modes:
        print(f"[bench_acceptance] {mode} ...", flush=True)
        argv = server_args(mode, args.head, args.dtype)
        try:
            if mode.endswith("_pd"):
                with PDLaunch(argv, logs / mode) as pd:
                    results[mode] = measure(pd.router.url, texts, args.max_new_tokens)
                    results[mode]["remote_draft_bytes"] = pd.decode.oasis_stats()["remote_draft_bytes"]
            else:
                with ServerProcess(argv, log_path=logs / f"{mode}.log") as server:
                    results[mode] = measure(server.url, texts, args.max_new_tokens)
        except Exception as exc:  # a failed server or request: record it and go on
            results[mode] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}

    reference = [p["text"] for p in results["dense"].get("per_prompt", [])]
    dense_tok_s = results["dense"].get("tok_s")
    rows = []
    for mode in modes:
        r = results[mode]
        if "per_prompt" in r and reference:
            r["same_as_dense"] = sum(
                p["text"] == ref for p, ref in zip(r["per_prompt"], reference, strict=False)
            )
        if r.get("tok_s") and dense_tok_s:
            r["ratio_tok_s"] = r["tok_s"] / dense_tok_s
        rows.append(
            [
                mode,
                r.get("acceptance") if r.get("acceptance") is not None else "-",
                r.get("tokens", "-"),
                r.get("verify_steps", "-"),
                r.get("tok_s", "-"),
                r.get("ratio_tok_s", "-"),
                f"{r['same_as_dense']}/{args.prompts}" if "same_as_dense" in r else "-",
                r.get("error", "")[:80].replace("\n", " "),
            ]
        )
    print_table(
        ["mode", "acceptance", "tokens", "verify_steps", "tok_s", "vs_dense", "same_as_dense", "error"], rows
    )
    results["target_acceptance"] = TARGET_ACCEPTANCE
    accepted = results.get("eagle3", {}).get("acceptance")
    print(
        f"eagle3 acceptance {accepted:.3f}" if accepted is not None else "eagle3 acceptance -",
        f"(target > {TARGET_ACCEPTANCE}) on {args.prompts} chat prompts, up to {args.max_new_tokens} tokens each",
    )
    for mode in modes[1:]:  # the headline numbers first (run_all shows the first 8)
        results[f"{mode}.acceptance"] = results[mode].get("acceptance")
    first = (*(f"{mode}.acceptance" for mode in modes[1:]), "target_acceptance", *modes)
    results = {**{key: results[key] for key in first}, **results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 1 if any("error" in results[mode] for mode in modes) else 0


if __name__ == "__main__":
    sys.exit(main())
