"""The runtime's captured decode step on a GPU, without SGLang: ``benchmark/gpu_check.py``'s captured rows.

``attention/decode_program.py`` is the sparse decode step that ``--oasis-decode-step captured`` compiles on
CPU: per layer on fixed shapes, without a host sync, the new token into the host tier, its page's summary
and the active blocks; attention over each KV head's working set plus the active tail; scoring, top-K
and the capped delta plan; the copies of the next step's blocks. Here a Qwen3-8B-shaped layer stack
(``gpu_check.Stack``, random weights) runs it as its attention, and the whole step is captured in one
``torch.cuda.CUDAGraph`` and replayed.

The host tier (every request's ``context`` tokens, one pool shared by the layers as in ``gpu_pipeline.py``)
is pinned host memory. The step reads it in place: its index kernels get a device view of the pinned
pages (CUDA's unified addressing), so the copies of the next step's blocks cross PCIe inside the graph.
Each layer's copies (``decode_ops.copy_blocks``) run on a side stream forked from the step's stream
after that layer's attention and plan, so they overlap the later layers, and joined at the step's end
(the next step's attention reads them); both inside the captured graph. Summaries, working sets (K
blocks per KV head) and the active blocks are on the device.

Rows per (context, batch), K = 128 with the 5% cap, random hidden states every step (each step's
selection drifts as far as it can: the heaviest copy load), 50 replays timed:

- ``eager_ms``, ``replay_ms``, and ``dense_ms`` (``gpu_check.dense_step``: SDPA over the whole context in
  device memory, also replayed from a graph) at the same batch and context;
- ``host_blocks_per_step`` (the copies from the host tier; blocks that just filled come from the active
  blocks), ``host_bytes_per_step`` and those bytes over the replay time (``host_gbps``), to read beside
  the pinned host-to-device copy bandwidth in ``gpu_check``'s ``bandwidth``.

Checks (``checks``): ``replay_equals_eager``: a few steps replayed (copies on the side stream) from a copy
of the starting state leave the same outputs and state as the same steps run eagerly with the copies in
line; ``covering_rel_err``: with K covering every
block and no cap, the step after the working sets were filled attends exactly as SDPA over the whole
context (relative error of the output).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from gpu_pipeline import HostPool
from gpu_timing import graphed, timed
from sglang_oasis.attention.decode_program import (
    LayerState,
    StepPlan,
    StepShape,
    attend_and_plan,
    copy_blocks,
)
from sglang_oasis.memory.pinned_host import device_view
from sglang_oasis.memory.working_set import EMPTY

CHECK_STEPS = 3  # steps replayed against eager ones


class Program:
    """Every layer's state for ``batch`` requests of ``context`` tokens, and the step's plan."""

    def __init__(
        self, s: Any, batch: int, context: int, top_k: int, fetch_ratio: float, device: str, dtype: torch.dtype,
        layers: int | None = None, fill: bool = True,
    ) -> None:  # fmt: skip
        b, h, d = s.block, s.kv_heads, s.head_dim
        if context % b:
            raise ValueError(f"context {context} is not a multiple of the block size {b}")
        self.s, self.batch, self.context, self.device = s, batch, context, device
        self.layers = s.layers if layers is None else layers
        blocks = context // b  # full blocks once this step's token (position context - 1) is in
        per_request = (blocks + 1) * b  # room for the next position (the covering check's second step)
        slots = batch + 1  # the last one takes the padding rows and masked copies
        span = 2 * b
        copies = top_k if fetch_ratio >= 1 else min(top_k, math.ceil(fetch_ratio * top_k) + 1)
        self.shape = StepShape(b, span, 0, top_k, fetch_ratio, copies, batch)
        gen = torch.Generator(device="cpu").manual_seed(context * 31 + batch)
        pool = HostPool(batch * per_request, h, d, dtype, device)  # pinned on CUDA
        host_k, host_v = pool.k, pool.v
        self.host_k, self.host_v = host_k, host_v
        view_k, self.uva = device_view(host_k)
        view_v, _ = device_view(host_v)
        # The prompt (positions 0 .. context - 2) is in: summaries of every page, the last partial block in
        # the active ring, the covered blocks the working sets may hold.
        base = torch.arange(batch, device=device) * per_request
        tokens = (base[:, None] + torch.arange(context - 1, device=device)).flatten()
        pages = (base // b)[:, None] + torch.arange(blocks, device=device)
        kmin = torch.full((batch * (blocks + 1), h, d), torch.inf, device=device, dtype=dtype)
        kmax = torch.full_like(kmin, -torch.inf)
        keys = view_k[tokens]
        page_of = (tokens // b)[:, None, None].expand_as(keys)
        kmin.scatter_reduce_(0, page_of, keys, "amin")
        kmax.scatter_reduce_(0, page_of, keys, "amax")
        covered = blocks - 1
        tail = base[:, None] + covered * b + torch.arange(b - 1, device=device)  # [batch, B - 1]
        ring = (
            torch.arange(batch, device=device)[:, None] * span
            + (covered * b + torch.arange(b - 1, device=device)) % span
        )
        self.states: list[LayerState] = []
        for _ in range(self.layers):
            ws_k = torch.zeros((slots, h, top_k, b, d), device=device, dtype=dtype)
            ws_v = torch.zeros_like(ws_k)
            slot_block = torch.full((slots, h, top_k), EMPTY, dtype=torch.int64, device=device)
            if fill:  # K distinct covered blocks per head (a random working set), their KV from the host
                held = torch.rand((batch, h, covered), generator=gen).argsort(-1)[..., :top_k].to(device)
                count = held.shape[-1]
                slot_block[:batch, :, :count] = held
                rows = (pages.gather(1, held.flatten(1)).view(batch, h, count) * b)[..., None] + torch.arange(
                    b, device=device
                )
                head = torch.arange(h, device=device)[None, :, None, None]
                ws_k[:batch, :, :count] = view_k[rows, head]
                ws_v[:batch, :, :count] = view_v[rows, head]
            active_k = torch.zeros((slots * span, h, d), device=device, dtype=dtype)
            active_v = torch.zeros_like(active_k)
            active_k[ring.flatten()] = view_k[tail.flatten()]
            active_v[ring.flatten()] = view_v[tail.flatten()]
            start = torch.zeros(slots, dtype=torch.int64, device=device)
            start[:batch] = covered * b
            end = torch.zeros_like(start)
            end[:batch] = context - 1
            self.states.append(LayerState(
                view_k, view_v, kmin.clone(), kmax.clone(), ws_k, ws_v, slot_block, torch.zeros_like(slot_block),
                torch.full((slots,), covered, dtype=torch.int64, device=device),
                torch.full((slots,), top_k, dtype=torch.int64, device=device),
                torch.full((slots, h, 1), -1, dtype=torch.int64, device=device), active_k, active_v, start, end,
            ))  # fmt: skip
        self.plan = StepPlan(
            torch.arange(batch, device=device), torch.full((batch,), context, device=device), base + context - 1,
            pages, torch.tensor(1, device=device),
        )  # fmt: skip
        self.loads = torch.zeros(2, dtype=torch.int64, device=device)  # copies: all, from the active blocks
        self.scale = d**-0.5
        self.side = torch.cuda.Stream() if device == "cuda" else None  # None: the copies in line
        self._in_flight: list[Any] = []  # the copies' index tensors, kept until the join (no reuse before)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        state = self.states[layer]
        out, counts, copies = attend_and_plan(self.shape, state, self.plan, q, k, v, self.scale)
        self.loads += counts[:, [0, 2]].sum(0)
        if self.side is None:
            copy_blocks(state, copies)
            return out
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)  # fork: this layer's tables and the tokens the copies read are written
        with torch.cuda.stream(self.side):
            copy_blocks(state, copies)
        self._in_flight.append(copies)
        if layer == self.layers - 1:  # join: the next step's attention reads the copied blocks
            main.wait_stream(self.side)
            self._in_flight.clear()
        return out

    def snapshot(self) -> list[list[torch.Tensor]]:
        # everything but the host tier (and the recall probe's fields: this step has none)
        return [[t.clone() for t in state[2:] if t is not None] for state in self.states]

    def restore(self, saved: list[list[torch.Tensor]]) -> None:
        for state, tensors in zip(self.states, saved, strict=True):
            for t, kept in zip([t for t in state[2:] if t is not None], tensors, strict=True):
                t.copy_(kept)  # in place: a captured graph keeps its addresses


def replay_equals_eager(stack: Any, program: Program, x: torch.Tensor, device: str) -> dict[str, Any]:
    """``CHECK_STEPS`` steps from one starting state, eager and replayed: the same outputs and state."""
    inputs = [torch.randn_like(x) for _ in range(CHECK_STEPS)]
    static_in = x.clone()
    out: list[torch.Tensor] = []

    def step() -> None:
        out[:] = [stack.step(static_in, program.attend)]

    saved = program.snapshot()
    replay, _ = graphed(step, device, strict=True)  # on CPU the same function twice (the check still runs)
    graph_out = out[0] if out else None  # the graph's output buffer (a replay writes into it)
    program.restore(saved)
    eager, side = [], program.side
    program.side = None  # the eager steps copy in line
    for x_i in inputs:
        static_in.copy_(x_i)
        step()
        eager.append(out[0].clone())
    program.side = side
    eager_state = program.snapshot()
    program.restore(saved)
    replayed = []
    for x_i in inputs:
        static_in.copy_(x_i)
        replay()
        replayed.append((out[0] if graph_out is None else graph_out).clone())
    state_same = all(
        torch.equal(a, b)
        for la, lb in zip(eager_state, program.snapshot(), strict=True)
        for a, b in zip(la, lb, strict=True)
    )
    err = max(
        float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(replayed, eager, strict=True)
    )
    return {
        "replay_equals_eager": state_same and err == 0.0,
        "state_equal": state_same,
        "output_rel_err": err,
    }


def covering_rel_err(s: Any, context: int, device: str, dtype: torch.dtype) -> float:
    """K = every block, no cap, one layer, batch 1: the first step fills the working sets, the next one
    (position ``context``) attends over them as SDPA over the whole context does."""
    blocks = context // s.block
    program = Program(s, 1, context, blocks, 1.0, device, dtype, layers=1, fill=False)
    h, g, d = s.kv_heads, s.q_heads // s.kv_heads, s.head_dim
    q, k, v = (torch.randn(1, n, d, device=device, dtype=dtype) for n in (s.q_heads, h, h))
    program.attend(0, q, k, v)
    plan = program.plan
    program.plan = plan._replace(seq_lens=plan.seq_lens + 1, locs=plan.locs + 1, step=plan.step + 1)
    q, k, v = (torch.randn(1, n, d, device=device, dtype=dtype) for n in (s.q_heads, h, h))
    out = program.attend(0, q, k, v)
    state = program.states[0]
    keys = state.host_k[: context + 1].to(device).transpose(0, 1)[None]  # [1, H, context + 1, D]
    values = state.host_v[: context + 1].to(device).transpose(0, 1)[None]
    want = torch.nn.functional.scaled_dot_product_attention(q.view(1, h, g, d), keys, values).reshape(
        1, -1, d
    )
    return float((out.float() - want.float()).norm() / want.float().norm())


def captured_rows(
    stack: Any, batches: list[int], contexts: list[int], device: str, dense_ms: Callable[[int, int], float],
    top_k: int, fetch_ratio: float, repeat: int,
) -> dict[str, Any]:  # fmt: skip
    """The rows (see the module's docstring) and the checks."""
    s, dtype = stack.s, stack.layers[0][0].dtype
    small = min(contexts)
    check_program = Program(s, min(batches), small, top_k, fetch_ratio, device, dtype)
    x = torch.randn(min(batches), s.hidden, device=device, dtype=dtype)
    checks = replay_equals_eager(stack, check_program, x, device)
    checks["covering_rel_err"] = covering_rel_err(s, small, device, dtype)
    checks["host_tier_device_view"] = check_program.uva
    del check_program
    rows = []
    for context in contexts:
        for batch in batches:
            program = Program(s, batch, context, top_k, fetch_ratio, device, dtype)
            rows.append(_row(stack, program, repeat, device, dense_ms(batch, context)))
            del program
            if device == "cuda":
                torch.cuda.empty_cache()
    return {"checks": checks, "rows": rows}


def _row(stack: Any, program: Program, repeat: int, device: str, dense_ms: float) -> dict[str, Any]:
    s, batch, dtype = program.s, program.batch, program.states[0].ws_k.dtype
    x = torch.randn(batch, s.hidden, device=device, dtype=dtype)

    def step() -> None:
        stack.step(x.normal_(), program.attend)  # random hidden states: the selection drifts

    eager_ms = timed(step, device, min(repeat, 10))
    replay, graph = graphed(step, device, strict=True)  # CPU: no graph; the eager step again
    program.loads.zero_()  # counted over the replays (in the graph) and their warm-ups
    steps = [0]

    def counted() -> None:
        steps[0] += 1
        replay()

    replay_ms = timed(counted, device, repeat)
    loads, from_active = (int(v) for v in program.loads.tolist())
    host_blocks = (loads - from_active) / steps[0]
    host_bytes = host_blocks * 2 * s.block * s.head_dim * dtype.itemsize
    return {
        "context": program.context, "batch": batch, "top_k": program.shape.max_top_k, "cuda_graph": graph,
        "side_stream": program.side is not None,
        "eager_ms": eager_ms, "replay_ms": replay_ms, "dense_ms": dense_ms, "replay_vs_dense": replay_ms / dense_ms,
        "host_blocks_per_step": host_blocks, "host_bytes_per_step": host_bytes,
        "host_gbps": host_bytes / (replay_ms * 1e-3) / 1e9,
    }  # fmt: skip
