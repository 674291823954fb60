"""benchmark/bench_selection.py's selectors and restricted attention on constructed keys (exact expected
choices and outputs), and on the tiny Llama: with K covering every block each selector decodes exactly
what dense attention decodes."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from bench_selection import DEPTHS, Selector, run_selector

B, DIM, BLOCKS = 4, 8, 5


def keys_with_aligned_blocks() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[1 KV head, 5 blocks * 4 + 1 tokens, 8]`` small random keys; block 1's tokens align with query
    ``a``, block 3's with query ``b`` (2 query heads, the same direction in both)."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, BLOCKS * B + 1, DIM, generator=gen) * 0.1
    a, b = torch.zeros(DIM), torch.zeros(DIM)
    a[0], b[1] = 1.0, 1.0
    keys[0, 1 * B : 2 * B] += 3 * a
    keys[0, 3 * B : 4 * B] += 3 * b
    return keys, torch.stack([a, a]) * 2, torch.stack([b, b]) * 2


@pytest.mark.parametrize("name", ["oracle", "minmax", "minmax-current", "minmax-sub2", "minmax-center"])
def test_each_selector_ranks_the_aligned_block_first(name: str) -> None:
    keys, a, b = keys_with_aligned_blocks()
    selector = Selector(name, top_k=1, block_size=B)
    full = keys[:, : BLOCKS * B]
    assert int(selector.scores(a, full).argmax()) == 1
    assert int(selector.scores(b, full).argmax()) == 3


def test_center_scores_each_block_at_its_boxs_center() -> None:
    """``minmax-center``: per KV head, the group's queries dotted with (min + max) / 2 of each block's
    keys, summed over the group (2 KV heads of 3 query heads, 3 blocks of 4, random)."""
    gen = torch.Generator().manual_seed(2)
    keys, query = torch.randn(2, 12, DIM, generator=gen), torch.randn(6, DIM, generator=gen)
    boxes = keys.view(2, 3, B, DIM)
    center = (boxes.amin(dim=2) + boxes.amax(dim=2)) / 2  # [kv_heads, blocks, dim]
    expected = torch.einsum("hgd,hbd->hb", query.view(2, 3, DIM), center)
    torch.testing.assert_close(Selector("minmax-center", 1, B).scores(query, keys), expected)


@pytest.mark.parametrize(("name", "block"), [("minmax", 1), ("oracle", 1), ("minmax-current", 3)])
def test_decode_attends_the_chosen_block_and_the_tail_only(name: str, block: int) -> None:
    """The step before predicted with ``a`` (block 1); this step's own query is ``b`` (block 3): the
    predictive selectors attend block 1, Quest's original attends block 3; the current token's partly
    filled block (here its one token) is always attended."""
    keys, a, b = keys_with_aligned_blocks()
    values = torch.randn(keys.shape, generator=torch.Generator().manual_seed(1))
    selector = Selector(name, top_k=1, block_size=B)
    selector.previous[0] = a
    query = b[None, :, None, :]  # [1, q_heads, 1, dim]
    out, _ = selector.attend(SimpleNamespace(layer_idx=0), query, keys[None], values[None], None, scaling=0.5)
    seen = [*range(block * B, (block + 1) * B), BLOCKS * B]
    weights = (b[:, None, :] @ keys[0, seen].T[None] * 0.5).softmax(-1)  # [2, 1, 5]
    expected = (weights @ values[0, seen])[:, 0]  # [q_heads, dim]
    torch.testing.assert_close(out[0, 0], expected)
    assert torch.equal(selector.previous[0], b), "this step's query predicts the next step"


def test_covering_k_decodes_exactly_like_dense(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_oasis.evaluation.passkey import essays_text, make_case

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    text = essays_text()
    cases = [make_case(tokenizer, 150, depth, seed=i, text=text) for i, depth in enumerate(DEPTHS[:2])]
    dense = run_selector(model, tokenizer, cases, Selector("dense", 64, 16), 6)["answers"]
    for name in ("oracle", "minmax", "minmax-current", "minmax-sub4", "minmax-center"):
        assert run_selector(model, tokenizer, cases, Selector(name, 64, 16), 6)["answers"] == dense, name


def test_window_starts_from_the_prompts_attention_and_keeps_its_best_block() -> None:
    """``window``: the prompt's last queries point at block 3, the last prompt token's own query at
    block 1: the first decode step attends block 3 (the window's choice, not the bound of the previous
    query), and with the whole K kept the next step still does though its predicting query is ``a``."""
    keys, a, b = keys_with_aligned_blocks()
    values = torch.randn(keys.shape, generator=torch.Generator().manual_seed(1))
    selector = Selector("window", top_k=1, block_size=B, window_tokens=2, window_keep=1.0)
    module = SimpleNamespace(layer_idx=0, num_key_value_groups=2, is_causal=True, training=False)
    prompt = torch.stack([b, b, a], dim=1)[None]  # [1, q_heads, 3 prompt tokens, dim]: window = (b, a)
    prompt[0, :, 1] *= 5  # b dominates the window's mass
    selector.attend(module, prompt, keys[None, :, :-1], values[None, :, :-1], None, scaling=0.5)
    assert selector.first[0].tolist() == [[3]] and selector.pinned[0].tolist() == [[3]]
    for _ in range(2):
        out, _ = selector.attend(module, a[None, :, None, :], keys[None], values[None], None, scaling=0.5)
        seen = [*range(3 * B, 4 * B), BLOCKS * B]
        weights = (a[:, None, :] @ keys[0, seen].T[None] * 0.5).softmax(-1)
        torch.testing.assert_close(out[0, 0], (weights @ values[0, seen])[:, 0])
