"""``DraftAttnBackend``: dense attention for the EAGLE-3 draft model of ``--oasis-lookahead eagle3``.

The draft model (one layer) attends densely over its own small KV cache, SGLang's torch_native way; the
oasis backend's factory gives it to a draft worker, and hook 1 (``sglang_hooks.draft_extend_backend``) to
the draft's extend. Its own file so that the hooks need not import the oasis backend (which imports the
parts that read the hooks' listener names).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sglang_oasis.sglang_contract import DRAFT_KV_ATTRIBUTE

if TYPE_CHECKING:
    from sglang.srt.model_executor.model_runner import ModelRunner


class DraftAttnBackend(TorchNativeAttnBackend):
    """Dense attention for the draft model of ``--oasis-lookahead eagle3`` (one layer, its own KV)."""

    def __init__(self, model_runner: ModelRunner) -> None:
        super().__init__(model_runner)
        # PD remote fetching moves the draft's KV whole: its stager and fetcher find the pool on the
        # request-to-token pool, which is the target's. SGLang's scheduler hands the target's to the draft
        # worker (``Scheduler.init_memory_pools`` -> ``TpModelWorker.alloc_memory_pool`` sets it on the
        # draft's model runner) before it builds any attention backend (``init_all_attention_backends``).
        setattr(model_runner.req_to_token_pool, DRAFT_KV_ATTRIBUTE, model_runner.token_to_kv_pool)
