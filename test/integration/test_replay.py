"""Trace replay against real servers on CPU: the shared Mooncake trace and chitchat conversations on the
sparse tiny Qwen3 (SGLang's radix cache must reuse shared prefixes), a server that is not there, and a
server that dies mid-run (the run ends with errors counted and a complete report)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sglang_oasis.replay.build_chitchat import write_chitchat
from sglang_oasis.replay.prompts import BlockPrompts, corpus_token_ids
from sglang_oasis.replay.schedule import turn_positions
from sglang_oasis.replay.trace import load_trace
from sglang_oasis.server_process import ServerProcess, child_env, free_port

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parents[2]
SHARED_TRACE = REPO / "data" / "traces" / "mooncake_conversation_trace.head2000.jsonl"  # shipped
SCALE = 0.05
PAGE = 16  # sparse mode's page size: the radix cache matches whole pages
# The prefill window (default 32 tokens): sparse mode's prefix match leaves at least these to compute.
WINDOW = 32


def matchable(prompt_tokens: int, shared: int) -> int:
    """Tokens of a prompt the radix cache can serve when ``shared`` of them are cached: whole pages, at
    most the prompt minus the prefill window."""
    return max(0, min(shared, prompt_tokens - WINDOW)) // PAGE * PAGE


def replay(*args: str, timeout: float = 600, wait: bool = True) -> subprocess.Popen[str]:
    env = child_env(
        {
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]),
        }
    )
    command = [sys.executable, "-m", "sglang_oasis.replay", "--no-progress", *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if wait:
        process.wait(timeout=timeout)
    return process


def output(process: subprocess.Popen[str]) -> str:
    out, err = process.communicate(timeout=60)
    return out + err


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@pytest.fixture(scope="module")
def first50(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "first50.jsonl"
    with SHARED_TRACE.open() as src:
        path.write_text("".join(next(src) for _ in range(50)))
    return path


def test_mooncake_replay_reuses_shared_prefixes(
    tiny_qwen3_sparse_server: ServerProcess, tiny_qwen3_dir: Path, first50: Path, tmp_path: Path
) -> None:
    out = tmp_path / "replay.json"
    started = time.monotonic()
    done = replay(
        "--trace", str(first50), "--url", tiny_qwen3_sparse_server.url, "--out", str(out),
        "--length-scale", str(SCALE), "--speedup", "10", "--max-concurrency", "4",
    )  # fmt: skip
    elapsed = time.monotonic() - started
    log = output(done)
    assert done.returncode == 0, log
    report = json.loads(out.read_text())
    summary = report["summary"]
    print(
        f"50-request replay at scale {SCALE}: {elapsed:.1f} s wall, {summary['duration_s']:.1f} s run, "
        f"cached share {summary['cached_share']:.3f}, TTFT p50 {summary['ttft_s']['p50']:.3f} s"
    )
    assert (summary["requests"], summary["completed"], summary["errors"]) == (50, 50, 0)
    assert report["settings"]["tokenizer"] == str(tiny_qwen3_dir)  # asked the server for its model

    from transformers import AutoTokenizer

    requests = load_trace(first50).requests
    prompts = BlockPrompts(corpus_token_ids(AutoTokenizer.from_pretrained(tiny_qwen3_dir)), SCALE)
    records = sorted(report["requests"], key=lambda r: r["sent_s"])
    by_line = {r.line: r for r in requests}
    sent_ids: list[list[int]] = []
    reused = 0
    for record in records:
        request = by_line[record["line"]]
        ids = prompts.prompt(request.hash_ids, request.input_length, f"line{request.line}")
        assert (
            record["prompt_tokens"]
            == record["input_tokens"]
            == len(ids)
            == round(request.input_length * SCALE)
        )
        assert record["completion_tokens"] == max(1, round(request.output_length * SCALE))
        # the cache holds only tokens of earlier requests: at most the longest prefix shared with one
        longest = max((common_prefix(ids, earlier) for earlier in sent_ids), default=0)
        assert record["cached_tokens"] <= longest
        finished_before = [
            r
            for r in records
            if r["end_s"] < record["sent_s"] and set(by_line[r["line"]].hash_ids) & set(request.hash_ids)
        ]
        if finished_before and matchable(len(ids), longest) >= PAGE:
            assert record["cached_tokens"] > 0, record
            reused += 1
        sent_ids.append(ids)
    assert reused >= 30  # every request shares hash id 0, the trace's common system prompt
    assert summary["cached_share"] == sum(r["cached_tokens"] for r in records) / sum(
        r["prompt_tokens"] for r in records
    )
    for path in report["plots"].values():
        assert Path(path).read_bytes()[:4] == b"\x89PNG"


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chats") / "chitchat.jsonl"
    assert write_chitchat(path, count=3, max_turns=3) == 3
    return path


@pytest.mark.parametrize("history", ["recorded", "generated"])
def test_multi_turn_conversations_reuse_earlier_turns(
    tiny_qwen3_sparse_server: ServerProcess, chats: Path, tmp_path: Path, history: str
) -> None:
    out = tmp_path / f"chats-{history}.json"
    done = replay(
        "--trace", str(chats), "--url", tiny_qwen3_sparse_server.url, "--out", str(out), "--history", history,
        "--length-scale", "0.5", "--speedup", "0", "--no-plots",
    )  # fmt: skip
    log = output(done)
    assert done.returncode == 0, log
    report = json.loads(out.read_text())
    assert report["settings"]["format"] == "messages"  # auto-detected
    conversations = [json.loads(line) for line in chats.read_text().splitlines()]
    turns = sum(len(turn_positions(c["messages"])) for c in conversations)
    assert report["summary"]["completed"] == turns and report["summary"]["errors"] == 0
    by_conversation: dict[int, list[dict[str, Any]]] = {}
    for record in report["requests"]:
        by_conversation.setdefault(record["conversation"], []).append(record)
    assert len(by_conversation) == 3
    for records in by_conversation.values():
        records.sort(key=lambda r: r["turn"])
        for earlier, later in itertools.pairwise(records):
            assert later["sent_s"] >= earlier["end_s"]  # turns of one conversation are sequential
            assert later["prompt_tokens"] > earlier["prompt_tokens"]  # and carry the earlier turns
            # at least the earlier prompt's whole pages come from the radix cache (but the prefill window)
            expected = matchable(later["prompt_tokens"], earlier["prompt_tokens"])
            assert later["cached_tokens"] >= expected > 0, (earlier, later)


def test_unreachable_server_ends_the_run_without_waiting_for_the_schedule(
    tiny_qwen3_dir: Path, tmp_path: Path
) -> None:
    trace = tmp_path / "hour.jsonl"  # requests due over an hour
    lines = [
        {"timestamp": t * 600_000, "input_length": 100, "output_length": 5, "hash_ids": [0]} for t in range(7)
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "down.json"
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    done = replay(
        "--trace",
        str(trace),
        "--url",
        url,
        "--out",
        str(out),
        "--tokenizer",
        str(tiny_qwen3_dir),
        timeout=120,
    )
    log = output(done)
    assert done.returncode == 1, log
    report = json.loads(out.read_text())
    assert (report["summary"]["requests"], report["summary"]["completed"], report["errors"]["count"]) == (
        7,
        0,
        7,
    )
    errors = [r["error"] for r in report["requests"]]
    assert errors[0].startswith("connect:")
    assert all(e.startswith("not sent: server unreachable") for e in errors[1:])


def test_failing_request_is_counted_and_the_run_goes_on(
    tiny_qwen3_sparse_server: ServerProcess, tmp_path: Path
) -> None:
    lines = [
        {"timestamp": 0, "input_length": 300, "output_length": 3, "hash_ids": [900]},
        {"timestamp": 10, "input_length": 9000, "output_length": 3, "hash_ids": [901]},  # > 8192 context
        {"timestamp": 20, "input_length": 300, "output_length": 3, "hash_ids": [900]},
    ]
    trace = tmp_path / "one-bad.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "one-bad.json"
    done = replay(
        "--trace", str(trace), "--url", tiny_qwen3_sparse_server.url, "--out", str(out), "--no-plots"
    )
    log = output(done)
    assert done.returncode == 1, log
    report = json.loads(out.read_text())
    assert (report["summary"]["completed"], report["summary"]["errors"]) == (2, 1)
    assert report["errors"]["first"] == [f"line 2: {report['requests'][1]['error']}"]
    assert "context length" in report["errors"]["first"][0]
    assert "line 2: server:" in log  # the first errors are printed too


def running_requests(url: str) -> float:
    import requests

    try:
        text = requests.get(url + "/metrics", timeout=5).text
    except requests.RequestException:
        return 0.0
    values = [line.split()[-1] for line in text.splitlines() if line.startswith("sglang:num_running_reqs")]
    return float(values[0]) if values else 0.0


@pytest.fixture
def doomed_server(tiny_qwen3_dir: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    args = [
        "--model-path",
        str(tiny_qwen3_dir),
        "--oasis-mode",
        "dense",
        "--max-total-tokens",
        "8192",
        "--enable-metrics",
    ]
    server = ServerProcess(args, log_path=tmp_path / "doomed.log").start()
    try:
        yield server
    finally:
        server.stop()


def test_server_dying_mid_run_ends_the_run_with_errors(doomed_server: ServerProcess, tmp_path: Path) -> None:
    trace = tmp_path / "long.jsonl"  # 20 requests of 2000 output tokens: minutes of work, 2 at a time
    trace.write_text(
        "".join(
            json.dumps({"timestamp": 0, "input_length": 200, "output_length": 2000, "hash_ids": [i]}) + "\n"
            for i in range(20)
        )
    )
    out = tmp_path / "died.json"
    process = replay(
        "--trace", str(trace), "--url", doomed_server.url, "--out", str(out), "--speedup", "0",
        "--max-concurrency", "2", "--read-timeout", "60", wait=False,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while running_requests(doomed_server.url) < 1:
        assert process.poll() is None, output(process)
        assert time.monotonic() < deadline, "the replay never reached the server"
        time.sleep(0.5)
    doomed_server.stop()
    stopped = time.monotonic()
    process.wait(timeout=120)  # ends promptly instead of waiting on a dead server
    print(f"replay ended {time.monotonic() - stopped:.1f} s after the server was stopped")
    log = output(process)
    assert process.returncode == 1, log
    report = json.loads(out.read_text())
    assert (report["summary"]["requests"], report["summary"]["errors"]) == (20, 20)
    errors = [r["error"] for r in report["requests"]]
    assert sum(e.startswith("not sent: server unreachable") for e in errors) >= 10  # never sent
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary files
