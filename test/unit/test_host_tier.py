"""The host tier's default size from the available host RAM, and the launcher's use of it (no server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sglang_oasis.config import OasisConfig
from sglang_oasis.launcher.argv import LaunchError, option_value
from sglang_oasis.launcher.sparse_mode import host_tier_args, sparse_mode_args
from sglang_oasis.memory.host_tier import (
    HostTierError,
    KVFootprint,
    check_fits,
    default_host_kv_tokens,
    kv_footprint,
    served_dtype_bytes,
)

GIB = 2**30


def write_config(directory: Path, **config: object) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    """4 layers x 2 KV heads x head_dim 64 (from hidden_size / heads), a float32 checkpoint."""
    return write_config(
        tmp_path / "tiny", num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        hidden_size=256, torch_dtype="float32",
    )  # fmt: skip


def test_default_model_footprint(default_model_dir: Path) -> None:
    """SmolLM2-135M: 30 layers, 3 KV heads of 64; its float32 checkpoint is served in float16."""
    assert kv_footprint(default_model_dir) == KVFootprint(30, 3, 64, 2)
    assert kv_footprint(default_model_dir).bytes_per_token == 30 * 3 * 64 * 2 * 2  # type: ignore[union-attr]
    assert kv_footprint(default_model_dir, dtype="float32").bytes_per_token == 46_080  # type: ignore[union-attr]
    assert kv_footprint(default_model_dir, kv_cache_dtype="fp8_e4m3").element_bytes == 1  # type: ignore[union-attr]


def test_footprint_reads_head_dim_nesting_and_gives_up_without_a_shape(
    tmp_path: Path, tiny_dir: Path
) -> None:
    assert kv_footprint(tiny_dir) == KVFootprint(4, 2, 64, 2)
    explicit = write_config(
        tmp_path / "qwen", num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=1,
        hidden_size=256, head_dim=128, torch_dtype="bfloat16",
    )  # fmt: skip
    assert kv_footprint(explicit) == KVFootprint(3, 1, 128, 2)
    no_gqa = write_config(tmp_path / "mha", num_hidden_layers=2, num_attention_heads=4, hidden_size=128)
    assert kv_footprint(no_gqa, dtype="float32") == KVFootprint(2, 4, 32, 4)
    nested = write_config(
        tmp_path / "vlm", torch_dtype="bfloat16",
        text_config={"num_hidden_layers": 5, "num_attention_heads": 2, "hidden_size": 64},
    )  # fmt: skip
    assert kv_footprint(nested) == KVFootprint(5, 2, 32, 2)
    assert kv_footprint(tmp_path / "absent") is None
    assert kv_footprint(write_config(tmp_path / "odd", model_type="mamba")) is None


@pytest.mark.parametrize("dtype", ["auto", "float32", "float16", "half", "bfloat16"])
@pytest.mark.parametrize(
    "checkpoint",
    [
        {"torch_dtype": "float32"},
        {"torch_dtype": "bfloat16"},
        {"dtype": "float16"},
        {},
        {"torch_dtype": "float32", "model_type": "gemma2"},
    ],
    ids=["fp32", "bf16", "fp16", "none", "gemma-fp32"],
)
def test_dtype_rule_is_sglangs(checkpoint: dict, dtype: str) -> None:
    """The element size follows SGLang's own resolution of --dtype (fails if a new version changes it)."""
    from sglang.srt.configs.model_config import _get_and_verify_dtype

    assert served_dtype_bytes(checkpoint, dtype) == _get_and_verify_dtype(checkpoint, dtype).itemsize


def test_default_tokens_are_whole_blocks_of_the_share_of_ram() -> None:
    assert default_host_kv_tokens(1000, 10**6, 0.5, 16) == 496  # 500 tokens, 31 whole blocks
    assert default_host_kv_tokens(1000, 10**6, 1.0, 16) == 992
    with pytest.raises(HostTierError, match="--oasis-host-memory-fraction"):
        default_host_kv_tokens(1000, 10**4, 0.5, 16)  # 5 tokens: not one block


def test_a_size_larger_than_the_available_ram_is_refused() -> None:
    check_fits(1000, 1000, 10**6, "--oasis-host-kv-tokens")
    with pytest.raises(HostTierError, match=r"--oasis-host-kv-tokens 1001: .* more than the"):
        check_fits(1001, 1000, 10**6, "--oasis-host-kv-tokens")


def test_launcher_sizes_the_tier_from_ram_capped_on_cpu(tiny_dir: Path, tmp_path: Path) -> None:
    per_token = 4 * 2 * 64 * 2 * 2  # 2,048 bytes
    argv = ["--model-path", str(tiny_dir)]
    small = 16 * 2**20  # 16 MiB: half of it holds 4,096 tokens, under the CPU cap
    assert option_value(host_tier_args(argv, OasisConfig(), True, small), "--max-total-tokens") == "4096"
    config = OasisConfig(host_memory_fraction=0.25)
    assert option_value(host_tier_args(argv, config, True, small), "--max-total-tokens") == "2048"
    # Plenty of RAM: the CPU defaults' cap, unless they are off (or on a GPU).
    assert option_value(host_tier_args(argv, OasisConfig(), True, GIB), "--max-total-tokens") == "32768"
    uncapped = host_tier_args(argv, OasisConfig(cpu_defaults=False), True, GIB)
    assert option_value(uncapped, "--max-total-tokens") == str(GIB // 2 // per_token)
    assert option_value(host_tier_args(argv, OasisConfig(), False, GIB), "--max-total-tokens") == "262144"
    # An EAGLE-3 draft model's pool holds as many tokens: its KV bytes count too (1 layer here).
    draft = write_config(
        tmp_path / "draft", num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, hidden_size=256
    )
    with_draft = host_tier_args(
        [*argv, "--speculative-draft-model-path", str(draft)], OasisConfig(), True, small
    )
    assert option_value(with_draft, "--max-total-tokens") == str(
        8 * 2**20 // (per_token + per_token // 4) // 16 * 16
    )


def test_launcher_leaves_given_sizes_and_unknown_models_alone(tiny_dir: Path, tmp_path: Path) -> None:
    argv = ["--model-path", str(tiny_dir)]
    assert host_tier_args([*argv, "--max-total-tokens", "4096"], OasisConfig(), True, GIB) == []
    assert host_tier_args([*argv, "--mem-fraction-static", "0.5"], OasisConfig(), True, GIB) == []
    assert host_tier_args(["--model-path", str(tmp_path / "hub-id")], OasisConfig(), True, GIB) == []
    with pytest.raises(LaunchError, match="--max-total-tokens 4096: the host KV tier needs"):
        host_tier_args([*argv, "--max-total-tokens", "4096"], OasisConfig(), True, 2**20)
    config = OasisConfig(host_kv_tokens=4096)
    explicit = [*argv, *sparse_mode_args(argv, config)]
    with pytest.raises(LaunchError, match="--oasis-host-kv-tokens 4096"):
        host_tier_args(explicit, config, True, 2**20)
    with pytest.raises(LaunchError, match="--oasis-host-memory-fraction"):
        host_tier_args(argv, OasisConfig(host_memory_fraction=0.001), True, 2**20)
