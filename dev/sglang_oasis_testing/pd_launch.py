"""``launch_pd`` as a child process group, for tests and benchmarks: start, wait for its ready file,
talk to the router and both servers, stop (SIGTERM to its group; the launcher stops its children)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sglang_oasis.server_process import ServerProcess, child_env


class PDLaunch:
    """``launch_pd`` in its own process group; its ready file names the three processes."""

    def __init__(self, args: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.ready_file = log_dir / "ready.json"
        self.launcher_log = log_dir / "launcher.log"
        log = open(self.launcher_log, "wb")  # noqa: SIM115 - owned by the child
        self.process = subprocess.Popen(
            [sys.executable, "-m", "sglang_oasis.launch_pd", "--port", "0", "--log-dir", str(log_dir),
             "--ready-file", str(self.ready_file), *args],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=child_env({"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}),
        )  # fmt: skip
        log.close()
        deadline = time.monotonic() + 600
        while not self.ready_file.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"launch_pd did not come up:\n{self.launcher_log.read_text()[-4000:]}")
            time.sleep(1)
        self.info: dict[str, Any] = json.loads(self.ready_file.read_text())
        self.router = self._client("router")
        self.decode = self._client("decode")
        self.prefill = self._client("prefill")

    def _client(self, name: str) -> ServerProcess:
        """A ServerProcess used only as an HTTP client of an already running process."""
        port = int(self.info[name]["url"].rsplit(":", 1)[1])
        return ServerProcess([], Path(self.info[name]["log"]), port=port)

    def transferred_mb(self) -> tuple[float, int]:
        """(sum, count) of the prefill server's ``sglang:kv_transfer_total_mb`` histogram (SGLang's own KV
        transfers; needs ``--enable-metrics`` on the prefill server)."""
        import urllib.request

        with urllib.request.urlopen(self.info["prefill"]["url"] + "/metrics", timeout=30) as response:
            text = response.read().decode()
        total, count = 0.0, 0
        for line in text.splitlines():
            if line.startswith("sglang:kv_transfer_total_mb_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith("sglang:kv_transfer_total_mb_count"):
                count += int(float(line.rsplit(" ", 1)[1]))
        return total, count

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the launcher stops its three children
            self.process.wait(timeout=300)

    def __enter__(self) -> PDLaunch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
