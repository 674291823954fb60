"""The whole test suite in two lanes at once: two pytest processes.

A test with a server mostly waits on that server, which computes on one thread (``OMP_NUM_THREADS=1``),
so in one pytest process the second core mostly idles. The ``servers`` lane runs the modules that share
session servers (the tiny models' dense and sparse servers), the light ones first and the ones with
many servers at once last; the ``unit`` lane runs the unit tests, then the modules with their own few
servers (``UNIT_LANE``), while the other lane is still on its light modules.

Memory, not CPU, bounds the lanes: a server here holds about 3 GiB, and 24 GiB do not hold the heavy
modules' servers of both lanes at once (tried: the machine ran out and a start timed out). So the
``unit`` lane yields: each server it starts first waits until ``UNIT_LANE_WAITS_FOR_GIB`` are available
(``SGLANG_OASIS_SPAWN_WAIT_FOR_GIB``, read by ``ServerProcess.spawn``). The ``servers`` lane waits too,
for room for one server only (``SERVERS_LANE_WAITS``) and at most a few minutes: on a machine whose unit
tests run fast the unit lane's last servers (TP ranks, compiling captured steps) met the servers lane's
PD pairs, memory fell to 0.1 GiB and five PD servers did not start (2026-12-05, Intel Xeon with AMX).

Each lane's lines are printed as they come, prefixed with the lane's name (a module's with the lane's
minutes when it finished); both lanes' summaries, times and slowest modules, and the lowest available memory (when, and the module each lane had last finished), at the end. A lane's temporary directory (its servers' logs) is
kept under /tmp when it fails. Exits 0 only when both lanes pass. With one CPU (or
``SGLANG_OASIS_TEST_LANES=1``) it runs one pytest over everything, as ``pytest`` alone would.

    python scripts/run_lanes.py        (scripts/run_tests.sh runs it when given no pytest arguments)
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sglang_oasis.server_process import SPAWN_WAIT_ENV, mem_available_gib

ROOT = Path(__file__).resolve().parent.parent
INTEGRATION = ROOT / "test" / "integration"
# Modules with their own servers (none of the session ones), after the unit tests; the lane took 7.1 min.
UNIT_LANE = (
    "test_sparse_tensor_parallel.py",  # first: its 2-rank servers start while the other lane is light
    # the PD pairs next, while the other lane runs the tiny models' modules: later they met test_passkey's
    # three SmolLM2 servers (1 GiB left; the prefill node's health check failed and the router dropped it)
    "test_pd_retraction.py",
    "test_codes_pd_tp.py",
    "test_remote_fetch.py",
    "test_prefetch_pipeline.py",
    "test_accuracy_bench.py",
    "test_rpf_bench.py",
    "test_default_server.py",
    "test_direct_launch.py",
    "test_captured_step.py",
    "test_tensor_parallel.py",
)
# The servers lane's first modules: PD launches (test_pd_tensor_parallel's 2 ranks per node, ~10 GiB) run
# before any session server starts, while the unit lane is on its unit tests. In the unit lane they met
# the servers lane's heaviest modules: the memory gate (UNIT_LANE_WAITS_FOR_GIB) held test_pd_tensor_parallel's
# router back until launch_pd timed out, and test_pd_captured's start 8.7 minutes.
SERVERS_LANE_FIRST = ("test_pd_tensor_parallel.py", "test_pd_captured.py")
# The servers lane's modules with the most servers at once, last (in this order); the rest between.
SERVERS_LANE_LAST = (
    "test_passkey.py",
    "test_pd_eagle3.py",
    "test_pd.py",
    "test_sparse_equivalence.py",
)
UNIT_LANE_WAITS_FOR_GIB = 9.0
SERVERS_LANE_WAITS = "3.5:240"  # GiB, at most seconds: then it starts anyway (never both lanes stuck)


def lanes() -> dict[str, list[str]]:
    every = sorted(path.name for path in INTEGRATION.glob("test_*.py"))
    placed = (*UNIT_LANE, *SERVERS_LANE_FIRST, *SERVERS_LANE_LAST)
    missing = [name for name in placed if name not in every]
    if missing:
        raise SystemExit(f"run_lanes.py names test modules that do not exist: {', '.join(missing)}")
    rest = [name for name in every if name not in placed]
    return {
        "unit": ["test/unit", *(f"test/integration/{name}" for name in UNIT_LANE)],
        "servers": [f"test/integration/{name}" for name in (*SERVERS_LANE_FIRST, *rest, *SERVERS_LANE_LAST)],
    }


class LowestMemory(threading.Thread):
    """The machine's lowest ``MemAvailable`` while the lanes run (sampled every 2 s), when it was, and the
    test module each lane had last finished then (``finished``, which ``run_lane`` fills): where a later
    run should look."""

    def __init__(self, finished: dict[str, str], read: Callable[[], float] = mem_available_gib) -> None:
        super().__init__(daemon=True)
        self.finished, self.read = finished, read
        self.lowest: float | None = None
        self.at_s = 0.0
        self.lanes_then: dict[str, str] = {}
        self.started = time.monotonic()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(2.0):
            self.sample()

    def sample(self) -> None:
        now = self.read()
        if self.lowest is None or now < self.lowest:
            self.lowest, self.at_s, self.lanes_then = (
                now,
                time.monotonic() - self.started,
                dict(self.finished),
            )

    def report(self) -> str:
        if self.lowest is None:
            return ""
        after = ", ".join(f"{lane} after {module}" for lane, module in sorted(self.lanes_then.items()))
        return (
            f"  lowest available memory while they ran: {self.lowest:.1f} GiB at {self.at_s / 60:.1f} min"
            + (f" ({after})" if after else "")
        )


def finished_module(line: str) -> str | None:
    """The test module a pytest progress line reports (``path.py ..s  [ 42%]``), else None."""
    first = line.split(" ", 1)[0]
    return first if first.endswith(".py") and "[" in line else None


RUNNING: list[subprocess.Popen[str]] = []  # the lanes' pytest processes, told to stop on Ctrl-C


def slowest(timeline: list[tuple[str, float]], count: int = 6) -> str:
    """The ``count`` modules a lane spent longest on, from ``timeline`` (each module and the lane's seconds
    when pytest reported it done: a module's time runs from the one before's end, waits for memory
    included), as ``name minutes`` pairs."""
    spans, before = [], 0.0
    for module, at in timeline:
        spans.append((at - before, module.rsplit("/", 1)[-1]))
        before = at
    return ", ".join(
        f"{module} {seconds / 60:.1f}" for seconds, module in sorted(spans, reverse=True)[:count]
    )


WAITED = re.compile(r"^\[server_process\] waited (\d+) s for", re.M)  # ServerProcess.spawn's log line


def gate_waits(basetemp: str) -> tuple[float, int]:
    """The seconds a lane's servers waited for memory before starting, in all, and how many waited: read
    from their logs under the lane's ``basetemp`` (``ServerProcess.spawn`` writes each wait there)."""
    waits = [
        int(seconds)
        for log in Path(basetemp).rglob("*.log")
        for seconds in WAITED.findall(log.read_text(errors="replace"))
    ]
    return float(sum(waits)), len(waits)


def run_lane(
    name: str,
    paths: list[str],
    width: int,
    out: threading.Lock,
    results: dict[str, tuple],
    env: dict[str, str] | None = None,
    finished: dict[str, str] | None = None,
    timeline: list[tuple[str, float]] | None = None,
) -> None:
    """One lane's pytest; ``finished[name]``: the last test module it reported done (pytest prints a
    module's line when it finishes), ``timeline``: each module and when (the line shows the lane's
    minutes)."""
    started = time.monotonic()
    basetemp = tempfile.mkdtemp(prefix=f"pytest-{name}-")  # each lane its own; pytest empties it first
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--basetemp={basetemp}", *paths]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    RUNNING.append(process)
    assert process.stdout is not None
    last = ""
    for line in process.stdout:
        module = finished_module(line)
        if module is not None:
            at = time.monotonic() - started
            line = f"{line.rstrip()}  {at / 60:.1f} min\n"
            if timeline is not None:
                timeline.append((module, at))
            if finished is not None:
                finished[name] = module
        with out:
            print(f"[{name:<{width}}] {line}", end="", flush=True)
        if line.strip():
            last = line.strip()
    code = process.wait()
    waited = gate_waits(basetemp)
    if code == 0:  # kept when it failed: the servers' logs are in it
        shutil.rmtree(basetemp, ignore_errors=True)
    results[name] = (code, time.monotonic() - started, last, basetemp, waited)


def main() -> int:
    wanted = int(os.environ.get("SGLANG_OASIS_TEST_LANES", "2" if (os.cpu_count() or 1) > 1 else "1"))
    if wanted < 2:
        return subprocess.call([sys.executable, "-m", "pytest"], cwd=ROOT)
    plan = lanes()
    width = max(len(name) for name in plan)
    out = threading.Lock()
    results: dict[str, tuple] = {}
    envs = {
        "unit": {SPAWN_WAIT_ENV: str(UNIT_LANE_WAITS_FOR_GIB)},
        "servers": {SPAWN_WAIT_ENV: SERVERS_LANE_WAITS},
    }
    finished: dict[str, str] = {}
    timelines: dict[str, list[tuple[str, float]]] = {name: [] for name in plan}
    threads = [
        threading.Thread(
            target=run_lane,
            args=(name, paths, width, out, results, envs.get(name), finished, timelines[name]),
        )
        for name, paths in plan.items()
    ]
    memory = LowestMemory(finished)
    memory.start()
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except KeyboardInterrupt:  # each pytest stops as on its own Ctrl-C: its fixtures stop their servers
        for process in RUNNING:
            process.send_signal(signal.SIGINT)
        for thread in threads:
            thread.join()
    memory.done.set()
    print("\nlanes:")
    for name in plan:
        code, seconds, last, basetemp, (waited, servers) = results.get(
            name, (1, 0.0, "(the lane did not finish)", "-", (0.0, 0))
        )
        kept = f"  (its servers' logs: {basetemp})" if code else ""
        print(f"  {name:<{width}}  exit {code}  {seconds / 60:.1f} min  {last}{kept}")
        print(f"  {'':<{width}}  slowest modules (min): {slowest(timelines[name])}")
        print(f"  {'':<{width}}  {servers} server(s) waited for memory, {waited / 60:.1f} min in all")
    if memory.lowest is not None:
        print(memory.report())
    return 0 if all(result[0] == 0 for result in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
