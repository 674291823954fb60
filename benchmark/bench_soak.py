"""Soak, long variant (issue 25): a few hundred greedy requests with client disconnects, ``/abort_request``
calls, streaming and not, shared stems and exact repeats, against each mode in turn, with a host tier
small enough (and ``--schedule-conservativeness`` low enough) that SGLang retracts requests under load.

Modes (``--modes``, comma-separated):

- ``dense``: dense SGLang, the baseline (is the engine itself exact under this load?);
- ``sparse``: sparse mode, K = ``--top-k``;
- ``eagle3``: sparse with ``--oasis-lookahead eagle3`` (the draft head shipped for SmolLM2; needs the
  whole model, so this mode ignores ``--num-layers``);
- ``pd``: ``launch_pd`` (sparse prefill and decode servers, Mooncake on 127.0.0.1, remote partial
  fetching, the decode radix cache on); aborts go to both servers, the drain reads both. With ``--pd-faults`` it also injects
  faults: about one request in ten has a prompt of ``--inject-tokens`` tokens, whose decode-time KV
  transfers the servers fail (``SGLANG_OASIS_INJECT_TRANSFER_FAILURE``), and once ``--kill-at`` of the
  requests have finished the prefill server is killed (SIGKILL to its process group) and ``launch_pd``
  restarts it. A failure is expected when an injected request fails naming the injected failure
  (``failed_injected``) or a request was in flight while the prefill server was down, up to 5 s after
  it answered again (``failed_prefill_restart``); any other is unexpected. Every request that completes
  must still answer as alone; the decode node's ``remote_failed_reads`` and ``transfer_failures`` and
  the outage (``prefill_outage_s``) are reported.

Per mode (``benchmark/soak.py`` does the work): requests sent, completed, aborted, disconnected,
failed as expected (aborted or disconnected by the client), failed unexpectedly (must be 0), completed
requests SGLang retracted, completed outputs differing from the same request served alone (must be 0;
``differing_retracted`` counts those SGLang retracted apart: see below), and what the server still holds
after the drain and a radix flush (request slots, working-set tokens, staged bytes, host-pool tokens;
must be 0).

Retractions: a small host tier and a low ``--conservativeness`` make them possible, but SGLang's
admission avoids them well on these loads (none in the runs so far); ``--retract-every N`` forces them
with SGLang's own test switch (``SGLANG_TEST_RETRACT``: every N forward passes a decode batch retracts).
The solo runs then go through the same server, so with forced retractions a solo run may itself have
been retracted; ``test/integration/test_soak.py`` takes its references from a server without the switch.

A request SGLang retracts is re-prefilled with its generated tokens as prompt: the token after them is
computed by the dense prefill, and its first working set is chosen again from the prefill window, so in
sparse mode its continuation can differ from the solo run's (dense: the same). That is reported, not
hidden, in ``differing_retracted``.

    python benchmark/bench_soak.py --json soak.json [--modes dense,sparse,eagle3,pd] [--requests 200]
        [--concurrency 16] [--num-layers 6] [--top-k 8] [--host-kv-tokens 4096]
        [--prompt-tokens 200,1500] [--new-tokens 16,64] [--seed 25] [--retract-every N]
        [--pd-faults [--inject-tokens N] [--kill-at 0.5]] [--modes-at-once N]

Modes run side by side, ``--modes-at-once`` of them (default: one per core; each server computes on one
thread), the longest first (eagle3, pd, sparse, dense); a mode's outcome does not depend on what runs
beside it (greedy outputs are compared with its own solo runs, on its own server).

Prints a table and writes JSON (one section per mode, plus ``settings``, ``date``, ``machine``); exits 1
when a mode failed a must-be-0 figure or did not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import requests

from common import BY_SUMMARIES, machine_info, print_table
from sglang_oasis.evaluation.passkey import essays_text
from sglang_oasis.models.default_model import prepare_default_model
from sglang_oasis.server_process import ServerProcess
from soak import (
    HELD,
    Excuses,
    Outcome,
    SoakRequest,
    compare,
    drain,
    nothing_held,
    run_mix,
    solo_outputs,
    summary,
    workload,
)

MUST_BE_ZERO = ("failed_unexpectedly", "differing")
LONGEST_FIRST = ("eagle3", "pd", "sparse", "dense")  # the order modes start in when they run side by side


def mode_args(mode: str, args: argparse.Namespace, model: Path) -> list[str]:
    common = ["--model-path", str(model), "--dtype", "float32", "--schedule-conservativeness",
              str(args.conservativeness)]  # fmt: skip
    if mode == "dense":
        return [*common, "--oasis-mode", "dense", "--max-total-tokens", str(args.host_kv_tokens)]
    selection = [*BY_SUMMARIES, "--oasis-top-k", str(args.top_k)]  # results.md's rows
    sparse = [*common, *selection, "--oasis-host-kv-tokens", str(args.host_kv_tokens)]
    if mode == "eagle3":
        from sglang_oasis.models.default_model import default_draft_dir

        return [
            *sparse,
            "--oasis-lookahead",
            "eagle3",
            "--speculative-draft-model-path",
            str(default_draft_dir()),
        ]
    return sparse


def retract_env(every: int) -> dict[str, str]:
    """SGLang's own test switch: retract running requests every ``every`` forward passes (0: off)."""
    return {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": str(every)} if every else {}


class PrefillKiller:
    """``--pd-faults``: once ``at`` of the ``total`` requests have finished, SIGKILL the prefill server's
    process group and time until it answers ``/health`` again (``launch_pd`` restarts it); the outage goes
    to ``excuses``."""

    def __init__(self, launch: Any, total: int, at: float, excuses: Excuses) -> None:
        self.launch, self.excuses = launch, excuses
        self.threshold = max(1, round(at * total))
        self.finished = 0
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.outage_s: float | None = None
        self.started = time.monotonic()  # made right before the mix starts
        self.killed_at: float | None = None  # seconds into the mix

    def on_done(self, outcome: Outcome) -> None:
        with self.lock:
            self.finished += 1
            if self.finished == self.threshold:
                self.thread = threading.Thread(target=self._kill, daemon=True)
                self.thread.start()

    def _kill(self) -> None:
        url = self.launch.info["prefill"]["url"]
        down = time.monotonic()
        os.killpg(int(self.launch.info["prefill"]["pid"]), signal.SIGKILL)
        self.excuses.outages.append((down, math.inf))
        self.killed_at = round(down - self.started, 1)
        time.sleep(2)  # the launcher notices within a second
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if requests.get(url + "/health", timeout=10).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(1)
        up = time.monotonic()
        self.excuses.outages[-1] = (down, up)
        self.outage_s = round(up - down, 1)

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join(timeout=900)


def serving_again(router_url: str, timeout_s: float = 300.0) -> float:
    """Seconds until the router serves a one-token request again (after a prefill restart)."""
    started = time.monotonic()
    body: dict[str, Any] = {
        "input_ids": list(range(100, 132)),
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }
    while time.monotonic() - started < timeout_s:
        with contextlib.suppress(requests.RequestException):
            if requests.post(router_url + "/generate", json=body, timeout=120).status_code == 200:
                break
        time.sleep(2)
    return round(time.monotonic() - started, 1)


def run_pd(
    args: argparse.Namespace, reqs: list, model: Path, env: dict[str, str], logs: Path
) -> dict[str, Any]:
    from sglang_oasis_testing.pd_launch import PDLaunch

    excuses = Excuses(args.inject_tokens if args.pd_faults else None)
    if args.pd_faults:
        env = {**env, "SGLANG_OASIS_INJECT_TRANSFER_FAILURE": str(args.inject_tokens),
               "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60"}  # fmt: skip
    # The decode radix cache on: requests sharing a stem reuse decode-side KV, and a fetched request's
    # remaining blocks are read in the background before its KV is shared (DecodeFetcher.complete_later).
    pd_args = [*mode_args("sparse", args, model), "--decode-args=--disaggregation-decode-enable-radix-cache"]
    with PDLaunch(pd_args, logs / "pd", env) as launch:
        urls = [launch.prefill.url, launch.decode.url]
        killer = PrefillKiller(launch, len(reqs), args.kill_at, excuses) if args.pd_faults else None
        outcomes = run_mix(launch.router.url, reqs, args.concurrency, abort_urls=urls,
                           on_done=killer.on_done if killer else None)  # fmt: skip
        retry: list[SoakRequest] = []
        retried: list[Outcome] = []
        if killer is not None:
            killer.join()
            back_s = serving_again(launch.router.url)
            # the clients whose requests the outage failed send them again, to be served as alone
            retry = [replace(r, rid=f"{r.rid}-retry", fate="complete") for r, o in zip(reqs, outcomes, strict=True)
                     if excuses(r, o) == "prefill_restart"]  # fmt: skip
            retried = run_mix(launch.router.url, retry, args.concurrency, abort_urls=urls)
        held = {url: drain(url, sparse=True) for url in urls}
        solo = solo_outputs(launch.router.url, [*reqs, *retry], [*outcomes, *retried])
        merged = {"flushed": all(h["flushed"] for h in held.values())}
        merged |= {name: sum(h[name] for h in held.values()) for name in HELD}
        # the decode node's retractions: selection states kept at the backup, and resumed with them
        decode_stats = requests.get(launch.decode.url + "/oasis/stats", timeout=30).json()
        names = ("retracted_requests", "resumed_requests", "remote_failed_reads", "transfer_failures")
        result = {
            **compare(reqs, outcomes, solo, excuses if args.pd_faults else None),
            "held_after_drain": merged,
            "decode_node": {name: int(decode_stats[name]) for name in names},
        }
        if killer is not None:
            result["prefill_outage_s"] = killer.outage_s
            result["prefill_restarted"] = "restarting it" in launch.launcher_log.read_text()
            result["prefill_killed_at_s"] = killer.killed_at
            result["router_serving_again_s"] = back_s
            result["after_restart"] = (
                compare(retry, retried, solo, Excuses(excuses.inject_len)) if retry else {}
            )
        result["requests"] = summary(reqs, outcomes)
        return result


def mode_model(mode: str, args: argparse.Namespace) -> Path:
    return prepare_default_model(None if mode == "eagle3" else args.num_layers)


def run_mode(mode: str, args: argparse.Namespace, corpus: list[int], logs: Path) -> dict[str, Any]:
    model = mode_model(mode, args)
    env = retract_env(args.retract_every)
    inject = args.inject_tokens if mode == "pd" and args.pd_faults else None
    reqs = workload(args.seed, args.requests, corpus, args.prompt_tokens, args.new_tokens, inject_len=inject)
    started = time.monotonic()
    if mode == "pd":
        result = run_pd(args, reqs, model, env, logs)
    else:
        with ServerProcess(mode_args(mode, args, model), log_path=logs / f"{mode}.log", env=env) as server:
            outcomes = run_mix(server.url, reqs, args.concurrency)
            merged = drain(server.url, sparse=mode != "dense")
            solo = solo_outputs(server.url, reqs, outcomes)
            answers = server.alive()
        result = {**compare(reqs, outcomes, solo), "held_after_drain": merged, "alive_after": answers}
        result["requests"] = summary(reqs, outcomes)
    result["seconds"] = time.monotonic() - started
    return result


def failures(result: dict[str, Any]) -> list[str]:
    if "error" in result:
        return [result["error"]]
    bad = [f"{name} = {result[name]}" for name in MUST_BE_ZERO if result[name]]
    again = result.get("after_restart") or {}
    bad += [f"after the restart: {name} = {again[name]}" for name in MUST_BE_ZERO if again.get(name)]
    held = result["held_after_drain"]
    if not held.get("flushed"):
        bad.append("the radix cache could not be flushed")
    # kept retraction states are bounded, not a leak
    bad += [
        f"{name} = {value} after the drain"
        for name, value in nothing_held(held, True).items()
        if name != "flushed"
    ]
    return bad


def pair(text: str) -> tuple[int, int]:
    low, high = (int(x) for x in text.split(","))
    return low, high


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--modes", default="dense,sparse,eagle3,pd")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-layers", type=int, default=6, help="SmolLM2 truncated (eagle3: all 30)")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--host-kv-tokens", type=int, default=4096)
    parser.add_argument("--conservativeness", type=float, default=0.3, help="SGLang's; low: retractions")
    parser.add_argument("--prompt-tokens", type=pair, default=(200, 1500))
    parser.add_argument("--new-tokens", type=pair, default=(16, 64))
    parser.add_argument("--seed", type=int, default=25)
    parser.add_argument(
        "--pd-faults", action="store_true", help="pd: inject transfer failures, restart prefill"
    )
    parser.add_argument(
        "--inject-tokens", type=int, default=613, help="--pd-faults: the failing prompt length"
    )
    parser.add_argument(
        "--kill-at", type=float, default=0.5, help="--pd-faults: kill prefill after this share"
    )
    parser.add_argument(
        "--modes-at-once", type=int, default=None, help="modes run side by side (default: one per core)"
    )
    parser.add_argument(
        "--retract-every",
        type=int,
        default=0,
        help="force SGLang retractions every N forward passes (0: off)",
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in LONGEST_FIRST]
    if unknown:
        parser.error(f"--modes: unknown {', '.join(unknown)} (known: {', '.join(LONGEST_FIRST)})")
    if args.modes_at_once is not None and args.modes_at_once < 1:
        parser.error("--modes-at-once must be at least 1")
    at_once = min(len(modes), args.modes_at_once or os.cpu_count() or 1)

    from transformers import AutoTokenizer

    corpus = AutoTokenizer.from_pretrained(prepare_default_model()).encode(
        essays_text(), add_special_tokens=False
    )
    results: dict[str, Any] = {
        "settings": {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k != "json"
        },
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
    }
    results["settings"]["modes_at_once"] = at_once
    logs = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    print(f"server logs in {logs}; {at_once} mode(s) at once", flush=True)
    for mode in modes:  # converted once, before the modes that share a model start side by side
        mode_model(mode, args)
    written = threading.Lock()

    def run(mode: str) -> None:
        print(f"[bench_soak] {mode} ...", flush=True)
        try:
            result = run_mode(mode, args, corpus, logs)
        except Exception as exc:  # one mode failing still reports the others
            result = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"[bench_soak] {mode} done in {result.get('seconds', 0):.0f} s", flush=True)
        with written:
            results[mode] = result
            args.json.write_text(json.dumps(results, indent=2))

    with ThreadPoolExecutor(at_once) as pool:
        list(pool.map(run, sorted(modes, key=LONGEST_FIRST.index)))
    columns = ["sent", "completed", "aborted", "disconnected", "failed_unexpectedly", "retracted", "differing",
               "differing_retracted"]  # fmt: skip
    rows, bad = [], {}
    for mode in modes:
        result = results[mode]
        held = result.get("held_after_drain", {})
        leaks = sum(held.get(n, 0) for n in HELD if n != "held_kept_retractions")
        rows.append(
            [mode, *(result.get(c, "-") for c in columns), leaks, held.get("held_kept_retractions", "-")]
        )
        if failures(result):
            bad[mode] = failures(result)
    # kept: retraction states of requests aborted while retracted (bounded, evicted oldest first)
    print_table(["mode", *columns, "held", "kept"], rows)
    for mode, problems in bad.items():
        print(f"{mode}: {'; '.join(problems)}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
