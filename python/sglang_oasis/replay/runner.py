"""One replay from start to report: validate the trace, load the tokenizer, send, summarise, write."""

from __future__ import annotations

import json
import math
import os
import sys
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from sglang_oasis.replay.client import ClientSettings, Result, send_all
from sglang_oasis.replay.prompts import BlockPrompts, ChatPrompts, corpus_token_ids
from sglang_oasis.replay.report import build_report, write_json, write_plots
from sglang_oasis.replay.schedule import History, conversation_sessions, mooncake_sessions
from sglang_oasis.replay.trace import TraceFormat, load_trace


class ReplaySetupError(RuntimeError):
    """The run could not start (no tokenizer, no model info); nothing was sent."""


@dataclass(frozen=True)
class ReplayConfig:
    trace: Path
    """JSONL input: a Mooncake trace or OpenAI-messages conversations."""
    url: str
    """Base URL of an SGLang-compatible server (its ``/generate`` is used)."""
    out: Path
    """The report JSON; the PNG plots go beside it."""
    format: TraceFormat | Literal["auto"] = "auto"
    tokenizer: str | None = None
    """Tokenizer path; default: the server's ``/get_model_info`` ``model_path``."""
    speedup: float = 1.0
    """Timestamps are divided by it; 0 or infinity sends everything at once (within max_concurrency)."""
    max_requests: int | None = None
    """Replay only the first N requests (conversation turns count one each)."""
    max_concurrency: int | None = None
    """At most N requests in flight."""
    length_scale: float = 1.0
    """Multiplies input (Mooncake) and output lengths; at least 1 token each."""
    history: History = "recorded"
    """Conversations: earlier replies as recorded in the file, or as the server generated them."""
    default_output_length: int = 64
    """Conversations: output length of a turn with neither output_length nor a recorded reply."""
    timeout_s: float = 1800.0
    """Per request, in total."""
    read_timeout_s: float = 300.0
    """Per request, between two streamed chunks."""
    plots: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        problems = []
        if self.speedup < 0 or math.isnan(self.speedup):
            problems.append(f"--speedup must be >= 0 (0 or inf: as fast as allowed), got {self.speedup}")
        if self.max_requests is not None and self.max_requests < 1:
            problems.append(f"--max-requests must be >= 1, got {self.max_requests}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            problems.append(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not (self.length_scale > 0 and math.isfinite(self.length_scale)):
            problems.append(f"--length-scale must be a positive number, got {self.length_scale}")
        if self.default_output_length < 1:
            problems.append(f"--default-output-length must be >= 1, got {self.default_output_length}")
        if not (self.timeout_s > 0 and self.read_timeout_s > 0):
            problems.append("timeouts must be > 0")
        if self.out.suffix.lower() != ".json":
            problems.append(f"--out must name a .json file, got {self.out}")
        if problems:
            raise ValueError("; ".join(problems))


def model_path(url: str, timeout_s: float = 30.0) -> str:
    """The server's model path (``/get_model_info``, or ``/model_info`` where that is gone)."""
    errors = []
    for route in ("/get_model_info", "/model_info"):
        try:
            with urllib.request.urlopen(url.rstrip("/") + route, timeout=timeout_s) as response:
                return str(json.load(response)["model_path"])
        except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
            errors.append(f"{route}: {exc}")
    raise ReplaySetupError(f"cannot ask {url} for its model ({'; '.join(errors)}); pass --tokenizer")


def load_tokenizer(path: str) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ReplaySetupError(f"cannot load the tokenizer from {path}: {exc}") from exc


def run_replay(config: ReplayConfig) -> dict[str, Any]:
    """Replay ``config.trace`` against ``config.url`` and write the report; returns it.

    Raises ``TraceError`` (malformed input) and ``ReplaySetupError`` before anything is sent.
    """
    trace = load_trace(config.trace, config.format)
    tokenizer_path = config.tokenizer or model_path(config.url)
    tokenizer = load_tokenizer(tokenizer_path)
    if trace.format == "mooncake":
        block_prompts = BlockPrompts(corpus_token_ids(tokenizer), config.length_scale)
        sessions = mooncake_sessions(trace.requests, block_prompts, config.speedup, config.max_requests)
    else:
        sessions = conversation_sessions(
            trace.conversations, ChatPrompts(tokenizer), config.speedup, config.length_scale,
            config.history, config.default_output_length, config.max_requests,
        )  # fmt: skip
    total = sum(len(s.turns) for s in sessions)
    settings: dict[str, Any] = {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
        "format": trace.format,
        "tokenizer": tokenizer_path,
        "speedup": None if math.isinf(config.speedup) else config.speedup,
        "out_of_order_timestamps": trace.out_of_order_timestamps,
        "sessions": len(sessions),
    }
    for private in ("plots", "progress"):
        settings.pop(private)
    started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")

    from tqdm import tqdm

    with tqdm(total=total, unit="req", file=sys.stderr, disable=not config.progress, desc="replay") as bar:
        errors = 0

        def done(result: Result) -> None:
            nonlocal errors
            errors += result.error is not None
            bar.update(1)
            bar.set_postfix(errors=errors, refresh=False)

        client = ClientSettings(
            config.url,
            config.max_concurrency,
            timeout_s=config.timeout_s,
            read_timeout_s=config.read_timeout_s,
        )
        results = send_all(sessions, client, done)

    report = build_report(results, settings, started_at)
    if config.plots:
        try:
            report["plots"] = write_plots(config.out, results)
        except Exception as exc:  # the numbers matter more than the pictures: keep the report
            report["plots"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"warning: no plots: {type(exc).__name__}: {exc}", file=sys.stderr)
    write_json(config.out, report)
    return report
