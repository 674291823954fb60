"""The host tier on a CUDA machine: pinned host memory that GPU kernels read and write in place.

With unified addressing, a pinned (page-locked) host buffer has a device address, so a CUDA tensor over the
same memory lets every kernel (SGLang's prefill writing the prompt's KV, the decode step's copies into the
working sets) cross PCIe itself, with no staging copy. ``device_view`` makes that tensor;
``sglang_hooks.pool_in_pinned_host_memory`` puts SGLang's KV pool there. Never run on a GPU
(``benchmark/gpu_step.py`` reads its host tier through it; docs/gpu.md).
"""

from __future__ import annotations

import torch


def pinned_like(buffer: torch.Tensor) -> torch.Tensor:
    """A copy of ``buffer`` in pinned host memory."""
    host = torch.empty(buffer.shape, dtype=buffer.dtype, pin_memory=True)
    host.copy_(buffer)
    return host


def device_view(host: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``host`` (pinned) as a CUDA tensor over the same memory (True); on CPU, or with ``host`` not pinned,
    ``host`` itself, and if CUDA refuses the pointer a device copy (False)."""
    if not host.is_pinned():
        return host, False
    raw = host.view(torch.int16 if host.element_size() == 2 else torch.int32)

    view = type("PinnedView", (), {})()  # what torch.as_tensor reads: CUDA's array interface
    view.__cuda_array_interface__ = {
        "shape": tuple(raw.shape), "typestr": f"<i{raw.element_size()}", "data": (raw.data_ptr(), False),
        "version": 3, "strides": None,
    }  # fmt: skip
    view.host = host  # the CUDA tensor keeps ``view`` alive, and so the pinned memory under it
    try:
        return torch.as_tensor(view, device="cuda").view(host.dtype), True
    except Exception as error:  # the step still runs, reading a device copy
        print(
            f"no device view of pinned memory ({type(error).__name__}: {error}); host tier copied to the GPU"
        )
        return host.to("cuda"), False
