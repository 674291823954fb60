"""Timing and CUDA graph capture for the GPU check (``gpu_check.py``, ``gpu_step.py``): the median of
``fn``'s runs (device events on CUDA) and ``fn`` captured as a CUDA graph. ``QUICK`` (``gpu_check.py
--smoke``): one run, no warm-up, no graph (the interpreter is slow; the numbers mean nothing). ``FAKE``
(``gpu_check.py --fake-cuda``: a fake CUDA device, ``sglang_oasis_testing.fake_cuda``): host timings, and
a "replay" is ``fn`` run where any sync or host<->device copy raises, as a graph replay would not make it."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch

QUICK = False
FAKE: Any = None  # the FakeCuda in force (gpu_check.py --fake-cuda)


def timed(fn: Callable[[], Any], device: str, repeat: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` (device events on CUDA)."""
    if QUICK:
        repeat, warmup = 1, 0
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device == "cuda" and FAKE is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    times.sort()
    return times[len(times) // 2]


def graphed(fn: Callable[[], Any], device: str, strict: bool = False) -> tuple[Callable[[], Any], bool]:
    """``fn`` captured in a CUDA graph (replays without Python or launch gaps) and True, or ``fn`` itself
    and False on CPU, with ``QUICK``, or if capture fails (``strict``: the failure raises)."""
    if FAKE is not None:

        def replay() -> Any:
            with FAKE.replay("a CUDA graph replay"):
                return fn()

        return replay, False  # no graph: its output buffers are not the capture's
    if device != "cuda" or QUICK:
        return fn, False
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the capture (allocations, Triton compiles)
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay, True
    except Exception as error:  # report eager timings then
        if strict:
            raise
        print(f"CUDA graph capture failed ({type(error).__name__}: {error}); timing eagerly", file=sys.stderr)
        torch.cuda.synchronize()
        return fn, False
