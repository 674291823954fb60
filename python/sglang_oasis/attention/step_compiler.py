"""When the captured decode step's shapes compile: in the background while the server decodes eagerly, or
inline at first use (``--oasis-captured-compile``).

``torch.compile`` builds one graph per (batch bucket, block bucket) at the first call of that shape: on
these CPUs 10-25 s cold, 1-3 s from torch's on-disk cache. Inline, the pass that first needs a shape waits
for it (every running request stalls; the benchmarks and equivalence tests want that determinism). In the
background, a pass whose shape is not ready runs the eager step (same answers) and asks for the shape; one
thread compiles the shapes asked for, one at a time, by calling the program on a warm-up pass of padding
rows only (the tier's padding slot and SGLang's padding page 0, which no request reads), then marks the
shape ready; the serving thread switches to it at its next pass. The graph it leaves is the one the serving
thread's calls hit (same code, same guards: the first sparse layer's state views, whose strides every layer
shares).

Who writes what: the serving thread asks (``ready``), the compile thread adds to ``ready_shapes`` (a set,
one add under the GIL) and never touches a request's state.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Shape = tuple[int, int]  # (batch bucket, block bucket)


class StepCompiler:
    def __init__(
        self, program: Callable[..., Any], background: bool, on_compiled: Callable[[Shape, float], None]
    ) -> None:
        self.program = program
        self.background = background
        self.on_compiled = on_compiled  # (shape, seconds): counters and the log
        self.ready_shapes: set[Shape] = set()
        self.failed = False  # a compile failed: the server decodes eagerly from then on
        self.warm_inputs: Callable[[Shape], tuple[Any, ...]] | None = None  # known at the first decode
        self._asked: set[Shape] = set()
        self._queue: queue.Queue[Shape | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def ready(self, shape: Shape) -> bool:
        """Whether a pass of ``shape`` may run the compiled program now; in the background, a shape not
        ready yet is asked for (once) and the pass runs eagerly."""
        if shape in self.ready_shapes or not self.background:
            return not self.failed
        self.ask(shape)
        return False

    def ask(self, shape: Shape) -> None:
        """Compile ``shape`` in the background unless it was asked for already."""
        if shape in self._asked or self.failed or not self.background or self.warm_inputs is None:
            return
        self._asked.add(shape)
        logger.info(
            "oasis: compiling the captured decode step for %d rows x %d blocks in the background (%d queued; "
            "such passes decode eagerly meanwhile; torch caches the graph across starts)", *shape,
            self._queue.qsize(),
        )  # fmt: skip
        self._queue.put(shape)
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="oasis-step-compiler", daemon=True)
            self._thread.start()

    def compiled_inline(self, shape: Shape, seconds: float) -> None:
        """The serving thread compiled ``shape`` at its first call (inline mode)."""
        self.ready_shapes.add(shape)
        self.on_compiled(shape, seconds)

    def _work(self) -> None:
        while (shape := self._queue.get()) is not None:
            assert self.warm_inputs is not None
            started = time.perf_counter()
            try:
                self.program(*self.warm_inputs(shape))
            except Exception:  # never the process: the server keeps decoding eagerly
                logger.exception("oasis: compiling the captured decode step for %d rows x %d blocks failed; "
                                 "decoding eagerly from now on", *shape)  # fmt: skip
                self.failed = True
                return
            self.ready_shapes.add(shape)
            self.on_compiled(shape, time.perf_counter() - started)

    def shutdown(self) -> None:
        """Let the shape compiling now finish and stop (a thread inside a torch op at interpreter exit
        aborts the process)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
