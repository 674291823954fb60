"""A real ``sglang_oasis.launch_server`` process on 127.0.0.1, started and stopped by its own process group.

Used by tests (session-scoped fixtures) and benchmarks (dense and sparse servers in one run). Only the
process group this object started is ever signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sglang_oasis.memory.host_tier import available_host_memory


class GenerateError(RuntimeError):
    """A ``/generate`` request answered with an error status."""


def greedy_body(input_ids: list[int], max_new_tokens: int) -> dict[str, Any]:
    """A ``/generate`` body: greedy, exactly ``max_new_tokens`` tokens (EOS ignored)."""
    return {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a process a test starts: this one's, less ``TRITON_INTERPRET`` (the test
    process runs Triton kernels interpreted on CPU; servers and tools compile theirs as usual)."""
    inherited = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return {**inherited, **(extra or {})}


def _ephemeral_ports_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, below the kernel's ephemeral range where it can be: a port the
    kernel hands out (bind to 0) goes back to that range when released, where any outgoing connection
    (an HTTP client, ZMQ, Mooncake) may take it before the server that was given it binds it (seen in CI:
    the PD router's metrics port, chosen ~50 s before the router started)."""
    low, high = 20000, _ephemeral_ports_start()
    for _ in range(200 if high - low >= 1000 else 0):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", random.randrange(low, high)))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerStartError(RuntimeError):
    pass


SPAWN_WAIT_ENV = "SGLANG_OASIS_SPAWN_WAIT_FOR_GIB"  # set by scripts/run_lanes.py for its yielding lane
MODEL_SERVERS = ("sglang_oasis.launch_server", "sglang.launch_server")  # the modules that hold a model
CRASH_DIAGNOSTICS_ENV = ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH")  # SGLang's


def mem_available_gib() -> float:
    """Host memory available to new allocations now, in GiB (``available_host_memory``)."""
    return available_host_memory() / 2**30


def wait_for_memory(
    gib: float,
    timeout_s: float,
    available: Callable[[], float | None] = mem_available_gib,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """Wait until ``available()`` GiB are at least ``gib`` (or it cannot be read), at most ``timeout_s``;
    returns the seconds waited. Two test lanes share one machine's memory: the lane that yields starts a
    server only when the other's servers leave room for it, else both run out of memory together."""
    waited = 0.0
    while waited < timeout_s:
        now = available()
        if now is None or now >= gib:
            break
        sleep(2.0)
        waited += 2.0
    return waited


def spawn_gate(value: str) -> tuple[float, float] | None:
    """``SGLANG_OASIS_SPAWN_WAIT_FOR_GIB``'s ``GIB`` or ``GIB:SECONDS`` as (GiB, seconds; default 20
    minutes); None when unset."""
    gib, _, seconds = value.partition(":")
    return (float(gib), float(seconds or 1200)) if gib else None


class ServerProcess:
    """``python -m sglang_oasis.launch_server <args> --host 127.0.0.1 --port <free>``, logged to a file
    (``host``/``port`` override the address; ``module`` runs another server module taking ``--host``/``--port``, e.g. SGLang's router; it is
    ready when ``ready_path`` answers 200)."""

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        module: str = "sglang_oasis.launch_server",
        ready_path: str = "/health_generate",
        ready_timeout_s: float = 300.0,
    ) -> None:
        self.port = port or free_port()
        self.ready_timeout_s = ready_timeout_s  # a captured step compiles its programs before ready
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{self.port}"
        self.log_path = log_path
        self.ready_path = ready_path
        self.command = [sys.executable, "-m", module, "--host", host, "--port", str(self.port), *args]
        # ``stop`` ends the group with SIGTERM: SGLang takes its scheduler's exit for a crash and sleeps 5 s
        # before py-spy and CUDA core dumps of schedulers that are gone, at every stop (the test suite
        # stops dozens); a stopped server did not crash. A caller's environment may ask for them again.
        quiet = {name: os.environ.get(name, "0") for name in CRASH_DIAGNOSTICS_ENV}
        self.env = child_env({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **quiet, **(env or {})})
        # Only a model server waits for memory (SGLANG_OASIS_SPAWN_WAIT_FOR_GIB): SGLang's router holds next
        # to none, and a router waiting for a lane's 9 GiB kept a PD pair whose two servers were ready from
        # serving until its test's start deadline passed (test_pd_retraction in the full suite).
        self.gated = module in MODEL_SERVERS
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float | None = None) -> ServerProcess:
        return self.spawn().wait_ready(self.ready_timeout_s if timeout_s is None else timeout_s)

    def spawn(self) -> ServerProcess:
        """Start the process (its own process group) without waiting for it to be ready. A model server
        with ``SGLANG_OASIS_SPAWN_WAIT_FOR_GIB`` set (``GIB`` or ``GIB:SECONDS``) first waits (up to SECONDS,
        default 20 minutes) until that much memory is available; the wait is written to the server's log."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        gate = spawn_gate(os.environ.get(SPAWN_WAIT_ENV, "")) if self.gated else None
        waited = wait_for_memory(*gate) if gate else 0.0
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        if waited:
            log.write(
                f"[server_process] waited {waited:.0f} s for {gate[0] if gate else 0:g} GiB of available memory\n".encode()
            )
            log.flush()
        self.process = subprocess.Popen(
            self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> ServerProcess:
        assert self.process is not None, "spawn() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"server exited with {self.process.returncode} during start-up:\n{self.log_tail()}"
                )
            if self._ready():
                return self
            time.sleep(1.0)
        stacks = self._stack_dumps()
        self.stop()
        raise ServerStartError(f"server not ready after {timeout_s:.0f} s:\n{self.log_tail()}\n{stacks}")

    def _stack_dumps(self) -> str:
        """Where each process of the server's group is stuck (``py-spy dump``, when installed), and the
        machine's free memory: for a start-up that never finishes."""
        import shutil

        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        out = []
        out.append(f"available memory: {mem_available_gib():.2f} GiB")
        assert self.process is not None
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getpgid(int(entry.name)) != self.process.pid:
                    continue
                dump = subprocess.run(
                    [spy, "dump", "--pid", entry.name], capture_output=True, text=True, timeout=30
                )
                out.append(f"--- pid {entry.name}:\n{dump.stdout[-3000:]}{dump.stderr[-500:]}")
            except (OSError, subprocess.SubprocessError):
                continue
        return "\n".join(out)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.ready_path, timeout=30) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 600.0) -> tuple[int, str]:
        """POST JSON; ``(status, response text)`` whatever the status."""
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return int(response.status), response.read().decode()
        except urllib.error.HTTPError as error:
            return int(error.code), error.read().decode(errors="replace")

    def generate(self, input_ids: list[int], max_new_tokens: int, timeout_s: float = 600.0) -> dict[str, Any]:
        """Greedy ``/generate`` of exactly ``max_new_tokens`` tokens (EOS ignored): SGLang's JSON reply
        (``output_ids``, ``meta_info``...). Raises ``GenerateError`` unless the server answers 200."""
        status, text = self.post("/generate", greedy_body(input_ids, max_new_tokens), timeout_s)
        if status != 200:
            raise GenerateError(f"HTTP {status}: {text[:2000]}")
        return dict(json.loads(text))

    def oasis_stats(self) -> dict[str, Any]:
        """``GET /oasis/stats``: sglang-oasis's counters and gauges."""
        with urllib.request.urlopen(self.url + "/oasis/stats", timeout=30) as response:
            return dict(json.loads(response.read()))

    def restart(self) -> ServerProcess:
        """Start the process again after it exited (same command and port); what is left of its old
        process group is killed first."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)  # its group id is its pid (new session)
        return self.spawn()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group, then SIGKILL it if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        pgid = os.getpgid(self.process.pid)
        os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)  # children that outlived the parent
        self.process.wait(timeout=timeout_s)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
