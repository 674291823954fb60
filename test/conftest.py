"""Shared fixtures. Servers used by several modules are session-scoped: a start costs 20-40 s on these CPU
machines."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # sgl-kernel-oasis's Triton kernels are tested on CPU under Triton's interpreter, which must be on
    # before Triton is first imported (its own library functions are decorated then). Servers started by
    # the tests do not inherit it (ServerProcess drops it).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Servers the tests start decode eagerly unless a test asks for the captured step (the launcher's CPU
# default, which compiles each batch bucket at its first pass: 13-22 s per bucket and shape on a fresh
# machine, for ~40 servers of many shapes). test_captured_step.py and the default server run it.
os.environ.setdefault("SGLANG_OASIS_CPU_DECODE_STEP", "eager")

from sglang_oasis.models.default_model import prepare_default_model
from sglang_oasis.server_process import ServerProcess
from sglang_oasis_testing.tiny_models import TinyModelSpec, build_tiny_model

# fp32 everywhere an equivalence is claimed; small pools so several servers fit beside each other.
FP32 = ["--dtype", "float32"]
SMALL_POOL = ["--max-total-tokens", "16384"]
SPARSE_SMALL = ["--oasis-host-kv-tokens", "16384", "--oasis-device-kv-tokens", "16384"]
# the selector and K these servers' tests count bytes and blocks for (the serving default is codes at K = 16)
SUMMARIES_128 = ["--oasis-selector", "summaries", "--oasis-top-k", "128"]


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def smollm2_6l_dir() -> Path:
    """SmolLM2's first 6 layers: those layers' attention exactly, ~3x faster than all 30."""
    return prepare_default_model(num_layers=6)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(TinyModelSpec(arch="qwen3"), tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = TinyModelSpec(arch="llama", hidden_size=384, num_heads=6, num_kv_heads=2)
    return build_tiny_model(spec, tmp_path_factory.mktemp("models"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Backends made in-process by unit tests run a gauge thread each; stop them before the interpreter
    exits (one inside a torch op at teardown aborts the process, failing a run whose tests passed)."""
    from sglang_oasis.attention.gauges import Gauges

    Gauges.stop_all()


def _serve(
    args: list[str], name: str, tmp_path_factory: pytest.TempPathFactory, env: dict[str, str] | None = None,
    ready_timeout_s: float = 300.0,
) -> Iterator[ServerProcess]:  # fmt: skip
    log_path = tmp_path_factory.mktemp("logs") / f"{name}.log"
    with ServerProcess(args, log_path=log_path, env=env, ready_timeout_s=ready_timeout_s) as server:
        yield server


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The README's first command as a newcomer runs it: no model path, sparse mode, CPU defaults. Module
    scope: it is the largest server (all 30 layers, its device tier 65,536 tokens of KV, ~5 GiB here) and one
    module uses it; 24 GiB do not hold it beside every later module's servers."""
    # the launcher's own defaults: key codes at K = 16 on the eager decode step (nothing compiles)
    yield from _serve([], "default-server", tmp_path_factory, {"SGLANG_OASIS_CPU_DECODE_STEP": ""}, 900)


@pytest.fixture(scope="module")
def default_dense_server(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Dense SGLang on the default model (all 30 layers): the passkey tests' baseline. Module scope: one
    module uses it, and its ~3 GiB are better freed for the modules after it."""
    args = ["--model-path", str(default_model_dir), "--oasis-mode", "dense", "--max-total-tokens", "32768"]
    yield from _serve(args, "default-dense", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_qwen3_server(
    tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Dense baseline on the tiny Qwen3."""
    args = ["--model-path", str(tiny_qwen3_dir), "--oasis-mode", "dense", *FP32, *SMALL_POOL]
    yield from _serve(args, "tiny-qwen3-dense", tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_qwen3_sparse_server(
    tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Sparse on the tiny Qwen3 with K = 64 blocks by the summaries (covers every block of prompts up to 1024 tokens), a
    6144-token host tier (smaller than the model's 8192-token context) and Prometheus metrics; the
    default asynchronous prefetch with the adaptive fetch cap; recall telemetry at every decode step."""
    args = [
        "--model-path", str(tiny_qwen3_dir), "--oasis-top-k", "64", *FP32, "--enable-metrics",
        "--oasis-host-kv-tokens", "6144", "--oasis-device-kv-tokens", "16384", "--oasis-adaptive-cap", "true",
        "--oasis-recall-sample-every", "1", "--oasis-selector", "summaries",
    ]  # fmt: skip
    yield from _serve(args, "tiny-qwen3-sparse", tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2_dense_server(
    smollm2_6l_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ["--model-path", str(smollm2_6l_dir), "--oasis-mode", "dense", *FP32, *SMALL_POOL]
    yield from _serve(args, "smollm2-6l-dense", tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2_sparse_server(
    smollm2_6l_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Sparse with K = 128 blocks of 16 by the summaries: covers every block of prompts up to 2048 tokens;
    synchronous transfers without a fetch cap (the tiny Qwen3's sparse server covers the defaults)."""
    args = [
        "--model-path", str(smollm2_6l_dir), *FP32, *SPARSE_SMALL, *SUMMARIES_128,
        "--oasis-prefetch", "sync", "--oasis-fetch-ratio", "1.0",
    ]  # fmt: skip
    yield from _serve(args, "smollm2-6l-sparse", tmp_path_factory)
