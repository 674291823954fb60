"""The fetch cap: how many blocks per KV head a decode step's selection may load, per layer."""

from __future__ import annotations

import math

from sglang_oasis.config import OasisConfig


class FetchCaps:
    """Blocks per KV head a decode step may load, per layer: ``ceil(--oasis-fetch-ratio x K)`` (None:
    no cap), or with ``--oasis-adaptive-cap`` ``ceil(1.25 x`` the layer's moving average of predicted
    but missing blocks per head and step``)``, within ``OasisConfig.fetch_cap_bounds``."""

    def __init__(self, config: OasisConfig, num_layers: int) -> None:
        self.config = config
        self.caps: list[int | None] = [config.fetch_cap] * num_layers
        self._drift = [0.0] * num_layers

    def __getitem__(self, layer: int) -> int | None:
        return self.caps[layer]

    def observe(self, layer: int, missing_per_head: float) -> None:
        """A decode step's drift at ``layer``: blocks per head it loaded plus those the cap deferred."""
        if not self.config.adaptive_cap:
            return
        low, high = self.config.fetch_cap_bounds
        drift = 0.75 * self._drift[layer] + 0.25 * missing_per_head
        self._drift[layer] = drift
        self.caps[layer] = min(high, max(low, math.ceil(1.25 * drift)))
