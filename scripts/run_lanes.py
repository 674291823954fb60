"""The whole test suite in two lanes at once: two pytest processes, each with its own servers.

A test with a server mostly waits on that server, which computes on one thread (``OMP_NUM_THREADS=1``),
and a third of the suite's time is servers starting; in one pytest process the second core idles. Each
lane keeps the servers it shares (session fixtures) to itself: the SmolLM2 lane has the unit tests and
the modules on SmolLM2's servers (all 30 layers, or the first 6), the tiny lane every other module (the
random-weight tiny models). A module belongs to the SmolLM2 lane when it is named in ``SMOLLM2_LANE``;
a new module goes to the tiny lane unless added there.

Each lane's lines are printed as they come, prefixed with the lane's name; both lanes' summaries and
times at the end. A lane's temporary directory (servers' logs) is kept when it fails, under /tmp. Exits 0 only when both lanes pass. With one CPU (or ``SGLANG_OASIS_TEST_LANES=1``) it
runs one pytest over everything, as ``pytest`` alone would.

    python scripts/run_lanes.py        (scripts/run_tests.sh runs it when given no pytest arguments)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INTEGRATION = ROOT / "test" / "integration"
# The modules on SmolLM2's servers; with the unit tests (~4 minutes) they take about as long as the rest.
SMOLLM2_LANE = (
    "test_accuracy_bench.py",
    "test_default_server.py",
    "test_passkey.py",
    "test_pd.py",
    "test_rpf_bench.py",
)


def lanes() -> dict[str, list[str]]:
    every = sorted(path.name for path in INTEGRATION.glob("test_*.py"))
    missing = [name for name in SMOLLM2_LANE if name not in every]
    if missing:
        raise SystemExit(f"run_lanes.py: SMOLLM2_LANE names modules that do not exist: {', '.join(missing)}")
    smollm2 = ["test/unit", *(f"test/integration/{name}" for name in SMOLLM2_LANE)]
    tiny = [f"test/integration/{name}" for name in every if name not in SMOLLM2_LANE]
    return {"smollm2": smollm2, "tiny": tiny}


def mem_available_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return None


class LowestMemory(threading.Thread):
    """The machine's lowest ``MemAvailable`` while the lanes run (sampled every 2 s): how close the lanes'
    servers together came to the memory's end."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.lowest: float | None = None
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(2.0):
            now = mem_available_gib()
            if now is not None and (self.lowest is None or now < self.lowest):
                self.lowest = now


RUNNING: list[subprocess.Popen[str]] = []  # the lanes' pytest processes, told to stop on Ctrl-C


def run_lane(name: str, paths: list[str], width: int, out: threading.Lock, results: dict[str, tuple]) -> None:
    started = time.monotonic()
    basetemp = tempfile.mkdtemp(prefix=f"pytest-{name}-")  # each lane its own; pytest empties it first
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--basetemp={basetemp}", *paths]
    process = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    RUNNING.append(process)
    assert process.stdout is not None
    last = ""
    for line in process.stdout:
        with out:
            print(f"[{name:<{width}}] {line}", end="", flush=True)
        if line.strip():
            last = line.strip()
    code = process.wait()
    if code == 0:  # kept when it failed: the servers' logs are in it
        shutil.rmtree(basetemp, ignore_errors=True)
    results[name] = (code, time.monotonic() - started, last, basetemp)


def main() -> int:
    wanted = int(os.environ.get("SGLANG_OASIS_TEST_LANES", "2" if (os.cpu_count() or 1) > 1 else "1"))
    if wanted < 2:
        return subprocess.call([sys.executable, "-m", "pytest"], cwd=ROOT)
    plan = lanes()
    width = max(len(name) for name in plan)
    out = threading.Lock()
    results: dict[str, tuple] = {}
    threads = [
        threading.Thread(target=run_lane, args=(name, paths, width, out, results))
        for name, paths in plan.items()
    ]
    memory = LowestMemory()
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
        code, seconds, last, basetemp = results[name]
        kept = f"  (its servers' logs: {basetemp})" if code else ""
        print(f"  {name:<{width}}  exit {code}  {seconds / 60:.1f} min  {last}{kept}")
    if memory.lowest is not None:
        print(f"  lowest available memory while they ran: {memory.lowest:.1f} GiB")
    return 0 if all(result[0] == 0 for result in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
