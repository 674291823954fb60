"""The hand-off of remote partial fetching: what the prefill node tells the decode node about one request
(where its KV is staged, its first selection), in the form it travels over the side channel; and the KV
pools both nodes read and write it from."""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from sglang_oasis.disaggregation.side_channel import reachable
from sglang_oasis.disaggregation.staging import StagedKVLayout
from sglang_oasis.sglang_contract import DRAFT_KV_ATTRIBUTE

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


def pool_buffers(pool: MHATokenToKVPool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A KV pool's per-layer K and V buffers (``[tokens, kv_heads, head_dim]``), in layer order."""
    start = int(getattr(pool, "start_layer", 0) or 0)
    layers = range(start, start + pool.layer_num)
    return [pool.get_key_buffer(layer) for layer in layers], [
        pool.get_value_buffer(layer) for layer in layers
    ]


def draft_kv_pool(req_to_token_pool: ReqToTokenPool) -> MHATokenToKVPool | None:
    """The EAGLE-3 draft model's KV pool of this scheduler process, which its attention backend sets on
    the request-to-token pool it shares with the target (``DraftAttnBackend``); None without one. The
    draft shares the target's token locations, so a request's draft KV is where its target KV is."""
    return getattr(req_to_token_pool, DRAFT_KV_ATTRIBUTE, None)


@dataclass(frozen=True)
class Handoff:
    """What the prefill node hands the decode node for one request."""

    layout: StagedKVLayout | None  # None: sent whole by SGLang (over the staging cap), nothing staged
    selection: torch.Tensor  # bool [layers, kv_heads, full blocks]: the first working sets
    decode_prefix_len: int  # tokens the decode node holds through its radix cache (never read)
    draft: StagedKVLayout | None = None  # the EAGLE-3 draft model's KV (no summaries needed)
    pinned: torch.Tensor | None = None  # bool, like selection: the prefill window's kept blocks
    whole_tokens: int = 0  # a request sent whole: its prompt's tokens (else layout.num_tokens)

    @property
    def num_tokens(self) -> int:
        return self.whole_tokens if self.layout is None else self.layout.num_tokens

    def reached_via(self, bootstrap_host: str) -> Handoff:
        """The hand-off with its Mooncake sessions reachable from here (``side_channel.reachable``), for a
        decode node that reached the prefill's bootstrap server at ``bootstrap_host``."""

        def reached(layout: StagedKVLayout | None) -> StagedKVLayout | None:
            if layout is None:
                return None
            return dataclasses.replace(layout, session=reachable(layout.session, bootstrap_host))

        return dataclasses.replace(self, layout=reached(self.layout), draft=reached(self.draft))

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "layout": None if self.layout is None else self.layout.to_dict(),
                "whole_tokens": self.whole_tokens,
                "selection_shape": list(self.selection.shape),
                "selection": _pack_bits(self.selection),
                "pinned": None if self.pinned is None else _pack_bits(self.pinned),
                "decode_prefix_len": self.decode_prefix_len,
                "draft": None if self.draft is None else self.draft.to_dict(),
            }
        ).encode()

    @classmethod
    def from_json(cls, body: bytes) -> Handoff:
        data = json.loads(body)
        shape = tuple(data["selection_shape"])
        layout, draft, pinned = data["layout"], data.get("draft"), data.get("pinned")
        return cls(
            None if layout is None else StagedKVLayout.from_dict(layout),
            _unpack_bits(data["selection"], shape),
            int(data["decode_prefix_len"]),
            None if draft is None else StagedKVLayout.from_dict(draft),
            None if pinned is None else _unpack_bits(pinned, shape),
            int(data.get("whole_tokens", 0)),
        )


def _pack_bits(mask: torch.Tensor) -> str:
    return base64.b64encode(np.packbits(mask.numpy().astype(np.uint8).ravel()).tobytes()).decode("ascii")


def _unpack_bits(text: str, shape: tuple[int, ...]) -> torch.Tensor:
    bits = np.frombuffer(base64.b64decode(text), dtype=np.uint8)
    count = int(np.prod(shape))
    return torch.from_numpy(np.unpackbits(bits)[:count].astype(bool).reshape(shape))
