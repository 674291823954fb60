"""From a validated trace to sessions: start times, turns, prompt builders and output lengths.

Start times are the trace timestamps relative to the first line, divided by ``speedup`` (0 or infinity:
all at once), never earlier than an earlier line's (file order wins over decreasing timestamps).

A conversation's turns are its user messages that are followed by an assistant message or end the list
(consecutive user messages travel together). Turn ``k`` sends every message up to and including its
user message, through the chat template, with each earlier turn's reply either as recorded in the file
(``history="recorded"``: prompts identical from run to run, so dense and sparse see the same tokens) or
as the server generated it (``"generated"``: a real agent loop)::

    turn 0:  [system] user0                         -> reply0
    turn 1:  [system] user0 reply0 user1            -> reply1
    turn 2:  [system] user0 reply0 user1 reply1 user2

Its output length is the line's ``output_length``, else the recorded reply's token count, else
``default_output_length``; scaled by ``length_scale`` (at least 1 token).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from sglang_oasis.replay.client import Session, Turn
from sglang_oasis.replay.prompts import BlockPrompts, ChatPrompts, scaled
from sglang_oasis.replay.trace import Conversation, TraceRequest

History = Literal["recorded", "generated"]


def start_times(timestamps_ms: Sequence[float], speedup: float) -> list[float]:
    """Seconds after the run starts at which each line is due."""
    out: list[float] = []
    latest = timestamps_ms[0] if timestamps_ms else 0.0
    first = latest
    for ts in timestamps_ms:
        latest = max(latest, ts)
        out.append(0.0 if speedup == 0 or math.isinf(speedup) else (latest - first) / 1000 / speedup)
    return out


def mooncake_sessions(
    requests: Sequence[TraceRequest], prompts: BlockPrompts, speedup: float, max_requests: int | None = None
) -> list[Session]:
    chosen = list(requests[:max_requests] if max_requests is not None else requests)
    starts = start_times([r.timestamp_ms for r in chosen], speedup)
    sessions = []
    for index, (request, start) in enumerate(zip(chosen, starts, strict=True)):

        def build(_replies: Sequence[str], request: TraceRequest = request) -> list[int]:
            return prompts.prompt(request.hash_ids, request.input_length, f"line{request.line}")

        turn = Turn(request.line, index, 0, scaled(request.output_length, prompts.length_scale), build)
        sessions.append(Session(start, (turn,)))
    return sessions


def turn_positions(messages: Sequence[dict[str, str]]) -> list[int]:
    """Indices of the user messages that start a turn."""
    return [
        i
        for i, m in enumerate(messages)
        if m["role"] == "user" and (i + 1 == len(messages) or messages[i + 1]["role"] == "assistant")
    ]


def conversation_sessions(
    conversations: Sequence[Conversation],
    prompts: ChatPrompts,
    speedup: float,
    length_scale: float = 1.0,
    history: History = "recorded",
    default_output_length: int = 64,
    max_requests: int | None = None,
) -> list[Session]:
    starts = start_times([c.timestamp_ms for c in conversations], speedup)
    budget = math.inf if max_requests is None else max_requests
    sessions = []
    for index, (conv, start) in enumerate(zip(conversations, starts, strict=True)):
        if budget <= 0:
            break
        positions = turn_positions(conv.messages)[: int(min(budget, 1 << 30))]
        budget -= len(positions)
        turns = []
        for k, position in enumerate(positions):
            reply = conv.messages[position + 1] if position + 1 < len(conv.messages) else None
            if conv.output_length is not None:
                length = conv.output_length
            elif reply is not None:
                length = max(1, prompts.count(reply["content"]))
            else:
                length = default_output_length

            def build(
                replies: Sequence[str], conv: Conversation = conv, upto: int = position, k: int = k
            ) -> list[int]:
                messages = [dict(m) for m in conv.messages[: upto + 1]]
                if history == "generated":
                    for j, earlier in enumerate(turn_positions(conv.messages)[:k]):
                        messages[earlier + 1]["content"] = replies[j]
                return prompts.prompt(messages)

            turns.append(Turn(conv.line, index, k, scaled(length, length_scale), build))
        sessions.append(Session(start, tuple(turns), stop_after_error=history == "generated"))
    return sessions
