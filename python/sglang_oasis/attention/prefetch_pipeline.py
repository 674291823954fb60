"""The layer-local prefetch pipeline: each layer's prediction -> selection -> transfer job runs in the
background while later layers compute, and step t+1's attention at layer l waits only for the job layer
l issued at step t.

    step t:    layer 0 attn | layer 1 attn | layer 2 attn | ...
    worker:         job(0, t) | job(1, t)   | job(2, t)    | ...
    step t+1:  wait(0) layer 0 attn | wait(1) layer 1 attn | ...

On CPU the worker is one thread (torch releases the GIL inside its ops, so the job's scoring and copies
run beside the foreground's matmuls). On CUDA the same thread issues each job's kernels and copies on a
side stream: the job's stream first waits for an event recorded on the foreground stream at submission
(the queries it reads are computed there), and ``wait(layer)`` makes the foreground stream wait for the
event recorded after the job, so the layer's next attention kernels queue behind its transfer without
the host blocking on the GPU. ``asynchronous=False`` runs each job inline at submission, on the current
stream (the synchronous baseline).

A job returns its own result (counts, timings, failed requests); exceptions escaping a job are re-raised
in the foreground at ``wait``: jobs are expected to catch the failures they can attribute to requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, NamedTuple, TypeVar

import torch

T = TypeVar("T")


class _Pending(NamedTuple, Generic[T]):
    # the job's result and, on CUDA, the event recorded after it
    future: Future[tuple[T, torch.cuda.Event | None]]
    job: Callable[[], T]  # kept until waited for: its tensors must outlive the side stream's use


class PrefetchPipeline(Generic[T]):
    def __init__(self, asynchronous: bool, device: torch.device | str = "cpu") -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="oasis-prefetch") if asynchronous else None
        self.device = torch.device(device)
        cuda = asynchronous and self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._pending: dict[int, _Pending[T]] = {}
        self.waited_ns = 0  # foreground time spent waiting for jobs, since the last ``take_waited_ns``

    @property
    def asynchronous(self) -> bool:
        return self._executor is not None

    @property
    def side_stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream jobs run on (None on CPU and in sync mode)."""
        return self._stream

    def submit(self, layer: int, job: Callable[[], T]) -> list[T]:
        """Start ``job`` for ``layer``; returns the results of any earlier job of that layer still
        pending (waited for first, so one layer never has two jobs in flight)."""
        earlier = self.wait(layer)
        if self._executor is None:
            future: Future[tuple[T, torch.cuda.Event | None]] = Future()
            future.set_result((job(), None))
        else:
            ready = None
            if self._stream is not None:  # the job's inputs are computed on the foreground stream
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
            future = self._executor.submit(self._run, job, ready)
        self._pending[layer] = _Pending(future, job)
        return earlier

    def _run(self, job: Callable[[], T], ready: torch.cuda.Event | None) -> tuple[T, torch.cuda.Event | None]:
        """Worker side: on CUDA the job's kernels go to the side stream, after the foreground's work up
        to submission, and an event marks their end."""
        if self._stream is None:
            return job(), None
        assert ready is not None  # ``submit`` records one whenever there is a side stream
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            result = job()
            done = torch.cuda.Event()
            done.record(self._stream)
        return result, done

    def running(self) -> int:
        """Jobs submitted and not finished yet."""
        return sum(not pending.future.done() for pending in list(self._pending.values()))

    def wait(self, layer: int) -> list[T]:
        """Block until ``layer``'s pending job is done (on CUDA: issued, and the foreground stream
        ordered after its kernels); its result (empty if none was pending)."""
        pending = self._pending.pop(layer, None)
        if pending is None:
            return []
        start = time.perf_counter_ns()
        result, done = pending.future.result()
        if done is not None:
            torch.cuda.current_stream(self.device).wait_event(done)
        self.waited_ns += time.perf_counter_ns() - start
        return [result]

    def drain(self) -> list[T]:
        """Wait for every pending job (before request slots change hands)."""
        results: list[T] = []
        for layer in list(self._pending):
            results += self.wait(layer)
        return results

    def take_waited_ns(self) -> int:
        waited, self.waited_ns = self.waited_ns, 0
        return waited

    def shutdown(self) -> None:
        self.drain()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
