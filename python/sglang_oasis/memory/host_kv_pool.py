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

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from sglang_oasis.memory import pinned_host


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
