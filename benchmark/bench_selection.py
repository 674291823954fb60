"""How good is the block selection itself? Passkey retrieval with the decode attention restricted, per
layer and KV head, to the K blocks a selector picks (plus the active block), offline with the HF model.

The model runs in transformers with an attention function that is dense for the prompt and, at each
decode step, attends only the selected blocks of each KV head (full blocks of ``--block-size`` tokens;
the partly filled last block is always attended). No fetch cap, no sinks: this measures the selector,
not the pipeline. Selectors (``--selectors``):

- ``dense``: every block (the reference);
- ``oracle``: the K blocks holding most of the predicting query's true attention (softmax over the full
  blocks, summed over the KV head's query heads): the best any selector can do at this K;
- ``minmax``: the runtime's Quest bound over min/max summaries (``sgl_kernel_oasis.score_blocks``);
- ``minmax-current``: the same, but selecting with the current step's own query (Quest's original,
  not predictive; the runtime selects one step ahead);
- ``minmax-sub<N>``: the bound over N min/max boxes per block (B/N tokens each), a block scoring its best
  box: finer summaries (N times their memory) at the same transfer granularity (at 4K, K = 32: N = 2, 4,
  8, 16 find 1, 3, 4, 4 of 5 keys; N = B scores each block by its best key exactly);
- ``minmax-center``: the same min/max summaries scored at the box's center, ``q . (kmin + kmax) / 2``
  (an estimate of the block's mean key's score rather than a bound on its best key);
- ``window``: the runtime's default (``--oasis-prefill-window``, ``--oasis-window-keep``): the first
  step's blocks are the top-K by the exact attention mass of the prompt's last ``--window-tokens``
  queries (known at prefill), the best ``ceil(--window-keep x K)`` of them stay selected at every step,
  and the rest follow the min/max bound of the previous query;
- ``lowrank<r>`` (e.g. ``lowrank16``): the oracle's mass with the logits computed in the top ``r``
  principal directions of the KV head's centered keys (Loki-style per-token low-rank keys; the basis
  fitted on the same keys, an optimistic calibration);
- ``codes<b>`` (e.g. ``codes2``; ``window-codes2``: the window's start and pins, then codes): the
  oracle's mass over keys known to b bits per channel within their block's min/max box (the min/max
  summaries plus b bits per token and channel; ``codes2`` is the runtime's ``--oasis-selector codes``,
  ``sgl_kernel_oasis.key_codes``). At 4K, K = 32: b = 1, 2, 4 hold 0.953, 0.985, 0.988 of the best K's
  mass on the suite's three samples (the oracle 0.988);
- ``<selector>-softmax`` (``minmax-softmax``, ``window-softmax``...): a GQA group's bounds combined as
  each query head's softmax over the blocks (scaled by ``1 / sqrt(dim)``), summed, instead of summed
  raw: one head's clear best block can win (at 4K, K = 32: the same hits and mass as the sum);
- ``<selector>-cap<N>`` and/or ``-ema<P>`` (e.g. ``window-cap2-ema50``): the working set lives across
  steps as the runtime's: at most N blocks per KV head enter per step (``--oasis-fetch-ratio`` x K), and
  each block's score is smoothed, P% of this step's plus the rest of its score before;
- ``target<P>`` (e.g. ``target90``): ``window`` under ``--oasis-recall-target 0.<P>`` with the default
  maximum of 4 x K: each layer's first K sized from the window's mass (the runtime's ``window_top_k``),
  then after every decode step the step's exact recall (worst KV head) doubles K below the target and
  halves it after 3 steps well above (the runtime samples every ``--oasis-recall-sample-every`` steps
  of a request; here every step). ``top_k_used`` records the K of every (step, layer).

Every selector but ``minmax-current`` selects step t+1's blocks with step t's query (the runtime's
timing; after the prompt, the last prompt token's query). The passkey cases are the test's (5 depths,
seeds 0-4, ~``--context-tokens`` tokens of essays, greedy, 12 new tokens).

    python benchmark/bench_selection.py --json selection.json [--context-tokens 4000] [--top-k 32]
        [--block-size 16] [--selectors dense,oracle,minmax,minmax-current,minmax-sub4,window] [--model-dir DIR]
        [--window-tokens 32] [--window-keep 0.25]

Besides the hits, ``held_vs_oracle``: at every (decode step, layer) that selects, the chosen blocks'
share of the step's own query's attention mass over the full blocks, over the share its best K blocks
hold (1: the current step's oracle), averaged.

Writes ``selectors.<name>.{hits, cases, answers, held_vs_oracle}``, ``settings``, ``date`` and ``machine``; prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from accuracy_tasks import TASKS
from bench_accuracy import chat_ids
from common import machine_info, print_table
from sgl_kernel_oasis import build_block_summaries, score_blocks, window_block_mass
from sglang_oasis.attention.recall_probe import window_top_k
from sglang_oasis.evaluation.passkey import essays_text, make_case

DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


class Residency:
    """The ``-cap<N>`` and ``-ema<P>`` modifiers: a working set that lives across steps, as the runtime's.
    ``cap``: at most N blocks per KV head and step enter it (best score first; blocks that filled up
    since the layer's last step enter free, as the runtime loads those from the active block), and blocks
    no longer selected leave least recently selected first, ties lowest id first (the runtime's order,
    ``WorkingSetPool.plan_selections``); ``ema``: a block's score is P% of this step's plus the
    rest of its smoothed score (a new block: its own). Neither: each step selects afresh."""

    def __init__(self, cap: int | None = None, ema: float | None = None) -> None:
        self.cap, self.ema = cap, ema
        self.resident: dict[int, torch.Tensor] = {}  # layer -> [kv_heads, K] block ids
        self.full: dict[int, int] = {}  # layer -> its full blocks at its last step
        self.last: dict[int, list[dict[int, int]]] = {}  # layer -> per KV head, block -> step last selected
        self.steps: dict[int, int] = {}  # layer -> its steps so far
        self.smoothed: dict[int, torch.Tensor] = {}  # layer -> [kv_heads, blocks]

    def reset(self) -> None:
        self.resident.clear()
        self.full.clear()
        self.smoothed.clear()
        self.last.clear()
        self.steps.clear()

    def smooth(self, layer: int, scores: torch.Tensor) -> torch.Tensor:
        if self.ema is None:
            return scores
        before = self.smoothed.get(layer)
        if before is not None:
            n = min(before.shape[1], scores.shape[1])
            scores = scores.clone()
            scores[:, :n] = self.ema * scores[:, :n] + (1 - self.ema) * before[:, :n]
        self.smoothed[layer] = scores
        return scores

    def admit(
        self, layer: int, chosen: torch.Tensor, full: int, selected: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``chosen`` ``[kv_heads, K]`` is the layer's working set (the first one: no cap); the blocks
        this step ``selected`` (default: all of ``chosen``) are stamped as selected now."""
        self.resident[layer], self.full[layer] = chosen, full
        step = self.steps[layer] = self.steps.get(layer, -1) + 1
        last = self.last.setdefault(layer, [{} for _ in range(chosen.shape[0])])
        for head, blocks in enumerate((chosen if selected is None else selected).tolist()):
            last[head].update(dict.fromkeys(blocks, step))
        return chosen

    def step(self, layer: int, wanted: torch.Tensor, scores: torch.Tensor, full: int) -> torch.Tensor:
        """The layer's working set after a step that selected ``wanted`` ``[kv_heads, K]`` by ``scores``
        ``[kv_heads, blocks]``, of ``full`` full blocks."""
        if self.cap is None or layer not in self.resident:
            return self.admit(layer, wanted, full)
        fresh_from, rows = self.full[layer], []
        for head, resident in enumerate(self.resident[layer].tolist()):
            want, score, last = set(wanted[head].tolist()), scores[head].tolist(), self.last[layer][head]
            incoming = sorted((b for b in want if b not in resident), key=lambda b: -score[b])
            fresh = [b for b in incoming if b >= fresh_from]
            take = fresh + [b for b in incoming if b < fresh_from][: self.cap]
            unwanted = sorted((b for b in resident if b not in want), key=lambda b: (last[b], b))
            leaving = set(unwanted[: len(take)])
            rows.append([b for b in resident if b not in leaving] + take)
            for block in leaving:
                del last[block]
        return self.admit(layer, torch.tensor(rows), full, selected=wanted)


class Selector:
    """The attention function's state: which selector, K, B, and each layer's predicting query."""

    def __init__(
        self, name: str, top_k: int, block_size: int, window_tokens: int = 32, window_keep: float = 0.25
    ) -> None:
        modifiers = cast(re.Match[str], re.fullmatch(r"(.*?)(?:-cap(\d+))?(?:-ema(\d+))?", name))
        name, cap, ema = modifiers.groups()  # the selector itself, and its Residency modifiers
        self.residency = Residency(None if cap is None else int(cap), None if ema is None else int(ema) / 100)
        self.name, self.top_k, self.block = name, top_k, block_size
        self.window_tokens, self.window_blocks = window_tokens, math.ceil(window_keep * top_k)
        self.target = int(name.removeprefix("target")) / 100 if name.startswith("target") else 0.0
        self.max_top_k = 4 * top_k
        self.layer_k: dict[int, int] = {}  # ``target<P>``: layer -> its current K
        self.above: dict[int, int] = {}  # ``target<P>``: layer -> steps in a row well above the target
        self.top_k_used: list[int] = []  # ``target<P>``: the K of every (decode step, layer)
        self.previous: dict[int, torch.Tensor] = {}  # layer -> [q_heads, dim] last query
        self.first: dict[int, torch.Tensor] = {}  # ``window``: layer -> [kv_heads, K] first blocks
        self.pinned: dict[int, torch.Tensor] = {}  # ``window``: layer -> [kv_heads, P] kept blocks
        # (step, layer) where K < the full blocks: the chosen blocks' share of the step's own query's
        # attention mass over the full blocks, over the share the best K blocks hold (1: the oracle's)
        self.held: list[float] = []

    def reset(self) -> None:
        self.residency.reset()
        self.previous.clear()
        self.first.clear()
        self.pinned.clear()
        self.layer_k.clear()
        self.above.clear()

    def scores(self, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[kv_heads, blocks]`` scores of the full blocks of ``keys`` ``[kv_heads, tokens, dim]`` for
        ``query`` ``[q_heads, dim]``."""
        kv_heads, tokens, dim = keys.shape
        blocks = tokens // self.block
        by_token = keys.transpose(0, 1)  # [tokens, kv_heads, dim]
        if self.name == "oracle":
            group = query.shape[0] // kv_heads
            logits = torch.einsum("hgd,htd->hgt", query.float().view(kv_heads, group, dim), keys.float())
            mass = (logits / math.sqrt(dim)).softmax(-1).view(kv_heads, group, blocks, self.block)
            return mass.sum(dim=(1, 3))
        codes = re.search(r"codes(\d+)(?:x(\d+))?$", self.name)
        if codes:
            candidates = None if codes.group(2) is None else int(codes.group(2))
            return self.coded_mass(query, keys, int(codes.group(1)), candidates)
        if self.name.startswith("lowrank"):
            return self.low_rank_mass(query, keys, int(self.name.removeprefix("lowrank")))
        if self.name == "minmax-center":
            kmin, kmax = build_block_summaries(by_token, self.block)
            group = query.shape[0] // kv_heads
            center = (kmin.float() + kmax.float()).permute(1, 2, 0) / 2  # [kv_heads, dim, blocks]
            return torch.matmul(query.float().view(kv_heads, group, dim), center).sum(dim=1)
        # min/max selectors: a block scores its best box (one box per block but for ``minmax-sub<N>``)
        base = self.name.removesuffix("-softmax")
        boxes = int(base.removeprefix("minmax-sub")) if base.startswith("minmax-sub") else 1
        kmin, kmax = build_block_summaries(by_token, self.block // boxes)
        if self.name.endswith("-softmax"):  # each query head's bounds as a softmax over the boxes, summed
            group = query.shape[0] // kv_heads
            q = query.float().view(kv_heads, group, 1, dim)
            lo, hi = kmin.float().transpose(0, 1)[:, None], kmax.float().transpose(0, 1)[:, None]
            bound = torch.maximum(q * lo, q * hi).sum(-1) / math.sqrt(dim)  # [kv_heads, group, boxes]
            box_scores = bound.softmax(-1).sum(dim=1)
        else:
            box_scores = score_blocks(query[None], kmin, kmax)[0]  # [kv_heads, blocks * boxes]
        return box_scores.view(kv_heads, blocks, boxes).amax(-1)

    def coded_mass(
        self, query: torch.Tensor, keys: torch.Tensor, bits: int, candidates: int | None = None
    ) -> torch.Tensor:
        """``codes<b>``: the oracle's mass over keys known only to ``bits`` bits per channel within their
        block's min/max box (each key's channel rounded to one of 2^b levels from the block's min to its
        max): the min/max summaries plus b bits per token and channel. ``codes<b>x<m>``: only each KV
        head's ``m x K`` best blocks by the min/max bound are scored so (the softmax over them alone),
        the others score 0."""
        kv_heads, tokens, dim = keys.shape
        blocks, levels = tokens // self.block, 2**bits - 1
        k = keys.float().view(kv_heads, blocks, self.block, dim)
        lo, hi = k.amin(2, keepdim=True), k.amax(2, keepdim=True)
        span = (hi - lo).clamp_min(1e-12)
        coded = lo + ((k - lo) / span * levels).round() / levels * span
        group = query.shape[0] // kv_heads
        q = query.float().view(kv_heads, group, dim)
        logits = torch.einsum("hgd,htd->hgt", q, coded.view(kv_heads, tokens, dim)) / math.sqrt(dim)
        if candidates is not None and candidates * self.top_k < blocks:
            bound = score_blocks(query[None], lo[:, :, 0].transpose(0, 1), hi[:, :, 0].transpose(0, 1))[0]
            kept = torch.zeros((kv_heads, blocks), dtype=torch.bool)
            kept.scatter_(1, bound.topk(candidates * self.top_k, dim=-1).indices, True)
            logits = logits.masked_fill(~kept.repeat_interleave(self.block, dim=1)[:, None], float("-inf"))
        mass = logits.softmax(-1).view(kv_heads, group, blocks, self.block)
        return mass.sum(dim=(1, 3))

    def low_rank_mass(self, query: torch.Tensor, keys: torch.Tensor, rank: int) -> torch.Tensor:
        """``lowrank<r>``: the oracle's mass with every logit computed in the top ``rank`` principal
        directions of the KV head's centered keys (Loki-style; the mean key's logit is the same for every
        key, so it leaves the softmax unchanged). The basis is fitted on these very keys, at every step:
        an optimistic calibration (a basis fitted on other text would do no better, as a rule)."""
        kv_heads, tokens, dim = keys.shape
        centered = keys.float() - keys.float().mean(dim=1, keepdim=True)
        basis = torch.linalg.svd(centered, full_matrices=False).Vh[:, :rank]  # [kv_heads, rank, dim]
        group = query.shape[0] // kv_heads
        q = torch.einsum("hgd,hrd->hgr", query.float().view(kv_heads, group, dim), basis)
        logits = torch.einsum("hgr,htr->hgt", q, torch.einsum("htd,hrd->htr", centered, basis))
        mass = (logits / math.sqrt(dim)).softmax(-1).view(kv_heads, group, tokens // self.block, self.block)
        return mass.sum(dim=(1, 3))

    def hold_target(
        self,
        layer: int,
        top_k: int,
        query: torch.Tensor,
        keys: torch.Tensor,
        visible: torch.Tensor,
        scale: float,
    ) -> None:
        """``target<P>``: the runtime's rule (``RecallProbe.hold_target``) on this step's exact recall."""
        worst = float(recall_of(query, keys, visible, scale).min())
        if worst < self.target:
            self.layer_k[layer] = min(self.max_top_k, 2 * top_k)
            self.above.pop(layer, None)
        elif worst >= 1 - (1 - self.target) / 4 and top_k > self.top_k:
            self.above[layer] = self.above.get(layer, 0) + 1
            if self.above[layer] >= 3:
                self.layer_k[layer], self.above[layer] = max(self.top_k, top_k // 2), 0
        else:
            self.above.pop(layer, None)

    def attend(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> Any:  # fmt: skip
        """transformers attention function: ``query [1, q_heads, q_len, dim]``, ``key``/``value``
        ``[1, kv_heads, tokens, dim]`` (the cache included); returns ``([1, q_len, q_heads, dim], None)``."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layer = module.layer_idx
        q_heads, kv_heads, tokens = query.shape[1], key.shape[1], key.shape[2]
        if self.name == "dense" or query.shape[2] > 1:  # the prompt attends densely
            self.previous[layer] = query[0, :, -1]
            windowed = self.name.startswith("window") or self.target
            if windowed and tokens // self.block > self.top_k:
                rows = min(self.window_tokens, query.shape[2])
                mass = window_block_mass(query[0, :, -rows:].transpose(0, 1), key[0].transpose(0, 1),
                                         self.block, scaling or query.shape[-1] ** -0.5)  # fmt: skip
                first_k = self.top_k
                if self.target:  # the runtime's sizing, from the window's share of the attention
                    share = mass / (rows * (q_heads // kv_heads))
                    full_now = torch.tensor([tokens // self.block])
                    first_k = int(
                        window_top_k(share[None], full_now, 0, self.top_k, self.max_top_k, self.target)[0]
                    )
                    self.layer_k[layer] = first_k
                self.first[layer] = mass.topk(min(first_k, mass.shape[-1]), dim=-1).indices
                self.pinned[layer] = mass.topk(self.window_blocks, dim=-1).indices
            return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                          dropout=dropout, **kwargs)  # fmt: skip
        now = query[0, :, 0]
        predicting = now if self.name == "minmax-current" else self.previous[layer]
        self.previous[layer] = now
        full = (tokens - 1) // self.block  # full blocks before the current token's
        visible = torch.ones((kv_heads, tokens), dtype=torch.bool)
        top_k = self.layer_k.get(layer, self.top_k)
        if self.target:
            self.top_k_used.append(top_k)
        if full > top_k:
            if layer in self.first:  # ``window``: the first step after the prompt
                chosen = self.residency.admit(layer, self.first.pop(layer), full)
            else:
                scores = self.residency.smooth(layer, self.scores(predicting, key[0, :, : full * self.block]))
                if layer in self.pinned:
                    scores = scores.scatter(1, self.pinned[layer], float("inf"))
                chosen = self.residency.step(layer, scores.topk(top_k, dim=-1).indices, scores, full)
            self.held.append(held_share(now, key[0, :, : full * self.block], chosen, top_k, self.block))
            in_blocks = torch.zeros((kv_heads, full), dtype=torch.bool).scatter_(1, chosen, True)
            visible[:, : full * self.block] = in_blocks.repeat_interleave(self.block, dim=1)
        group = q_heads // kv_heads
        if self.target:
            self.hold_target(layer, top_k, now, key[0], visible, scaling or query.shape[-1] ** -0.5)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(group, 1), value.repeat_interleave(group, 1),
            attn_mask=visible.repeat_interleave(group, 0)[None, :, None, :], scale=scaling,
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None


def held_share(
    query: torch.Tensor, keys: torch.Tensor, chosen: torch.Tensor, top_k: int, block: int
) -> float:
    """The attention mass of ``query`` ``[q_heads, dim]`` over the full blocks of ``keys`` ``[kv_heads,
    tokens, dim]`` that the ``chosen`` ``[kv_heads, K]`` blocks hold, over what the best ``top_k`` blocks
    hold (per KV head: the group's mean softmax; averaged over the KV heads)."""
    kv_heads, tokens, dim = keys.shape
    q = query.float().view(kv_heads, -1, dim)
    mass = (torch.einsum("hgd,htd->hgt", q, keys.float()) / math.sqrt(dim)).softmax(-1).mean(dim=1)
    per_block = mass.view(kv_heads, tokens // block, block).sum(-1)
    best = per_block.topk(top_k, dim=-1).values.sum(-1)
    return float((per_block.gather(1, chosen).sum(-1) / best).mean())


def recall_of(query: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """``[kv_heads]``: the exact attention mass of ``query`` ``[q_heads, dim]`` over ``keys``
    ``[kv_heads, tokens, dim]`` that lies on ``visible`` ``[kv_heads, tokens]`` (mean over each group)."""
    kv_heads, _, dim = keys.shape
    q = query.float().view(kv_heads, -1, dim)
    mass = (torch.einsum("hgd,htd->hgt", q, keys.float()) * scale).softmax(-1).mean(dim=1)
    return (mass * visible).sum(-1)


@dataclass(frozen=True)
class SuiteCase:
    """A ``bench_accuracy`` sample (``--suite-samples``) as a case: a hit when its task scores the answer 1."""

    sample: Any
    messages: list[dict[str, str]]
    prompt_tokens: int

    @property
    def max_tokens(self) -> int:
        return int(self.sample.max_tokens)

    def hit(self, answer: str) -> bool:
        return TASKS[self.sample.task].score(self.sample, answer) == 1.0


def suite_cases(tokenizer: Any, names: str) -> list[SuiteCase]:
    """``task@context`` samples of bench_accuracy's suite (seed 0), comma-separated."""

    ids = chat_ids(tokenizer)
    cases = []
    for name in names.split(","):
        task, _, context = name.partition("@")
        sample = TASKS[task].generate(0, int(context), lambda messages: len(ids(messages)))
        cases.append(SuiteCase(sample, list(sample.prompt_messages), sample.prompt_tokens))
    return cases


def run_selector(model: Any, tokenizer: Any, cases: list[Any], selector: Selector, new_tokens: int) -> dict:
    from transformers import AttentionInterface

    AttentionInterface.register("oasis_selection", selector.attend)
    model.set_attn_implementation("oasis_selection")
    answers = []
    for case in cases:
        ids = tokenizer.apply_chat_template(case.messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]  # fmt: skip
        selector.reset()
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=getattr(case, "max_tokens", new_tokens), do_sample=False)
        answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    hits = [case.hit(answer) for case, answer in zip(cases, answers, strict=True)]
    held = sum(selector.held) / len(selector.held) if selector.held else 1.0
    return {"hits": sum(hits), "cases": hits, "answers": answers, "held_vs_oracle": held}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--context-tokens", type=int, default=4000)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--selectors", default="dense,oracle,minmax,minmax-current,minmax-sub4,window")
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--window-tokens", type=int, default=32, help="the window selector's prompt tokens")
    parser.add_argument(
        "--window-keep", type=float, default=0.25, help="the window selector's kept share of K"
    )
    parser.add_argument(
        "--model-dir", type=Path, default=None, help="default: SmolLM2-135M-Instruct (30 layers)"
    )
    parser.add_argument(
        "--suite-samples",
        default="",
        help="instead of passkey: bench_accuracy samples, e.g. niah_single_uuid@2000",
    )
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_oasis.models.default_model import prepare_default_model

    model_dir = args.model_dir or prepare_default_model(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = essays_text()
    cases: list[Any] = [
        make_case(tokenizer, args.context_tokens, depth, seed=i, text=text) for i, depth in enumerate(DEPTHS)
    ]
    labels = " ".join(map(str, DEPTHS))
    if args.suite_samples:
        cases, labels = suite_cases(tokenizer, args.suite_samples), args.suite_samples.replace(",", " ")
    results: dict[str, Any] = {
        "settings": {"context_tokens": args.context_tokens, "top_k": args.top_k, "block_size": args.block_size,
                     "window_tokens": args.window_tokens, "window_keep": args.window_keep,
                     "prompt_tokens": [case.prompt_tokens for case in cases], "depths": list(DEPTHS),
                     "suite_samples": args.suite_samples, "model": str(model_dir)},
        "selectors": {},
    }  # fmt: skip
    for name in args.selectors.split(","):
        started = time.monotonic()
        result = run_selector(
            model,
            tokenizer,
            cases,
            Selector(name, args.top_k, args.block_size, args.window_tokens, args.window_keep),
            args.new_tokens,
        )
        results["selectors"][name] = {**result, "seconds": round(time.monotonic() - started, 1)}
        print(
            f"[bench_selection] {name}: {result['hits']}/{len(cases)}, "
            f"held {result['held_vs_oracle']:.3f} of the oracle's mass",
            flush=True,
        )
    results["date"] = time.strftime("%Y-%m-%d")
    results["machine"] = machine_info()
    rows = [
        [
            name,
            f"{r['hits']}/{len(cases)}",
            " ".join("x" if hit else "." for hit in r["cases"]),
            f"{r['held_vs_oracle']:.3f}",
        ]
        for name, r in results["selectors"].items()
    ]
    print_table(["selector", "hits", f"by case {labels}", "mass vs oracle"], rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
