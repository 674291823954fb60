"""The captured step compiles its programs before the server is ready (``attention/compile_ahead.py``):
which, when, on what, and what a pass whose program was not compiled does (it runs eagerly, no stall).

In process, on the CPU backend of ``test_fake_cuda.py`` (SGLang's pools, real extends, two sparse layers),
with a program that records its calls instead of compiling (the real compiles: a server's, in
``test/integration/test_captured_step.py``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from test_fake_cuda import Server, config

from sglang_oasis.attention.captured_step import CapturedStep
from sglang_oasis.attention.compile_ahead import CompileAhead, buckets_ahead, graphs_ahead, kind_of
from sglang_oasis.attention.decode_program import decode_layer


def test_the_buckets_compiled_follow_the_running_cap_and_sglangs_graph_sizes() -> None:
    buckets = (1, 2, 4, 8, 16, 32)
    assert buckets_ahead(buckets, running=20) == (1, 2, 4, 8, 16, 32)  # 20 rows pad to 32
    assert buckets_ahead(buckets, running=20, max_bs=4) == (1, 2, 4)  # --cuda-graph-max-bs-decode
    assert buckets_ahead(buckets, running=20, max_bs=3) == (1, 2, 4)
    assert buckets_ahead(buckets, running=2, max_bs=16) == (1, 2)
    assert buckets_ahead(buckets, running=20, sizes=[1, 3, 24]) == (1, 4, 32)  # --cuda-graph-bs-decode
    assert kind_of(False, False) == "decode" and kind_of(True, True) == "verify+sample"
    # per kind: one graph for a single row, one for every larger bucket (the batch dimension is symbolic)
    assert graphs_ahead((1, 2, 4, 8), ("decode", "decode+sample")) == 4
    assert graphs_ahead((4, 32), ("decode",)) == 1 and graphs_ahead((1,), ("verify",)) == 1
    runner = type("Runner", (), {"server_args": type("Args", (), {"cuda_graph_max_bs_decode": 2})(),
                                 "max_running_requests": 7})()  # fmt: skip
    ahead = CompileAhead.for_server(buckets, runner, verify_rows=2, sampling=True)
    assert (ahead.buckets, ahead.kinds) == ((1, 2), ("verify", "verify+sample"))


def test_the_first_decode_pass_compiles_every_program_first_and_an_uncompiled_bucket_runs_eagerly() -> None:
    """The first pass (SGLang's warm-up, before the server is ready) runs every (bucket, kind) on padding
    rows, at the smallest and the largest block bucket, before its own program; then a pass of two rows runs its compiled program, one of three rows
    (bucket 4, not compiled) runs eagerly and is counted, and every output is the eager step's."""
    cfg = config(recall_sample_every=4)
    eager = Server("cpu", dataclasses.replace(cfg, decode_step="eager"), graphs=False)
    server = Server("cpu", cfg, graphs=False)
    step = server.oasis.captured
    assert isinstance(step, CapturedStep)
    calls: list[tuple[int, bool, bool, list[int], int]] = []
    blocks = (step.block_buckets[0], step.block_buckets[-1])
    assert blocks[0] < blocks[1]
    before: dict[str, torch.Tensor] = {}
    padding = step.shape.padding_slot

    def program(*args: Any) -> Any:  # what a compile runs; it records each call's plan
        plan = args[2]
        calls.append((len(plan.slots), plan.tree is not None, plan.sampled is not None, plan.slots.tolist(),
                      plan.pages.shape[1]))  # fmt: skip
        if (
            len(calls) == 9
        ):  # the first pass's own program, after the compiles: nothing a request holds changed
            for name, table in step.tier.tables.host.items():
                assert torch.equal(table[:padding], before[name][:padding]), name
        return decode_layer(*args)

    step.program = program
    step.ahead = CompileAhead((1, 2), ("decode", "decode+sample"), 0)
    for run in (eager, server):
        run.extend([1, 2, 3], [150, 70, 90], [0, 0, 0])
        lens = {1: 150, 2: 70, 3: 90}
        for rows in ([1, 2], [1, 2], [1, 2, 3], [1, 2]):
            for row in rows:
                lens[row] += 1
            if run is server and not calls:
                before.update({name: t.clone() for name, t in step.tier.tables.host.items()})
            run.decode(rows, [lens[row] for row in rows])
    ahead = calls[:8]  # the compiles, at the first pass, before its own two layers: the smallest and the
    # largest block bucket each (a guard on the block count would compile a second graph here, not serving)
    assert [(c[0], c[2], c[4]) for c in ahead] == [
        (rows, sample, n) for rows in (1, 2) for sample in (False, True) for n in blocks
    ]
    assert all(set(c[3]) == {padding} for c in ahead)  # padding rows only
    assert step.ahead.done and step.ahead.compiled == {(1, "decode"), (1, "decode+sample"), (2, "decode"),
                                                       (2, "decode+sample")}  # fmt: skip
    for run in (eager, server):
        run.oasis.selector.finish_pending()  # the eager step's last jobs into the counters
    ours, theirs = server.oasis.stats.snapshot(), eager.oasis.stats.snapshot()
    assert ours["captured_uncompiled_passes"] == 1  # the pass of three rows: bucket 4
    assert ours["selections"] == theirs["selections"] and ours["blocks_loaded"] == theirs["blocks_loaded"]
    assert ours["captured_decode_passes"] == 3
    assert not any(rows == 4 for rows, *_ in calls)  # never compiled while serving
    for a_pass, b_pass in zip(server.passes, eager.passes, strict=True):
        for a, b in zip(a_pass, b_pass, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    server.stop()
    eager.stop()
