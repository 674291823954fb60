"""``DraftAttnBackend``: dense attention for the EAGLE-3 draft model of ``--oasis-lookahead eagle3``.

The draft model (one layer) attends densely over its own small KV cache, SGLang's torch_native way; the
oasis backend's factory gives it to a draft worker, and hook 1 (``sglang_hooks.draft_extend_backend``) to
the draft's extend. Its own file so that the hooks need not import the oasis backend (which imports the
parts that read the hooks' listener names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sglang_oasis.disaggregation.pd_partial import register_draft_pool

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.model_runner import ModelRunner


class DraftAttnBackend(TorchNativeAttnBackend):
    """Dense attention for the draft model of ``--oasis-lookahead eagle3`` (one layer, its own KV)."""

    def __init__(self, model_runner: ModelRunner) -> None:
        super().__init__(model_runner)
        # PD remote fetching moves it whole; SGLang declares the abstract KVCache, a draft's is this one
        register_draft_pool(cast("MHATokenToKVPool", model_runner.token_to_kv_pool))
