"""SGLang 0.5.23's CUDA graph contract for the ``oasis`` backend (``OasisAttnBackend`` mixes this in).

SGLang's decode graph runner calls, on the attention backend: ``init_cuda_graph_state(max_bs,
max_num_tokens)`` once; ``get_cuda_graph_seq_len_fill_value()`` for padding rows;
``init_forward_metadata_out_graph(fb, in_capture=True)`` before it warms up and captures the graph of
``fb.batch_size`` rows; and, per replayed pass, ``init_forward_metadata_out_graph(fb_view)`` (host side)
before ``graph.replay()``. Every decode pass whose batch fits a captured size replays; the runner asks
no backend first. Sparse mode must run some passes eagerly (admissions, recall samples: what the
captured step does not cover), so hook 14 (``sglang_hooks.py``) adds the backend's ``graph_ready`` to the
runner's ``can_run_graph``: the pass is begun and planned there, and if it runs eagerly after all,
``init_forward_metadata`` finds it begun (``graph_begun``) and does not begin it twice.

The work is ``graphed_step.GraphedStep``'s. Written against SGLang's runner and never run under it (no
GPU here; SGLang's CUDA build cannot reach the lent GPU machine): the launcher lets sparse mode start on
CUDA only with ``--oasis-cuda-untested true``. ``test/unit/test_graph_hooks.py`` makes these calls on CPU
in the runner's order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang_oasis.attention.graphed_step import GraphedStep

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from sglang_oasis.attention.batch_view import BatchView
    from sglang_oasis.attention.captured_step import CapturedStep
    from sglang_oasis.attention.selector import Selector
    from sglang_oasis.config import OasisConfig


class GraphHooks:
    config: OasisConfig
    captured: CapturedStep | None
    selector: Selector
    batch: BatchView
    dense_layers: frozenset[int]
    _graph_begun: Any = None  # the forward batch ``graph_ready`` began, until ``init_forward_metadata``
    _graph_answer = False  # what ``graph_ready`` answered for it

    def begin_forward(self, forward_batch: ForwardBatch) -> None: ...  # ``OasisAttnBackend``'s

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if self.dense_layers:
            raise ValueError(
                "--oasis-dense-layers decode through SGLang's torch_native attention, which a CUDA graph "
                "cannot capture: pass --disable-cuda-graph, or no dense layers"
            )
        step = self.captured = GraphedStep.for_graphs(self, max_bs)  # type: ignore[arg-type]
        self.selector.fold_first(step.fold)  # host code that waits for the tables gets the replay's

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # a padding row: one token, its own (``StepPlan``'s padding)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        step = self.graphed_step()
        if in_capture:
            step.capture(forward_batch.batch_size)
        else:
            step.load(forward_batch.batch_size)

    def graph_ready(self, forward_batch: ForwardBatch) -> bool:
        """Hook 14: SGLang's runner may replay this decode pass (begun and planned here, once: SGLang asks
        ``can_run_graph`` again of a batch it asked before, e.g. its speculative workers before and in the
        model runner's forward, and the pass must not begin twice)."""
        step = self.graphed_step()
        if self._graph_begun is forward_batch:
            return self._graph_answer
        step.fold()
        self.begin_forward(forward_batch)
        self._graph_begun = forward_batch
        self._graph_answer = step.ready(self.batch, forward_batch)
        return self._graph_answer

    def graph_begun(self, forward_batch: ForwardBatch) -> bool:
        """At an eager pass's ``init_forward_metadata``: whether ``graph_ready`` began it already (the last
        replay's counts are folded first)."""
        if isinstance(self.captured, GraphedStep):
            self.captured.fold()
        begun, self._graph_begun = self._graph_begun is forward_batch, None
        return begun

    def settle(self, reqs: set[int]) -> None:
        """Hook 4, before SGLang processes the results of a batch of request rows ``reqs``: a replay of
        that batch is folded now, so a request finishing there has its figures (``GraphedStep.settle``)."""
        if isinstance(self.captured, GraphedStep):
            self.captured.settle(reqs)

    def graphed_step(self) -> GraphedStep:
        if not isinstance(self.captured, GraphedStep):
            raise RuntimeError("oasis: a CUDA graph call before init_cuda_graph_state")
        return self.captured
