"""The host KV tier's size: how many tokens of full KV it holds when no size is given.

In sparse mode SGLang's KV pool is the host tier (``--max-total-tokens`` tokens, which
``--oasis-host-kv-tokens`` sets). Given neither, the launcher sizes it from the host RAM available at
start-up::

    tokens = floor(--oasis-host-memory-fraction x available RAM / KV bytes per token), whole blocks
    KV bytes per token = sum over the served model and its EAGLE-3 draft model (SGLang gives the draft
                         a pool of the same token count) of
                         layers x KV heads x head_dim x 2 (K and V) x bytes per element

Bytes per element follow SGLang's resolution of ``--dtype auto`` (the checkpoint's dtype; float32
checkpoints are served in float16, Gemma's in bfloat16) and ``--kv-cache-dtype`` (8-bit and 4-bit
formats are counted as one byte: an upper bound that leaves room for their scales).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import psutil

# Bytes per element of ``--dtype`` values and checkpoint dtypes (``torch_dtype`` / ``dtype`` strings).
_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float64": 8,
    "double": 8,
}
# ``--kv-cache-dtype`` values other than ``auto`` (the 4-bit formats are counted as a byte: room for scales).
_KV_CACHE_DTYPE_BYTES = {
    "bf16": 2,
    "bfloat16": 2,
    "fp8_e5m2": 1,
    "fp8_e4m3": 1,
    "mxfp8": 1,
    "nvfp4": 1,
    "fp4_mx_block16": 1,
}


class HostTierError(ValueError):
    """The host tier cannot be sized as asked; the message names the option."""


class KVFootprint(NamedTuple):
    """Per-token KV of one model: ``num_layers x num_kv_heads x head_dim`` elements for K and for V."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    element_bytes: int

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.element_bytes


def served_dtype_bytes(config: dict[str, Any], dtype: str = "auto") -> int:
    """Bytes per element of the weights and activations SGLang serves ``config``'s model in."""
    dtype = dtype.lower()
    if dtype != "auto":
        if dtype not in _DTYPE_BYTES:
            raise HostTierError(f"--dtype {dtype}: unknown dtype")
        return _DTYPE_BYTES[dtype]
    checkpoint = str(config.get("dtype") or config.get("torch_dtype") or "float32").replace("torch.", "")
    if checkpoint == "float32":
        return 2  # SGLang serves float32 checkpoints in float16 (Gemma's in bfloat16)
    return _DTYPE_BYTES.get(checkpoint, 4)


def model_config(model_dir: Path) -> dict[str, Any] | None:
    """The model directory's ``config.json``; None if it has none (a hub id, or another format)."""
    path = Path(model_dir) / "config.json"
    return dict(json.loads(path.read_text())) if path.is_file() else None


def kv_footprint(model_dir: Path, dtype: str = "auto", kv_cache_dtype: str = "auto") -> KVFootprint | None:
    """The model's per-token KV shape from its ``config.json``; None if the directory has none (a hub
    id, or a format this does not read): SGLang then sizes its pool itself."""
    config = model_config(model_dir)
    if config is None:
        return None
    text = config.get("text_config") or config  # multimodal checkpoints nest the language model's
    kv_cache_dtype = kv_cache_dtype.lower()
    if kv_cache_dtype in _KV_CACHE_DTYPE_BYTES:
        element_bytes = _KV_CACHE_DTYPE_BYTES[kv_cache_dtype]
    else:  # auto: the served dtype (an unknown --dtype raises here, naming it)
        element_bytes = served_dtype_bytes({**config, **text}, dtype)
    try:
        num_heads = int(text["num_attention_heads"])
        return KVFootprint(
            num_layers=int(text["num_hidden_layers"]),
            num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
            head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // num_heads),
            element_bytes=element_bytes,
        )
    except (KeyError, TypeError, ValueError):
        return None


def available_host_memory() -> int:
    """Bytes of host RAM available to new allocations now (``MemAvailable`` on Linux)."""
    return int(psutil.virtual_memory().available)


def default_host_kv_tokens(bytes_per_token: int, available: int, fraction: float, block_size: int) -> int:
    """Tokens of KV, in whole blocks, that ``fraction`` of ``available`` bytes holds."""
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
    tokens = int(fraction * available) // bytes_per_token
    tokens -= tokens % block_size
    if tokens < block_size:
        raise HostTierError(
            f"--oasis-host-memory-fraction {fraction}: {fraction} x {gib(available)} of available host "
            f"RAM holds no block of {block_size} tokens at {bytes_per_token} KV bytes per token; give "
            "--oasis-host-kv-tokens or a larger fraction"
        )
    return tokens


def check_fits(tokens: int, bytes_per_token: int, available: int, option: str) -> None:
    """Refuse a host tier larger than the host RAM available now."""
    needed = tokens * bytes_per_token
    if needed > available:
        raise HostTierError(
            f"{option} {tokens}: the host KV tier needs {gib(needed)} at {bytes_per_token} bytes per "
            f"token, more than the {gib(available)} of host RAM available"
        )


def gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
