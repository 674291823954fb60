"""The runtime's own decode step on a GPU, without SGLang: ``benchmark/gpu_check.py``'s captured rows.

A Qwen3-8B-shaped layer stack (``gpu_check.Stack``, random weights) runs, as its attention, the step the
server runs under SGLang's CUDA graphs, built from the runtime's own classes, not a copy of them:

- the device tier is ``DeviceTier`` on the device (working sets, active blocks, summaries, and its index
  tables with their host mirror: ``memory/tier_tables.py``);
- the host tier is a stand-in for SGLang's pool (which this machine need not have), every layer reading
  one buffer of ``context`` tokens per request, page-locked in place (``memory/pinned_host.py``'s
  ``page_locked``) and read by the step through its CUDA view (unified addressing): the copies of the
  next step's blocks cross PCIe inside the graph;
- the step is ``GraphedStep`` (``attention/graphed_step.py``), called as SGLang's decode graph runner
  calls it: ``allocate`` once, ``capture`` before the graph of ``batch`` rows is warmed up and captured,
  then per pass ``prepare`` (the host plan, and the tables' rows uploaded), ``load`` (the plan into the
  graph's buffers), the replay (``decode_program.decode_layer`` per layer), ``fold`` (the counts and
  tables read back, one copy).

Rows per (context, batch), K = 128 with the 5% cap, random hidden states every step (each step's
selection drifts as far as it can: the heaviest copy load), ``repeat`` passes timed:

- ``eager_ms`` (the program per layer, uncaptured), ``replay_ms`` (the graph's replay alone), ``pass_ms``
  (a whole pass: the host plan, load, replay, fold), and ``dense_ms`` (``gpu_check.dense_step``: SDPA
  over the whole context in device memory, also replayed from a graph) at the same batch and context;
- ``host_blocks_per_step`` (the copies from the host tier; blocks that just filled come from the active
  blocks), ``host_bytes_per_step`` and those bytes over the replay time (``host_gbps``), to read beside
  the pinned host-to-device copy bandwidth in ``gpu_check``'s ``bandwidth``.

Checks (``checks``): ``replay_equals_eager``: a few passes through ``GraphedStep``'s buffers (replayed on
a GPU; on CPU the same calls on the same buffers) from a copy of the starting state leave the same
outputs and state as the same steps run eagerly on plans of their own (``StepPlan.to``, as
``CapturedStep`` runs); ``covering_rel_err``: with K covering every block and no cap, the step after the
working sets were filled attends exactly as SDPA over the whole context (relative error of the output).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from gpu_timing import graphed, timed
from sglang_oasis.attention.batch_view import BatchView
from sglang_oasis.attention.block_prefetcher import JobResult
from sglang_oasis.attention.decode_program import LayerState, decode_layer
from sglang_oasis.attention.graphed_step import GraphedStep
from sglang_oasis.attention.request_slots import RequestSlots
from sglang_oasis.config import OasisConfig
from sglang_oasis.memory import pinned_host
from sglang_oasis.memory.device_layout import TierShape, layout
from sglang_oasis.memory.device_tier import DeviceTier
from sglang_oasis.stats import OasisStats

CHECK_STEPS = 3  # passes replayed against eager ones


class HostTier:
    """The stand-in for SGLang's pool (``get_key_buffer``/``get_value_buffer``): one page-locked buffer
    of ``tokens`` per K and V, shared by every layer (the copies read them all the same), as the device
    reads it (its CUDA view; on CPU the buffer itself)."""

    def __init__(self, tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str) -> None:
        shape = (tokens, kv_heads, head_dim)
        self.in_place = device == "cuda"
        if self.in_place:
            self.k_host, self.v_host = (pinned_host.page_locked(shape, dtype) for _ in range(2))
            self.k, self.v = pinned_host.cuda_view(self.k_host), pinned_host.cuda_view(self.v_host)
        else:
            self.k, self.v = (torch.zeros(shape, dtype=dtype) for _ in range(2))
        chunk = 1 << 16  # random values made on the device: randn on 2 CPU cores would take minutes
        for start in range(0, tokens, chunk):
            rows = slice(start, min(start + chunk, tokens))
            self.k[rows] = torch.randn(self.k[rows].shape, device=device, dtype=dtype)
            self.v[rows] = torch.randn(self.v[rows].shape, device=device, dtype=dtype)

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v


class Program:
    """``batch`` requests of ``context`` tokens in the runtime's device tier and its graphed step."""

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
        self.pool = HostTier(batch * per_request + b, h, d, dtype, device)  # page 0: SGLang's padding page
        shape = TierShape(self.layers, h, d, dtype.itemsize, batch * (blocks + 1) + 2, b, top_k, 1, 2 * b, 1)
        self.tier = DeviceTier(shape, layout(1 << 50, shape, max_request_slots=batch), dtype, device, top_k)
        config = OasisConfig(
            block_size=b,
            top_k=top_k,
            fetch_ratio=fetch_ratio,
            decode_step="captured",
            sink_blocks=0,
            selector="summaries",
        )
        req_to_token = torch.zeros((batch + 1, per_request), dtype=torch.int32)
        for row in range(1, batch + 1):  # request row r's tokens, after the padding page
            req_to_token[row] = torch.arange(per_request, dtype=torch.int32) + (row - 1) * per_request + b
        requests = SimpleNamespace(req_to_token=req_to_token, req_generation=torch.zeros(batch + 1, dtype=torch.int64),
                                   free_slots=[])  # fmt: skip
        self.slots = RequestSlots(self.tier, requests, b)
        self.step = GraphedStep(config, self.tier, self.pool, req_to_token, self.slots, OasisStats(None, owner=False),
                                list(range(self.layers)))  # fmt: skip
        self.step.allocate(batch)
        self.results: list[JobResult] = []
        self.step.account = self.results.append
        self._admit(blocks, top_k if fill else 0, torch.Generator().manual_seed(context * 31 + batch))
        reqs = list(range(1, batch + 1))
        self.view = BatchView(reqs, torch.tensor(reqs), torch.tensor([self.tier.slot(r) for r in reqs]), [0] * batch, 1,
                              torch.zeros(batch, dtype=torch.bool))  # fmt: skip
        self.seq_lens = torch.full((batch,), context, dtype=torch.int64)
        self.locs = req_to_token[reqs, context - 1].to(torch.int64)
        self.scale = d**-0.5
        self.layer_specs = [
            SimpleNamespace(layer_id=layer, tp_q_head_num=s.q_heads, qk_head_dim=d, v_head_dim=d, scaling=self.scale)
            for layer in range(self.layers)
        ]  # fmt: skip

    def _admit(self, blocks: int, held_blocks: int, gen: torch.Generator) -> None:
        """The prompt (positions 0 .. context - 2) in, as an admission leaves it: every page's summary, the
        last partial block in the active ring, K random covered blocks per head in the working sets (their
        KV from the host tier): on the host's tables, uploaded; the data on the device."""
        tier, b, batch, host = self.tier, self.s.block, self.batch, self.tier.tables.host
        covered = blocks - 1
        keys, values = self.pool.k, self.pool.v
        table = self.slots.req_pool.req_to_token
        for row in range(1, batch + 1):
            slot = self.slots.claim(row, 0)
            tokens = table[row, : self.context - 1].to(torch.int64).to(keys.device)
            tier.summaries.update(0, tokens, keys[tokens].to(tier.summaries.kmin.dtype))  # layer 0's; below
            page_ids = table[row, 0 : blocks * b : b].to(torch.int64) // b
            heads = self.s.kv_heads
            if held_blocks:
                held = torch.rand((self.layers, heads, covered), generator=gen).argsort(-1)[..., :held_blocks]
                count = held.shape[-1]
                host["slot_block"][slot, :, :, :count] = held
                rows = (page_ids[held] * b)[..., None] + torch.arange(b)  # [L, H, count, B]
                head = torch.arange(heads)[None, :, None, None]
                ws = tier.working_sets
                ws.k[slot, :, :, :count] = keys[rows.to(keys.device), head.to(keys.device)].to(ws.k.device)
                ws.v[slot, :, :, :count] = values[rows.to(keys.device), head.to(keys.device)].to(ws.v.device)
            tail = tokens[covered * b :]
            ring = tier.active.rows(torch.tensor([slot]), torch.arange(covered * b, self.context - 1)[None])[
                0
            ]
            for layer in range(self.layers):
                tier.active.k[layer][ring.to(keys.device)] = keys[tail]
                tier.active.v[layer][ring.to(keys.device)] = values[tail]
            host["covered"][slot] = covered
            host["active_start"][slot], host["active_end"][slot] = covered * b, self.context - 1
        summaries = tier.summaries  # every layer reads the same host buffer: the same summaries
        summaries.kmin[1:] = summaries.kmin[0]
        summaries.kmax[1:] = summaries.kmax[0]
        tier.tables.upload(torch.arange(batch))

    # --- the step, as SGLang's decode graph runner calls it ---------------------------------------

    def plan(self) -> None:
        """The host's part of a pass before the replay: plan (tables uploaded), then the graph's buffers."""
        if not self.step.prepare(self.view, self.seq_lens, self.locs):
            raise RuntimeError("the graphed step would not run this pass (its tails are not held)")
        self.step.load(self.batch)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One layer inside the graph: ``GraphedStep.decode`` on its buffers."""
        out = self.step.decode(self.layer_specs[layer], q, k, v)  # type: ignore[arg-type]
        assert out is not None
        return out.view(self.batch, self.s.q_heads, self.s.head_dim)

    def eager_pass(self, stack: Any, x: torch.Tensor) -> torch.Tensor:
        """A pass uncaptured (``CapturedStep``'s way): the host plan, the program per layer on a plan of its
        own, the tables read back."""
        self.step.prepare(self.view, self.seq_lens, self.locs)
        out = stack.step(x, self.eager_attend)
        self.tier.tables.download(self.view.slots)
        return out

    def eager_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One layer uncaptured, on a plan of its own (what ``CapturedStep`` runs)."""
        state = LayerState.of(self.tier, self.pool, layer)  # type: ignore[arg-type]
        plan = self.step.planned.plan.to(torch.device(self.device))
        out, _ = decode_layer(self.step.shape, state, plan, q, k, v, self.scale)
        return out

    def _state(self) -> list[torch.Tensor]:
        return [*self.tier.tensors().values(), *self.tier.host_tensors().values()]

    def snapshot(self) -> list[torch.Tensor]:
        """The device tier's state and the host's tables (the host tier: only this step's token writes it,
        the same each time)."""
        return [t.clone() for t in self._state()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, kept in zip(self._state(), saved, strict=True):
            t.copy_(kept)  # in place: a captured graph keeps its addresses


def replay_equals_eager(stack: Any, program: Program, x: torch.Tensor, device: str) -> dict[str, Any]:
    """``CHECK_STEPS`` passes from one starting state, eager and through the graphed step: the same
    outputs and state."""
    inputs = [torch.randn_like(x) for _ in range(CHECK_STEPS)]
    static_in = x.clone()
    out: list[torch.Tensor] = []
    saved = program.snapshot()
    eager = [program.eager_pass(stack, x_i).clone() for x_i in inputs]
    eager_state = program.snapshot()
    program.restore(saved)

    def step() -> None:
        out[:] = [stack.step(static_in, program.attend)]

    program.step.capture(program.batch)
    replay, _ = graphed(step, device, strict=True)  # SGLang's runner: warm-up and capture on padding rows
    graph_out = out[0] if out else None  # the graph's output buffer (a replay writes into it)
    program.restore(saved)
    replayed = []
    for x_i in inputs:
        static_in.copy_(x_i)
        program.plan()
        replay()
        program.step.fold()
        replayed.append((out[0] if graph_out is None else graph_out).clone())
    state_same = all(torch.equal(a, b) for a, b in zip(eager_state, program.snapshot(), strict=True))
    err = max(
        float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(replayed, eager, strict=True)
    )
    return {
        "replay_equals_eager": state_same and err < 1e-3,
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
    program.step.prepare(program.view, program.seq_lens, program.locs)
    program.eager_attend(0, q, k, v)
    program.tier.tables.download(program.view.slots)
    program.seq_lens, program.locs = program.seq_lens + 1, program.locs + 1
    program.view = program.view._replace(step=2)
    q, k, v = (torch.randn(1, n, d, device=device, dtype=dtype) for n in (s.q_heads, h, h))
    program.step.prepare(program.view, program.seq_lens, program.locs)
    out = program.eager_attend(0, q, k, v)
    first = int(program.slots.req_pool.req_to_token[1, 0])
    keys = program.pool.k[first : first + context + 1].transpose(0, 1)[None]  # [1, H, context + 1, D]
    values = program.pool.v[first : first + context + 1].transpose(0, 1)[None]
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
    checks["host_tier_device_view"] = check_program.pool.in_place
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
    s, batch, dtype = program.s, program.batch, program.tier.working_sets.k.dtype
    x = torch.randn(batch, s.hidden, device=device, dtype=dtype)

    eager_ms = timed(lambda: program.eager_pass(stack, x.normal_()), device, min(repeat, 10))

    def step() -> None:
        stack.step(x.normal_(), program.attend)  # random hidden states: the selection drifts

    program.step.capture(batch)
    replay, graph = graphed(step, device, strict=True)  # CPU: no graph; the same calls again
    program.plan()
    replay_ms = timed(replay, device, repeat)  # the replay alone (the plan in its buffers: the same)
    program.step.fold()
    program.results.clear()

    def whole_pass() -> None:
        program.plan()
        replay()
        program.step.fold()

    pass_ms = timed(whole_pass, device, repeat)
    loads = sum(r.loads - r.from_active for r in program.results) / max(1, len(program.results))
    host_bytes = loads * 2 * s.block * s.head_dim * dtype.itemsize
    return {
        "context": program.context, "batch": batch, "top_k": program.step.shape.max_top_k, "cuda_graph": graph,
        "eager_ms": eager_ms, "replay_ms": replay_ms, "pass_ms": pass_ms, "dense_ms": dense_ms,
        "replay_vs_dense": replay_ms / dense_ms, "pass_vs_dense": pass_ms / dense_ms,
        "host_blocks_per_step": loads, "host_bytes_per_step": host_bytes,
        "host_gbps": host_bytes / (replay_ms * 1e-3) / 1e9,
    }  # fmt: skip
