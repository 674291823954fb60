"""Sending the replay: streamed ``/generate`` calls with token ids, timed, at the trace's pace.

A *session* is what runs sequentially: one Mooncake request, or the turns of one conversation. Sessions
start at their scheduled time (trace timestamp / speedup) and run concurrently; every request holds one
slot of a semaphore (``max_concurrency``) while it is in flight. A request that fails is recorded with
its error and the run goes on; once the server cannot be reached at all, requests not yet sent are
recorded as failed without being sent (a refused connection followed by a failed ``/health`` probe), so
a server that dies ends the run instead of hanging it, even while later requests wait for their time. Every
call has a total timeout and a timeout on the gap between two streamed chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

STREAM_BUFFER_BYTES = 1 << 22  # one SSE line holds the whole text so far


@dataclass(frozen=True)
class Turn:
    """One request to send; ``build`` makes its token ids from the replies of earlier turns."""

    line: int
    conversation: int
    turn: int
    max_new_tokens: int
    build: Callable[[Sequence[str]], list[int]]


@dataclass(frozen=True)
class Session:
    start_s: float
    turns: tuple[Turn, ...]
    stop_after_error: bool = False  # later turns need this turn's reply


@dataclass
class Result:
    """What one request did; times are seconds since the run started. ``scheduled_s`` is when the request
    was due: its trace time, or for a later turn of a conversation when the previous reply ended."""

    line: int
    conversation: int
    turn: int
    scheduled_s: float
    max_new_tokens: int
    input_tokens: int = 0
    sent_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    error: str | None = None
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (arrival, new tokens)

    @property
    def ttft_s(self) -> float | None:
        if self.error or self.sent_s is None or self.first_token_s is None:
            return None
        return self.first_token_s - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        if self.error or self.sent_s is None or self.end_s is None:
            return None
        return self.end_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.error or self.completion_tokens < 2 or self.first_token_s is None or self.end_s is None:
            return None
        return (self.end_s - self.first_token_s) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class ClientSettings:
    url: str
    max_concurrency: int | None = None
    timeout_s: float = 1800.0
    read_timeout_s: float = 300.0
    connect_timeout_s: float = 30.0


class _Run:
    def __init__(self, settings: ClientSettings, on_done: Callable[[Result], None]) -> None:
        self.settings = settings
        self.on_done = on_done
        self.url = settings.url.rstrip("/") + "/generate"
        self.slots = asyncio.Semaphore(settings.max_concurrency) if settings.max_concurrency else None
        self.unreachable: str | None = None
        self.dead = asyncio.Event()  # set with ``unreachable``: wakes sessions still waiting to start
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def session(self, http: aiohttp.ClientSession, session: Session, results: list[Result]) -> None:
        delay = session.start_s - self.now()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.dead.wait(), delay)
        replies: list[str] = []
        failed = False
        for turn in session.turns:
            ready = session.start_s if turn.turn == 0 else self.now()  # later turns: when the reply came
            result = Result(turn.line, turn.conversation, turn.turn, ready, turn.max_new_tokens)
            if failed and session.stop_after_error:
                result.error = "not sent: an earlier turn of this conversation failed"
            else:
                await self.request(http, turn, replies, result)
            failed = failed or result.error is not None
            replies.append(result.text)
            results.append(result)
            self.on_done(result)

    async def request(
        self, http: aiohttp.ClientSession, turn: Turn, replies: list[str], result: Result
    ) -> None:
        try:
            input_ids = turn.build(replies)
        except Exception as exc:  # a tokenizer failure is this request's error, not the run's
            result.error = f"prompt: {type(exc).__name__}: {exc}"
            return
        result.input_tokens = len(input_ids)
        if self.slots is not None:
            await self.slots.acquire()
        try:
            if self.unreachable is not None:
                result.error = f"not sent: {self.unreachable}"
                return
            await self.stream(http, input_ids, turn.max_new_tokens, result)
        except aiohttp.ClientConnectorError as exc:
            result.error = f"connect: {exc}"
            if not await self.healthy(http):
                self.unreachable = f"server unreachable ({exc})"
                self.dead.set()
        except TimeoutError:
            result.error = (
                f"timeout (total {self.settings.timeout_s:g} s, between chunks "
                f"{self.settings.read_timeout_s:g} s)"
            )
        except (aiohttp.ClientError, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            if self.slots is not None:
                self.slots.release()

    async def healthy(self, http: aiohttp.ClientSession) -> bool:
        """A second look before giving up on the server: one connection refused may be a blip."""
        try:
            probe = aiohttp.ClientTimeout(total=self.settings.connect_timeout_s)
            async with http.get(self.settings.url.rstrip("/") + "/health", timeout=probe) as response:
                return response.status < 500
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def stream(
        self, http: aiohttp.ClientSession, input_ids: list[int], max_new_tokens: int, result: Result
    ) -> None:
        body = {
            "input_ids": input_ids,
            "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
        }
        result.sent_s = self.now()
        async with http.post(self.url, json=body) as response:
            if response.status != 200:
                text = (await response.text())[:300]
                result.error = f"HTTP {response.status}: {text}"
                return
            done = False
            meta: dict[str, Any] = {}
            async for raw in response.content:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    done = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    error = chunk["error"]
                    result.error = (
                        f"server: {error.get('message', error) if isinstance(error, dict) else error}"
                    )
                    return
                now = self.now()
                meta = chunk.get("meta_info", {})
                produced = int(meta.get("completion_tokens", 0))
                if produced > result.completion_tokens:
                    if result.first_token_s is None:
                        result.first_token_s = now
                    result.token_times.append((now, produced - result.completion_tokens))
                    result.completion_tokens = produced
                text = chunk.get("text", "")
                # SGLang streams the whole text so far; a server streaming pieces gets them appended
                result.text = text if text.startswith(result.text) else result.text + text
            result.end_s = self.now()
            result.prompt_tokens = int(meta.get("prompt_tokens", 0))
            result.cached_tokens = int(meta.get("cached_tokens", 0))
            finish = meta.get("finish_reason")
            if isinstance(finish, dict) and finish.get("type") == "abort":
                result.error = f"aborted by the server: {finish.get('message')}"
            elif not done:
                result.error = "the stream ended before [DONE]"
            elif result.completion_tokens == 0:
                result.error = "no tokens generated"


async def _run(
    sessions: Sequence[Session], settings: ClientSettings, on_done: Callable[[Result], None]
) -> list[Result]:
    run = _Run(settings, on_done)
    results: list[Result] = []
    timeout = aiohttp.ClientTimeout(
        total=settings.timeout_s, sock_connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s
    )
    connector = aiohttp.TCPConnector(limit=settings.max_concurrency or 0)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=connector, read_bufsize=STREAM_BUFFER_BYTES
    ) as http:
        await asyncio.gather(*(run.session(http, s, results) for s in sessions))
    return sorted(results, key=lambda r: (r.scheduled_s, r.conversation, r.turn))


def send_all(
    sessions: Sequence[Session], settings: ClientSettings, on_done: Callable[[Result], None] = lambda r: None
) -> list[Result]:
    """Run every session to the end; returns one result per turn, in schedule order."""
    return asyncio.run(_run(sessions, settings, on_done))
