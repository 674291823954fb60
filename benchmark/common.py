"""Shared pieces of the benchmarks: real-text prompts, streamed generation with token timestamps,
metric scraping, and table printing."""

from __future__ import annotations

import json
import os
import platform
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from sglang_oasis.evaluation.passkey import essays_text

# The selection results.md's sparse rows were measured with (the serving default became key codes at K = 16
# later): the benchmarks that reproduce those rows pass it, before any option a run names.
BY_SUMMARIES = ("--oasis-selector", "summaries")


def essay_prompts(model_dir: Path, count: int, tokens: int) -> list[list[int]]:
    """``count`` distinct windows of ``tokens`` essay tokens (no shared prefixes)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir).encode(essays_text(), add_special_tokens=False)
    stride = max(1, (len(ids) - tokens) // max(1, count))
    return [ids[(i * stride) % (len(ids) - tokens) :][:tokens] for i in range(count)]


@dataclass
class Stream:
    token_times: list[float] = field(default_factory=list)  # time each new token arrived
    output_ids: list[int] = field(default_factory=list)  # the generated token ids
    error: str | None = None


def stream_generate(url: str, input_ids: list[int], max_new_tokens: int) -> Stream:
    body = {
        "input_ids": input_ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
    }
    result = Stream()
    seen = 0
    with requests.post(url + "/generate", json=body, stream=True, timeout=3600) as response:
        if response.status_code != 200:
            result.error = response.text[:300]
            return result
        for line in response.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            chunk = json.loads(line[len("data: ") :])
            produced = int(chunk["meta_info"]["completion_tokens"])
            ids = chunk.get("output_ids") or []
            if len(ids) == produced:  # cumulative (SGLang's default)
                result.output_ids = list(ids)
            elif len(ids) == produced - seen:  # --incremental-streaming-output
                result.output_ids += ids
            result.token_times += [now] * (produced - seen)
            seen = produced
    return result


def machine_info() -> dict[str, Any]:
    """The CPU (``platform.processor()``, else /proc/cpuinfo's model name), its core count, the OS."""
    processor = platform.processor()
    if not processor:
        try:
            lines = Path("/proc/cpuinfo").read_text().splitlines()
            processor = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
        except OSError:
            pass
    return {"processor": processor or "unknown", "cpu_count": os.cpu_count(), "platform": platform.platform()}


def oasis_stats(url: str) -> dict[str, Any]:
    """``GET /oasis/stats``: sglang-oasis's raw counters (plus ``per_decode_step`` averages)."""
    response = requests.get(url + "/oasis/stats", timeout=30)
    response.raise_for_status()
    return dict(response.json())


def scrape_metric(url: str, name: str) -> float | None:
    try:
        text = requests.get(url + "/metrics", timeout=10).text
    except requests.RequestException:
        return None
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
    return float(match.group(1)) if match else None


class PeakSampler:
    """Polls a Prometheus gauge in the background and keeps its peak."""

    def __init__(self, url: str, name: str, period_s: float = 0.2) -> None:
        self.url, self.name, self.period_s = url, name, period_s
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            value = scrape_metric(self.url, self.name)
            if value is not None:
                self.peak = max(self.peak, value)
            self._stop.wait(self.period_s)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def int_list(text: str) -> list[int]:
    """An argparse type: ``"1000,2000"`` -> ``[1000, 2000]`` (empty parts ignored)."""
    return [int(part) for part in text.split(",") if part.strip()]
