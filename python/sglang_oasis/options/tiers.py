"""Where the KV lives (the two tiers) and where the server runs (CPU defaults, the CUDA gate)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_oasis.options import (
    DEFAULT_DEVICE_KV_TOKENS,
    MODES,
    OasisConfigError,
    check_choice,
    check_positive,
    option,
)


@dataclass(frozen=True)
class TierOptions:
    """The two tiers: the host tier holds every token's KV, the device tier the working sets."""

    mode: str = field(
        default="sparse",
        metadata={
            "help": "KV caching mode. 'sparse': full KV in the host tier, decode attends over per-KV-head "
            "working sets (the oasis attention backend). 'dense' serves plain SGLang through this entry "
            "point (the baseline for every comparison).",
            "choices": MODES,
        },
    )
    block_size: int = field(
        default=16,
        metadata={"help": "Tokens per KV block (sparse mode; becomes SGLang's --page-size)."},
    )
    host_kv_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Capacity of the host KV tier in tokens (sparse mode: SGLang's KV pool, i.e. "
            "--max-total-tokens, lives in host memory); start-up fails if the host RAM available "
            "cannot hold it. Default: --oasis-host-memory-fraction of the available host RAM over the "
            "model's KV bytes per token (draft model included), in whole blocks; on CPU with the CPU "
            "defaults at most --oasis-cpu-max-total-tokens.",
        },
    )
    host_memory_fraction: float = field(
        default=0.5,
        metadata={
            "help": "Share of the host RAM available at start-up that the host KV tier takes when "
            "neither --oasis-host-kv-tokens nor --max-total-tokens is given (sparse mode).",
        },
    )
    device_kv_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Device-tier budget, as the tokens of KV a dense pool would hold in the same bytes "
            "(sparse mode): the device tier gets N x the served model's KV bytes per token and holds in "
            "them the block summaries of the whole host tier, then whole requests' working sets (K + "
            "sink blocks per layer and KV head, with their index tensors). --max-running-requests is "
            "set to the requests that fit, unless given; a larger value is refused. Start-up fails when "
            f"not even one request fits beside the summaries. Default: {DEFAULT_DEVICE_KV_TOKENS} on CPU; on "
            "CUDA the GPU memory SGLang would have given its KV pool (which lives in host memory here).",
        },
    )

    def check_tiers(self) -> None:
        check_choice(self, "mode", MODES)
        check_positive(self, "block_size", "device_kv_tokens")
        if not 0 < self.host_memory_fraction <= 1:
            raise OasisConfigError(
                f"{option('host_memory_fraction')}: must be in (0, 1], got {self.host_memory_fraction}"
            )
        if self.host_kv_tokens is not None and self.host_kv_tokens < self.block_size:
            raise OasisConfigError(
                f"{option('host_kv_tokens')}: must hold at least one block ({self.block_size}), "
                f"got {self.host_kv_tokens}"
            )

    @property
    def device_tokens(self) -> int:
        """``--oasis-device-kv-tokens``, or its CPU default (on CUDA, unset, the budget is the GPU memory
        SGLang would have given its KV pool: ``DeviceTier.for_pool``)."""
        return DEFAULT_DEVICE_KV_TOKENS if self.device_kv_tokens is None else self.device_kv_tokens


@dataclass(frozen=True)
class PlatformOptions:
    """Where it runs: the CPU engine's defaults, and the CUDA path's gate."""

    cpu_defaults: bool = field(
        default=True,
        metadata={
            "help": "Without a GPU, serve on SGLang's CPU engine with CPU-friendly settings "
            "(--device cpu, --oasis-decode-step captured, --attention-backend torch_native, --max-total-tokens "
            "<oasis-cpu-max-total-tokens>, --sleep-on-idle, --dtype: the type this CPU computes "
            "fastest, float32 unless it has native bf16/fp16 matrix support; OMP_NUM_THREADS: the "
            "usable cores per model rank). Any of them given explicitly wins; 'false' applies none "
            "except the CPU engine itself.",
        },
    )
    cuda_untested: bool = field(
        default=False,
        metadata={
            "help": "Let sparse mode start on a CUDA machine, where it has never run: the oasis backend "
            "on CUDA tensors, the host tier in pinned host memory read in place by the GPU, and the decode "
            "step in SGLang's CUDA graphs (docs/gpu.md says what is written and what is verified). "
            "Single GPU, no --oasis-dense-layers. 'false': the launcher refuses sparse mode on a GPU.",
        },
    )
    cpu_max_total_tokens: int = field(
        default=32768,
        metadata={"help": "KV cache cap (tokens) used on CPU when --max-total-tokens is not given."},
    )

    def check_platform(self) -> None:
        check_positive(self, "cpu_max_total_tokens")
