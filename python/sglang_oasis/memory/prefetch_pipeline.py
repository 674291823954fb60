"""The layer-local prefetch pipeline: each layer's prediction -> selection -> transfer job runs in the
background while later layers compute, and step t+1's attention at layer l waits only for the job layer
l issued at step t.

    step t:    layer 0 attn | layer 1 attn | layer 2 attn | ...
    worker:         job(0, t) | job(1, t)   | job(2, t)    | ...
    step t+1:  wait(0) layer 0 attn | wait(1) layer 1 attn | ...

On CPU the worker is one thread (torch releases the GIL inside its ops, so the job's scoring and copies
run beside the foreground's matmuls); on CUDA the same contract maps to a side stream and an event per
layer. ``asynchronous=False`` runs each job inline at submission (the synchronous baseline).

A job returns its own result (counts, timings, failed requests); exceptions escaping a job are re-raised
in the foreground at ``wait``: jobs are expected to catch the failures they can attribute to requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


class PrefetchPipeline(Generic[T]):
    def __init__(self, asynchronous: bool) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="oasis-prefetch") if asynchronous else None
        self._pending: dict[int, Future[T]] = {}
        self.waited_ns = 0  # foreground time spent waiting for jobs, since the last ``take_waited_ns``

    @property
    def asynchronous(self) -> bool:
        return self._executor is not None

    def submit(self, layer: int, job: Callable[[], T]) -> list[T]:
        """Start ``job`` for ``layer``; returns the results of any earlier job of that layer still
        pending (waited for first, so one layer never has two jobs in flight)."""
        earlier = self.wait(layer)
        if self._executor is None:
            future: Future[T] = Future()
            future.set_result(job())
        else:
            future = self._executor.submit(job)
        self._pending[layer] = future
        return earlier

    def wait(self, layer: int) -> list[T]:
        """Block until ``layer``'s pending job is done; its result (empty if none was pending)."""
        future = self._pending.pop(layer, None)
        if future is None:
            return []
        start = time.perf_counter_ns()
        result = future.result()
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
