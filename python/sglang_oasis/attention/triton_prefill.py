"""Sparse mode's extends through SGLang's Triton attention backend (``--oasis-prefill-attention``).

An extend (a prompt, a suffix after a cached prefix, a chunk of a chunked prefill) attends densely: each
new token over its whole sequence. The ``oasis`` backend extends SGLang's torch_native backend, whose
extend is SDPA per request: the CPU path. On a GPU that is correct but slow, so there this mixin hands
the attention of every extend to SGLang's own ``TritonAttnBackend``, which plans the batch once per pass
(``init_forward_metadata``) and per layer writes the new tokens' KV into SGLang's pool (the host tier:
pinned host memory behind a CUDA view, ``memory/pinned_host.py``, so the prompt's KV reaches the host tier
layer by layer as the forward goes) and runs its extend kernel over prefix and new tokens. The rest of an
extend stays the oasis backend's (summaries, first working sets, retraction resumes), on the same q/k/v.

Decode and verify passes never come here. On a CPU the Triton backend runs only under Triton's
interpreter (tests: the same greedy tokens as the torch path, ``test/integration/test_triton_prefill.py``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from sglang_oasis.stats import OasisStats

INTERPRET_ENV = "TRITON_INTERPRET"


class TritonPrefillError(ValueError):
    """``--oasis-prefill-attention triton`` where SGLang's Triton kernels cannot run."""


def wants_triton(choice: str, device: str) -> bool:
    """``--oasis-prefill-attention`` on ``device``: whether extends go through SGLang's Triton backend."""
    on_cuda = device.startswith("cuda")
    if choice == "auto":
        return on_cuda
    if choice == "triton" and not on_cuda and os.environ.get(INTERPRET_ENV) != "1":
        raise TritonPrefillError(
            f"--oasis-prefill-attention triton on {device}: SGLang's Triton kernels run on a GPU, or on a "
            f"CPU under Triton's interpreter ({INTERPRET_ENV}=1, for tests); use torch or auto"
        )
    return choice == "triton"


class TritonPrefill:
    """Mixin of ``OasisAttnBackend`` (before torch_native in its bases): extends through ``self.prefill``
    when there is one."""

    prefill: TritonAttnBackend | None = None
    stats: OasisStats

    def init_triton_prefill(self, model_runner: ModelRunner, choice: str) -> None:
        if wants_triton(choice, str(model_runner.device)):
            from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

            self.prefill = TritonAttnBackend(model_runner)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        super().init_forward_metadata(forward_batch)  # type: ignore[misc]
        mode = forward_batch.forward_mode
        if self.prefill is not None and mode.is_extend() and not mode.is_target_verify():
            self.prefill.init_forward_metadata(forward_batch)

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
        forward_batch: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        if self.prefill is None:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)  # type: ignore[misc]
        self.stats.add("triton_extend_layers")
        return self.prefill.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
