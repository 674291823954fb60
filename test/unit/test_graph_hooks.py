"""SGLang's CUDA graph contract on the ``oasis`` backend (``attention/graph_hooks.py``,
``attention/graphed_step.py``, hook 14), driven on CPU in the order SGLang's decode graph runner makes
the calls: ``init_cuda_graph_state``; capture of a 4-row graph (``init_forward_metadata_out_graph`` with
``in_capture=True``, then the layer's forward, twice: warm-up and capture); then per pass
``can_run_graph`` (hook 14) and either the replay (``init_forward_metadata_out_graph`` on the padded view,
then what the graph recorded: the program on the same tensors) or the eager forward.

CPU cannot replay a CUDA graph, so what makes a replay right is checked instead: every tensor the step
reads and writes is the one it used at capture (same memory), the in-graph work makes no host sync (the
sync guard), and the outputs, state and counters equal the eager backend's step after step, in four
configurations. The harness admits one sparse layer beside a dense one (which ``init_cuda_graph_state``
refuses), so the step is made as that hook makes it; ``test_fake_cuda.py`` drives the whole order,
``init_cuda_graph_state`` and a capture included, on a fake CUDA device, where a replay that syncs or
copies, or mixes devices, fails.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from test_decode_program import (
    CONTEXTS,
    DIM,
    KV_HEADS,
    Q_HEADS,
    REQS,
    SPARSE_LAYER,
    TARGET,
    admitted,
    assert_same_state,
    configs,
    eager_step,
    layer,
    step_inputs,
    stop,
)

from sglang_oasis import sglang_hooks as hooks
from sglang_oasis.attention.decode_program import COUNTS, decode_layer
from sglang_oasis.attention.graphed_step import GraphedStep
from sglang_oasis.attention.oasis_backend import OasisAttnBackend
from sglang_oasis.attention.sync_guard import SyncGuard

GRAPH_BS = 4  # the captured size the 3-row batch pads to
STEPS = 30


def forward_batch(oasis: OasisAttnBackend, step: int) -> SimpleNamespace:
    """SGLang's forward batch of the 3 requests' decode ``step``."""
    reqs = torch.tensor(REQS)
    seq_lens = torch.tensor(CONTEXTS) + 1 + step
    locs = oasis.req_to_token_pool.req_to_token[reqs, seq_lens - 1].long()
    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE, batch_size=len(REQS), req_pool_indices=reqs, seq_lens=seq_lens,
        seq_lens_cpu=seq_lens.clone(), out_cache_loc=locs, encoder_lens=None, spec_info=None, rids=None,
    )  # fmt: skip


def padded_view(batch: SimpleNamespace, bs: int) -> SimpleNamespace:
    """The runner's replay view (``build_replay_fb_view``): rows padded to the graph's ``bs``."""
    pad = bs - batch.batch_size
    return SimpleNamespace(
        batch_size=bs, forward_mode=ForwardMode.DECODE, num_padding=pad,
        req_pool_indices=torch.cat([batch.req_pool_indices, torch.zeros(pad, dtype=torch.int64)]),
        seq_lens=torch.cat([batch.seq_lens, torch.ones(pad, dtype=torch.int64)]),
        out_cache_loc=batch.out_cache_loc, spec_info=None,
    )  # fmt: skip


def padded(t: torch.Tensor, bs: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros((bs - t.shape[0], *t.shape[1:]))]).reshape(bs, -1)


def graphed(config: Any, own_k: dict[int, int], pins: dict[int, list[int]]) -> OasisAttnBackend:
    """An admitted backend after ``init_cuda_graph_state``. The harness's layer 0 is a dense layer, which
    the hook refuses (``test_dense_layers_are_refused``): its graphed step is made as the hook makes it."""
    oasis = admitted(config, own_k, pins)
    oasis.captured = GraphedStep.for_graphs(oasis, max_bs=8)
    return oasis


class Recorder:
    """The program as the graph records it: every tensor's address, per call."""

    def __init__(self) -> None:
        self.addresses: list[tuple[int, ...]] = []

    def __call__(self, shape: Any, state: Any, plan: Any, q: Any, k: Any, v: Any, scale: float) -> Any:
        self.addresses.append(tuple(t.data_ptr() for t in (*state, *plan) if t is not None))
        return decode_layer(shape, state, plan, q, k, v, scale)


def capture(oasis: OasisAttnBackend, bs: int) -> None:
    """The runner's capture of the ``bs``-row graph: metadata in capture mode, then warm-up and capture."""
    oasis.init_forward_metadata_out_graph(SimpleNamespace(batch_size=bs), in_capture=True)
    zeros = [torch.zeros(bs, heads * DIM) for heads in (Q_HEADS, KV_HEADS, KV_HEADS)]
    for _ in range(2):
        out = oasis.forward_decode(*zeros, layer(SPARSE_LAYER), SimpleNamespace(batch_size=bs))
        assert out.shape == (bs, Q_HEADS * DIM)


def runner_step(oasis: OasisAttnBackend, step: int) -> tuple[torch.Tensor, bool]:
    """One decode pass through the runner: replayed if hook 14 says so, else eager."""
    batch = forward_batch(oasis, step)
    replays = hooks.ask_backend_to_replay(lambda runner, fb: True, SimpleNamespace(attn_backend=oasis), batch)
    q, k, v = step_inputs(step)
    if replays:
        oasis.init_forward_metadata_out_graph(padded_view(batch, GRAPH_BS))
        with SyncGuard():  # what the graph recorded: no host sync
            out = oasis.forward_decode(padded(q, GRAPH_BS), padded(k, GRAPH_BS), padded(v, GRAPH_BS),
                                       layer(SPARSE_LAYER), batch)  # fmt: skip
        return out[: len(REQS)].view(len(REQS), Q_HEADS, DIM), True
    oasis.init_forward_metadata(batch)  # an eager pass: begun by hook 14 already, not again
    bs = len(REQS)
    out = oasis.forward_decode(q.view(bs, -1), k.view(bs, -1), v.view(bs, -1), layer(SPARSE_LAYER), batch)
    return out.view(bs, Q_HEADS, DIM), False


@pytest.mark.parametrize("case", ["k_sparse_capped", "k_per_row", "k_covering", "recall_target"])
def test_replays_equal_the_eager_backend(case: str) -> None:
    """``recall_target``: a target's growth as blocks fill up replays in the graph (the rows' own K and
    targets in the static plan); its samples' passes run eagerly."""
    config, own_k, pins = configs("k_sparse_capped" if case == "recall_target" else case)
    config = dataclasses.replace(config, **(TARGET if case == "recall_target" else {}))
    config = dataclasses.replace(config, recall_sample_every=8)  # some passes sample: they run eagerly
    eager = admitted(config, own_k, pins)
    oasis = graphed(dataclasses.replace(config, cuda_untested=True), own_k, pins)
    recorder = Recorder()
    assert isinstance(oasis.captured, GraphedStep)
    oasis.captured.program = recorder
    capture(oasis, GRAPH_BS)
    assert_same_state(eager, oasis)  # capture ran padding rows only: nothing a request owns changed
    captured_at = recorder.addresses[-1]
    replayed, grown_in_replays, fold = 0, [0], oasis.captured._fold

    def counting_fold(rows: int) -> None:  # the target's growths the replays counted
        assert isinstance(oasis.captured, GraphedStep)
        grown_in_replays[0] += int(oasis.captured.counts[:rows, COUNTS.index("target_grows")].sum())
        fold(rows)

    oasis.captured._fold = counting_fold  # type: ignore[method-assign]
    for step in range(STEPS):
        out, replay = runner_step(oasis, step)
        replayed += replay
        torch.testing.assert_close(out, eager_step(eager, step), rtol=1e-5, atol=1e-6)
        assert_same_state(eager, oasis)
        assert recorder.addresses[-1] == captured_at  # a replay reads and writes the captured memory
    assert STEPS // 2 < replayed < STEPS  # the passes with a recall sample due ran eagerly
    oasis.init_forward_metadata(forward_batch(oasis, STEPS))  # the next pass folds the last replay's counts
    eager.selector.finish_pending()
    ours, theirs = eager.stats.snapshot(), oasis.stats.snapshot()
    assert theirs["captured_decode_passes"] == replayed
    for name in ("selections", "scored_selections", "selection_changes", "blocks_loaded", "decode_bytes_host_to_device",
                 "blocks_just_filled", "blocks_from_active", "blocks_deferred", "decode_steps"):  # fmt: skip
        assert ours[name] + (name == "decode_steps") == theirs[name], name  # one more pass begun
    if case == "recall_target":  # its samples grew K, eagerly; replays held every block as blocks filled
        assert ours["recall_target_grows"] == theirs["recall_target_grows"] > 0 and grown_in_replays[0] > 0
        assert not bool((oasis.captured.static.target != 0).all())  # padding rows: no target
    stop(eager, oasis)


def test_a_pass_the_step_does_not_cover_runs_eagerly() -> None:
    """Hook 14 answers False for a pass whose rows were just admitted (their tails are not in the active
    blocks yet); the runner's own False is final (the backend is not asked, nothing is begun)."""
    config, own_k, pins = configs("k_sparse_capped")
    oasis = graphed(dataclasses.replace(config, cuda_untested=True), own_k, pins)
    runner = SimpleNamespace(attn_backend=oasis)
    before = oasis.step
    assert not hooks.ask_backend_to_replay(lambda runner, fb: False, runner, forward_batch(oasis, 0))
    assert oasis.step == before
    oasis.tier.active.start[:, SPARSE_LAYER] = 0  # no tail held: the step cannot cover the pass
    oasis.tier.active.end[:, SPARSE_LAYER] = 0
    assert not hooks.ask_backend_to_replay(lambda runner, fb: True, runner, forward_batch(oasis, 0))
    assert oasis.step == before + 1
    with pytest.raises(RuntimeError, match="not planned"):
        oasis.init_forward_metadata_out_graph(padded_view(forward_batch(oasis, 0), GRAPH_BS))
    stop(oasis)


def test_dense_layers_are_refused() -> None:
    config, own_k, pins = configs("k_sparse_capped")  # layer 0 decodes densely
    config = dataclasses.replace(config, cuda_untested=True)
    oasis = admitted(config, own_k, pins)
    with pytest.raises(ValueError, match="--disable-cuda-graph"):
        oasis.init_cuda_graph_state(8, 8)
    assert oasis.get_cuda_graph_seq_len_fill_value() == 1
    no_dense = admitted(dataclasses.replace(config, dense_layers=()), own_k, pins)
    no_dense.init_cuda_graph_state(8, 8)
    assert isinstance(no_dense.captured, GraphedStep) and no_dense.captured.static.pages.shape[0] == 8
    stop(oasis, no_dense)
