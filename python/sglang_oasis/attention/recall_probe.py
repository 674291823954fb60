"""Live recall telemetry (``--oasis-recall-sample-every N``): how much attention the sparse selection misses.

Every N decode steps, for up to ``SAMPLED_REQUESTS`` requests of the batch (rotating through it), at
every sparse layer, right after the layer's decode attention, the step's queries attend the request's
whole context exactly (its keys read from the host tier, counted apart in ``telemetry_bytes``, never in
``bytes_host_to_device``). Per KV head:

- recall: the exact attention mass (averaged over the head's query heads) on the tokens decode attention
  saw, the working set plus the active tail; 1.0 when the working set holds every block;
- lookahead agreement: the share of the step's true top-K blocks (by exact mass) that it saw, i.e. how
  well the prediction made at the previous step chose this step's blocks.

The counters ``recall_samples``, ``recall_sum_ppm`` and ``lookahead_agreement_sum_ppm`` give the mean
over any interval (their deltas' quotient, as Prometheus rates do). Over the last ``WINDOW`` (request,
layer, KV head) samples the probe also publishes ``recall_mean_ppm``,
``recall_p10_ppm`` and ``lookahead_agreement_ppm``, and per layer ``recall_layer_ppm_<layer>`` (millionths
plus one; 0: never sampled). ``GET /oasis/stats`` turns them into ``recall_mean``, ``recall_p10``,
``recall_per_layer`` and ``lookahead_agreement``. At a verify step (lookahead) the real row's query is
sampled: the working set it attends is the one the previous step's draft row predicted.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch

from sglang_oasis.attention.batch_view import BatchView
from sglang_oasis.memory.device_tier import DeviceTier
from sglang_oasis.memory.headwise_map import EMPTY
from sglang_oasis.stats import MAX_RECALL_LAYERS, OasisStats

logger = logging.getLogger(__name__)

SAMPLED_REQUESTS = 4
WINDOW = 4096


class RecallProbe:
    def __init__(
        self,
        every: int,
        tier: DeviceTier,
        req_to_token_pool: Any,
        kv_pool: Any,
        top_k: int,
        stats: OasisStats,
    ) -> None:
        self.every = every
        self.working_sets = tier.working_sets
        self.block_size = tier.working_sets.block_size
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.top_k = top_k
        self.stats = stats
        self._recall: deque[float] = deque(maxlen=WINDOW)
        self._agreement: deque[float] = deque(maxlen=WINDOW)
        self._per_layer: dict[int, deque[float]] = {}

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def sample_safely(self, *args: Any) -> None:
        """``sample``; an error turns the telemetry off (logged) instead of failing the step's requests."""
        try:
            self.sample(*args)
        except Exception:
            logger.exception("oasis: recall telemetry failed; it is off from now on")
            self.every = 0

    def sample(
        self, batch: BatchView, layer_id: int, q_rows: torch.Tensor, seq_lens: list[int], scale: float,
        last_locs: list[int] | None = None,
    ) -> None:  # fmt: skip
        """Measure the batch's sampled requests at ``layer_id`` (``q_rows`` ``[bs, q_heads, dim]``, the
        step's queries; ``seq_lens`` count the step's token, whose host location is ``last_locs[row]``
        where given, else SGLang's table's) and publish the window's figures."""
        rows = len(batch.reqs)
        first = (batch.step // max(1, self.every)) * SAMPLED_REQUESTS
        for row in sorted({(first + i) % rows for i in range(min(rows, SAMPLED_REQUESTS))}):
            last = None if last_locs is None else last_locs[row]
            recall, agreement = self.measure(
                batch.reqs[row], int(batch.slots[row]), layer_id, q_rows[row], seq_lens[row], scale, last
            )
            self.stats.add("recall_samples", len(recall))
            self.stats.add("recall_sum_ppm", round(1e6 * float(recall.sum())))
            self.stats.add("lookahead_agreement_sum_ppm", round(1e6 * float(agreement.sum())))
            self._recall.extend(recall.tolist())
            self._agreement.extend(agreement.tolist())
            self._per_layer.setdefault(layer_id, deque(maxlen=WINDOW)).extend(recall.tolist())
        self._publish(layer_id)

    def measure(
        self, req: int, slot: int, layer_id: int, query: torch.Tensor, seq_len: int, scale: float,
        last_loc: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``([kv_heads], [kv_heads])``: recall and lookahead agreement of one request at one layer."""
        block = self.block_size
        locs = self.req_to_token_pool.req_to_token[req, :seq_len].to(torch.int64)
        if last_loc is not None:  # a verify step's real row: its key is at the row's own location
            locs = torch.cat([locs[:-1], torch.tensor([last_loc], dtype=torch.int64)])
        pool_keys = self.kv_pool.get_key_buffer(layer_id)
        keys = pool_keys[locs.to(pool_keys.device)].float().cpu()  # [T, H, D]
        self.stats.add("telemetry_bytes", keys.numel() * pool_keys.element_size())
        heads = keys.shape[1]
        q = query.float().cpu().view(heads, -1, keys.shape[-1])  # [H, G, D]
        mass = torch.softmax(torch.einsum("hgd,thd->hgt", q, keys) * scale, dim=-1).mean(dim=1)  # [H, T]
        full = seq_len // block
        covered = int(self.working_sets.covered[slot, layer_id])
        held = self.working_sets.slot_block[slot, layer_id]  # [H, S]
        seen_blocks = torch.zeros((heads, full + 1), dtype=torch.bool)
        seen_blocks.scatter_(1, torch.where((held != EMPTY) & (held < full), held, full), True)
        seen_blocks[:, min(covered, full) :] = True  # the active tail (and the partial block)
        token_block = (torch.arange(seq_len) // block).clamp(max=full)
        recall = (mass * seen_blocks[:, token_block]).sum(dim=-1)
        if full == 0:
            return recall, torch.ones(heads)
        block_mass = mass[:, : full * block].reshape(heads, full, block).sum(dim=-1)
        top = block_mass.topk(min(self.top_k, full), dim=-1).indices
        agreement = seen_blocks.gather(1, top).float().mean(dim=-1)
        return recall, agreement

    def _publish(self, layer_id: int) -> None:
        if not self._recall:
            return
        ordered = sorted(self._recall)
        self.stats.set("recall_mean_ppm", round(1e6 * sum(ordered) / len(ordered)))
        self.stats.set("recall_p10_ppm", round(1e6 * ordered[int(0.1 * (len(ordered) - 1))]))
        self.stats.set("lookahead_agreement_ppm", round(1e6 * sum(self._agreement) / len(self._agreement)))
        if layer_id < MAX_RECALL_LAYERS:
            layer = self._per_layer[layer_id]
            self.stats.set(f"recall_layer_ppm_{layer_id}", 1 + round(1e6 * sum(layer) / len(layer)))
