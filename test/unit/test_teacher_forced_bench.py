"""benchmark/bench_teacher_forced.py on the tiny Llama: the dense setting agrees with itself exactly, K
covering every block agrees with dense at every forced step (KL ~ 0), and K = 1 of ~9 blocks does not."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from bench_teacher_forced import compare, documents, forced_logits, run, summarise


def test_compare_counts_agreement_and_kl() -> None:
    dense = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    same = compare(dense, dense)
    assert same["agree"] == [True, True] and same["kl"] == pytest.approx([0.0, 0.0], abs=1e-7)
    flipped = compare(dense, torch.tensor([[0.0, 2.0, 0.0], [0.0, 1.0, 0.0]]))
    assert flipped["agree"] == [False, True]
    p = dense[0].softmax(-1)
    want = float((p * (p.log() - torch.tensor([0.0, 2.0, 0.0]).log_softmax(-1))).sum())
    assert flipped["kl"][0] == pytest.approx(want, rel=1e-5) and flipped["kl"][1] == pytest.approx(
        0, abs=1e-7
    )
    summary = summarise([flipped])
    assert (
        summary["top1_agreement"] == 0.5 and summary["steps"] == 2 and summary["max_kl"] == flipped["kl"][0]
    )


def test_covering_k_agrees_with_dense_at_every_forced_step(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_oasis.evaluation.passkey import essays_text

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    docs = documents(tokenizer, essays_text(), 150, 2)
    assert [len(d) for d in docs] == [150, 150] and docs[0] != docs[1]
    settings = [("dense", 1), ("minmax", 64), ("minmax", 1), ("window", 1), ("target99", 1)]
    results = run(model, docs, 5, settings, 16)
    assert results["dense"][1]["top1_agreement"] == 1.0 and results["dense"][1]["max_kl"] == 0.0
    covering = results["minmax"][64]
    assert covering["steps"] == 10 and covering["top1_agreement"] == 1.0 and covering["max_kl"] < 1e-6
    for name in ("minmax", "window"):  # 1 of 9 full blocks: the distribution moves
        assert results[name][1]["mean_kl"] > 1e-4, name
    # The tiny random model attends nearly uniformly: a 0.99 target grows K = 1 (up to 4) and misses less.
    target = results["target99"][1]
    assert 1 < target["mean_top_k"] <= 4 and target["mean_kl"] < results["window"][1]["mean_kl"]
    assert "mean_top_k" not in results["window"][1]
    assert forced_logits(model, docs[0], [1, 2, 3]).shape == (2, model.config.vocab_size)
