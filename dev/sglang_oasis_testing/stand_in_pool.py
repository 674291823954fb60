"""``StandInPool``: the slice of SGLang's ``MHATokenToKVPool`` the oasis backend uses, as plain per-layer K/V
tensors filled with random values, for in-process tests and benchmarks of the backend (no server)."""

from __future__ import annotations

from typing import Any

import torch


class StandInPool:
    """``size`` tokens (plus SGLang's two padding pages) of ``layer_num`` layers x ``head_num`` KV heads x
    ``head_dim``, float32; ``seed`` makes two pools alike (None: torch's global generator)."""

    dtype = torch.float32

    def __init__(
        self, size: int, page_size: int, layer_num: int, head_num: int, head_dim: int, seed: int | None = None
    ) -> None:
        self.size, self.page_size, self.layer_num, self.head_num, self.head_dim = (
            size, page_size, layer_num, head_num, head_dim,
        )  # fmt: skip
        generator = None if seed is None else torch.Generator().manual_seed(seed)
        shape = (size + 2 * page_size, head_num, head_dim)
        self.k = [torch.randn(shape, generator=generator) for _ in range(layer_num)]
        self.v = [torch.randn(shape, generator=generator) for _ in range(layer_num)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    def set_kv_buffer(self, layer: Any, loc: Any, k: torch.Tensor, v: torch.Tensor) -> None:
        """SGLang's signature; ``loc`` is a ``KVWriteLoc``."""
        self.k[layer.layer_id][loc.loc] = k.view(-1, self.head_num, self.head_dim)
        self.v[layer.layer_id][loc.loc] = v.view(-1, self.head_num, self.head_dim)
