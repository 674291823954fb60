"""Prefill side of remote partial fetching: each request's full KV and block summaries, staged in host
memory registered with the transfer engine, and the layout the decode node reads them by.

Staged layout of one request (block size B, H KV heads, head dim D, P = ceil(tokens / B) pages)::

    kv        [layers, 2 (K, V), P, B, H, D]   block p of layer l's K: one contiguous run of B*H*D items,
                                               the same shape as a page of SGLang's KV pool
    summaries [layers, 2 (min, max), P, H, D]  the min/max key summary of each block and KV head
    codes     [layers, P, B, H, D / 4] uint8    with ``--oasis-selector codes``: each full block's keys
                                               coded within its summary's box (``key_code_store.py``);
                                               the last page's are zero when it is partly filled

The last page may be partly filled (the active block); its padding rows are zero. ``StagedKVLayout`` is
the typed hand-off: the decode node computes every remote address from it and needs nothing else.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any

import torch

from sgl_kernel_oasis import build_block_summaries
from sgl_kernel_oasis.key_codes import PER_BYTE, encode_key_codes
from sglang_oasis.disaggregation.transfer_engine import MooncakeEndpoint


@dataclass(frozen=True)
class StagedKVLayout:
    """Where one request's staged KV and summaries live on the prefill node."""

    session: str  # the prefill node's transfer engine ("host:port")
    kv_address: int
    summary_address: int  # 0: staged without summaries
    num_layers: int
    num_tokens: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    itemsize: int
    code_address: int = 0  # 0: staged without key codes

    @property
    def num_pages(self) -> int:
        return -(-self.num_tokens // self.block_size)

    @property
    def full_blocks(self) -> int:
        return self.num_tokens // self.block_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K (or V) of one layer, all KV heads."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def summary_row_bytes(self) -> int:
        """Bytes of one block's min (or max) summary of one layer, all KV heads."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def code_row_bytes(self) -> int:
        """Bytes of one block's key codes of one layer, all KV heads."""
        return self.block_size * self.num_kv_heads * self.head_dim // PER_BYTE

    @property
    def kv_bytes(self) -> int:
        """The full transfer: every page of K and V in every layer."""
        return self.num_layers * 2 * self.num_pages * self.block_bytes

    @property
    def summary_bytes(self) -> int:
        return self.num_layers * 2 * self.num_pages * self.summary_row_bytes

    def block_address(self, layer: int, kv: int, page: int) -> int:
        """``kv`` 0 = K, 1 = V."""
        return self.kv_address + ((layer * 2 + kv) * self.num_pages + page) * self.block_bytes

    def summary_address_of(self, layer: int, which: int, page: int) -> int:
        """``which`` 0 = min, 1 = max."""
        return self.summary_address + ((layer * 2 + which) * self.num_pages + page) * self.summary_row_bytes

    def code_address_of(self, layer: int, page: int) -> int:
        return self.code_address + (layer * self.num_pages + page) * self.code_row_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StagedKVLayout:
        return cls(**data)


class KVStagingArea:
    """Stages requests' KV in registered host memory until the decode node is done with them."""

    def __init__(self, endpoint: MooncakeEndpoint, block_size: int) -> None:
        self.endpoint = endpoint
        self.block_size = block_size
        self._staged: dict[str, tuple[list[torch.Tensor], StagedKVLayout]] = {}  # rid -> registered, layout
        self._lock = threading.Lock()

    def stage(
        self, rid: str, keys: torch.Tensor, values: torch.Tensor, summaries: bool = True, codes: bool = False
    ) -> StagedKVLayout:
        """Copies one request's KV (``keys``/``values``: ``[layers, tokens, kv_heads, head_dim]``) into
        registered host memory with its block summaries (unless ``summaries`` is False: KV the decode node
        reads whole, like the EAGLE-3 draft model's) and, with ``codes``, its full blocks' key codes;
        returns the layout to hand to the decode node."""
        if keys.shape != values.shape or keys.dim() != 4:
            raise ValueError(f"keys and values must both be [layers, tokens, heads, dim], got "
                             f"{tuple(keys.shape)} and {tuple(values.shape)}")  # fmt: skip
        if codes and not summaries:
            raise ValueError("key codes are coded within the summaries' boxes: stage them too")
        layers, tokens, heads, dim = keys.shape
        b = self.block_size
        pages = -(-tokens // b)
        kv = torch.zeros((layers, 2, pages * b, heads, dim), dtype=keys.dtype)
        kv[:, 0, :tokens] = keys
        kv[:, 1, :tokens] = values
        summary: torch.Tensor | None = None
        coded: torch.Tensor | None = None
        if summaries:
            summary = torch.empty((layers, 2, pages, heads, dim), dtype=keys.dtype)
            full = tokens // b
            if codes:  # coded within the staged boxes (the keys' dtype), as the decode node codes its own
                coded = torch.zeros((layers, pages, b, heads, dim // PER_BYTE), dtype=torch.uint8)
            for layer in range(layers):
                summary[layer, 0], summary[layer, 1] = build_block_summaries(keys[layer].cpu(), b)
                if coded is not None and full:
                    blocks = keys[layer, : full * b].cpu().view(full, b, heads, dim)
                    coded[layer, :full] = encode_key_codes(
                        blocks, summary[layer, 0, :full], summary[layer, 1, :full]
                    )
        registered: list[torch.Tensor] = []
        try:
            addresses = []
            for tensor in (kv, summary, coded):
                addresses.append(0 if tensor is None else self.endpoint.register(tensor))
                if tensor is not None:
                    registered.append(tensor)
        except Exception:  # never leave memory registered without a record to release it by
            for tensor in registered:
                self.endpoint.unregister(tensor)
            raise
        layout = StagedKVLayout(
            session=self.endpoint.session_id,
            kv_address=addresses[0],
            summary_address=addresses[1],
            num_layers=layers,
            num_tokens=tokens,
            block_size=b,
            num_kv_heads=heads,
            head_dim=dim,
            itemsize=keys.element_size(),
            code_address=addresses[2],
        )
        with self._lock:
            if rid in self._staged:
                self._release(rid)
            self._staged[rid] = (registered, layout)
        return layout

    def release(self, rid: str) -> None:
        """Drops a request's staged KV (the decode node finished or gave up)."""
        with self._lock:
            self._release(rid)

    def _release(self, rid: str) -> None:
        staged = self._staged.pop(rid, None)
        for tensor in [] if staged is None else staged[0]:
            self.endpoint.unregister(tensor)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(tensor.nbytes for tensors, _ in self._staged.values() for tensor in tensors)

    def __len__(self) -> int:
        return len(self._staged)
