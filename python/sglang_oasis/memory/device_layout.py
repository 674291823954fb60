"""How a device budget divides (``memory/device_tier.py`` allocates it): plain arithmetic, no torch, so
the launcher can size ``--max-running-requests`` before anything is imported.

    budget          = --oasis-device-kv-tokens x the served model's KV bytes per token
    summaries       = 2 (min, max) x layers x host pages x KV heads x head_dim x element bytes
                      (each page's epoch is host bookkeeping: ``summary_store.py``)
                      + layers x host pages x block x KV heads x head_dim / 4 with --oasis-selector codes
                      (2-bit key codes: ``key_code_store.py``)
    per request     = 2 (K, V) x layers x KV heads x (top-K + sinks) x block x head_dim x element bytes
                      (top-K: --oasis-recall-max-top-k when --oasis-recall-target is on)
                      + 2 (K, V) x layers x KV heads x active span x head_dim x element bytes
                      + 8 bytes x layers x KV heads x (2 x (top-K + sinks) + window pins)   (index tensors)
                      + 8 bytes x layers x 4           (covered, top-K; active blocks' start, end)
                      + 8 bytes x layers + 4 bytes x layers x KV heads x 2   (the recall probe's streak
                                                       and last sample, per layer: recall, agreement)
    request slots   = (budget - summaries) // per request - padding slots
    padding slots   = 1 with --oasis-decode-step captured (padding rows of a batch bucket write there), else 0
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from sglang_oasis.config import OasisConfig

INDEX_BYTES = 8  # int64 index tensors
FIGURE_BYTES = 4  # float32 recall figures


class DeviceTierError(ValueError):
    """The device budget cannot hold what it must; the message names the option."""


class DeviceTierLayout(NamedTuple):
    """How a device budget divides: the fixed summaries, then whole request slots."""

    budget_bytes: int
    summary_bytes: int
    request_bytes: int
    request_slots: int  # slots requests may hold
    padding_slots: int = 0  # slots no request holds: the captured step's padding rows write there

    @property
    def total_bytes(self) -> int:
        """Bytes the device tier allocates (at most ``budget_bytes``)."""
        return self.summary_bytes + (self.request_slots + self.padding_slots) * self.request_bytes


class TierShape(NamedTuple):
    """What sizes the device tier's tensors."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    element_bytes: int
    host_pages: int  # pages of SGLang's KV pool (its padding pages included)
    block_size: int
    slots_per_head: int  # the largest top-K (--oasis-recall-max-top-k) + sink blocks
    window_blocks: int  # blocks per layer and KV head the prefill window may pin (at the largest top-K)
    active_tokens: int  # ring positions per layer and KV head of the active blocks (``active_span``)
    padding_slots: int = 0  # request slots for padding rows (captured decode step or CUDA graphs: 1)
    key_codes: bool = False  # --oasis-selector codes: every full block's keys coded beside the summaries
    epoch_layer: int = 0  # the layer whose key writes restart page epochs: the first sparse one (-1: none)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.num_kv_heads * self.head_dim * 2 * self.element_bytes

    @classmethod
    def of(
        cls, config: OasisConfig, num_layers: int, num_kv_heads: int, head_dim: int, element_bytes: int,
        host_pages: int,
    ) -> TierShape:  # fmt: skip
        """The shape of a model's KV (layers, KV heads, head_dim, element bytes) served with ``config``."""
        return cls(
            num_layers, num_kv_heads, head_dim, element_bytes, host_pages, config.block_size,
            config.slots_per_head, config.pin_slots,
            active_span(config.block_size, config.verify_rows),
            int(config.decode_step == "captured" or config.cuda_untested),  # CUDA graphs pad rows too
            config.selector == "codes",
            next((layer for layer in range(num_layers) if layer not in config.dense_layers), -1),
        )  # fmt: skip


def active_span(block_size: int, verify_rows: int) -> int:
    """Token positions the active blocks hold per request, layer and KV head
    (``memory/active_blocks.py``): the tail after the covered blocks (less than one block: every step's
    selection covers every full block) plus one step's new tokens (a decode's one; a verify's ``rows``,
    and as many accepted drafts), in whole blocks so that a block that fills up is copied out whole."""
    return block_size * math.ceil((block_size + 2 * verify_rows) / block_size)


def budget_bytes(config: OasisConfig, shape: TierShape) -> int:
    """``--oasis-device-kv-tokens`` x the model's KV bytes per token: the device tier's budget."""
    return config.device_tokens * shape.kv_bytes_per_token


def layout(budget_bytes: int, shape: TierShape, max_request_slots: int | None = None) -> DeviceTierLayout:
    """Divide ``budget_bytes``: summaries first, then as many request slots as fit (at most
    ``max_request_slots``); raises ``DeviceTierError`` when not even one request fits."""
    s = shape
    summary = 2 * s.num_layers * s.host_pages * s.num_kv_heads * s.head_dim * s.element_bytes
    if s.key_codes:  # 2 bits per channel of every key (``sgl_kernel_oasis.key_codes``)
        summary += s.num_layers * s.host_pages * s.block_size * s.num_kv_heads * (s.head_dim // 4)
    heads = s.num_layers * s.num_kv_heads
    request = 2 * heads * s.slots_per_head * s.block_size * s.head_dim * s.element_bytes  # K and V
    request += 2 * heads * s.slots_per_head * INDEX_BYTES  # slot_block, last_selected
    request += 2 * heads * s.active_tokens * s.head_dim * s.element_bytes  # active blocks' K and V
    request += 4 * s.num_layers * INDEX_BYTES  # covered, top-K; active blocks' start and end
    request += heads * s.window_blocks * INDEX_BYTES  # pinned
    request += s.num_layers * INDEX_BYTES + 2 * heads * FIGURE_BYTES  # recall streak, last sample
    slots = max(0, budget_bytes - summary) // request - s.padding_slots
    if max_request_slots is not None:
        slots = min(slots, max_request_slots)
    if slots < 1:
        raise DeviceTierError(
            f"--oasis-device-kv-tokens: the device budget ({budget_bytes / 2**20:.1f} MiB) holds the block "
            f"summaries ({summary / 2**20:.1f} MiB) and not one request's working sets "
            f"({request / 2**20:.1f} MiB): raise it, or lower --oasis-top-k or the host tier"
        )
    return DeviceTierLayout(budget_bytes, summary, request, slots, s.padding_slots)
