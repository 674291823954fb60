"""Tiny random models: Qwen3 served on CPU matches transformers token for token (fp32, greedy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests
import torch

from sglang_oasis.server_process import ServerProcess

pytestmark = pytest.mark.server


def transformers_greedy(model_dir: Path, input_ids: list[int], new_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([input_ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    return out[0, len(input_ids) :].tolist()


@pytest.mark.parametrize("prompt_len", [5, 37, 300])
def test_tiny_qwen3_matches_transformers(
    tiny_qwen3_server: ServerProcess, tiny_qwen3_dir: Path, prompt_len: int
) -> None:
    gen = torch.Generator().manual_seed(prompt_len)
    input_ids = torch.randint(3, 49152, (prompt_len,), generator=gen).tolist()
    new_tokens = 16
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True},
    }
    served = requests.post(tiny_qwen3_server.url + "/generate", json=body, timeout=120).json()
    assert served["output_ids"] == transformers_greedy(tiny_qwen3_dir, input_ids, new_tokens)


def test_tiny_qwen3_serves_concurrent_chat(tiny_qwen3_server: ServerProcess) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def ask(i: int) -> dict:
        body = {"model": "default", "messages": [{"role": "user", "content": f"count to {i}"}],
                "max_tokens": 8, "temperature": 0, "ignore_eos": True}  # fmt: skip
        return requests.post(tiny_qwen3_server.url + "/v1/chat/completions", json=body, timeout=120).json()

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(8)))
    assert all(a["usage"]["completion_tokens"] == 8 for a in answers)
