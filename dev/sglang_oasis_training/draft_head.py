"""The EAGLE-3 draft head as a plain torch module, computing what SGLang 0.5.23's
``LlamaForCausalLMEagle3`` computes, with a loader and saver for SGLang's checkpoint layout.

One draft step at sequence position p (SGLang's draft positions are the target's)::

    aux_p   = concat(target hidden states entering layers a+1, for a in aux_layer_ids)   [3H]
    h_p     = fc(aux_p)                             (step 2 and later: the previous step's output)
    x       = concat(input_layernorm(embed(token_{p+1})), hidden_norm(h_p))              [2H]
    r       = h_p + o_proj(attention(x; RoPE at p; the draft's own KV of earlier positions))
    out_p   = r + mlp(post_attention_layernorm(r))   (pre-norm; fed back as h at the next step)
    logits  = lm_head(norm(out_p))                  over the draft vocabulary
    token   = draft_id + d2t[draft_id]              (target vocabulary)

The token embedding is the target's (SGLang shares it with the draft), so it is never saved here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from sglang_oasis.models.default_model import DRAFT_DIR

DEFAULT_DRAFT_DIR = DRAFT_DIR  # the head shipped for the default model
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class DraftHeadConfig:
    hidden_size: int
    """Width of the head and of the target's hidden states."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    """Width of the midlayer's gated MLP."""
    vocab_size: int
    """Target vocabulary (size of the shared embedding and of ``t2d``)."""
    draft_vocab_size: int
    """Tokens the head can propose (rows of ``lm_head`` and of ``d2t``)."""
    aux_layer_ids: tuple[int, ...]
    """SGLang's ``eagle_aux_hidden_state_layer_ids``: id a captures the input of target layer a+1,
    i.e. HF ``hidden_states[a + 1]``."""
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError("num_heads * head_dim must equal hidden_size")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError("draft_vocab_size must be in 1..vocab_size")
        if not self.aux_layer_ids:
            raise ValueError("aux_layer_ids must not be empty")

    @property
    def hf_hidden_state_indices(self) -> list[int]:
        """Indices into an HF model's ``output_hidden_states`` tuple that make up the aux input."""
        return [a + 1 for a in self.aux_layer_ids]

    @classmethod
    def from_target(
        cls, target: dict[str, Any], draft_vocab_size: int, aux_layer_ids: tuple[int, ...] | None = None
    ) -> DraftHeadConfig:
        """Shapes from a Llama target's HF ``config.json``; aux layers default to SGLang's
        ``[2, L // 2, L - 3]`` capture points, written as ids ``[1, L // 2 - 1, L - 4]``."""
        layers = int(target["num_hidden_layers"])
        if aux_layer_ids is None:
            aux_layer_ids = (1, layers // 2 - 1, layers - 4)
        return cls(
            hidden_size=int(target["hidden_size"]),
            num_heads=int(target["num_attention_heads"]),
            num_kv_heads=int(target.get("num_key_value_heads", target["num_attention_heads"])),
            head_dim=int(target.get("head_dim") or target["hidden_size"] // target["num_attention_heads"]),
            intermediate_size=int(target["intermediate_size"]),
            vocab_size=int(target["vocab_size"]),
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=tuple(aux_layer_ids),
            rms_norm_eps=float(target.get("rms_norm_eps", 1e-5)),
            rope_theta=_rope_theta(target),
            max_position_embeddings=int(target.get("max_position_embeddings", 8192)),
        )

    @classmethod
    def from_sglang_json(cls, config: dict[str, Any]) -> DraftHeadConfig:
        return cls(
            hidden_size=int(config["hidden_size"]),
            num_heads=int(config["num_attention_heads"]),
            num_kv_heads=int(config["num_key_value_heads"]),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]),
            intermediate_size=int(config["intermediate_size"]),
            vocab_size=int(config["vocab_size"]),
            draft_vocab_size=int(config["draft_vocab_size"]),
            aux_layer_ids=tuple(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
            rms_norm_eps=float(config["rms_norm_eps"]),
            rope_theta=_rope_theta(config),
            max_position_embeddings=int(config.get("max_position_embeddings", 8192)),
        )

    def to_sglang_json(self, torch_dtype: str = "float32") -> dict[str, Any]:
        """The ``config.json`` SGLang's EAGLE3 loader reads (``LlamaForCausalLMEagle3``).

        ``torch_dtype`` should be the target's: SGLang resolves ``--dtype auto`` per config (float32 ->
        float16), and the draft must end up in the target's dtype since it consumes its hidden states.
        The stored weights may be narrower; the loader casts them."""
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            # The lm_head is the head's own (draft vocabulary); the embedding comes from the target.
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 2,
            "dtype": torch_dtype,
            "torch_dtype": torch_dtype,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "use_aux_hidden_state": True,
            },
        }


def _rope_theta(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class DraftKV(NamedTuple):
    """The draft layer's keys and values of every position so far, ``[batch, kv_heads, seq, head_dim]``
    (keys after RoPE)."""

    keys: torch.Tensor
    values: torch.Tensor


class DraftStep(NamedTuple):
    logits: torch.Tensor
    """``[batch, seq, draft_vocab_size]``."""
    hidden: torch.Tensor
    """Pre-norm output ``[batch, seq, hidden]``: the next draft step's ``hidden`` input."""
    kv: DraftKV
    """Past plus this call's keys and values."""


class DraftAttention(nn.Module):
    def __init__(self, config: DraftHeadConfig) -> None:
        super().__init__()
        width = 2 * config.hidden_size  # concat(embedding, hidden)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        self.q_proj = nn.Linear(width, config.num_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(width, config.num_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(width, config.num_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: DraftKV | None,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, DraftKV]:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if past is not None:
            k = torch.cat([past.keys, k], dim=2)
            v = torch.cat([past.values, v], dim=2)
        if mask is None:
            mask = causal_mask(seq, k.shape[2], x.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        out = out.transpose(1, 2).reshape(batch, seq, self.num_heads * self.head_dim)
        return self.o_proj(out), DraftKV(k, v)


class DraftMLP(nn.Module):
    def __init__(self, config: DraftHeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftMidlayer(nn.Module):
    """SGLang's EAGLE-3 input decoder layer (checkpoint prefix ``midlayer``)."""

    def __init__(self, config: DraftHeadConfig) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: DraftKV | None,
        mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, DraftKV]:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn, kv = self.self_attn(x, cos, sin, past, mask)
        residual = hidden + attn
        return residual + self.mlp(self.post_attention_layernorm(residual)), kv


class Eagle3DraftHead(nn.Module):
    """State-dict names are SGLang's checkpoint names (``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
    ``d2t``, ``t2d``); the target's embedding is a non-persistent buffer set by ``set_embedding``."""

    def __init__(self, config: DraftHeadConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(len(config.aux_layer_ids) * hidden, hidden, bias=False)
        self.midlayer = DraftMidlayer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.d2t: torch.Tensor
        self.t2d: torch.Tensor
        self.embed_tokens: torch.Tensor
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.register_buffer("embed_tokens", torch.zeros(0, hidden), persistent=False)

    def set_embedding(self, weight: torch.Tensor) -> None:
        """Share the target's token embedding ``[vocab_size, hidden]`` (not copied)."""
        if tuple(weight.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"embedding shape {tuple(weight.shape)} does not match the head's config")
        self.embed_tokens = weight

    def set_draft_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Fill ``d2t`` (offset target id - draft id) and ``t2d`` from the sorted target ids of the
        draft vocabulary."""
        ids = draft_to_target.to(torch.long)
        if ids.shape != (self.config.draft_vocab_size,) or not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("draft vocabulary must be draft_vocab_size strictly increasing target ids")
        self.d2t.copy_(ids - torch.arange(ids.shape[0]))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        past: DraftKV | None = None,
        mask: torch.Tensor | None = None,
    ) -> DraftStep:
        """One draft step over ``seq`` new positions.

        input_ids: ``[batch, seq]`` target-vocabulary tokens (the token after each hidden state).
        hidden: ``[batch, seq, A * hidden]`` target aux states (fused by ``fc``) or ``[batch, seq,
        hidden]`` outputs of the previous draft step. positions: ``[seq]`` or ``[batch, seq]``.
        mask: boolean ``[seq, past + seq]`` (True = attend); default causal after all of ``past``.
        """
        if self.embed_tokens.numel() == 0:
            raise RuntimeError("call set_embedding(target embedding) first")
        if hidden.shape[-1] != self.config.hidden_size:
            hidden = self.fc(hidden)
        embeds = F.embedding(input_ids, self.embed_tokens).to(hidden.dtype)
        cos, sin = self.rope(positions, hidden.dtype)
        out, kv = self.midlayer(embeds, hidden, cos, sin, past, mask)
        return DraftStep(self.lm_head(self.norm(out)), out, kv)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama RoPE cos and sin ``[(batch,) 1, seq, head_dim]`` (NeoX layout: halves rotated together),
    computed in float32 whatever ``dtype``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
    angles = positions.to(torch.float32)[..., None] * (1.0 / theta**exponents)
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(-3)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def causal_mask(queries: int, keys: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[queries, keys]`` True where query i (the last ``queries`` of ``keys`` positions) may attend."""
    past = keys - queries
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(diagonal=past)


def aux_hidden_states(
    hidden_states: tuple[torch.Tensor, ...] | list[torch.Tensor], config: DraftHeadConfig
) -> torch.Tensor:
    """The head's input from an HF target's ``output_hidden_states``: ``[..., A * hidden]``."""
    return torch.cat([hidden_states[i] for i in config.hf_hidden_state_indices], dim=-1)


def save_draft_head(
    head: Eagle3DraftHead, out_dir: Path, dtype: torch.dtype = torch.bfloat16, config_dtype: str = "float32"
) -> Path:
    """Write ``config.json`` (declaring ``config_dtype``, the target's) and ``model.safetensors``
    (floating weights stored in ``dtype``; no embedding)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: (t.to(dtype) if t.is_floating_point() else t).contiguous().cpu()
        for name, t in head.state_dict().items()
    }
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(
        json.dumps(head.config.to_sglang_json(config_dtype), indent=2) + "\n"
    )
    return out_dir / WEIGHTS_FILE


def load_draft_head(
    path: Path = DEFAULT_DRAFT_DIR,
    target_embedding: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> Eagle3DraftHead:
    """Load a head saved in SGLang's EAGLE-3 layout; pass the target's embedding to run it."""
    from safetensors.torch import load_file

    config = DraftHeadConfig.from_sglang_json(json.loads((Path(path) / "config.json").read_text()))
    head = Eagle3DraftHead(config)
    head.load_state_dict(load_file(str(Path(path) / WEIGHTS_FILE)), strict=True)
    head = head.to(dtype)  # floating tensors only; d2t and t2d keep their dtypes
    if target_embedding is not None:
        head.set_embedding(target_embedding)
    return head.eval()
