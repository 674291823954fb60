"""Reading and validating replay inputs: Mooncake traces and OpenAI-messages conversations.

Two JSONL formats, one JSON object per line (blank lines are skipped, unknown fields ignored):

* ``mooncake``: ``{"timestamp": ms, "input_length": int, "output_length": int, "hash_ids": [int, ...]}``
  (``hash_ids`` name 512-token prefix blocks; equal ids mean equal prefix blocks).
* ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...], "output_length": int (optional),
  "timestamp": ms (optional, when the conversation starts)}``.

Every line is checked before anything is sent; the first problem raises :class:`TraceError` naming the
file, the line number (1-based) and the field. Rules:

* lengths are integers (not booleans); ``input_length`` and ``output_length`` are at least 1;
  ``hash_ids`` is a list of non-negative integers; ``timestamp`` is a non-negative number;
* timestamps need not increase: the file is replayed in file order, and a line whose timestamp is
  lower than an earlier line's is sent as if it carried that earlier timestamp (right after it). How
  many lines did so is reported (``out_of_order_timestamps``);
* a conversation needs at least one ``user`` message; roles are ``system``, ``user``, ``assistant``
  or ``tool``; contents are strings.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

TraceFormat = Literal["mooncake", "messages"]
FORMATS: tuple[TraceFormat, ...] = ("mooncake", "messages")
ROLES = ("system", "user", "assistant", "tool")


class TraceError(ValueError):
    """A malformed input file: ``str()`` reads ``FILE:LINE: field 'NAME': problem``."""

    def __init__(self, path: Path, line: int | None, problem: str, field: str | None = None) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        what = f"field {field!r}: {problem}" if field is not None else problem
        super().__init__(f"{where}: {what}")
        self.path, self.line, self.field, self.problem = path, line, field, problem


@dataclass(frozen=True)
class TraceRequest:
    """One Mooncake line: an independent request."""

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class Conversation:
    """One messages line: turns sent one after another, each carrying the earlier ones."""

    line: int
    timestamp_ms: float
    messages: tuple[dict[str, str], ...]
    output_length: int | None


@dataclass(frozen=True)
class Trace:
    path: Path
    format: TraceFormat
    requests: tuple[TraceRequest, ...] = ()
    conversations: tuple[Conversation, ...] = ()
    out_of_order_timestamps: int = 0


def _lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(path, None, f"cannot read: {exc.strerror or exc}") from exc
    with handle:
        try:
            for number, text in enumerate(handle, start=1):
                if not text.strip():
                    continue
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise TraceError(path, number, f"invalid JSON ({exc.msg} at column {exc.colno})") from exc
                if not isinstance(value, dict):
                    raise TraceError(path, number, f"expected a JSON object, got {_kind(value)}")
                yield number, value
        except UnicodeDecodeError as exc:
            raise TraceError(path, None, f"not UTF-8 text ({exc.reason})") from exc


def _kind(value: object) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}
    names.update({dict: "an object", type(None): "null"})
    return names.get(type(value), type(value).__name__)


def _require(path: Path, line: int, obj: dict[str, Any], field: str) -> Any:
    if field not in obj:
        raise TraceError(path, line, "missing", field)
    return obj[field]


def _integer(path: Path, line: int, value: Any, field: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(path, line, f"expected an integer, got {_kind(value)}", field)
    if value < minimum:
        raise TraceError(path, line, f"must be >= {minimum}, got {value}", field)
    return value


def _timestamp(path: Path, line: int, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceError(path, line, f"expected a number (milliseconds), got {_kind(value)}", "timestamp")
    if not math.isfinite(value) or value < 0:
        raise TraceError(path, line, f"must be a finite number >= 0, got {value}", "timestamp")
    return float(value)


def _mooncake(path: Path, line: int, obj: dict[str, Any]) -> TraceRequest:
    timestamp = _timestamp(path, line, _require(path, line, obj, "timestamp"))
    input_length = _integer(path, line, _require(path, line, obj, "input_length"), "input_length", 1)
    output_length = _integer(path, line, _require(path, line, obj, "output_length"), "output_length", 1)
    hash_ids = _require(path, line, obj, "hash_ids")
    if not isinstance(hash_ids, list):
        raise TraceError(path, line, f"expected a list of integers, got {_kind(hash_ids)}", "hash_ids")
    for position, item in enumerate(hash_ids):
        _integer(path, line, item, f"hash_ids[{position}]", 0)
    return TraceRequest(line, timestamp, input_length, output_length, tuple(hash_ids))


def _conversation(path: Path, line: int, obj: dict[str, Any]) -> Conversation:
    messages = _require(path, line, obj, "messages")
    if not isinstance(messages, list) or not messages:
        raise TraceError(
            path, line, f"expected a non-empty list of messages, got {_kind(messages)}", "messages"
        )
    checked = []
    for position, message in enumerate(messages):
        field = f"messages[{position}]"
        if not isinstance(message, dict):
            raise TraceError(path, line, f"expected an object, got {_kind(message)}", field)
        role = message.get("role")
        if role not in ROLES:
            raise TraceError(path, line, f"expected one of {', '.join(ROLES)}, got {role!r}", f"{field}.role")
        content = message.get("content")
        if not isinstance(content, str):
            raise TraceError(path, line, f"expected a string, got {_kind(content)}", f"{field}.content")
        checked.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in checked):
        raise TraceError(path, line, "no 'user' message, so nothing to send", "messages")
    output_length = obj.get("output_length")
    if output_length is not None:
        output_length = _integer(path, line, output_length, "output_length", 1)
    timestamp = _timestamp(path, line, obj["timestamp"]) if "timestamp" in obj else 0.0
    return Conversation(line, timestamp, tuple(checked), output_length)


def detect_format(obj: dict[str, Any]) -> TraceFormat | None:
    if "messages" in obj:
        return "messages"
    if {"hash_ids", "input_length", "output_length"} & obj.keys():
        return "mooncake"
    return None


def load_trace(path: Path, fmt: TraceFormat | Literal["auto"] = "auto") -> Trace:
    """Parse and validate the whole file; ``auto`` decides the format from the first line."""
    requests: list[TraceRequest] = []
    conversations: list[Conversation] = []
    chosen: TraceFormat | None = None if fmt == "auto" else fmt
    latest = 0.0
    out_of_order = 0
    for line, obj in _lines(path):
        if chosen is None:
            chosen = detect_format(obj)
            if chosen is None:
                raise TraceError(
                    path, line, "unknown format: expected 'hash_ids'/'input_length' (mooncake) or "
                    "'messages' (messages); pass --format",
                )  # fmt: skip
        item: TraceRequest | Conversation
        if chosen == "mooncake":
            item = _mooncake(path, line, obj)
            requests.append(item)
        else:
            item = _conversation(path, line, obj)
            conversations.append(item)
        if item.timestamp_ms < latest:
            out_of_order += 1
        latest = max(latest, item.timestamp_ms)
    if chosen is None or not (requests or conversations):
        raise TraceError(path, None, "no requests (the file is empty)")
    return Trace(path, chosen, tuple(requests), tuple(conversations), out_of_order)
