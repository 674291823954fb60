"""The host tier on a CUDA machine: SGLang's KV pool with its buffers in page-locked host memory.

In sparse mode SGLang's KV pool is the host tier. SGLang sizes that pool from GPU memory and allocates it
on the GPU; this pool class (which hook 15 hands SGLang's configurator for the target model) allocates
every layer's K and V in host memory instead, page-locked in place (``pinned_host.page_locked``: exactly
its bytes), and gives SGLang CUDA views of it (``pinned_host.cuda_view``), so SGLang's own kernels (the
prefill writing a prompt's KV) and the decode step's copies read and write the host tier in place, and
none of it takes GPU memory. Its size is host RAM's (hook 16); the GPU memory SGLang would have given it
goes to the device tier (``gpu_kv_bytes``, ``DeviceTier.for_pool``).

Layout as SGLang's own pool (``MHATokenToKVPool._create_buffers_normal``, NHD): per layer one allocation,
K and V its two halves, each ``[size + page_size, KV heads, head_dim]``. Never run on a GPU; on CPU
``test/unit/test_fake_cuda.py`` builds it on a fake CUDA device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from sglang_oasis.memory import host_tier, pinned_host

if TYPE_CHECKING:
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
    from sglang.srt.mem_cache.memory_pool import KVCache

    from sglang_oasis.options.tiers import TierOptions

logger = logging.getLogger(__name__)


class PinnedHostKVPool(MHATokenToKVPool):
    """SGLang's ``MHATokenToKVPool`` over page-locked host memory (see the module)."""

    # the GPU bytes SGLang's profiling would have given this pool (hook 16), None: not profiled
    gpu_kv_bytes: int | None = None

    def _create_buffers_normal(self) -> None:
        if self.kv_cache_layout != "nhd" or self.is_quantized_kv_cache:
            raise ValueError(
                f"oasis host tier: SGLang's {self.kv_cache_layout} KV layout (or a quantized KV cache) is not "
                "served in sparse mode; unset SGLANG_USE_HND_KVCACHE / --kv-cache-dtype"
            )
        k_shape, v_shape = self._kv_buffer_shapes()
        if k_shape != v_shape:
            raise ValueError(f"oasis host tier: K {k_shape} and V {v_shape} rows differ (MLA is not served)")
        self.host_buffers = [
            pinned_host.page_locked((2, *k_shape), self.store_dtype) for _ in range(self.layer_num)
        ]
        views = [pinned_host.cuda_view(host) for host in self.host_buffers]
        self.k_buffer = [view[0] for view in views]  # type: ignore[assignment]  # SGLang declares None
        self.v_buffer = [view[1] for view in views]  # type: ignore[assignment]

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the pool holds."""
        return sum(t.nbytes for t in self.host_buffers)

    def in_host_memory(self) -> bool:
        """Whether every buffer SGLang reads is a view of this pool's host memory."""
        hosts = {t.untyped_storage().data_ptr() for t in self.host_buffers}
        buffers: list[torch.Tensor] = [*(self.k_buffer or ()), *(self.v_buffer or ())]
        return bool(buffers) and all(
            isinstance(b, torch.Tensor) and b.untyped_storage().data_ptr() in hosts for b in buffers
        )


def _host_tier_here(configurator: KVCacheConfigurator) -> bool:
    """Whether the configurator builds the target model's KV pool on CUDA (the host tier, hooks 15 and 16)."""
    return not configurator.is_draft_worker and torch.device(configurator.device).type == "cuda"


class GpuKVBytes:
    """What hook 16 measured for each configurator (by identity: SGLang's configurator has slots), until
    hook 15 hands it to the pool it builds. Owned by the two registered hooks (``sglang_hooks.register``)."""

    def __init__(self) -> None:
        self._bytes: dict[int, int] = {}

    def keep(self, configurator: KVCacheConfigurator, gpu_bytes: int) -> None:
        self._bytes[id(configurator)] = gpu_bytes

    def take(self, configurator: KVCacheConfigurator) -> int | None:
        return self._bytes.pop(id(configurator), None)


def build_pool(
    measured: GpuKVBytes, original: Callable[..., KVCache], configurator: KVCacheConfigurator, *,
    max_total_num_tokens: int, mha_pool_class: type, quant_method: object | None = None,
) -> KVCache:  # fmt: skip
    """AROUND hook 15 (``sglang_hooks.register``): the target model's KV pool on CUDA built as ``PinnedHostKVPool``."""
    if not _host_tier_here(configurator):
        return original(configurator, max_total_num_tokens=max_total_num_tokens, mha_pool_class=mha_pool_class,
                        quant_method=quant_method)  # fmt: skip
    if mha_pool_class is not MHATokenToKVPool or quant_method is not None:
        raise ValueError(
            f"oasis sparse mode keeps the KV pool in host memory and serves SGLang's plain MHA pool only; SGLang "
            f"chose {getattr(mha_pool_class, '__name__', mha_pool_class)} (quantized: {quant_method is not None})"
        )
    pool = original(configurator, max_total_num_tokens=max_total_num_tokens, mha_pool_class=PinnedHostKVPool)
    assert isinstance(pool, PinnedHostKVPool)
    pool.gpu_kv_bytes = measured.take(configurator)
    return pool


def host_tier_bytes(
    config: TierOptions, measured: GpuKVBytes, original: Callable[..., int], configurator: KVCacheConfigurator,
    pre_model_load_memory: int,
) -> int:  # fmt: skip
    """AROUND hook 16 (``sglang_hooks.register``): the bytes SGLang sizes the target's KV pool by on CUDA: host RAM's share, not the
    GPU's (which is kept for the device tier)."""
    gpu_bytes = original(configurator, pre_model_load_memory)
    if not _host_tier_here(configurator):
        return gpu_bytes
    measured.keep(configurator, gpu_bytes)
    available = host_tier.available_host_memory()
    host_bytes = (
        available if config.host_kv_tokens is not None else int(config.host_memory_fraction * available)
    )
    logger.info(
        "oasis: the host KV tier is sized by host RAM (%.1f GiB of %.1f GiB available), not the GPU's %.1f GiB, "
        "which goes to the device tier", host_bytes / 2**30, available / 2**30, gpu_bytes / 2**30,
    )  # fmt: skip
    return host_bytes
