"""The soak workload (issue 25), shared by ``bench_soak.py`` and ``test/integration/test_soak.py``.

A seeded mix of greedy requests against one server: prompts of mixed lengths, some sharing a stem (radix
hits) and some repeating an earlier prompt exactly, streaming and non-streaming, and three fates:

- ``complete``: runs to its length;
- ``disconnect``: a streaming request whose client closes the connection after a few chunks;
- ``abort``: ``POST /abort_request`` with its rid after a short delay (it may finish first).

``run_mix`` sends them ``concurrency`` at a time and records each request's ``Outcome``; ``solo_outputs``
then serves every completed request's prompt alone, one at a time, and ``compare`` checks that the
concurrent run gave each the same greedy tokens. ``drain`` waits for the server to go idle, flushes
SGLang's radix cache and reads what is still held (``/oasis/stats`` gauges; SGLang's host pool).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Sequence
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


def workload(
    seed: int,
    count: int,
    corpus: Sequence[int],
    prompt_tokens: tuple[int, int],
    new_tokens: tuple[int, int],
    stems: int = 3,
    fate_weights: tuple[float, float, float] = (0.7, 0.15, 0.15),
) -> list[SoakRequest]:
    """``count`` requests: prompt lengths uniform in ``prompt_tokens``, outputs in ``new_tokens``; half
    start with one of ``stems`` shared stems (half the shortest prompt long), one in eight repeats an
    earlier request's prompt and length exactly."""
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
            start = rng.randrange(len(corpus) - length)
            ids = (*stem, *corpus[start : start + length - len(stem)])
            max_new = rng.randint(*new_tokens)
        made.append(SoakRequest(f"soak-{seed}-{i}", tuple(ids), max_new, stream, fate, fate_at))
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
    timer = None
    if request.fate == "abort":

        def abort() -> None:
            for server in abort_urls or [url]:
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
    url: str, reqs: Sequence[SoakRequest], concurrency: int, abort_urls: Sequence[str] = ()
) -> list[Outcome]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda r: send(url, r, abort_urls), reqs))


def solo_outputs(url: str, reqs: Sequence[SoakRequest], outcomes: Sequence[Outcome]) -> dict[tuple, Outcome]:
    """Each completed request's prompt and length served alone (once per distinct pair), non-streaming."""
    solo: dict[tuple, Outcome] = {}
    for request, outcome in zip(reqs, outcomes, strict=True):
        key = (request.input_ids, request.max_new_tokens)
        if outcome.status == "completed" and key not in solo:
            response = requests.post(url + "/generate", json=_body(request, None, False), timeout=600)
            response.raise_for_status()
            reply = response.json()
            retractions = int(reply["meta_info"].get("num_retractions") or 0)
            solo[key] = Outcome("completed", list(reply["output_ids"]), retractions)
    return solo


def compare(
    reqs: Sequence[SoakRequest], outcomes: Sequence[Outcome], solo: dict[tuple, Outcome]
) -> dict[str, Any]:
    """Counts by outcome, and the completed requests whose output differs from the solo run (apart:
    those SGLang retracted and re-prefilled on the way, in the mix or in their solo run)."""
    counts = {"sent": len(reqs), "completed": 0, "aborted": 0, "disconnected": 0, "failed_as_expected": 0,
              "failed_unexpectedly": 0, "retracted": 0, "differing": 0, "differing_retracted": 0}  # fmt: skip
    unexpected: list[str] = []
    differing: list[str] = []
    for request, outcome in zip(reqs, outcomes, strict=True):
        if outcome.status in ("aborted", "disconnected") and request.fate != "complete":
            counts[outcome.status] += 1
            counts["failed_as_expected"] += 1
            continue
        if outcome.status != "completed":
            counts["failed_unexpectedly"] += 1
            unexpected.append(f"{request.rid} ({request.fate}): {outcome.status}: {outcome.error}")
            continue
        counts["completed"] += 1
        alone = solo[(request.input_ids, request.max_new_tokens)]
        counts["retracted"] += outcome.retractions > 0
        retracted = outcome.retractions > 0 or alone.retractions > 0
        same = outcome.output_ids == alone.output_ids
        if not same:
            differing.append(request.rid)
            counts["differing_retracted" if retracted else "differing"] += 1
            if not retracted:
                unexpected.append(f"{request.rid}: output differs from the solo run")
    return {**counts, "problems": unexpected[:20], "differing_requests": differing}


def drain(url: str, sparse: bool, timeout_s: float = 120.0) -> dict[str, Any]:
    """Wait until the server runs nothing, flush the radix cache, and read what is still held: the
    sparse gauges (request slots, working-set tokens, staged bytes) and SGLang's host pool."""
    deadline = time.monotonic() + timeout_s
    while True:
        flushed = requests.post(url + "/flush_cache", timeout=60).status_code == 200
        stats = requests.get(url + "/oasis/stats", timeout=30).json() if sparse else {}
        idle = not sparse or (stats["running_requests"] == 0 and stats["host_tokens_used"] == 0)
        if (flushed and idle) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    held = {"flushed": flushed}
    if sparse:
        for name in ("running_requests", "device_working_set_tokens", "staged_bytes", "host_tokens_used"):
            held[name] = int(stats[name])
    return held


def summary(reqs: Sequence[SoakRequest], outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """Per request, for the JSON: its settings (without the prompt) and outcome (without the tokens)."""
    rows = []
    for request, outcome in zip(reqs, outcomes, strict=True):
        row = {k: v for k, v in asdict(request).items() if k != "input_ids"}
        row.update(prompt_tokens=len(request.input_ids), status=outcome.status, retractions=outcome.retractions,
                   output_tokens=len(outcome.output_ids), error=outcome.error)  # fmt: skip
        rows.append(row)
    return rows
