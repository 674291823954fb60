"""Shared fixtures. Servers are session-scoped: a start costs 20-40 s on these CPU machines."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_oasis.models.default_model import prepare_default_model
from sglang_oasis.models.tiny_models import TinyModelSpec, build_tiny_model
from sglang_oasis.testing.server_process import ServerProcess


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(TinyModelSpec(arch="qwen3"), tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        TinyModelSpec(arch="llama", hidden_size=384, num_heads=6, num_kv_heads=2),
        tmp_path_factory.mktemp("models"),
    )


def _serve(args: list[str], log: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(args, log_path=log).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The README's first command as a newcomer runs it: no model path, CPU defaults."""
    yield from _serve([], tmp_path_factory.mktemp("logs") / "default-server.log")


@pytest.fixture(scope="session")
def tiny_qwen3_server(
    tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ["--model-path", str(tiny_qwen3_dir), "--dtype", "float32", "--max-total-tokens", "8192"]
    yield from _serve(args, tmp_path_factory.mktemp("logs") / "tiny-qwen3-server.log")
