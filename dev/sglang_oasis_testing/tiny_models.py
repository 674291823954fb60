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


def build_tiny_eagle3_head(spec: TinyModelSpec, out_root: Path, draft_vocab_size: int = 4096) -> Path:
    """A random EAGLE-3 draft head for the tiny model of ``spec``, in the layout SGLang's
    ``LlamaForCausalLMEagle3`` loads: one ``midlayer`` over [embedding, fc(3 target hidden states)], a
    draft vocabulary of the first ``draft_vocab_size`` token ids (``d2t`` offsets all zero), no embedding
    (SGLang shares the target's). Its drafts are poor; tests use it for the mechanics, not acceptance."""
    import json

    import torch
    from safetensors.torch import save_file

    target = out_root / f"{spec.name}-eagle3"
    if (target / ".complete").exists():
        return target
    vocab_size, hidden, inter = 49152, spec.hidden_size, spec.intermediate_size
    q, kv, dim = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.head_dim
    gen = torch.Generator().manual_seed(spec.seed + 1)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * (shape[-1] ** -0.5)

    weights = {
        "fc.weight": rand(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": rand(q, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": rand(kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": rand(hidden, q),
        "midlayer.mlp.gate_proj.weight": rand(inter, hidden),
        "midlayer.mlp.up_proj.weight": rand(inter, hidden),
        "midlayer.mlp.down_proj.weight": rand(hidden, inter),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(draft_vocab_size, hidden),
        "d2t": torch.zeros(draft_vocab_size, dtype=torch.int64),
        "t2d": torch.arange(vocab_size) < draft_vocab_size,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [0, 1, spec.num_layers - 2]
        },  # distinct for >= 4 layers
    }
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file(
        {name: tensor.contiguous() for name, tensor in weights.items()}, str(staging / "model.safetensors")
    )
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    (target / ".complete").touch()
    return target
