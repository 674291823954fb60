"""Lookahead from draft tokens on real servers (tiny random Qwen3, fp32, K covering every block).

The speculative worker runs the target in TARGET_VERIFY with two rows per request (the real token and
one draft); the oasis backend attends both over the same working set and selects the next step's blocks
with the draft row. With K covering every block the output must equal dense token for token whatever
the drafts are:

- eagle3 + reject: a random EAGLE-3 head; no draft is ever accepted (one verify step per token);
- ngram + verify: SGLang's NGRAM drafter with normal acceptance; some drafts are accepted (more than one
  token per verify step), which exercises committing accepted drafts into the summaries; layer 1 is
  listed in --oasis-dense-layers and two sink blocks are kept, so those paths are served too; and the
  same with the verify passes through the captured step (``--oasis-decode-step captured``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from sglang_oasis.evaluation.chat_prompts import CHAT_PROMPTS as ALL_CHAT_PROMPTS
from sglang_oasis.server_process import ServerProcess
from sglang_oasis_testing.tiny_models import TinyModelSpec, build_tiny_eagle3_head

pytestmark = pytest.mark.server

PROMPT_LENGTHS = [5, 17, 100, 333, 1000]
NEW_TOKENS = 40
SPARSE = [
    "--oasis-top-k",
    "64",
    "--dtype",
    "float32",
    "--oasis-host-kv-tokens",
    "8192",
    "--oasis-device-kv-tokens",
    "8192",
]

NGRAM_VERIFY = ["--oasis-lookahead", "ngram", "--oasis-draft-policy", "verify"]


def _module_server(
    args: list[str], name: str, factory: pytest.TempPathFactory, ready_timeout_s: float = 300.0
) -> Iterator[ServerProcess]:
    log_path = factory.mktemp("logs") / f"{name}.log"
    with ServerProcess(args, log_path=log_path, ready_timeout_s=ready_timeout_s) as server:
        yield server


@pytest.fixture(scope="module")
def eagle3_reject_server(
    tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    head = build_tiny_eagle3_head(TinyModelSpec(arch="qwen3"), tiny_qwen3_dir.parent)
    args = [
        "--model-path",
        str(tiny_qwen3_dir),
        "--oasis-lookahead",
        "eagle3",
        "--speculative-draft-model-path",
        str(head),
        *SPARSE,
    ]
    yield from _module_server(args, "tiny-eagle3-reject", tmp_path_factory)


@pytest.fixture(scope="module")
def ngram_verify_server(
    tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ["--model-path", str(tiny_qwen3_dir), *NGRAM_VERIFY, *SPARSE]
    yield from _module_server(args, "tiny-ngram-verify", tmp_path_factory)


@pytest.fixture(scope="module")
def ngram_verify_captured_server(
    tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """ngram + verify with the verify passes through the compiled program (``--oasis-decode-step
    captured``: its programs compile before the server is ready, the verify passes' of batch buckets 1 to
    8; no recall telemetry, whose sample passes would double them)."""
    args = ["--model-path", str(tiny_qwen3_dir), *NGRAM_VERIFY, "--oasis-decode-step", "captured", *SPARSE,
            "--oasis-recall-sample-every", "0"]  # fmt: skip
    yield from _module_server(args, "tiny-ngram-verify-captured", tmp_path_factory, ready_timeout_s=600)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def generate(server: ServerProcess, input_ids: list[int]) -> dict:
    return server.generate(input_ids, NEW_TOKENS)


def concurrently(server: ServerProcess, batch: list[list[int]]) -> list[dict]:
    with ThreadPoolExecutor(len(batch)) as pool:
        return list(pool.map(lambda ids: generate(server, ids), batch))


def test_eagle3_reject_equals_dense_one_token_per_step(
    eagle3_reject_server: ServerProcess, tiny_qwen3_server: ServerProcess
) -> None:
    batch = prompts()
    before = requests.get(eagle3_reject_server.url + "/oasis/stats", timeout=30).json()
    sparse = concurrently(eagle3_reject_server, batch)
    dense = concurrently(tiny_qwen3_server, batch)
    assert [r["output_ids"] for r in sparse] == [r["output_ids"] for r in dense]
    for result in sparse:
        # Every token after the prefill's came from its own verify step: no draft accepted.
        assert result["meta_info"]["spec_verify_ct"] == NEW_TOKENS - 1, result["meta_info"]
    after = requests.get(eagle3_reject_server.url + "/oasis/stats", timeout=30).json()
    assert after["decode_steps"] - before["decode_steps"] >= NEW_TOKENS - 1


def assert_ngram_verify_equals_dense(ngram: ServerProcess, dense_server: ServerProcess) -> None:
    """The prompts at once on both: the same greedy tokens, and some NGRAM draft accepted."""
    batch = prompts()
    sparse = concurrently(ngram, batch)
    dense = concurrently(dense_server, batch)
    assert [r["output_ids"] for r in sparse] == [r["output_ids"] for r in dense]
    steps = sum(r["meta_info"]["spec_verify_ct"] for r in sparse)
    assert steps < len(batch) * (NEW_TOKENS - 1), "no NGRAM draft was ever accepted"


def test_ngram_verify_equals_dense_and_accepts_drafts(
    ngram_verify_server: ServerProcess, tiny_qwen3_server: ServerProcess
) -> None:
    assert_ngram_verify_equals_dense(ngram_verify_server, tiny_qwen3_server)


def test_ngram_verify_through_the_captured_step_equals_dense(
    ngram_verify_captured_server: ServerProcess, tiny_qwen3_server: ServerProcess
) -> None:
    before = ngram_verify_captured_server.oasis_stats()
    assert_ngram_verify_equals_dense(ngram_verify_captured_server, tiny_qwen3_server)
    after = ngram_verify_captured_server.oasis_stats()
    passes = after["captured_decode_passes"] - before["captured_decode_passes"]
    verify_passes = after["decode_steps"] - before["decode_steps"]
    assert passes > verify_passes // 2, (passes, verify_passes)  # all but the admissions


# --- the shipped EAGLE-3 head on the default model (SmolLM2-135M-Instruct, all 30 layers) -------------

CHAT_PROMPTS = ALL_CHAT_PROMPTS[:8]


@pytest.fixture(scope="module")
def eagle3_verify_default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The README's default server with the shipped head and normal acceptance (K=128 covers these chats),
    in float32: SGLang's ``auto`` serves this model in float16, where a verify step's numerics differ
    from a decode step's and a near-tie can flip a greedy token."""
    args = ["--oasis-lookahead", "eagle3", "--oasis-draft-policy", "verify", "--dtype", "float32"]
    yield from _module_server(args, "default-eagle3-verify", tmp_path_factory)


@pytest.fixture(scope="module")
def default_dense_fp32_server(
    default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ["--model-path", str(default_model_dir), "--oasis-mode", "dense", "--dtype", "float32"]
    yield from _module_server([*args, "--max-total-tokens", "8192"], "default-dense-fp32", tmp_path_factory)


def generate_chat(server: ServerProcess, text: str) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": 64, "temperature": 0}}
    response = requests.post(server.url + "/generate", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.skipif(
    not os.environ.get("SGLANG_OASIS_SLOW_TESTS"),
    reason="opt-in (SGLANG_OASIS_SLOW_TESTS=1): in one CI run beside five other servers the 30-layer EAGLE3 "
    "server took 4 min to prefill and then stalled (not reproduced alone: passes in ~2 min)",
)
def test_shipped_eagle3_head_accepts_drafts_and_matches_dense(
    eagle3_verify_default_server: ServerProcess,
    default_dense_fp32_server: ServerProcess,
    default_model_dir: Path,
) -> None:
    """Greedy answers to chat prompts equal dense SGLang's (K covers every block), and the shipped head's
    drafts are accepted: SGLang's acceptance (completion tokens per verify step) clearly above a useless
    head's 1.0. Measured 1.299 on these 8 prompts at 64 tokens in float32 (2026-11-30; the previous head:
    1.24); benchmark/bench_acceptance.py measures the issue's 1.3 goal on 24 prompts: 1.352."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    verify_steps = tokens = 0
    for prompt in CHAT_PROMPTS:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        speculative = generate_chat(eagle3_verify_default_server, text)
        assert speculative["text"] == generate_chat(default_dense_fp32_server, text)["text"]
        verify_steps += speculative["meta_info"]["spec_verify_ct"]
        tokens += speculative["meta_info"]["completion_tokens"]
    acceptance = tokens / verify_steps
    print(
        f"shipped EAGLE-3 head: {acceptance:.3f} tokens per verify step on {len(CHAT_PROMPTS)} chat prompts"
    )
    assert acceptance > 1.2
