"""Tiny random Qwen3 and Llama models with grouped-query attention, built in seconds for tests.

They reuse the default model's tokenizer (so prompts tokenise like real text) and are saved in float32
with a fixed seed: the same arguments always give the same weights.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_oasis.models.default_model import prepare_default_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny model; the defaults give 4 query heads sharing 2 KV heads (GQA ratio 2)."""

    arch: str = "qwen3"  # "qwen3" or "llama"
    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    max_position_embeddings: int = 8192
    seed: int = 0

    @property
    def name(self) -> str:
        return (
            f"tiny-{self.arch}-l{self.num_layers}-h{self.hidden_size}-q{self.num_heads}"
            f"-kv{self.num_kv_heads}-d{self.head_dim}-s{self.seed}"
        )


def build_tiny_model(spec: TinyModelSpec, out_root: Path) -> Path:
    """Write the model to ``out_root/<spec.name>`` (reused if already there) and return the path."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    target = out_root / spec.name
    if (target / ".complete").exists():
        return target
    tokenizer_dir = prepare_default_model()
    vocab_size = 49152  # SmolLM2's tokenizer
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
        dtype="float32",
    )
    config_classes: dict[str, Any] = {"qwen3": Qwen3Config, "llama": LlamaConfig}
    if spec.arch not in config_classes:
        raise ValueError(f"unknown tiny model architecture {spec.arch!r} (qwen3 or llama)")
    config = config_classes[spec.arch](**common)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, staging / name)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    (target / ".complete").touch()
    return target
