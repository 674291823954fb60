"""The soak workload (issue 25), shared by ``bench_soak.py`` and ``test/integration/test_soak.py``.

A seeded mix of greedy requests against one server: prompts of mixed lengths, some sharing a stem (radix
hits) and some repeating an earlier prompt exactly, streaming and non-streaming, and three fates:

- ``complete``: runs to its length;
- ``disconnect``: a streaming request whose client closes the connection after a few chunks;
- ``abort``: ``POST /abort_request`` with its rid after a short delay (it may finish first).

``run_mix`` sends them ``concurrency`` at a time and records each request's ``Outcome``; ``solo_outputs``
then serves every completed request's prompt alone, one at a time, and ``compare`` checks that the
concurrent run gave each the same greedy tokens.

Faults (the PD variant of ``bench_soak.py --pd-faults``): ``workload(inject_len=L)`` makes some requests'
prompts exactly L tokens long, the length a server started with ``SGLANG_OASIS_INJECT_TRANSFER_FAILURE=L``
fails decode-time KV transfers of; ``compare(excuse=...)`` then counts a failure the fault explains
(``Excuses``: an injected transfer failure, or a request in flight while the prefill server was down)
as failed as expected, under its cause, and any other failure as unexpected. ``drain`` waits for the server to go idle, flushes
SGLang's radix cache and reads what is still held (``/oasis/stats`` gauges; SGLang's host pool).
"""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import requests

FATES = ("complete", "disconnect", "abort")


@dataclass(frozen=True)
class SoakRequest:
    rid: str
    input_ids: tuple[int, ...]
    max_new_tokens: int
    stream: bool
    fate: str  # one of FATES
    fate_at: float  # disconnect: after this many streamed chunks; abort: after this many seconds


@dataclass
class Outcome:
    status: str  # completed | aborted | disconnected | failed
    output_ids: list[int] = field(default_factory=list)
    retractions: int = 0
    error: str | None = None
    started: float = 0.0  # time.monotonic() when sent
    ended: float = 0.0  # ... and when its answer (or error) came back


def workload(
    seed: int,
    count: int,
    corpus: Sequence[int],
    prompt_tokens: tuple[int, int],
    new_tokens: tuple[int, int],
    stems: int = 3,
    fate_weights: tuple[float, float, float] = (0.7, 0.15, 0.15),
    inject_len: int | None = None,
    inject_share: float = 0.1,
) -> list[SoakRequest]:
    """``count`` requests: prompt lengths uniform in ``prompt_tokens``, outputs in ``new_tokens``; half
    start with one of ``stems`` shared stems (half the shortest prompt long), one in eight repeats an
    earlier request's prompt and length exactly. With ``inject_len`` about ``inject_share`` of the
    requests (fresh prompts, meant to complete) are ``inject_len`` tokens long instead (the seed's other
    draws stay as they are without it)."""
    rng = random.Random(seed)
    low, high = prompt_tokens
    if len(corpus) < 2 * high:
        raise ValueError(f"a corpus of {len(corpus)} tokens is too short for {high}-token prompts")
    stem_len = low // 2
    stem_ids = [tuple(corpus[i * stem_len : (i + 1) * stem_len]) for i in range(stems)]
    made: list[SoakRequest] = []
    for i in range(count):
        fate = rng.choices(FATES, weights=fate_weights)[0]
        stream = fate == "disconnect" or rng.random() < 0.5
        fate_at = float(rng.randint(1, 4)) if fate == "disconnect" else rng.uniform(0.05, 1.5)
        if made and rng.random() < 0.125:
            earlier = rng.choice(made)
            ids, max_new = earlier.input_ids, earlier.max_new_tokens
        else:
            length = rng.randint(low, high)
            stem = stem_ids[rng.randrange(stems)] if rng.random() < 0.5 else ()
            if inject_len is not None and rng.random() < inject_share:
                length, fate, stream = inject_len, "complete", rng.random() < 0.5
            start = rng.randrange(len(corpus) - length)
            ids = (*stem, *corpus[start : start + length - len(stem)])
            max_new = rng.randint(*new_tokens)
        # Fixed-width numbers: SGLang aborts every request whose rid starts with the aborted one's, so no
        # rid may be a prefix of another (an abort of soak-25-1 also aborted soak-25-10 to -19).
        made.append(SoakRequest(f"soak-{seed}-{i:04d}", tuple(ids), max_new, stream, fate, fate_at))
    return made


def _body(request: SoakRequest, rid: str | None, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": list(request.input_ids),
        "stream": stream,
        "sampling_params": {"max_new_tokens": request.max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    if rid is not None:
        body["rid"] = rid
    return body


def _finish(meta: dict[str, Any]) -> tuple[str, str | None]:
    """(status, error) from a final ``meta_info``: an abort's message, or completed."""
    reason = meta.get("finish_reason") or {}
    if isinstance(reason, dict) and reason.get("type") == "abort":
        return "aborted", str(reason.get("message"))
    return "completed", None


def send(url: str, request: SoakRequest, abort_urls: Sequence[str] = (), timeout_s: float = 600.0) -> Outcome:
    """Serve one request with its fate (``abort_urls``: the servers an abort goes to; default ``url``)."""
    started = time.monotonic()
    outcome = _send(url, request, abort_urls, timeout_s)
    outcome.started, outcome.ended = started, time.monotonic()
    return outcome


def _send(url: str, request: SoakRequest, abort_urls: Sequence[str], timeout_s: float) -> Outcome:
    timer = None
    if request.fate == "abort":

        def abort() -> None:
            for server in abort_urls or [url]:
                with contextlib.suppress(requests.RequestException):  # a server down (a fault run)
                    requests.post(server + "/abort_request", json={"rid": request.rid}, timeout=30)

        timer = threading.Timer(request.fate_at, abort)
        timer.start()
    try:
        body = _body(request, request.rid, request.stream)
        with requests.post(
            url + "/generate", json=body, stream=request.stream, timeout=timeout_s
        ) as response:
            if response.status_code != 200:
                return Outcome("failed", error=f"HTTP {response.status_code}: {response.text[:300]}")
            if not request.stream:
                reply = response.json()
                status, error = _finish(reply["meta_info"])
                return Outcome(status, list(reply.get("output_ids") or []),
                               int(reply["meta_info"].get("num_retractions") or 0), error)  # fmt: skip
            return _read_stream(response, request)
    except requests.RequestException as error:
        return Outcome("failed", error=f"{type(error).__name__}: {error}")
    finally:
        if timer is not None:
            timer.join()


def _read_stream(response: requests.Response, request: SoakRequest) -> Outcome:
    chunks, meta, ids = 0, {}, []
    for line in response.iter_lines(decode_unicode=True):
        if not line or not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: ") :])
        if "error" in chunk:
            return Outcome("failed", error=str(chunk["error"])[:300])
        meta, ids = chunk["meta_info"], list(chunk.get("output_ids") or [])
        chunks += 1
        if request.fate == "disconnect" and chunks >= request.fate_at and not meta.get("finish_reason"):
            response.close()
            return Outcome("disconnected", ids)
    status, error = _finish(meta)
    return Outcome(status, ids, int(meta.get("num_retractions") or 0), error)


def run_mix(
    url: str,
    reqs: Sequence[SoakRequest],
    concurrency: int,
    abort_urls: Sequence[str] = (),
    on_done: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Send ``reqs`` ``concurrency`` at a time; ``on_done`` is called with each outcome as it comes."""

    def serve(request: SoakRequest) -> Outcome:
        outcome = send(url, request, abort_urls)
        if on_done is not None:
            on_done(outcome)
        return outcome

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(serve, reqs))


def solo_outputs(url: str, reqs: Sequence[SoakRequest], outcomes: Sequence[Outcome]) -> dict[tuple, Outcome]:
    """Each completed request's prompt and length served alone (once per distinct pair), non-streaming."""
    solo: dict[tuple, Outcome] = {}
    for request, outcome in zip(reqs, outcomes, strict=True):
        key = (request.input_ids, request.max_new_tokens)
        if outcome.status == "completed" and key not in solo:
            response = requests.post(url + "/generate", json=_body(request, None, False), timeout=600)
            if response.status_code != 200:  # no reference (compare says so)
                solo[key] = Outcome("failed", error=f"HTTP {response.status_code}: {response.text[:300]}")
                continue
            reply = response.json()
            status, error = _finish(reply["meta_info"])
            retractions = int(reply["meta_info"].get("num_retractions") or 0)
            solo[key] = Outcome(status, list(reply["output_ids"]), retractions, error)
    return solo


class Excuses:
    """What explains a request's failure in a fault run (``compare``'s ``excuse``): its prompt has the
    injected length ``inject_len`` and the error names the injected transfer failure (``"injected"``),
    or it was in flight while the prefill server was down, between ``down`` and ``up`` (plus ``grace_s``;
    ``"prefill_restart"``)."""

    def __init__(self, inject_len: int | None = None, grace_s: float = 5.0) -> None:
        self.inject_len = inject_len
        self.grace_s = grace_s
        self.outages: list[tuple[float, float]] = []

    def __call__(self, request: SoakRequest, outcome: Outcome) -> str | None:
        error = outcome.error or ""
        if len(request.input_ids) == self.inject_len and "injected transfer failure" in error:
            return "injected"
        for down, up in self.outages:
            if outcome.started < up + self.grace_s and outcome.ended > down:
                return "prefill_restart"
        return None


def compare(
    reqs: Sequence[SoakRequest],
    outcomes: Sequence[Outcome],
    solo: dict[tuple, Outcome],
    excuse: Callable[[SoakRequest, Outcome], str | None] | None = None,
) -> dict[str, Any]:
    """Counts by outcome, and the completed requests whose output differs from the solo run (apart:
    those SGLang retracted and re-prefilled on the way, in the mix or in their solo run). A failure the
    client did not cause is expected when ``excuse`` names its cause (counted as ``failed_<cause>``,
    e.g. ``Excuses``); a completed request whose solo run failed is ``unverified`` (expected only when
    ``excuse`` explains the solo run's failure too)."""
    counts = {"sent": len(reqs), "completed": 0, "aborted": 0, "disconnected": 0, "failed_as_expected": 0,
              "failed_unexpectedly": 0, "retracted": 0, "differing": 0, "differing_retracted": 0}  # fmt: skip
    unexpected: list[str] = []
    differing: list[str] = []
    for request, outcome in zip(reqs, outcomes, strict=True):
        if outcome.status in ("aborted", "disconnected") and request.fate != "complete":
            counts[outcome.status] += 1
            counts["failed_as_expected"] += 1
            continue
        cause = excuse(request, outcome) if excuse is not None and outcome.status != "completed" else None
        if cause is not None:
            counts["failed_as_expected"] += 1
            counts[f"failed_{cause}"] = counts.get(f"failed_{cause}", 0) + 1
            continue
        if outcome.status != "completed":
            counts["failed_unexpectedly"] += 1
            unexpected.append(f"{request.rid} ({request.fate}): {outcome.status}: {outcome.error}")
            continue
        counts["completed"] += 1
        alone = solo[(request.input_ids, request.max_new_tokens)]
        if alone.status != "completed":
            counts["unverified"] = counts.get("unverified", 0) + 1
            if excuse is None or excuse(request, alone) is None:
                counts["failed_unexpectedly"] += 1
                unexpected.append(f"{request.rid}: its solo run failed: {alone.error}")
            continue
        counts["retracted"] += outcome.retractions > 0
        retracted = outcome.retractions > 0 or alone.retractions > 0
        same = outcome.output_ids == alone.output_ids
        if not same:
            differing.append(request.rid)
            counts["differing_retracted" if retracted else "differing"] += 1
            if not retracted:
                unexpected.append(f"{request.rid}: output differs from the solo run")
    return {**counts, "problems": unexpected[:20], "differing_requests": differing}


# What a sparse server still holds after a drain and a radix flush, where a leak would show: request
# slots of requests SGLang did not free, working-set tokens, SGLang's host pages not back on its free
# list, staged KV and hand-offs (PD prefill), remote-fetch state (PD decode), jobs still running,
# failures never taken, and kept retraction states (which a retracted request aborted while it waited
# leaves; bounded, so `held_kept_retractions` alone is no leak).
HELD = ("running_requests", "device_working_set_tokens", "host_tokens_used", "staged_bytes", "held_handoffs",
        "held_fetch_requests", "held_running_jobs", "held_failures", "held_kept_retractions")  # fmt: skip


def nothing_held(held: dict[str, Any], kept_retractions: bool = False) -> dict[str, Any]:
    """The entries of ``drain``'s result that show something held (empty: nothing); ``kept_retractions``:
    kept retraction states are allowed (a run with retractions and aborts)."""
    allowed = {"held_kept_retractions"} if kept_retractions else set()
    bad = {name: value for name, value in held.items() if name != "flushed" and value and name not in allowed}
    return bad if held.get("flushed") else {"flushed": False, **bad}


def drain(url: str, sparse: bool, timeout_s: float = 120.0) -> dict[str, Any]:
    """Wait until the server runs nothing, flush the radix cache, and read what is still held (``HELD``;
    dense servers: whether the flush went through)."""
    deadline = time.monotonic() + timeout_s
    while True:
        flushed = requests.post(url + "/flush_cache", timeout=60).status_code == 200
        stats = requests.get(url + "/oasis/stats", timeout=30).json() if sparse else {}
        idle = not sparse or all(stats[name] == 0 for name in HELD if name != "held_kept_retractions")
        if (flushed and idle) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    held = {"flushed": flushed}
    if sparse:
        held |= {name: int(stats[name]) for name in HELD}
    return held


def summary(reqs: Sequence[SoakRequest], outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """Per request, for the JSON: its settings (without the prompt) and outcome (without the tokens)."""
    rows = []
    first = min((o.started for o in outcomes), default=0.0)
    for request, outcome in zip(reqs, outcomes, strict=True):
        row = {k: v for k, v in asdict(request).items() if k != "input_ids"}
        row.update(prompt_tokens=len(request.input_ids), status=outcome.status, retractions=outcome.retractions,
                   output_tokens=len(outcome.output_ids), error=outcome.error,
                   sent_at_s=round(outcome.started - first, 2), answered_at_s=round(outcome.ended - first, 2))  # fmt: skip
        rows.append(row)
    return rows
