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

With a recall target (``--oasis-recall-target``) the probe also holds it. Every request is sampled at
its first decode step and every N-th of its own decode steps (so what it attends depends on its own
tokens, not on the batch it ran in), and a (request, layer) whose worst KV head's recall is below target doubles the top-K its next
selection takes (``WorkingSetPool.top_k``, up to ``--oasis-recall-max-top-k``); after
``SHRINK_AFTER`` samples in a row within a quarter of the miss budget of 1.0 it halves back, never below
``--oasis-top-k``. The first working sets are sized from the prefill window's attention
(``window_top_k``), before any decode step; a working set the target grew to hold every block of its
layer keeps holding every block as new ones fill (``Selector.select``) until a sample lets it shrink.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from sglang_oasis.attention.batch_view import BatchView
from sglang_oasis.memory.device_tier import DeviceTier
from sglang_oasis.memory.working_set import EMPTY
from sglang_oasis.stats import MAX_RECALL_LAYERS, OasisStats

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

logger = logging.getLogger(__name__)

SAMPLED_REQUESTS = 4
WINDOW = 4096
SHRINK_AFTER = 3


def window_top_k(
    prior: torch.Tensor,
    full: torch.Tensor,
    sink_blocks: int,
    top_k: int | torch.Tensor,
    max_top_k: int,
    target: float | torch.Tensor,
) -> torch.Tensor:
    """``[bs]``: the top-K each request's first working set needs at a layer for its worst KV head to hold
    ``target`` of the prefill window's attention (``prior`` ``[bs, kv_heads, N]``, each full block's share
    of it; the sinks and the partial tail are always held), within ``[top_k, max_top_k]`` (``top_k`` and
    ``target``: one for all, or ``[bs]`` each request's own)."""
    index = torch.arange(prior.shape[-1])
    scorable = (index[None, :] < full[:, None]) & (index[None, :] >= sink_blocks)  # [bs, N]
    mass = prior.masked_fill(~scorable[:, None, :], 0.0)
    ordered = mass.sort(dim=-1, descending=True).values
    missed = mass.sum(dim=-1, keepdim=True) - ordered.cumsum(dim=-1)  # [bs, H, N]: missed by top (i + 1)
    allowed = (1.0 - torch.as_tensor(target, dtype=prior.dtype)).expand(prior.shape[0])[:, None]  # [bs, 1]
    over = missed > allowed[..., None]
    need = torch.where(missed[..., 0] + ordered[..., 0] > allowed, over.sum(dim=-1) + 1, 0)
    return on_ladder(need.amax(dim=-1), top_k, max_top_k)


def on_ladder(need: torch.Tensor, top_k: int | torch.Tensor, max_top_k: int) -> torch.Tensor:
    """The smallest of ``top_k x 2**n`` at least ``need`` (the sizes doubling and halving visit; few sizes
    in a batch keep top-K to few calls), at most ``max_top_k``."""
    doublings = torch.ceil(torch.log2(need.clamp(min=1).double() / top_k)).clamp(min=0)
    return (top_k * 2**doublings).to(torch.int64).clamp(max=max_top_k)


class RecallProbe:
    def __init__(
        self,
        every: int,
        tier: DeviceTier,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: MHATokenToKVPool,
        top_k: int,
        stats: OasisStats,
        target: float = 0.0,
        max_top_k: int | None = None,
    ) -> None:
        self.every = every
        self.target = target
        self.max_top_k = top_k if max_top_k is None else max_top_k
        self.tier = tier
        self.working_sets = tier.working_sets
        self.block_size = tier.working_sets.block_size
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.top_k = top_k
        self.stats = stats
        self._recall: deque[float] = deque(maxlen=WINDOW)
        self._agreement: deque[float] = deque(maxlen=WINDOW)
        self._per_layer: dict[int, deque[float]] = {}
        self._steps: dict[int, tuple[int, int]] = {}  # request row -> (generation, decode steps since
        # its last extend): a new request on the row (a PD arrival too) starts from 0
        # [request slots, layers]: samples in a row well above target (the tier's; the captured step writes it too)
        self.streak = tier.recall_streak
        self.rows: list[int] = []  # batch rows the current pass samples

    def restart(self, reqs: list[int]) -> None:
        """Requests that just extended (new, or a retracted one re-prefilled): their step counts restart
        and their slots' shrink streaks are forgotten."""
        for req in reqs:
            self._steps.pop(req, None)
            self.streak[self.tier.slot_of(req)] = 0
        self.rows = []

    def state_of(self, req: int, slot: int) -> tuple[int, dict[int, int]]:
        """Request row ``req``'s own decode steps and its slot's shrink streaks per layer (a retraction
        keeps them; ``resume`` gives them to the row and slot it resumes in)."""
        streaks = self.streak[slot].tolist()
        return self._steps.get(req, (0, 0))[1], {layer: n for layer, n in enumerate(streaks) if n}

    def resume(self, req: int, generation: int, slot: int, state: tuple[int, dict[int, int]]) -> None:
        steps, above = state
        self._steps[req] = (generation, steps)
        self.streak[slot] = 0
        for layer, n in above.items():
            self.streak[slot, layer] = n

    def begin(self, batch: BatchView) -> None:
        """A decode or verify pass of ``batch``: count each request's step and choose the rows sampled
        (with a target: each request at its first and every ``every``-th of its own steps; else up to
        ``SAMPLED_REQUESTS`` rows, rotating through the batch, at every ``every``-th pass)."""
        steps = []
        for req, generation in zip(batch.reqs, batch.generations, strict=True):
            known, count = self._steps.get(req, (generation, 0))
            count = count + 1 if known == generation else 1
            self._steps[req] = (generation, count)
            steps.append(count)
        self.rows = []
        if self.every <= 0 or not steps:
            return
        # With a target (the server's, or the request's own): its first decode step too (the window that
        # sized its working sets was the prompt's end) and every ``every``-th of its own steps.
        targeted = (batch.targets(self.target) > 0).tolist()
        chosen = {
            row
            for row, count in enumerate(steps)
            if targeted[row] and (count % self.every == 0 or count == 1)
        }
        others = [row for row in range(len(steps)) if not targeted[row]]
        if others and batch.step % self.every == 0:  # the others rotate through the batch's rows
            first = (batch.step // self.every) * SAMPLED_REQUESTS
            chosen |= {others[(first + i) % len(others)] for i in range(min(len(others), SAMPLED_REQUESTS))}
        self.rows = sorted(chosen)

    def due(self) -> bool:
        return self.every > 0 and bool(self.rows)

    def plan_fields(self, batch: BatchView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What a captured pass of ``batch`` takes from the probe (``StepPlan``'s ``own_k``, ``target`` and
        ``sampled``): each row's own K and target (0: none; always in the plan, so a request with a target
        is not another graph), and the rows a sample due now measures (None: no sample due)."""
        sampled = None
        if self.due():
            sampled = torch.zeros(len(batch.reqs), dtype=torch.bool)
            sampled[self.rows] = True
        return batch.top_ks(self.top_k), batch.targets(self.target), sampled

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
        """Measure the pass's sampled rows (``begin``) at ``layer_id`` (``q_rows`` ``[bs, q_heads, dim]``,
        the step's queries; ``seq_lens`` count the step's token, whose host location is
        ``last_locs[row]`` where given, else SGLang's table's), publish the window's figures and, with a
        target, resize the sampled working sets."""
        own_k, targets = batch.top_ks(self.top_k).tolist(), batch.targets(self.target).tolist()
        for row in self.rows:
            last = None if last_locs is None else last_locs[row]
            slot = int(batch.slots[row])
            recall, agreement = self.measure(
                batch.reqs[row], slot, layer_id, q_rows[row], seq_lens[row], scale, last, own_k[row]
            )
            if targets[row]:
                self.hold_target(slot, layer_id, float(recall.min()), targets[row], own_k[row])
            self._record(batch.reqs[row], layer_id, recall.tolist(), agreement.tolist())
        self._publish(layer_id)

    def fold(self, batch: BatchView, layers: list[int], seq_lens: list[int]) -> None:
        """A captured pass's samples (``recall_program.py`` left each sampled row's figures per layer in the
        tier's ``recall``; its target decisions are made, counted in the pass's counts): into the
        counters and the window, as ``sample`` would have (``seq_lens`` count the step's token)."""
        if not self.rows:
            return
        figures = self.tier.recall[batch.slots[self.rows]][:, layers]  # [rows, layers, 2, H]
        kv_pool = self.kv_pool
        token_bytes = kv_pool.head_num * kv_pool.head_dim * kv_pool.dtype.itemsize
        for row, per_layer in zip(self.rows, figures.tolist(), strict=True):
            self.stats.add("telemetry_bytes", len(layers) * seq_lens[row] * token_bytes)
            for layer, (recall, agreement) in zip(layers, per_layer, strict=True):
                self._record(batch.reqs[row], layer, recall, agreement)
        for layer in layers:
            self._publish(layer)

    def _record(self, req: int, layer_id: int, recall: list[float], agreement: list[float]) -> None:
        """One sample of request row ``req`` at ``layer_id`` (per KV head) into the counters and the window."""
        self.stats.add("recall_samples", len(recall))
        self.stats.add("recall_sum_ppm", round(1e6 * sum(recall)))
        self.stats.add("lookahead_agreement_sum_ppm", round(1e6 * sum(agreement)))
        self.stats.requests.add_recall(req, len(recall), sum(recall), sum(agreement))
        self._recall.extend(recall)
        self._agreement.extend(agreement)
        self._per_layer.setdefault(layer_id, deque(maxlen=WINDOW)).extend(recall)

    def measure(
        self, req: int, slot: int, layer_id: int, query: torch.Tensor, seq_len: int, scale: float,
        last_loc: int | None = None, top_k: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``([kv_heads], [kv_heads])``: recall and lookahead agreement (against the step's true top
        ``top_k`` blocks: the request's K, default the server's) of one request at one layer."""
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
        top = block_mass.topk(min(top_k or self.top_k, full), dim=-1).indices
        agreement = seen_blocks.gather(1, top).float().mean(dim=-1)
        return recall, agreement

    def hold_target(self, slot: int, layer_id: int, worst: float, target: float, base: int) -> None:
        """One sample of (request slot, layer) whose worst KV head's recall was ``worst``: below ``target``
        (the request's), double its top-K (up to the maximum); well above (within a quarter of the miss
        budget of 1.0) ``SHRINK_AFTER`` times in a row, halve it (down to ``base``: the request's own
        top-K)."""
        top_k = self.working_sets.top_k
        current = int(top_k[slot, layer_id])
        streak = 0
        if worst < target:
            self.stats.add("recall_below_target")
            if current < self.max_top_k:
                top_k[slot, layer_id] = min(self.max_top_k, 2 * current)
                self.stats.add("recall_target_grows")
        elif worst >= 1.0 - (1.0 - target) / 4 and current > base:
            streak = int(self.streak[slot, layer_id]) + 1
            if streak >= SHRINK_AFTER:
                top_k[slot, layer_id] = max(base, current // 2)
                self.stats.add("recall_target_shrinks")
                streak = 0
        self.streak[slot, layer_id] = streak

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
