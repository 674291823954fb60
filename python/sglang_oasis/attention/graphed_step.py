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
        step.program = decode_layer  # the graph records its kernels; nothing to compile
        blocks = step.req_to_token.shape[1] // step.shape.block_size
        step.batch_buckets, step.block_buckets = (max_bs,), (blocks,)  # one plan shape: ``static``'s
        device = step.tier.working_sets.covered.device
        padding = step.padding_plan(max_bs, blocks)
        step.static = padding._replace(
            **{name: t.to(device) for name, t in padding._asdict().items() if t is not None}
        )
        step.static_counts = torch.zeros((max_bs, len(COUNTS)), dtype=torch.int64, device=device)
        return step

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

    def load(self, bs: int) -> None:
        """The planned pass (``ready``, by ``CapturedStep``) into ``static``'s first ``bs`` rows, before the
        graph replays."""
        if self.plan is None:
            raise RuntimeError(
                "oasis: a CUDA graph replay of a pass that was not planned (hook 14 not applied?)"
            )
        self._fill(self.plan, bs, live=self.rows)

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

    def fold(self) -> None:
        """The last replay's counts into the server's counters (at the next pass, outside any graph)."""
        if self.unfolded:
            live, self.unfolded = self.unfolded, 0
            self.plan, self.counts = self.view(live), self.static_counts[:live].cpu()
            self._fold(live)
            self.plan = None
