"""The host tier on a CUDA machine: page-locked host memory that GPU kernels read and write in place.

With unified addressing a page-locked host buffer has a device address, so a CUDA tensor over the same
memory (``cuda_view``) lets every kernel (SGLang's prefill writing the prompt's KV, the decode step's
copies into the working sets) cross PCIe itself, with no staging copy and no GPU memory of its own.

``page_locked`` allocates exactly the buffer's bytes on the host and page-locks them in place
(``cudaHostRegister``), so a host tier is sized by host RAM: torch's pinned allocations
(``pin_memory=True``) go through its caching host allocator, which rounds each block up to a power of two.
``memory/host_kv_pool.py`` builds SGLang's KV pool this way on CUDA. Never run on a GPU; on CPU
``test/unit/test_fake_cuda.py`` runs it on a fake CUDA device, where these two driver calls are the fake's.
"""

from __future__ import annotations

import torch

# cudaHostRegisterPortable | cudaHostRegisterMapped: every context sees it, and it has a device address
REGISTER_FLAGS = 1 | 2


class PinnedHostError(RuntimeError):
    """CUDA refused to page-lock host memory or to address it from the device; the message says why."""


def page_locked(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor of ``shape``, page-locked in place (``cudaHostRegister``): exactly its bytes.
    It stays locked while the process lives (SGLang's pool does too)."""
    host = torch.zeros(shape, dtype=dtype)
    if host.nbytes:
        status = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.nbytes, REGISTER_FLAGS)
        if int(status) != 0:
            raise PinnedHostError(
                f"cudaHostRegister of {host.nbytes / 2**30:.2f} GiB of host memory failed (CUDA error "
                f"{int(status)}): lower --oasis-host-kv-tokens or --oasis-host-memory-fraction, or raise the "
                "locked-memory limit (ulimit -l)"
            )
    return host


def cuda_view(host: torch.Tensor) -> torch.Tensor:
    """Page-locked ``host`` as a CUDA tensor over the same memory (unified addressing); raises
    ``PinnedHostError`` if CUDA refuses the pointer."""
    if host.element_size() not in (2, 4):
        raise PinnedHostError(f"a device view of {host.dtype} host memory (2- or 4-byte elements only)")
    raw = host.view(torch.int16 if host.element_size() == 2 else torch.int32)
    view = type("PinnedView", (), {})()  # what torch.as_tensor reads: CUDA's array interface
    view.__cuda_array_interface__ = {
        "shape": tuple(raw.shape), "typestr": f"<i{raw.element_size()}", "data": (raw.data_ptr(), False),
        "version": 3, "strides": None,
    }  # fmt: skip
    view.host = host  # the CUDA tensor keeps ``view`` alive, and so the host memory under it
    try:
        return torch.as_tensor(view, device="cuda").view(host.dtype)
    except Exception as error:
        raise PinnedHostError(
            f"CUDA gives no device address for page-locked host memory ({type(error).__name__}: {error}): "
            "the host tier needs unified addressing (a 64-bit Linux machine with a recent driver)"
        ) from error


def device_view(host: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``host`` as the device reads it: its CUDA view (True) when it is page-locked, else ``host`` itself
    (False: on CPU, and for memory nobody locked)."""
    if not host.is_pinned():
        return host, False
    return cuda_view(host), True
