"""``python -m sglang_oasis.launch_pd``: prefill/decode disaggregation on one machine with one command.

    python -m sglang_oasis.launch_pd --port 30000 [launch_server arguments for both servers ...]

It starts, on 127.0.0.1 by default:

- a prefill server and a decode server, each ``python -m sglang_oasis.launch_server`` (so ``--oasis-*``
  options, the embedded default model and the CPU defaults apply to both) with
  ``--disaggregation-mode prefill|decode`` and the Mooncake transfer backend (TCP with the CPU build);
- SGLang's router (``sglang_router.launch_router --pd-disaggregation``) on ``--host``/``--port``, which
  sends each request to both: the prefill server computes the prompt's KV and the first token, the
  decode server receives the KV over Mooncake and decodes the rest.

Clients talk to the router exactly as to one SGLang server (OpenAI API, ``/generate``). If the prefill or
the decode server dies, the launcher starts it again (same port; at most ``--max-restarts`` times each):
requests already decoding keep going (their KV is on the decode server), requests that needed the dead
server fail with an error, and the router sends new requests to the restarted one (it checks the
servers' health every 5 s, allowing 30 s for an answer, and takes a server back after two good answers;
its circuit breaker is off, so requests that fail alone do not stop the others; ``--router-args`` can
set ``--health-check-interval-secs``, ``--health-check-timeout-secs`` and the ``--cb-*`` options
otherwise). Ctrl-C or SIGTERM
stops all three; so does the router exiting. Each process logs to ``--log-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sglang_oasis.disaggregation.mooncake_builds import MissingSystemLibrary, check_system_libraries
from sglang_oasis.disaggregation.side_channel import TOKEN_ENV
from sglang_oasis.disaggregation.transfer_engine import engine_env_defaults
from sglang_oasis.launcher.argv import TENSOR_PARALLEL_OPTIONS, given
from sglang_oasis.server_process import ServerProcess, ServerStartError, free_port

PROG = "python -m sglang_oasis.launch_pd"
OWN_OPTIONS = ("--disaggregation-mode", "--disaggregation-bootstrap-port", "--host", "--port")


@dataclass
class PDCluster:
    prefill: ServerProcess
    decode: ServerProcess
    router: ServerProcess
    bootstrap_port: int

    @property
    def processes(self) -> dict[str, ServerProcess]:
        return {"prefill": self.prefill, "decode": self.decode, "router": self.router}

    def describe(self) -> dict[str, object]:
        info: dict[str, object] = {"url": self.router.url, "bootstrap_port": self.bootstrap_port}
        for name, server in self.processes.items():
            info[name] = {"url": server.url, "pid": server.process.pid if server.process else None,
                          "log": str(server.log_path)}  # fmt: skip
        return info

    def stop(self) -> None:
        for server in (self.router, self.decode, self.prefill):
            server.stop()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--host", default="127.0.0.1", help="the router's address")
    parser.add_argument(
        "--port",
        type=int,
        default=30000,
        help="the router's port (clients connect here); 0: a free one, chosen when the router starts "
        "(the ready file and the ready line name it)",
    )
    for name in ("prefill", "decode", "bootstrap"):
        parser.add_argument(
            f"--{name}-port", type=int, default=None, help=f"{name} port (default: a free one)"
        )
    parser.add_argument(
        "--transfer-backend", default="mooncake", help="SGLang's --disaggregation-transfer-backend"
    )
    parser.add_argument(
        "--prefill-args",
        default="",
        help='extra arguments for the prefill server only (one quoted string; write --prefill-args="...")',
    )
    parser.add_argument(
        "--decode-args",
        default="",
        help='extra arguments for the decode server only (one quoted string, --decode-args="...")',
    )
    parser.add_argument(
        "--router-args",
        default="",
        help='extra arguments for sglang_router (one quoted string, --router-args="...")',
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="logs of the three processes")
    parser.add_argument(
        "--ready-file", type=Path, default=None, help="write URLs and pids here (JSON) when ready"
    )
    parser.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds to wait for the servers"
    )
    parser.add_argument(
        "--max-restarts", type=int, default=3, help="restarts of a dead prefill/decode server"
    )
    return parser


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = build_parser()
    args, server_args = parser.parse_known_args(list(argv))
    for option in OWN_OPTIONS:
        if given(server_args, option):
            parser.error(f"{option}: set by {PROG} for each server (see --help)")
    prefill, decode = ([*server_args, *shlex.split(extra)] for extra in (args.prefill_args, args.decode_args))
    sizes = (
        last_value(prefill, TENSOR_PARALLEL_OPTIONS, "1"),
        last_value(decode, TENSOR_PARALLEL_OPTIONS, "1"),
    )
    sparse = last_value(decode, ("--oasis-mode",), "sparse") == "sparse"
    if sizes[0] != sizes[1] and sparse:
        parser.error(
            f"--tp-size: the prefill server's ({sizes[0]}) and the decode server's ({sizes[1]}) differ; in "
            "sparse mode each decode rank reads its KV heads from the prefill rank of the same number, so "
            "both servers need the same --tp-size (give it once for both)"
        )
    return args, server_args


def last_value(argv: Sequence[str], spellings: Sequence[str], default: str) -> str:
    """The value argparse takes for an option given by any of its ``spellings`` (the last one given)."""
    value = default
    for i, arg in enumerate(argv):
        name, equals, inline = arg.partition("=")
        if name in spellings:
            value = inline if equals else argv[i + 1] if i + 1 < len(argv) else value
    return value


# The router's recovery from a restarted server, unless --router-args sets them. Its own defaults (a
# health check every 60 s, 2 good ones to mark a worker healthy again, an open circuit tried again after
# 60 s) refuse every request for ~2 minutes after a prefill server restarts ("No available prefill
# workers (all circuits open or unhealthy)"). SGLang's /health runs a one-token generate through the
# scheduler, which on a CPU waits behind the prefills queued before it (seconds each): with the router's
# 5 s timeout, three slow answers in a row under load marked a working server unhealthy and every request
# failed with that 503 until it recovered (seen in bench_soak), so a health check may take 30 s.
ROUTER_RECOVERY = (
    ("--health-check-interval-secs", "5"),
    ("--cb-timeout-duration-secs", "10"),
    ("--health-check-timeout-secs", "30"),
)


# The router's circuit breaker is off unless --router-args configures it: with one server of each role it
# has no other worker to send to, so it only turns failures of single requests (a failed KV transfer, a
# request aborted mid-transfer: each fails alone, with its 500) into an outage of every request. Ten in
# its two-minute window opened it, and every request then failed with 503 "No available prefill workers
# (all circuits open or unhealthy)" until a trial request succeeded (seen in bench_soak --pd-faults).
# A dead server is still taken out (and back) by the health checks.
CIRCUIT_BREAKER_OPTIONS = (
    "--disable-circuit-breaker", "--cb-failure-threshold", "--cb-success-threshold", "--cb-timeout-duration-secs",
    "--cb-window-duration-secs",
)  # fmt: skip


def router_argv(
    prefill_url: str, bootstrap: int, decode_url: str, metrics_port: int, extra: str
) -> list[str]:
    """sglang_router's arguments: both servers, metrics on 127.0.0.1, ``ROUTER_RECOVERY``, ``extra``."""
    user = shlex.split(extra)
    recovery = [
        word for option, value in ROUTER_RECOVERY if not given(user, option) for word in (option, value)
    ]
    if not any(given(user, option) for option in CIRCUIT_BREAKER_OPTIONS):
        recovery.append("--disable-circuit-breaker")
    return ["--pd-disaggregation", "--prefill", prefill_url, str(bootstrap), "--decode", decode_url,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port), *recovery, *user]  # fmt: skip


def start_cluster(args: argparse.Namespace, server_args: list[str]) -> PDCluster:
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="sglang-oasis-pd-"))
    bootstrap = args.bootstrap_port or free_port()
    common = [*server_args, "--disaggregation-transfer-backend", args.transfer_backend,
              "--disaggregation-bootstrap-port", str(bootstrap)]  # fmt: skip
    env = engine_env_defaults()
    # The hand-off routes of remote partial fetching accept only this pair's servers (side_channel.py).
    env.setdefault(TOKEN_ENV, os.environ.get(TOKEN_ENV) or secrets.token_hex(16))
    servers = {}
    for role, port, extra in (("prefill", args.prefill_port, args.prefill_args),
                              ("decode", args.decode_port, args.decode_args)):  # fmt: skip
        role_args = [*common, "--disaggregation-mode", role, *shlex.split(extra)]
        if not given(role_args, "--nccl-port"):  # two servers on one machine must not share SGLang's default
            role_args += ["--nccl-port", str(free_port())]
        servers[role] = ServerProcess(
            role_args, log_dir / f"{role}.log", env, port=port, ready_path="/health"
        )
    for server in servers.values():
        server.spawn()
    prefill, decode = servers["prefill"], servers["decode"]
    started = list(servers.values())
    try:
        for server in servers.values():
            server.wait_ready(args.startup_timeout)
        # The router's ports (its own with --port 0, and its metrics port) are chosen only now, right
        # before it binds them: a port chosen before the servers start (~50 s) can be taken meanwhile by
        # one a starting server opens ("Address already in use").
        router = ServerProcess(
            router_argv(prefill.url, bootstrap, decode.url, free_port(), args.router_args),
            log_dir / "router.log", host=args.host, port=args.port or None,
            module="sglang_router.launch_router",
            ready_path="/readiness",  # 200 once it has registered healthy workers (/health answers earlier)
        )  # fmt: skip
        started.insert(0, router)
        router.spawn().wait_ready(args.startup_timeout)
        introduce(router)
    except (ServerStartError, KeyboardInterrupt, SystemExit):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        for process in started:
            process.stop()
        raise
    return PDCluster(prefill, decode, router, bootstrap)


def introduce(router: ServerProcess) -> None:
    """One short request through the pair: a decode node that fetches introduces itself to the prefill
    node by asking for its hand-off (the handshake of remote partial fetching: until then the prefill
    node sends it requests whole), so the first real request is already staged."""
    try:
        router.generate(list(range(1, 33)), 2, timeout_s=120)
    except Exception as error:  # the pair serves all the same: its first requests go whole
        print(f"[sglang-oasis] the warm-up request through the router failed: {error}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    args, server_args = parse(sys.argv[1:] if argv is None else argv)
    if args.transfer_backend == "mooncake":
        try:
            check_system_libraries()
        except MissingSystemLibrary as error:
            sys.exit(f"{PROG}: error: {error}")
    started = time.monotonic()

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)  # from here on, SIGTERM stops what was started
    try:
        cluster = start_cluster(args, server_args)
    except ServerStartError as error:
        sys.exit(f"{PROG}: error: {error}")
    info = cluster.describe()
    if args.ready_file is not None:
        args.ready_file.write_text(json.dumps(info, indent=2) + "\n")
    print(f"[sglang-oasis] PD ready in {time.monotonic() - started:.0f} s: {json.dumps(info)}", flush=True)

    try:
        status = supervise(cluster, args.max_restarts)
    except (KeyboardInterrupt, SystemExit):
        status = 0
    finally:
        # A second Ctrl-C or SIGTERM must not cut the clean-up short and orphan a server.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cluster.stop()
    sys.exit(status)


def supervise(cluster: PDCluster, max_restarts: int, period_s: float = 1.0) -> int:
    """Restart a dead prefill or decode server; returns (exit status 1) when the router exits or a
    server died more than ``max_restarts`` times."""
    restarts = {"prefill": 0, "decode": 0}
    while cluster.router.alive():
        for name in restarts:
            server = cluster.processes[name]
            if server.alive():
                continue
            restarts[name] += 1
            if restarts[name] > max_restarts:
                print(f"[sglang-oasis] the {name} server died {restarts[name]} times; stopping (log: "
                      f"{server.log_path})", file=sys.stderr, flush=True)  # fmt: skip
                return 1
            print(f"[sglang-oasis] the {name} server exited; restarting it ({restarts[name]}/{max_restarts})",
                  file=sys.stderr, flush=True)  # fmt: skip
            server.restart()
        time.sleep(period_s)
    print("[sglang-oasis] the router exited; stopping the servers", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    main()
