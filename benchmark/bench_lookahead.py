"""Lookahead accuracy: how well each source of a step-(t+1) query, available at step t, predicts the
blocks step t+1's real query selects. Offline, SmolLM2 in float32, greedy continuation of essay windows.

At decode step t (token x_t at position t, cache holding positions 0..t) the server selects, per layer
and KV head, the top-K of the N = (t+1) // B full blocks by min/max summary score (GQA group summed;
``sgl_kernel_oasis.score_blocks_batched`` + ``select_top_blocks``) for step t+1. The TRUE set is that
selection made with step t+1's real query. The sources predict it from a query available at step t:

    previous  step t's real query (what the sparse backend does today)
    eagle3    the query of the draft token d_t the trained EAGLE-3 head proposes, computed as row 1 of a
              two-row pass [x_t, d_t] (row 1 at position t+1 attends the cache and row 0)
    ngram     same, with d_t from an n-gram match over the context (SGLang NGRAM-style, n = 3..1)
    oracle    same, with the true next token x_{t+1} as the draft

Reported per layer and overall: agreement |predicted & true| / K, and attention mass captured: the share
of step t+1's softmax attention mass over the full blocks that falls in the predicted blocks (per query
head, averaged), next to the same for the true top-K (``true``); both also split by whether the draft
token was right. Attention here is dense, so a right draft's query equals step t+1's real one (the
oracle agrees exactly); in the server the draft row attends only the working set.

    python benchmark/bench_lookahead.py --json lookahead.json [--contexts 4 --context-tokens 2048
        --steps 100 --top-k 32 --block-size 16 --num-layers 30 --plot lookahead.png]

``--num-layers`` limits the analysed layers (the first N); the model always runs all its layers, since
the draft head reads layers 2, 15 and 27.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from sgl_kernel_oasis import build_block_summaries, score_blocks_batched, select_top_blocks
from sglang_oasis_training.draft_head import (
    DEFAULT_DRAFT_DIR,
    Eagle3DraftHead,
    apply_rope,
    load_draft_head,
    rope_cos_sin,
)

SOURCES = ("previous", "eagle3", "ngram", "oracle")


# ------------------------------------------------------------------------------------------ pure pieces


def ngram_propose(tokens: list[int], max_n: int = 3, min_n: int = 1) -> int:
    """The token that followed the most recent earlier occurrence of the last n tokens (n from
    ``max_n`` down to ``min_n``); the last token itself when nothing matches."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == pattern:
                return tokens[start + n]
    return tokens[-1]


def select_blocks(queries: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, top_k: int) -> torch.Tensor:
    """The server's selection for each query row: ``queries`` ``[rows, q_heads, dim]``, summaries
    ``[blocks, kv_heads, dim]`` -> bool ``[rows, kv_heads, blocks]``."""
    rows = queries.shape[0]
    scores = score_blocks_batched(queries, kmin.expand(rows, -1, -1, -1), kmax.expand(rows, -1, -1, -1))
    return select_top_blocks(scores, top_k)


def agreement(predicted: torch.Tensor, true: torch.Tensor, top_k: int) -> torch.Tensor:
    """``|predicted & true| / K`` per leading index (over the last, block, dimension)."""
    return (predicted & true).sum(-1).float() / top_k


def block_attention_mass(query: torch.Tensor, keys: torch.Tensor, block_size: int) -> torch.Tensor:
    """Softmax attention of ``query`` ``[q_heads, dim]`` over ``keys`` ``[blocks * B, kv_heads, dim]``
    (full blocks only), summed per block: ``[q_heads, blocks]``, each row summing to 1."""
    q_heads, dim = query.shape
    tokens, kv_heads, _ = keys.shape
    group = q_heads // kv_heads
    logits = torch.einsum("kgd,tkd->kgt", query.float().view(kv_heads, group, dim), keys.float()) * dim**-0.5
    probs = logits.softmax(-1).reshape(q_heads, tokens // block_size, block_size)
    return probs.sum(-1)


def mass_captured(block_mass: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Share of attention mass in the selected blocks, per KV head (query heads of a group averaged):
    ``block_mass`` ``[q_heads, blocks]``, ``selected`` bool ``[..., kv_heads, blocks]`` -> ``[..., kv_heads]``."""
    q_heads, blocks = block_mass.shape
    kv_heads = selected.shape[-2]
    per_group = block_mass.view(kv_heads, q_heads // kv_heads, blocks)
    return (per_group * selected[..., :, None, :].float()).sum(-1).mean(-1)


# ------------------------------------------------------------------------------------------- the target


class CachedLlama:
    """A batch-1 HF Llama run layer by layer over a preallocated KV cache (slot = position), returning
    each layer's post-RoPE queries and the draft head's aux hidden states. Rows written past the
    committed length are scratch (draft rows): the next call overwrites them."""

    def __init__(self, model: Any, max_len: int, aux_indices: list[int]) -> None:
        config = model.config
        self.model = model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.theta = float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
        self.aux_indices = aux_indices
        layers = config.num_hidden_layers
        self.keys = torch.zeros(layers, max_len, self.kv_heads, self.head_dim)
        self.values = torch.zeros(layers, max_len, self.kv_heads, self.head_dim)

    @torch.no_grad()
    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
        """Rows ``ids`` ``[T]`` at ``positions`` go to slots ``start..start+T``; ``mask`` ``[T, start+T]``.

        Returns logits ``[T, vocab]``, per-layer queries ``[T, q_heads, dim]``, aux ``[T, A * hidden]``
        and every layer's input hidden states (for checks).
        """
        seq, end = ids.shape[0], start + ids.shape[0]
        x = self.model.model.embed_tokens(ids)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta, x.dtype)
        queries, hidden = [], []
        for i, layer in enumerate(self.model.model.layers):
            hidden.append(x)
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = apply_rope(attn.q_proj(h).view(seq, self.heads, self.head_dim).transpose(0, 1), cos, sin)
            k = apply_rope(attn.k_proj(h).view(seq, self.kv_heads, self.head_dim).transpose(0, 1), cos, sin)
            self.keys[i, start:end] = k.transpose(0, 1)
            self.values[i, start:end] = attn.v_proj(h).view(seq, self.kv_heads, self.head_dim)
            keys = self.keys[i, :end].transpose(0, 1)
            values = self.values[i, :end].transpose(0, 1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = x + attn.o_proj(out.transpose(0, 1).reshape(seq, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            queries.append(q.transpose(0, 1))
        hidden.append(x)
        logits = self.model.lm_head(self.model.model.norm(x))
        aux = torch.cat([hidden[i] for i in self.aux_indices], dim=-1)
        return logits, queries, aux, hidden


def check_against_hf(model: Any, runner: CachedLlama, length: int = 40) -> float:
    """Largest difference of every layer's hidden states and the logits against HF's own forward on a
    short sequence (queries feed the attention, so equal outputs check the queries and RoPE)."""
    ids = torch.arange(100, 100 + length) * 7 % model.config.vocab_size
    with torch.no_grad():
        reference = model(ids[None], output_hidden_states=True)
    logits, _, _, hidden = runner.forward(ids, torch.arange(length), causal(length, length), 0)
    diffs = [float((a - b[0]).abs().max()) for a, b in zip(hidden, reference.hidden_states, strict=False)]
    # HF's last hidden state is after the final norm; compare logits instead
    return max(*diffs[:-1], float((logits - reference.logits[0]).abs().max()))


def causal(queries: int, keys: int) -> torch.Tensor:
    return torch.ones(queries, keys, dtype=torch.bool).tril(diagonal=keys - queries)


# ------------------------------------------------------------------------------------------ measurement


@dataclass
class Tally:
    agreement: list[list[float]] = field(default_factory=list)  # per layer, per (step, kv head)
    mass: list[list[float]] = field(default_factory=list)
    draft_hits: int = 0
    drafts: int = 0
    by_draft: dict[str, list[float]] = field(default_factory=dict)  # "agreement/right", "mass/wrong"...

    def ensure(self, layers: int) -> None:
        while len(self.agreement) < layers:
            self.agreement.append([])
            self.mass.append([])

    def summary(self) -> dict[str, Any]:
        per_layer = [sum(a) / max(1, len(a)) for a in self.agreement]
        per_layer_mass = [sum(m) / max(1, len(m)) for m in self.mass]
        out: dict[str, Any] = {
            "mean_agreement": sum(per_layer) / max(1, len(per_layer)),
            "per_layer": per_layer,
            "mean_mass": sum(per_layer_mass) / max(1, len(per_layer_mass)),
            "per_layer_mass": per_layer_mass,
        }
        if self.drafts:
            out["draft_accuracy"] = self.draft_hits / self.drafts
        for key, values in sorted(self.by_draft.items()):
            metric, verdict = key.split("/")
            out[f"mean_{metric}_{verdict}_draft"] = sum(values) / max(1, len(values))
        return out


def run_context(
    runner: CachedLlama,
    head: Eagle3DraftHead | None,
    context: list[int],
    steps: int,
    top_k: int,
    block_size: int,
    num_layers: int,
    tallies: dict[str, Tally],
) -> None:
    n = len(context)
    ids = torch.tensor(context)
    logits, _, aux, _ = runner.forward(ids, torch.arange(n), causal(n, n), 0)
    tokens = [*context, int(logits[-1].argmax())]
    draft = None
    draft_kv = None
    if head is not None:  # the head over the context: position p reads h_p and token p+1
        step = head(torch.tensor(tokens[1:])[None], aux[None], torch.arange(n))
        draft, draft_kv = int(head.draft_to_target(step.logits[0, -1].argmax())), step.kv
    pending: dict[str, torch.Tensor] | None = None  # step t's predictions, judged at step t+1
    pending_blocks = 0
    for t in range(n, n + steps + 1):
        # row 0: the real token x_t, committed
        logits, queries, aux, _ = runner.forward(
            torch.tensor([tokens[t]]), torch.tensor([t]), torch.ones(1, t + 1, dtype=torch.bool), t
        )
        tokens.append(int(logits[0].argmax()))  # x_{t+1}
        if pending is not None:
            judge(runner, queries, pending, pending_blocks, top_k, block_size, num_layers, tallies)
        if t == n + steps:
            break
        # draft rows at position t+1, each over the cache (0..t) and itself only
        drafts = {"ngram": ngram_propose(tokens[: t + 1]), "oracle": tokens[t + 1]}
        if draft is not None:
            drafts["eagle3"] = draft
        names = list(drafts)
        mask = torch.cat(
            [torch.ones(len(names), t + 1, dtype=torch.bool), torch.eye(len(names), dtype=torch.bool)], 1
        )
        _, draft_queries, _, _ = runner.forward(
            torch.tensor([drafts[k] for k in names]), torch.full((len(names),), t + 1), mask, t + 1
        )
        pending = {}
        for name in names:
            right = drafts[name] == tokens[t + 1]
            tallies[name].draft_hits += int(right)
            tallies[name].drafts += 1
            pending[f"{name}/verdict"] = torch.tensor(right)
        pending_blocks = (t + 1) // block_size
        for layer in range(num_layers):
            rows = [queries[layer][0]] + [draft_queries[layer][names.index(k)] for k in names]
            pending_layer = select_from(runner, layer, torch.stack(rows), pending_blocks, block_size, top_k)
            for r, name in enumerate(["previous", *names]):
                pending[f"{name}/{layer}"] = pending_layer[r]
        if head is not None and draft_kv is not None:  # the head's next proposal: h_t with token x_{t+1}
            step = head(torch.tensor([[tokens[t + 1]]]), aux[None], torch.tensor([t]), past=draft_kv)
            draft, draft_kv = int(head.draft_to_target(step.logits[0, -1].argmax())), step.kv


def select_from(
    runner: CachedLlama, layer: int, queries: torch.Tensor, blocks: int, block_size: int, top_k: int
) -> torch.Tensor:
    kmin, kmax = build_block_summaries(runner.keys[layer, : blocks * block_size], block_size)
    return select_blocks(queries, kmin, kmax, top_k)


def judge(
    runner: CachedLlama,
    queries: list[torch.Tensor],
    pending: dict[str, torch.Tensor],
    blocks: int,
    top_k: int,
    block_size: int,
    num_layers: int,
    tallies: dict[str, Tally],
) -> None:
    if blocks <= top_k:
        return  # the server keeps every block: nothing to predict
    for layer in range(num_layers):
        query = queries[layer][0]
        true = select_from(runner, layer, query[None], blocks, block_size, top_k)[0]
        mass = block_attention_mass(query, runner.keys[layer, : blocks * block_size], block_size)
        tallies["true"].ensure(num_layers)
        tallies["true"].agreement[layer] += agreement(true, true, top_k).tolist()
        tallies["true"].mass[layer] += mass_captured(mass, true).tolist()
        for name, tally in tallies.items():
            key = f"{name}/{layer}"
            if key not in pending:
                continue
            tally.ensure(num_layers)
            agreed = agreement(pending[key], true, top_k).tolist()
            captured = mass_captured(mass, pending[key]).tolist()
            tally.agreement[layer] += agreed
            tally.mass[layer] += captured
            verdict = pending.get(f"{name}/verdict")
            if verdict is not None:
                word = "right" if bool(verdict) else "wrong"
                tally.by_draft.setdefault(f"agreement/{word}", []).extend(agreed)
                tally.by_draft.setdefault(f"mass/{word}", []).extend(captured)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--contexts", type=int, default=4)
    parser.add_argument("--context-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=100, help="decode steps per context")
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--num-layers", type=int, default=None, help="analyse the first N layers (default all)"
    )
    parser.add_argument("--draft-dir", type=Path, default=DEFAULT_DRAFT_DIR)
    parser.add_argument("--plot", type=Path, default=None, help="optional PNG (needs matplotlib)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)

    from transformers import AutoModelForCausalLM

    from common import essay_prompts, print_table
    from sglang_oasis.models.default_model import prepare_default_model

    started = time.monotonic()
    model_dir = prepare_default_model()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = model.config.num_hidden_layers
    num_layers = min(args.num_layers or layers, layers)
    head = None
    if (args.draft_dir / "model.safetensors").exists():
        head = load_draft_head(args.draft_dir, model.get_input_embeddings().weight.detach())
    else:
        print(f"no draft head in {args.draft_dir}: skipping the eagle3 source")
    aux = head.config.hf_hidden_state_indices if head is not None else [0]
    runner = CachedLlama(model, args.context_tokens + args.steps + 8, aux)
    error = check_against_hf(model, runner)
    print(f"own forward vs HF (hidden states of every layer, logits): max |diff| {error:.2e}")
    if error > 1e-3:
        raise RuntimeError(f"the query-capturing forward disagrees with HF's by {error}")

    contexts = essay_prompts(model_dir, args.contexts, args.context_tokens)
    tallies = {name: Tally() for name in ("true", *SOURCES)}
    with torch.no_grad():
        for i, context in enumerate(contexts):
            run_context(runner, head, context, args.steps, args.top_k, args.block_size, num_layers, tallies)
            print(f"context {i + 1}/{len(contexts)} done ({time.monotonic() - started:.0f} s)", flush=True)

    results = {name: tally.summary() for name, tally in tallies.items() if tally.agreement}

    def cell(r: dict[str, Any], key: str) -> str:
        return f"{r[key]:.3f}" if key in r else "-"

    rows = [
        [name, *(cell(r, k) for k in ("mean_agreement", "mean_mass", "draft_accuracy"))]
        + [cell(r, f"mean_{m}_{v}_draft") for m in ("agreement", "mass") for v in ("right", "wrong")]
        for name, r in results.items()
    ]
    headers = ["source", "agreement", "mass captured", "draft accuracy"]
    headers += ["agr | right", "agr | wrong", "mass | right", "mass | wrong"]
    print_table(headers, rows)
    layer_rows = [
        [layer, *(results[name]["per_layer"][layer] for name in results if name != "true")]
        for layer in range(num_layers)
    ]
    print_table(["layer", *(f"{name} agr" for name in results if name != "true")], layer_rows)
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "settings": {
            "model": model_dir.name,
            "contexts": args.contexts,
            "context_tokens": args.context_tokens,
            "steps_per_context": args.steps,
            "decode_steps": args.contexts * args.steps,
            "top_k": args.top_k,
            "block_size": args.block_size,
            "num_layers": num_layers,
            "draft_head": str(args.draft_dir) if head is not None else None,
            "dtype": "float32",
            "seconds": round(time.monotonic() - started, 1),
        },
        "sources": results,
    }
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.json}")
    if args.plot is not None:
        plot(results, num_layers, args.plot)


def plot(results: dict[str, Any], num_layers: int, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        if name != "true":
            axes[0].plot(range(num_layers), r["per_layer"], label=name)
        axes[1].plot(range(num_layers), r["per_layer_mass"], label=name)
    axes[0].set(xlabel="layer", ylabel="agreement with the true top-K", title="block agreement")
    axes[1].set(xlabel="layer", ylabel="attention mass captured", title="attention mass")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
