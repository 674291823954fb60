"""``--oasis-prefill-attention triton``: sparse mode's extends through SGLang's Triton attention backend.

On a GPU that is the default (``attention/triton_prefill.py``); here SGLang's Triton kernels run under
Triton's interpreter on CPU, in a real server on the tiny Qwen3 (float32, K = 64 blocks: every block of
these prompts, so sparse decode equals dense). Its greedy tokens must equal dense SGLang's (torch_native
everywhere) token for token for: a prompt alone, one that finds most of its prefix cached (the Triton
kernel reads the prefix from the pool, the host tier), a prompt chunked by ``--chunked-prefill-size``, and
three prompts prefilled together; and every extend pass must have gone through the Triton backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from sglang_oasis.server_process import ServerProcess, greedy_body

pytestmark = pytest.mark.server

NEW_TOKENS = 12
CHUNK = 256
LAYERS = 4  # the tiny Qwen3's


@pytest.fixture(scope="module")
def triton_prefill_server(
    tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = [
        "--model-path", str(tiny_qwen3_dir), "--dtype", "float32", "--oasis-top-k", "64",
        "--oasis-host-kv-tokens", "8192", "--oasis-device-kv-tokens", "8192", "--oasis-prefill-attention", "triton",
        "--chunked-prefill-size", str(CHUNK),
    ]  # fmt: skip
    log = tmp_path_factory.mktemp("logs") / "tiny-qwen3-triton-prefill.log"
    with ServerProcess(args, log_path=log, env={"TRITON_INTERPRET": "1"}) as server:
        yield server


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(server: ServerProcess, input_ids: list[int]) -> tuple[list[int], int]:
    response = requests.post(server.url + "/generate", json=greedy_body(input_ids, NEW_TOKENS), timeout=600)
    assert response.status_code == 200, response.text
    body = response.json()
    return list(body["output_ids"]), int(body["meta_info"]["cached_tokens"])


def test_triton_extends_answer_as_dense_sglang(
    triton_prefill_server: ServerProcess, tiny_qwen3_server: ServerProcess
) -> None:
    before = triton_prefill_server.oasis_stats()["triton_extend_layers"]
    first = prompt(200, seed=1)
    assert generate(triton_prefill_server, first)[0] == generate(tiny_qwen3_server, first)[0]
    # most of it cached: the extend's prefix comes from the pool
    longer = first + prompt(45, seed=2)
    tokens, cached = generate(triton_prefill_server, longer)
    assert cached >= 192, cached
    assert tokens == generate(tiny_qwen3_server, longer)[0]
    # chunked: three extends of one request
    chunked = prompt(2 * CHUNK + 77, seed=3)
    assert generate(triton_prefill_server, chunked)[0] == generate(tiny_qwen3_server, chunked)[0]
    layers = triton_prefill_server.oasis_stats()["triton_extend_layers"] - before
    assert layers >= 5 * LAYERS, layers  # one extend, one, three chunks; each layer
    # three at once (their extends may share passes)
    batch = [prompt(length, seed=length) for length in (150, 333, 517)]
    with ThreadPoolExecutor(len(batch)) as pool:
        ours = list(pool.map(lambda ids: generate(triton_prefill_server, ids)[0], batch))
    assert ours == [generate(tiny_qwen3_server, ids)[0] for ids in batch]
