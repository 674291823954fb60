"""Tensor parallelism on SGLang's CPU engine through the launcher (issue 41, item 0): dense ``--tp-size 3``
on SmolLM2's first 6 layers (9 query heads, 3 KV heads: one KV head per rank) answers as ``--tp-size 1``
token for token. The launcher binds the 3 ranks to the 2 cores (``SGLANG_CPU_OMP_THREADS_BIND=0|1|0``:
ranks 0 and 2 share core 0) and keeps NCCL off (hook 13); the ranks all-reduce over gloo. Before, every
rank died building a PyNccl communicator on a CPU device."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_oasis.launcher.cpu_engine import CPU_BIND_ENV
from sglang_oasis.platform.cpu.capabilities import numa_nodes, rank_core_binding, usable_cores
from sglang_oasis.server_process import ServerProcess

PROMPTS = [
    "The history of the Roman Empire begins with",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Photosynthesis is the process by which plants",
    "Once upon a time, in a small village by the sea, there lived",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def dense_tp3(smollm2_6l_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--model-path", str(smollm2_6l_dir), "--oasis-mode", "dense", "--dtype", "float32",
            "--max-total-tokens", "4096", "--tp-size", "3"]  # fmt: skip
    log = tmp_path_factory.mktemp("logs") / "smollm2-6l-dense-tp3.log"
    with ServerProcess(args, log_path=log) as server:
        yield server


def generate(server: ServerProcess, text: str) -> list[int]:
    status, body = server.post(
        "/generate", {"text": text, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}
    )
    assert status == 200, body
    return list(json.loads(body)["output_ids"])


def test_dense_tp3_answers_as_tp1(dense_tp3: ServerProcess, smollm2_dense_server: ServerProcess) -> None:
    with urllib.request.urlopen(dense_tp3.url + "/get_server_info", timeout=30) as response:
        assert json.loads(response.read())["tp_size"] == 3
    if numa_nodes() < 3 and CPU_BIND_ENV not in os.environ:  # the launcher's binding (2 cores: 0|1|0)
        cores = sorted(os.sched_getaffinity(0))[: usable_cores()]
        assert f"SGLANG_CPU_OMP_THREADS_BIND={rank_core_binding(cores, 3)}:" in dense_tp3.log_tail(10**6)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: one batch across the ranks
        got = list(pool.map(lambda text: generate(dense_tp3, text), PROMPTS))
    expected = [generate(smollm2_dense_server, text) for text in PROMPTS]
    for text, tp3, tp1 in zip(PROMPTS, got, expected, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(tp3, tp1, strict=True)) if a != b), None)
        assert first is None, f"{text!r}: TP 3 and TP 1 part at token {first}: {tp3[first:]} vs {tp1[first:]}"
