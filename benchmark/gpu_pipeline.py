"""The real prefetch pipeline in a decode step, without SGLang: ``benchmark/gpu_check.py``'s pipeline rows.

A Qwen3-8B-shaped layer stack (``gpu_check.Stack``, random weights) decodes ``batch`` requests of
``context`` tokens. Per layer the step attends each KV head's working set plus a device tail
(``headwise_decode_attention``), then hands the layer's selection job to the runtime's own pieces:
``PrefetchPipeline`` (CUDA: a side stream and events; CPU: a worker thread) runs ``BlockPrefetcher.run``
(score every block summary, top-K per KV head, capped delta plan against the working sets, batched
copy of the admitted blocks from a host pool in pinned memory), and the layer's next attention waits for
it. The summaries and working sets are a real ``DeviceTier`` on the device (one request slot per
request), the host pool is pinned host memory: the CUDA layout is these constructor arguments. The queries are random, so every step's prediction drifts as far as it can and the fetch cap
(ceil(0.05 K) blocks per KV head and step) is always used in full: the heaviest transfer load.

Modes (eager steps: a step with the pipeline's host-side work cannot be captured in a CUDA graph):
``none`` (working sets never change: the attention-only floor), ``sync`` (jobs run inline) and ``async``
(jobs overlap the next layers). Reported per step: ms, the foreground's wait for jobs, the job time
(selection and transfer, summed over layers), blocks loaded and deferred. After the timed steps every
occupied working-set slot (up to 20,000 drawn at random) is compared with the host block it claims to
hold (``copies_ok``).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from sgl_kernel_oasis import ops
from sglang_oasis.attention.block_prefetcher import BlockPrefetcher, JobResult, SelectionJob
from sglang_oasis.attention.prefetch_pipeline import PrefetchPipeline
from sglang_oasis.memory.device_layout import TierShape, layout
from sglang_oasis.memory.device_tier import DeviceTier
from sglang_oasis.memory.working_set import EMPTY, WorkingSetPool


class HostPool:
    """One layer's pool buffers shared by every layer (the copies read them all the same), pinned on
    CUDA: ``[pages * B, kv_heads, head_dim]``."""

    def __init__(
        self, num_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str
    ) -> None:
        self.k = torch.empty((num_tokens, kv_heads, head_dim), dtype=dtype, pin_memory=device == "cuda")
        self.v = torch.empty_like(self.k, pin_memory=device == "cuda")
        chunk = 1 << 16  # filled on the device and copied out: randn on 2 CPU cores would take minutes
        for start in range(0, num_tokens, chunk):
            rows = slice(start, min(start + chunk, num_tokens))
            shape = self.k[rows].shape
            self.k[rows] = torch.randn(shape, device=device, dtype=dtype).cpu()
            self.v[rows] = torch.randn(shape, device=device, dtype=dtype).cpu()

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class PipelinedDecode:
    """One mode's decode state: working sets, the prefetcher and the pipeline; ``attend`` is the
    per-layer attention ``Stack.step`` calls."""

    def __init__(self, shape: Any, ctx: dict[str, Any], mode: str, device: str) -> None:
        s = shape
        self.ctx, self.mode, self.device = ctx, mode, device
        tier: DeviceTier = ctx["tier"]
        self.working_sets = tier.working_sets
        for slot in range(ctx["batch"]):  # every mode starts from empty working sets
            self.working_sets.claim(slot, tier.claims + 1 + slot)
        self.prefetcher = BlockPrefetcher(
            self.working_sets, tier.summaries, tier.active, ctx["host"], 0, s.kv_heads
        )
        self.pipeline: PrefetchPipeline[JobResult] = PrefetchPipeline(mode == "async", device)
        self.results: list[JobResult] = []
        self.step = 0
        self.scale = s.head_dim**-0.5

    def job(self, layer: int, queries: torch.Tensor, admission: bool) -> SelectionJob:
        ctx = self.ctx
        return SelectionJob(
            layer_id=layer, reqs=ctx["reqs"], slots=ctx["reqs"], generations=(0,) * ctx["batch"], queries=queries,
            prior=None, pinned=None, full=ctx["full"], pages=ctx["pages"], step=self.step, admission=admission,
            cap=None if admission else ctx["cap"], fail_reqs=(), top_k=ctx["top_k"],
        )  # fmt: skip

    def admit(self, layers: int, queries: torch.Tensor) -> None:
        """Every layer's first working set, uncapped."""
        for layer in range(layers):
            self.prefetcher.run(self.job(layer, queries, admission=True))

    def attend(self, layer: int, q: torch.Tensor, new_k: torch.Tensor, new_v: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        self.results.extend(self.pipeline.wait(layer))
        slot_rows = self.working_sets.slot_rows(ctx["reqs"], layer).to(
            self.device, non_blocking=True
        )  # as the backend
        ws_k, ws_v = self.working_sets.block_views()
        ctx["tail_k"][layer][ctx["new_locs"]] = new_k  # the new token joins the active block and its summary
        ctx["tail_v"][layer][ctx["new_locs"]] = new_v
        self.prefetcher.summaries.update(layer, ctx["summary_locs"], new_k)
        out = ops.headwise_decode_attention(
            q[:, None], ws_k, ws_v, slot_rows, ctx["tail_k"][layer], ctx["tail_v"][layer], ctx["tail_locs"],
            ctx["tail_valid"], self.scale,
        )[:, 0]  # fmt: skip
        if self.mode != "none":  # random predicting queries: the prediction drifts as far as it can
            selection = self.job(layer, torch.randn_like(q), admission=False)
            self.pipeline.submit(layer, lambda: self.prefetcher.run(selection))
        return out

    def run(self, stack: Any, x: torch.Tensor, steps: int) -> dict[str, Any]:
        """``steps`` timed decode steps after one warm-up; the row of this mode."""
        timings = []
        for step in range(steps + 1):
            self.step = step + 1
            if step == 1:  # the warm-up step's jobs are not counted
                self.results.clear()
                self.pipeline.take_waited_ns()
            _sync(self.device)
            began = time.perf_counter()
            stack.step(x, self.attend)
            _sync(self.device)
            if step:
                timings.append((time.perf_counter() - began) * 1e3)
        waited_ns = self.pipeline.take_waited_ns()
        self.results.extend(self.pipeline.drain())
        _sync(self.device)
        self.pipeline.shutdown()
        n = max(1, len(timings))
        results = self.results
        job_steps = max(1.0, len(results) / len(stack.layers))  # jobs per step: one per layer
        return {
            "mode": self.mode, "steps": len(timings),
            "step_ms": sorted(timings)[len(timings) // 2] if timings else 0.0,
            "wait_ms_per_step": waited_ns / 1e6 / n,
            "job_ms_per_step": sum(r.select_ns + r.transfer_ns for r in results) / 1e6 / job_steps,
            "loads_per_step": sum(r.loads for r in results) / job_steps,
            "deferred_per_step": sum(r.deferred for r in results) / job_steps,
            "copies_ok": copies_match(self.working_sets, self.ctx["host"], self.ctx["pages"]),
        }  # fmt: skip


def pipeline_rows(stack: Any, batch: int, contexts: list[int], device: str, steps: int) -> list[dict]:
    """One row per (context, mode); see the module docstring."""
    s = stack.s
    b, h, d = s.block, s.kv_heads, s.head_dim
    dtype = stack.layers[0][0].dtype
    x = torch.randn(batch, s.hidden, device=device, dtype=dtype)
    rows = []
    for context in contexts:
        blocks = context // b
        num_pages = batch * blocks
        element_bytes = torch.empty(0, dtype=dtype).element_size()
        shape = TierShape(
            s.layers, h, d, element_bytes, num_pages, b, s.top_k, window_blocks=0, active_tokens=b
        )
        tier = DeviceTier(shape, layout(2**62, shape, max_request_slots=batch), dtype, device)
        summaries = tier.summaries
        summaries.kmin.normal_()
        summaries.kmax.copy_(summaries.kmin + summaries.kmin.abs())
        tail = b // 2
        ctx = {
            "batch": batch, "dtype": dtype, "tier": tier,
            "host": HostPool(num_pages * b, h, d, dtype, device),
            "reqs": torch.arange(batch),
            "pages": torch.arange(num_pages).view(batch, blocks),  # request r's block i: page r * blocks + i
            "full": torch.full((batch,), blocks, dtype=torch.int64),
            "cap": math.ceil(s.fetch_ratio * s.top_k),
            "top_k": torch.full((batch,), s.top_k),
            # The device tier's active blocks (a ring of b positions per request and layer), as decode reads them.
            "tail_k": list(tier.active.k.normal_()),
            "tail_v": list(tier.active.v.normal_()),
            "tail_locs": torch.arange(batch, device=device)[:, None] * b + torch.arange(tail, device=device),
            "tail_valid": torch.ones(batch, 1, tail, dtype=torch.bool, device=device),
            "summary_locs": torch.arange(batch, device=device) * blocks * b + tail - 1,  # mid-page: no restart
        }  # fmt: skip
        ctx["new_locs"] = ctx["tail_locs"][:, -1].contiguous()
        queries = torch.randn(batch, s.q_heads, d, device=device, dtype=dtype)
        for mode in ("none", "sync", "async"):
            decode = PipelinedDecode(s, ctx, mode, device)
            decode.admit(s.layers, queries)
            row = decode.run(stack, x, steps)
            rows.append({"context": context, "batch": batch, "cap_per_head": ctx["cap"], **row})
            del decode
        del ctx, summaries, tier
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def copies_match(
    working_sets: WorkingSetPool, host: HostPool, pages: torch.Tensor, most: int = 20000
) -> bool:
    """Occupied slots (all, or ``most`` of them drawn at random) hold exactly the host block their
    mapping names (K and V)."""
    b = working_sets.block_size
    blocks = working_sets.slot_block  # [reqs, layers, heads, slots]
    occupied = (blocks != EMPTY).nonzero()
    if not len(occupied):
        return False
    if len(occupied) > most:
        occupied = occupied[torch.randperm(len(occupied), generator=torch.Generator().manual_seed(0))[:most]]
    req, layer, head, slot = occupied.unbind(1)
    tokens = pages[req, blocks[req, layer, head, slot]][:, None] * b + torch.arange(b)  # [n, B]
    want_k = host.k[tokens, head[:, None]]
    want_v = host.v[tokens, head[:, None]]
    got_k = working_sets.k[req, layer, head, slot].cpu()
    got_v = working_sets.v[req, layer, head, slot].cpu()
    return bool(torch.equal(got_k, want_k) and torch.equal(got_v, want_v))
