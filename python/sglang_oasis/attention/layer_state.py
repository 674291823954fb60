"""One layer's views of the device tier and of the host tier, as the captured decode program reads them."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_oasis.memory.device_tier import DeviceTier


class LayerState(NamedTuple):
    """One layer's views of the device tier and of the host tier (SGLang's pool), as the program reads
    and writes them; the same strides at every layer, so one compiled graph serves them all."""

    host_k: torch.Tensor  # [tokens, H, D]
    host_v: torch.Tensor
    kmin: torch.Tensor  # [pages, H, D]
    kmax: torch.Tensor
    ws_k: torch.Tensor  # [slots, H, S, B, D]
    ws_v: torch.Tensor
    slot_block: torch.Tensor  # [slots, H, S] int64, EMPTY where free
    last_selected: torch.Tensor  # [slots, H, S] int64
    covered: torch.Tensor  # [slots] int64
    top_k: torch.Tensor  # [slots] int64
    pinned: torch.Tensor  # [slots, H, P] int64, -1: none
    active_k: torch.Tensor  # [slots * span, H, D]
    active_v: torch.Tensor
    active_start: torch.Tensor  # [slots] int64
    active_end: torch.Tensor
    # the recall probe's (a recall-sample pass): its streak [slots] int64 and last sample [slots, 2, H]
    recall_streak: torch.Tensor | None = None
    recall: torch.Tensor | None = None
    codes: torch.Tensor | None = None  # --oasis-selector codes' [pages, B, H, D / 4] uint8

    @classmethod
    def of(cls, tier: DeviceTier, kv_pool: MHATokenToKVPool, layer: int) -> LayerState:
        """``layer``'s views; the index tables are the device's (``tier_tables.py``: on CUDA not the host
        plan's mirror)."""
        ws, active, summaries, t = tier.working_sets, tier.active, tier.summaries, tier.tables.device
        return cls(
            kv_pool.get_key_buffer(layer), kv_pool.get_value_buffer(layer), summaries.kmin[layer],
            summaries.kmax[layer], ws.k[:, layer], ws.v[:, layer], t["slot_block"][:, layer],
            t["last_selected"][:, layer], t["covered"][:, layer], t["top_k"][:, layer], t["pinned"][:, layer],
            active.k[layer], active.v[layer], t["active_start"][:, layer], t["active_end"][:, layer],
            t["recall_streak"][:, layer], t["recall"][:, layer], None if tier.codes is None else tier.codes.codes[layer],
        )  # fmt: skip
