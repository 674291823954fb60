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

from bench_selection import DEPTHS, Selector, held_share, run_selector

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


@pytest.mark.parametrize(
    "name", ["oracle", "minmax", "minmax-current", "minmax-sub2", "minmax-center", "minmax-softmax"]
)
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


def test_softmax_aggregation_lets_one_query_head_choose() -> None:
    """One-token blocks (the bound is ``q . k``): block 0 is query head 0's clear best and head 1's worst,
    block 2 both heads' second best. Summed bounds tie blocks 0 and 1 and pick block 2; each head's
    softmax over the blocks, summed, picks block 0 (head 0 puts almost all its mass there)."""
    scale = 2**0.5  # sqrt(dim): the bounds are divided by it before the softmax
    keys = torch.tensor([[[10 * scale, 0.0], [0.0, 0.0], [0.0, 2 * scale]]])  # [1 KV head, 3 tokens, 2]
    query = torch.tensor([[1.0, 1.0], [-1.0, 1.0]])  # 2 query heads, one group
    assert int(Selector("minmax", 1, 1).scores(query, keys).argmax()) == 2
    softmax = Selector("minmax-softmax", 1, 1).scores(query, keys)[0]
    logits = torch.tensor([[10.0, 0.0, 2.0], [-10.0, 0.0, 2.0]])
    torch.testing.assert_close(softmax, logits.softmax(-1).sum(0))
    assert int(softmax.argmax()) == 0


def test_held_share_is_the_chosen_blocks_mass_over_the_best_k() -> None:
    """2 KV heads of 2 query heads, 4 blocks of 2 tokens, random: the best K blocks hold 1; any other
    choice its mass over theirs, per KV head (the group's mean softmax), averaged over the heads."""
    gen = torch.Generator().manual_seed(3)
    keys, query = torch.randn(2, 8, 4, generator=gen) * 2, torch.randn(4, 4, generator=gen)
    logits = torch.einsum("hgd,htd->hgt", query.view(2, 2, 4), keys) / 2  # sqrt(dim) = 2
    per_block = logits.softmax(-1).mean(1).view(2, 4, 2).sum(-1)  # [kv_heads, blocks]
    best = per_block.topk(2, dim=-1)
    assert held_share(query, keys, best.indices, 2, 2) == pytest.approx(1.0)
    worst = per_block.topk(2, dim=-1, largest=False)
    expected = float((worst.values.sum(-1) / best.values.sum(-1)).mean())
    assert held_share(query, keys, worst.indices, 2, 2) == pytest.approx(expected)


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


def test_low_rank_at_full_rank_is_the_oracle_and_low_ranks_differ() -> None:
    """``lowrank<r>`` with every direction kept computes the exact logits up to a per-head constant (the
    mean key's), so its masses are the oracle's; with one direction they are not."""
    gen = torch.Generator().manual_seed(4)
    keys, query = torch.randn(2, 24, DIM, generator=gen), torch.randn(4, DIM, generator=gen) * 3
    oracle = Selector("oracle", 2, B).scores(query, keys)
    torch.testing.assert_close(Selector(f"lowrank{DIM}", 2, B).scores(query, keys), oracle)
    assert not torch.allclose(Selector("lowrank1", 2, B).scores(query, keys), oracle, atol=1e-3)


def test_suite_samples_are_cases_hit_when_their_task_scores_one(tiny_llama_dir: Path) -> None:
    """``--suite-samples``: a bench_accuracy sample becomes a case with its prompt, its answer budget and
    its task's scoring (the expected value: a hit; another: not)."""
    from transformers import AutoTokenizer

    from bench_selection import suite_cases

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    (case,) = suite_cases(tokenizer, "niah_single_number@400")
    assert case.sample.task == "niah_single_number" and case.max_tokens == case.sample.max_tokens
    assert 0 < case.prompt_tokens <= 400 and case.messages == list(case.sample.prompt_messages)
    assert case.hit(f"The number is {case.sample.expected[0]}.")
    assert not case.hit("The number is 1.")


def test_capped_residency_enters_the_best_blocks_and_evicts_the_least_recently_selected() -> None:
    """``-cap1``: of two wanted blocks not resident, only the better enters, and of the residents no
    longer wanted the one selected least recently leaves (the runtime's order, whatever the scores); a
    block that filled up since the last step enters free."""
    from bench_selection import Residency

    residency = Residency(cap=1)
    residency.admit(0, torch.tensor([[0, 1, 2]]), full=10)

    def scores(**by_block: float) -> torch.Tensor:
        out = torch.zeros(1, 10)
        for block, score in by_block.items():
            out[0, int(block.removeprefix("b"))] = score
        return out

    # 5 and 6 wanted, only 5 (the better) enters; 1 and 2 both last selected at the start: 1 leaves
    step1 = residency.step(0, torch.tensor([[5, 6, 0]]), scores(b5=0.9, b6=0.8, b0=0.7), full=10)
    assert step1.tolist() == [[0, 2, 5]]
    # 7 enters; of 0 (selected a step ago, scoring lower) and 2 (selected at the start), 2 leaves
    step2 = residency.step(
        0, torch.tensor([[5, 7, 8]]), scores(b7=0.9, b5=0.85, b8=0.8, b2=0.7, b0=0.1), full=10
    )
    assert step2.tolist() == [[0, 5, 7]]
    residency = Residency(cap=1)
    residency.admit(0, torch.tensor([[1, 2]]), full=4)
    filled = torch.tensor([[0.1, 0.2, 0.3, 0.5, 0.7]])  # block 4 filled up since the last step
    assert sorted(residency.step(0, torch.tensor([[3, 4]]), filled, full=5)[0].tolist()) == [3, 4]
    assert Selector("window-cap2-ema50", 4, B).residency.cap == 2
    assert Selector("window-cap2-ema50", 4, B).name == "window"


def test_smoothed_scores_mix_this_step_with_the_last() -> None:
    """``-ema50``: a block's score is half this step's plus half its smoothed score before; a block new
    this step keeps its own."""
    from bench_selection import Residency

    residency = Residency(ema=0.5)
    first = residency.smooth(0, torch.tensor([[1.0, 3.0]]))
    assert first.tolist() == [[1.0, 3.0]]
    assert residency.smooth(0, torch.tensor([[3.0, 1.0, 5.0]])).tolist() == [[2.0, 2.0, 5.0]]


def test_codes2_scores_what_the_runtimes_codes_selector_scores() -> None:
    """``codes2`` screens ``--oasis-selector codes``: the same masses as the runtime's op
    (``sgl_kernel_oasis.key_codes.coded_block_mass``); with 8 bits it is all but the oracle."""
    from sgl_kernel_oasis.key_codes import coded_block_mass, encode_key_codes

    gen = torch.Generator().manual_seed(4)
    keys, query = torch.randn(2, BLOCKS * B, DIM, generator=gen), torch.randn(6, DIM, generator=gen)
    by_page = keys.view(2, BLOCKS, B, DIM).permute(1, 2, 0, 3)  # [pages, B, kv_heads, D]
    kmin, kmax = by_page.amin(dim=1), by_page.amax(dim=1)
    runtime = coded_block_mass(
        query[None],
        kmin,
        kmax,
        encode_key_codes(by_page, kmin, kmax),
        torch.arange(BLOCKS)[None],
        torch.tensor([BLOCKS]),
        DIM**-0.5,
    )[0]
    torch.testing.assert_close(Selector("codes2", 2, B).scores(query, keys), runtime, rtol=1e-5, atol=1e-6)
    oracle = Selector("oracle", 2, B).scores(query, keys)
    torch.testing.assert_close(Selector("codes8", 2, B).scores(query, keys), oracle, rtol=0, atol=0.02)
    assert not torch.allclose(Selector("codes1", 2, B).scores(query, keys), oracle, atol=0.02)
