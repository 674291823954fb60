"""Replay inputs: parsing, validation errors (file, line, field), the CLI's exit code 2, and schedules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_oasis.replay.schedule import start_times, turn_positions
from sglang_oasis.replay.trace import TraceError, load_trace

REPO = Path(__file__).resolve().parents[2]
SHARED_TRACE = REPO / "data" / "traces" / "mooncake_conversation_trace.head2000.jsonl"  # shipped
GOOD = {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, "-m", "sglang_oasis.replay", "--no-progress", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_mooncake_lines_parse_in_file_order(tmp_path: Path) -> None:
    lines = [
        json.dumps(GOOD),
        "",  # blank lines are skipped but still counted
        json.dumps({**GOOD, "timestamp": 2500.5, "hash_ids": [0, 2], "extra": "ignored"}),
        json.dumps({**GOOD, "timestamp": 1000, "hash_ids": []}),
    ]
    trace = load_trace(write_lines(tmp_path / "t.jsonl", lines))
    assert trace.format == "mooncake"
    assert [r.line for r in trace.requests] == [1, 3, 4]
    assert [r.timestamp_ms for r in trace.requests] == [0.0, 2500.5, 1000.0]
    assert trace.requests[1].hash_ids == (0, 2)
    assert trace.out_of_order_timestamps == 1


@pytest.mark.parametrize(
    ("line", "field", "problem"),
    [
        ('{"timestamp": 0, "input_length": 7', None, "invalid JSON"),
        ("[1, 2, 3]", None, "expected a JSON object"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "output_length"}), "output_length", "missing"),
        (json.dumps({**GOOD, "input_length": "700"}), "input_length", "expected an integer, got a string"),
        (json.dumps({**GOOD, "input_length": 7.5}), "input_length", "expected an integer, got a number"),
        (json.dumps({**GOOD, "output_length": True}), "output_length", "expected an integer, got a boolean"),
        (json.dumps({**GOOD, "output_length": -3}), "output_length", "must be >= 1, got -3"),
        (json.dumps({**GOOD, "input_length": 0}), "input_length", "must be >= 1, got 0"),
        (json.dumps({**GOOD, "timestamp": -1}), "timestamp", "must be a finite number >= 0"),
        (json.dumps({**GOOD, "timestamp": "soon"}), "timestamp", "expected a number"),
        (json.dumps({**GOOD, "hash_ids": "0,1"}), "hash_ids", "expected a list of integers"),
        (json.dumps({**GOOD, "hash_ids": [0, -1]}), "hash_ids[1]", "must be >= 0"),
        (json.dumps({**GOOD, "hash_ids": [0, None]}), "hash_ids[1]", "expected an integer, got null"),
    ],
    ids=[
        "bad-json", "not-object", "missing-field", "string-length", "float-length", "bool-length",
        "negative-output", "zero-input", "negative-timestamp", "string-timestamp", "hash-ids-string",
        "negative-hash-id", "null-hash-id",
    ],
)  # fmt: skip
def test_malformed_mooncake_line_names_file_line_and_field(
    tmp_path: Path, line: str, field: str | None, problem: str
) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps(GOOD), json.dumps(GOOD), line])
    with pytest.raises(TraceError) as info:
        load_trace(path, "mooncake")
    message = str(info.value)
    assert message.startswith(f"{path}:3: ")
    assert problem in message
    if field is not None:
        assert f"field {field!r}" in message
    assert info.value.line == 3 and info.value.field == field


@pytest.mark.parametrize(
    ("record", "field", "problem"),
    [
        ({"messages": []}, "messages", "non-empty list"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages", "no 'user' message"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "expected one of"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "expected a string"),
        ({"messages": [{"role": "user", "content": "x"}], "output_length": 0}, "output_length", ">= 1"),
    ],
    ids=["empty", "no-user", "bad-role", "content-int", "zero-output"],
)
def test_malformed_conversation_names_field(tmp_path: Path, record: dict, field: str, problem: str) -> None:
    good = {"messages": [{"role": "user", "content": "hello"}]}
    path = write_lines(tmp_path / "chats.jsonl", [json.dumps(good), json.dumps(record)])
    with pytest.raises(TraceError) as info:
        load_trace(path)  # auto-detects "messages" from line 1
    assert str(info.value).startswith(f"{path}:2: field {field!r}: ")
    assert problem in str(info.value)


def test_empty_unknown_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no requests"):
        load_trace(write_lines(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(TraceError, match=r"unknown\.jsonl:1: unknown format"):
        load_trace(write_lines(tmp_path / "unknown.jsonl", ['{"prompt": "hi"}']))
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "absent.jsonl")


def test_cli_rejects_malformed_trace_with_exit_2_and_writes_nothing(tmp_path: Path) -> None:
    trace = write_lines(tmp_path / "bad.jsonl", [json.dumps(GOOD), json.dumps({**GOOD, "input_length": -5})])
    out_dir = tmp_path / "reports"
    out_dir.mkdir()
    done = run_cli(
        "--trace", str(trace), "--url", "http://127.0.0.1:9", "--out", str(out_dir / "report.json")
    )
    assert done.returncode == 2, done.stderr
    assert f"{trace}:2: field 'input_length': must be >= 1, got -5" in done.stderr
    assert list(out_dir.iterdir()) == []  # no report, no plots, no temporary files


def test_cli_usage_errors_exit_2(tmp_path: Path) -> None:
    trace = write_lines(tmp_path / "t.jsonl", [json.dumps(GOOD)])
    for extra in (["--speedup", "-1"], ["--max-concurrency", "0"], ["--length-scale", "0"]):
        done = run_cli(
            "--trace", str(trace), "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "r.json"), *extra
        )
        assert done.returncode == 2, (extra, done.stderr)
        assert extra[0] in done.stderr
    assert not (tmp_path / "r.json").exists()


def test_start_times_follow_file_order_and_speedup() -> None:
    assert start_times([1000, 3000, 2000, 5000], speedup=1) == [0.0, 2.0, 2.0, 4.0]
    assert start_times([1000, 3000, 2000, 5000], speedup=4) == [0.0, 0.5, 0.5, 1.0]
    assert start_times([1000, 3000], speedup=0) == [0.0, 0.0]
    assert start_times([1000, 3000], speedup=float("inf")) == [0.0, 0.0]


def test_turn_positions_group_consecutive_user_messages() -> None:
    roles = ["system", "user", "assistant", "user", "user", "assistant", "user"]
    messages = [{"role": r, "content": str(i)} for i, r in enumerate(roles)]
    assert turn_positions(messages) == [1, 4, 6]


def test_shared_mooncake_trace_validates() -> None:
    trace = load_trace(SHARED_TRACE)
    assert trace.format == "mooncake"
    assert len(trace.requests) == 2000
    assert all(r.input_length <= 512 * len(r.hash_ids) for r in trace.requests)
