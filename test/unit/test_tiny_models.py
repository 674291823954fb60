"""The tiny random models built for tests: requested shapes, GQA, deterministic weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sglang_oasis_testing.tiny_models import TinyModelSpec, build_tiny_model


def test_tiny_llama_has_the_requested_gqa_shape(tiny_llama_dir: Path) -> None:
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_attention_heads"] == 6 and config["num_key_value_heads"] == 2  # GQA ratio 3
    assert (tiny_llama_dir / "tokenizer.json").exists()


def test_same_spec_gives_same_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    spec = TinyModelSpec(arch="qwen3", num_layers=1, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32)
    first = load_file(build_tiny_model(spec, tmp_path / "a") / "model.safetensors")
    second = load_file(build_tiny_model(spec, tmp_path / "b") / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_unknown_architecture_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model architecture"):
        build_tiny_model(TinyModelSpec(arch="gpt9"), tmp_path)
