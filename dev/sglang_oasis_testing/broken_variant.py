"""A deliberately broken sparse decode attention, for the strict device test (test_strict_device.py).

Loaded as an SGLang plugin (entry point ``oasis_broken_variant`` of the sglang-oasis-dev package) in
every server process of the development venv; it does nothing unless ``BROKEN_ENV`` is
``read-host-pool``. Then each sparse layer's decode step runs as usual (selection, strict mode's
poisoning of the host tier's copies of resident blocks) and returns dense attention over SGLang's pool
instead, which reads the host tier. Under ``SGLANG_OASIS_STRICT_DEVICE=1`` its output must change: that
proves the garbage reaches whatever reads the host tier.
"""

from __future__ import annotations

import os
from typing import Any

BROKEN_ENV = "SGLANG_OASIS_TEST_BROKEN_VARIANT"


def load() -> None:
    if os.environ.get(BROKEN_ENV, "") == "":
        return
    if os.environ[BROKEN_ENV] != "read-host-pool":
        raise ValueError(f"{BROKEN_ENV}={os.environ[BROKEN_ENV]!r}: expected read-host-pool")
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from sglang_oasis.attention.oasis_backend import OasisAttnBackend

    sparse_decode = OasisAttnBackend.forward_decode

    def forward_decode(self: OasisAttnBackend, q, k, v, layer, forward_batch, save_kv_cache=True) -> Any:
        out = sparse_decode(self, q, k, v, layer, forward_batch, save_kv_cache)
        if layer.is_cross_attention or layer.layer_id in self.dense_layers:
            return out
        return TorchNativeAttnBackend.forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=False)

    OasisAttnBackend.forward_decode = forward_decode  # type: ignore[method-assign]
