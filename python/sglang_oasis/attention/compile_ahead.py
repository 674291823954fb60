"""The captured step's programs compiled before the server is ready, as SGLang captures its CUDA graphs.

SGLang captures a graph for every batch size it may run at start-up, before ``/health`` answers, so a user
never pays a capture while serving. The captured step (``--oasis-decode-step captured``) does the same: at
its first decode pass (SGLang's warm-up request, which runs before the server reports ready) it compiles
its program

- for every batch bucket it will run (``buckets_ahead``: up to the server's running-request cap, or
  ``--cuda-graph-max-bs-decode``, or the buckets holding ``--cuda-graph-bs-decode``'s sizes: SGLang's own
  knobs for its graphs' sizes),
- in every kind of pass the server runs (``kinds_ahead``: plain decode, or the lookahead's verify passes;
  with recall telemetry on, each one's sample-pass variant too),
- at the smallest and the largest block bucket (the block count is symbolic: one graph serves them all
  unless torch guards on it, and a second graph then compiles here; the sample pass sums over every
  position in double so that none is needed),

as two graphs per kind (``graphs_ahead``): the batch dimension is symbolic too (``StepPlan.mark_symbolic``),
so the first bucket above one row compiles a graph that every larger bucket reuses, and a single row
(torch specializes a dimension of one) has its own. On the README's default server (12 programs, AMD EPYC,
2 cores) that took the first start's compiles from 258 s to 90 s and a cached start's from 15.3 s to 8.2 s;
a compiled call costs ~2% more at 4 and 8 rows than a graph specialized to its bucket (in process),

on padding rows only (they write the device tier's padding slot, which no request holds). Each compile is
logged with its time and counted in ``captured_compile_ms`` (``Compiles``), which then never grows. A pass
of a bucket or kind not compiled runs eagerly (``captured_uncompiled_passes``) rather than stalling the
requests running for a compile. torch's on-disk cache (``TORCHINDUCTOR_CACHE_DIR``; the launcher's under
the project's cache) makes a later start's graphs ~2 s each.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

import torch
from torch._dynamo.utils import counters

from sglang_oasis.attention.layer_state import LayerState
from sglang_oasis.attention.step_plan import StepPlan, StepShape, held_slots, symbolic_rows

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.model_runner import ModelRunner

    from sglang_oasis.memory.device_tier import DeviceTier
    from sglang_oasis.stats import OasisStats

logger = logging.getLogger(__name__)


class CapturedStep(Protocol):
    """What compiling ahead uses of the captured step (``captured_step.CapturedStep``)."""

    tier: DeviceTier
    shape: StepShape
    stats: OasisStats
    sparse_layers: list[int]
    req_to_token: torch.Tensor
    block_buckets: tuple[int, ...]
    program: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    covers: Callable[[], bool]
    compiles: Compiles

    def state(self, layer_id: int) -> LayerState: ...


# torch's limit on one function's graphs (8 by default): the captured step has two per kind of pass (up to
# 4 kinds), more if torch guards on a block count or a batch size; every one is checked at every call
GRAPHS_LIMIT = 256


class Compiles:
    """The shapes the captured step's program has run at, and at a new one: torch's compile settings the
    step needs, for that call only (never process-wide: graphs per kind of pass, SGLang's CPU runner
    raises the same limit; compiled in this process, as a pool of compile workers would hold hundreds of
    MiB for nothing), and the time a graph torch compiled there took (``captured_compile_ms``)."""

    def __init__(self, stats: OasisStats) -> None:
        self.stats = stats
        self.shapes: set[tuple[int, int, str]] = set()  # (rows, blocks, kind of pass)

    @contextlib.contextmanager
    def at(self, rows: int, blocks: int, kind: str) -> Iterator[None]:
        dynamo = torch._dynamo.config
        if (rows, blocks, kind) in self.shapes:  # the graphs are there: only torch's limit, cheaply (~4 us)
            limit = dynamo.cache_size_limit
            dynamo.cache_size_limit = max(limit, GRAPHS_LIMIT)
            try:
                yield
            finally:
                dynamo.cache_size_limit = limit
            return
        self.shapes.add((rows, blocks, kind))
        graphs, started = counters["stats"]["unique_graphs"], time.perf_counter()
        limit = max(dynamo.cache_size_limit, GRAPHS_LIMIT)
        # no duck sizing: symbolic sizes equal at the trace (a batch of 8 rows, 8 held slots) stay apart,
        # or the graph would guard on their equality and the next pass compile another
        with (
            dynamo.patch(cache_size_limit=limit),
            torch._inductor.config.patch(compile_threads=1),
            torch.fx.experimental._config.patch(use_duck_shape=False),  # type: ignore[attr-defined]
        ):
            yield
        if counters["stats"]["unique_graphs"] != graphs:
            self.stats.add("captured_compile_ms", round((time.perf_counter() - started) * 1000))


def kind_of(verify: bool, sample: bool) -> str:
    """A pass's program variant (graphs of its own)."""
    return ("verify" if verify else "decode") + ("+sample" if sample else "")


def kinds_ahead(verify: bool, sampling: bool) -> tuple[str, ...]:
    """The kinds of pass a server runs: decode or verify, and with recall telemetry their sample passes."""
    return (kind_of(verify, False), kind_of(verify, True)) if sampling else (kind_of(verify, False),)


def buckets_ahead(
    batch_buckets: Sequence[int], running: int, max_bs: int | None = None, sizes: Sequence[int] | None = None
) -> tuple[int, ...]:
    """The batch buckets to compile: those holding ``sizes`` (``--cuda-graph-bs-decode``), else every bucket
    up to the one holding ``min(running, max_bs)`` (``--cuda-graph-max-bs-decode``)."""

    def holding(n: int) -> int:
        return next((b for b in batch_buckets if b >= n), batch_buckets[-1])

    if sizes:
        return tuple(sorted({holding(n) for n in sizes if n >= 1}))
    top = holding(max(1, min(running, max_bs) if max_bs else running))
    return tuple(b for b in batch_buckets if b <= top)


def graphs_ahead(buckets: Sequence[int], kinds: Sequence[str]) -> int:
    """The graphs compiling ``buckets`` x ``kinds`` makes: per kind, one for a single row and one for every
    larger bucket (the batch dimension is symbolic, ``StepPlan.mark_symbolic``; torch specializes one)."""
    return len(kinds) * ((1 in buckets) + any(b > 1 for b in buckets))


class CompileAhead:
    """The captured step's plan of compiles before ready (see the module), and what it compiled."""

    def __init__(self, buckets: tuple[int, ...], kinds: tuple[str, ...], verify_rows: int) -> None:
        self.buckets, self.kinds, self.verify_rows = buckets, kinds, verify_rows
        self.done = False
        self.compiled: set[tuple[int, str]] = set()

    @classmethod
    def for_server(
        cls, batch_buckets: Sequence[int], model_runner: ModelRunner, verify_rows: int, sampling: bool
    ) -> CompileAhead:
        """From SGLang's model runner: its running-request cap and its decode graphs' sizes, if given."""
        args = model_runner.server_args
        running = getattr(model_runner, "max_running_requests", None)
        buckets = buckets_ahead(
            batch_buckets, running if isinstance(running, int) else batch_buckets[-1],
            getattr(args, "cuda_graph_max_bs_decode", None), getattr(args, "cuda_graph_bs_decode", None),
        )  # fmt: skip
        return cls(buckets, kinds_ahead(verify_rows > 0, sampling), verify_rows)

    def covers(self, rows: int, kind: str) -> bool:
        """Whether a pass of ``rows`` (a bucket) and ``kind`` may run the program: compiled, or nothing
        compiled yet (this pass is the first: ``run`` compiles before it)."""
        return not self.done or (rows, kind) in self.compiled

    def run(self, step: CapturedStep, layer: RadixAttention, dtype: torch.dtype) -> None:
        """Compile every (bucket, kind) on padding rows, with the real layer's heads and scale."""
        self.done = True
        state = step.state(step.sparse_layers[0])
        device, kv_heads = step.tier.device, step.tier.shape.num_kv_heads
        started = time.perf_counter()
        logger.info(
            "oasis: compiling the captured decode step before the server is ready: batch buckets %s, %s "
            "(torch's cache: %s)", list(self.buckets), " and ".join(self.kinds),
            os.environ.get("TORCHINDUCTOR_CACHE_DIR", "its default"),
        )  # fmt: skip
        # the smallest and the largest block bucket: one graph serves every bucket between unless torch
        # guards on the block count (a threshold), and then the second graph is compiled here, not serving
        block_buckets = tuple(dict.fromkeys((step.block_buckets[0], step.block_buckets[-1])))
        built = 0  # graphs: two per kind of pass (one row; every larger bucket, ``StepPlan.mark_symbolic``)
        for rows in self.buckets:
            for kind in self.kinds:
                lead = (rows,) if kind.startswith("decode") else (rows, self.verify_rows)
                q = torch.zeros((*lead, layer.tp_q_head_num, layer.qk_head_dim), dtype=dtype, device=device)
                k = torch.zeros((*lead, kv_heads, layer.qk_head_dim), dtype=dtype, device=device)
                v = torch.zeros((*lead, kv_heads, layer.v_head_dim), dtype=dtype, device=device)
                symbolic_rows(q, k, v)  # as every pass
                began, graphs = time.perf_counter(), counters["stats"]["unique_graphs"]
                try:
                    for blocks in block_buckets:
                        plan = self.padding(step, rows, kind, blocks).to(device)
                        plan.mark_symbolic()
                        with step.compiles.at(rows, blocks, kind):
                            step.program(step.shape, state, plan, q, k, v, layer.scaling)
                except Exception:  # never the process: this server decodes eagerly from here on
                    logger.exception("oasis: compiling the captured decode step failed; decoding eagerly")
                    step.covers = lambda: False
                    return
                self.compiled.add((rows, kind))
                new, seconds = counters["stats"]["unique_graphs"] - graphs, time.perf_counter() - began
                if new:
                    logger.info("oasis: captured decode step, %d rows (%s): compiled in %.1f s (%d graphs for blocks "
                                "%s)", rows, kind, seconds, new, " to ".join(map(str, block_buckets)))  # fmt: skip
                else:  # the batch dimension is symbolic
                    logger.info("oasis: captured decode step, %d rows (%s): served by the graph of fewer rows "
                                "(%.1f s)", rows, kind, seconds)  # fmt: skip
                built += new
        logger.info(
            "oasis: the captured decode step's %d programs compiled in %.1f s, %d graphs (captured_compile_ms)",
            len(self.compiled), time.perf_counter() - started, built,
        )  # fmt: skip

    def padding(self, step: CapturedStep, rows: int, kind: str, blocks: int) -> StepPlan:
        """A plan of ``rows`` padding rows and ``blocks`` blocks of ``kind`` (the recall fields always: a plan
        with a target is not another graph; ``sampled`` on a sample pass; a verify pass's drafts and tree)."""
        none = torch.zeros(0, dtype=torch.int64)
        sampled = torch.zeros(0, dtype=torch.bool) if kind.endswith("+sample") else None
        drafts = tree = None
        if kind.startswith("verify"):
            drafts = torch.zeros((0, self.verify_rows - 1), dtype=torch.int64)
            tree = torch.zeros((0, self.verify_rows, self.verify_rows), dtype=torch.bool)
        return StepPlan.build(
            none, none, none, step.req_to_token, none, 0, step.shape, rows, blocks, drafts, tree,
            (none, none.double(), sampled),
        )._replace(held=held_slots(step.tier, None))  # fmt: skip
