"""The prefetch pipeline's contract: jobs run in the background, a layer's wait returns that layer's job
only, one job per layer in flight, errors surface at the wait; sync mode runs jobs inline."""

from __future__ import annotations

import threading

import pytest
import torch

from sglang_oasis.attention.prefetch_pipeline import PrefetchPipeline

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run by benchmark/gpu_check.sh)")


def test_a_layer_waits_only_for_its_own_job() -> None:
    pipeline: PrefetchPipeline[str] = PrefetchPipeline(asynchronous=True)
    release = threading.Event()
    started = threading.Event()

    def slow() -> str:
        started.set()
        release.wait(10)
        return "layer 0"

    pipeline.submit(0, slow)
    started.wait(10)
    pipeline.submit(1, lambda: "layer 1")  # queued behind layer 0's job on the one worker
    assert not pipeline._pending[0].future.done()
    release.set()
    assert pipeline.wait(0) == ["layer 0"]
    assert pipeline.wait(1) == ["layer 1"]
    assert pipeline.wait(1) == []  # nothing pending any more
    pipeline.shutdown()


def test_resubmitting_a_layer_returns_its_earlier_result_first() -> None:
    pipeline: PrefetchPipeline[int] = PrefetchPipeline(asynchronous=True)
    assert pipeline.submit(3, lambda: 1) == []
    assert pipeline.submit(3, lambda: 2) == [1]
    assert pipeline.drain() == [2]
    pipeline.shutdown()


def test_sync_mode_runs_jobs_at_submission() -> None:
    pipeline: PrefetchPipeline[str] = PrefetchPipeline(asynchronous=False)
    ran = []
    pipeline.submit(0, lambda: ran.append("ran") or "done")
    assert ran == ["ran"]
    assert not pipeline.asynchronous and pipeline.wait(0) == ["done"]


def test_an_escaping_error_surfaces_at_the_layers_wait() -> None:
    pipeline: PrefetchPipeline[None] = PrefetchPipeline(asynchronous=True)

    def broken() -> None:
        raise OSError("copy failed")

    pipeline.submit(2, broken)
    pipeline.submit(1, lambda: None)
    assert pipeline.wait(1) == [None]
    with pytest.raises(OSError, match="copy failed"):
        pipeline.wait(2)
    pipeline.shutdown()


@cuda
def test_cuda_jobs_run_on_a_side_stream_ordered_by_events() -> None:
    """A job's kernels go to the side stream after the foreground's work up to its submission, and the
    foreground's kernels after ``wait`` come after the job's, without the host waiting for either: each
    side is held back by a GPU sleep that an unordered read would overtake."""
    pipeline: PrefetchPipeline[object] = PrefetchPipeline(asynchronous=True, device="cuda")
    foreground = torch.cuda.current_stream()
    layers, n = 4, 1 << 16
    source = torch.zeros((layers, n), device="cuda")
    seen = torch.zeros((layers, n), device="cuda")  # what each job read of its layer's source
    written = torch.zeros((layers, n), device="cuda")  # what each job wrote after a sleep
    streams = []

    def job(layer: int) -> object:
        streams.append(torch.cuda.current_stream())
        seen[layer].copy_(source[layer])
        torch.cuda._sleep(50_000_000)  # ~25 ms: the foreground's read below must wait for it
        written[layer].fill_(layer + 1.0)
        return layer

    for layer in range(layers):
        torch.cuda._sleep(50_000_000)  # the producer of the job's input is slow
        source[layer].fill_(layer + 1.0)
        pipeline.submit(layer, lambda layer=layer: job(layer))
    after = []
    for layer in range(layers):
        assert pipeline.wait(layer) == [layer]
        after.append(written[layer].clone())  # queued on the foreground stream after the wait
    torch.cuda.synchronize()
    for layer in range(layers):
        assert bool((seen[layer] == layer + 1.0).all()), f"layer {layer}'s job read its input too early"
        assert bool((after[layer] == layer + 1.0).all()), f"layer {layer}: the foreground read too early"
    assert all(stream == pipeline.side_stream for stream in streams)
    assert pipeline.side_stream != foreground
    pipeline.shutdown()


def test_adaptive_cap_follows_the_drift_within_its_bounds() -> None:
    from sglang_oasis.attention.fetch_caps import FetchCaps
    from sglang_oasis.config import OasisConfig

    config = OasisConfig(top_k=40, fetch_ratio=0.05, adaptive_cap=True)
    assert config.fetch_cap == 2 and config.fetch_cap_bounds == (2, 8)
    caps = FetchCaps(config, num_layers=2)
    seen = []
    for _ in range(12):  # layer 0 drifts by 20 blocks per head and step, layer 1 by 3
        caps.observe(0, 20.0)
        caps.observe(1, 3.0)
        seen.append((caps[0], caps[1]))
    assert seen[0] == (7, 2)  # ceil(1.25 * 0.25 * 20) = 7; ceil(1.25 * 0.75) = 1 -> lower bound 2
    assert seen[-1] == (8, 4)  # the upper bound; 1.25 * ~3 -> 4
    for _ in range(30):
        caps.observe(0, 0.0)
    assert caps[0] == 2
    fixed = FetchCaps(OasisConfig(top_k=40, fetch_ratio=0.05), num_layers=1)
    fixed.observe(0, 20.0)
    assert fixed[0] == 2, "without --oasis-adaptive-cap the cap stays ceil(ratio x K)"
