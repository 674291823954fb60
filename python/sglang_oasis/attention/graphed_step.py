"""The sparse decode step under SGLang's CUDA graph runner (``graph_hooks.py``): ``decode_program`` on static
buffers, so a graph captured once per batch size replays every later plain decode pass.

A CUDA graph replays the kernels it recorded on the tensors it recorded: nothing in Python runs, no shape
changes, no new tensor is read. So, where ``CapturedStep`` (torch.compile on CPU) builds a fresh plan for
each pass, this step owns one ``StepPlan`` of ``max_bs`` rows by every block a request may have
(``static``), and the graph of ``bs`` rows reads its first ``bs`` rows. Per pass, on the host, before the
replay:

1. ``ready`` (``CapturedStep``'s; SGLang's runner asks whether it may replay, ``sglang_hooks`` hook 14):
   the pass is planned as ``CapturedStep.prepare`` plans it; a pass it does not cover (admissions, recall
   samples, tails the active blocks do not hold) answers False and runs eagerly; a recall target's growth
   is in the graph (``static``'s ``own_k`` and ``target``, zero without one).
2. ``load`` (``init_forward_metadata_out_graph``): the plan's rows into ``static`` (rows past the batch:
   padding rows, into the padding slot), the per-row counts zeroed.
3. The replay runs ``decode_layer`` per sparse layer on ``static`` (what ``decode`` recorded at capture).
4. The counts it left are folded into the server's counters at the next pass (``fold``): reading them is
   a sync, which belongs outside the graph.

``capture`` fills ``static`` with padding rows only, so SGLang's warm-up and capture runs write nothing a
request owns. Written for CUDA and never run on a GPU; on CPU the test drives these calls as SGLang's runner
would (``test/unit/test_graph_hooks.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang_oasis.attention.captured_step import CapturedStep, StepParts
from sglang_oasis.attention.decode_program import COUNTS, StepPlan, decode_layer
from sglang_oasis.attention.sync_guard import guarded, sync_guard_on

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from sglang_oasis.attention.batch_view import BatchView


class GraphedStep(CapturedStep):
    """``CapturedStep``'s host plan and program, on buffers that outlive every pass (see the module)."""

    static: StepPlan  # ``max_bs`` rows x every block a request may have, on the tier's device
    static_counts: torch.Tensor  # [max_bs, len(COUNTS)]: what the replayed layers counted
    graphing = False  # True between ``capture``/``load`` and the next pass's ``begin``
    verify_rows = False  # SGLang's decode graphs hold one row per request; verify passes run eagerly
    sample_passes = False  # a sample pass is another graph than SGLang's one per size: it runs eagerly
    unfolded = 0  # rows of the last replay whose counts are not folded yet

    @classmethod
    def for_graphs(cls, backend: StepParts, max_bs: int) -> GraphedStep:
        step = cls.for_backend(backend)
        assert isinstance(step, GraphedStep)
        step.allocate(max_bs)
        return step

    def allocate(self, max_bs: int) -> None:
        """The buffers graphs of up to ``max_bs`` rows read, on the tier's device (``static``)."""
        # the graph records its kernels; nothing to compile (the sync guard's test mode: each call guarded)
        self.program = guarded(decode_layer) if sync_guard_on() else decode_layer
        blocks = self.req_to_token.shape[1] // self.shape.block_size
        self.batch_buckets, self.block_buckets = (max_bs,), (blocks,)  # one plan shape: ``static``'s
        padding = self.padding_plan(max_bs, blocks)
        self.static = padding.to(self.tier.device)
        self.static_counts = torch.zeros((max_bs, len(COUNTS)), dtype=torch.int64, device=self.tier.device)

    def padding_plan(self, rows: int, blocks: int) -> StepPlan:
        """Padding rows only (with the recall fields, no target: a target's growth is in the graph)."""
        none = torch.zeros(0, dtype=torch.int64)
        return StepPlan.build(
            none, none, none, self.req_to_token, none, 0, self.shape, rows, blocks,
            recall=(none, none.double(), None),
        )  # fmt: skip

    def view(self, bs: int) -> StepPlan:
        """The plan a graph of ``bs`` rows reads: ``static``'s first rows (the same memory every pass)."""
        s = self.static
        assert s.own_k is not None and s.target is not None
        return StepPlan(s.slots[:bs], s.seq_lens[:bs], s.locs[:bs], s.pages[:bs], s.step, own_k=s.own_k[:bs],
                        target=s.target[:bs])  # fmt: skip

    def begin(self, plain_decode: bool) -> None:
        super().begin(plain_decode)
        self.graphing = False

    def capture(self, bs: int) -> None:
        """SGLang's runner captures (and warms up) the graph of ``bs`` rows next: padding rows only."""
        self._fill(self.padding_plan(*self.static.pages.shape), bs, live=0)

    def upload(self, plan: StepPlan, batch: BatchView) -> StepPlan:
        """The tables' rows of the batch to the device; the plan stays on the host until ``load`` copies it
        into ``static``."""
        self.tier.tables.upload(batch.slots)
        return plan

    def load(self, bs: int) -> None:
        """The planned pass (``ready``, by ``CapturedStep``) into ``static``'s first ``bs`` rows, before the
        graph replays; the pages its tokens start get a new epoch (host bookkeeping, which a replay does
        not run)."""
        if self.plan is None:
            raise RuntimeError(
                "oasis: a CUDA graph replay of a pass that was not planned (hook 14 not applied?)"
            )
        live = self.rows
        self.tier.summaries.restart_epochs(self.planned.plan.locs[:live])
        self._fill(self.plan, bs, live=live)

    def _fill(self, plan: StepPlan, bs: int, live: int) -> None:
        """``plan``'s first ``bs`` rows (``live`` of them a batch's) into ``static``; counts zeroed."""
        for static, rows in zip(self.static, plan, strict=True):
            if static is None or rows is None:  # a verify pass's fields: decode graphs have none
                continue
            if static.dim() == 0:
                static.copy_(rows, non_blocking=True)
            else:
                static[:bs].copy_(rows[:bs], non_blocking=True)
        self.static_counts.zero_()
        self.plan, self.rows, self.graphing, self.unfolded = self.view(bs), bs, True, live

    def run(
        self, batch: BatchView, forward_batch: ForwardBatch, layer: RadixAttention, q: torch.Tensor,
        k: torch.Tensor | None, v: torch.Tensor | None,
    ) -> torch.Tensor | None:  # fmt: skip
        if not self.graphing or k is None or v is None:
            return None  # an eager pass
        return self.decode(layer, q, k, v)

    def decode(
        self, layer: RadixAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor | None:
        """One sparse layer on ``static`` (SGLang's runner pads ``q``, ``k``, ``v`` to the graph's rows); no
        host sync, no tensor but this pass's outputs allocated."""
        plan, bs, layer_id = self.plan, self.rows, layer.layer_id
        assert plan is not None
        heads = self.tier.shape.num_kv_heads
        out, counts = self.program(
            self.shape, self.state(layer_id), plan, q.reshape(bs, layer.tp_q_head_num, layer.qk_head_dim),
            k.reshape(bs, heads, -1), v.reshape(bs, heads, -1), layer.scaling,
        )  # fmt: skip
        self.static_counts[:bs] += counts
        return out.reshape(bs, layer.tp_q_head_num * layer.v_head_dim)

    def layer_done(self, layer_id: int, batch_rows: int) -> None:
        """Nothing: a replay runs no Python (``load`` and ``fold`` do the host's part)."""

    def fold(self) -> None:
        """The last replay's counts and tables into the host's (at the next pass, or before its batch's
        results are processed: ``settle``; outside any graph), credited to the requests it ran."""
        if self.unfolded:
            live, self.unfolded = self.unfolded, 0
            self.counts = self.static_counts
            self._fold(live)
            self.plan = None

    def settle(self, reqs: set[int]) -> None:
        """Before SGLang processes the results of a batch of request rows ``reqs`` (hook 4): if the last
        replay ran that batch, its figures go in now (a request finishing there reports them). With the
        overlap scheduler the next pass has folded it already."""
        if self.unfolded and set(self.planned.batch.reqs) == reqs:
            self.fold()
