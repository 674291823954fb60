"""The default server (no arguments: SmolLM2 from PyPI on CPU) through SGLang's APIs."""

from __future__ import annotations

import json

import pytest
import requests

from sglang_oasis.server_process import ServerProcess

pytestmark = pytest.mark.server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def chat(server: ServerProcess, **body) -> requests.Response:
    payload = {"model": "default", "messages": QUESTION, "temperature": 0, "max_tokens": 24, **body}
    return requests.post(server.url + "/v1/chat/completions", json=payload, timeout=120)


def test_chat_answers_paris(default_server: ServerProcess) -> None:
    response = chat(default_server)
    assert response.status_code == 200, response.text
    assert "Paris" in response.json()["choices"][0]["message"]["content"]


def test_streaming_chat_equals_the_plain_answer(default_server: ServerProcess) -> None:
    plain = chat(default_server).json()["choices"][0]["message"]["content"]
    pieces = []
    with chat(default_server, stream=True) as response:
        assert response.status_code == 200
        for line in response.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[len("data: ") :])["choices"][0]["delta"]
            pieces.append(delta.get("content") or "")
    assert len([p for p in pieces if p]) > 1, "expected the answer in several chunks"
    assert "".join(pieces) == plain


def test_generate_and_completions(default_server: ServerProcess) -> None:
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    generated = requests.post(
        default_server.url + "/generate",
        json={"text": "Once upon a time", "sampling_params": params},
        timeout=120,
    ).json()
    assert generated["meta_info"]["completion_tokens"] == 12
    assert generated["text"].strip()

    completion = requests.post(
        default_server.url + "/v1/completions",
        json={"model": "default", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
              "ignore_eos": True},
        timeout=120,
    ).json()  # fmt: skip
    assert completion["usage"]["completion_tokens"] == 12
    assert completion["choices"][0]["text"] == generated["text"]  # same greedy continuation


def test_frontend_program_runs_against_the_server(default_server: ServerProcess) -> None:
    import sglang as sgl

    @sgl.function
    def capital(s, country):
        s += sgl.user(f"What is the capital of {country}?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=24, temperature=0))

    backend = sgl.RuntimeEndpoint(default_server.url)
    state = capital.run(country="France", backend=backend)
    assert "Paris" in state["answer"]


def test_repeated_long_prefix_is_cached(default_server: ServerProcess) -> None:
    prefix = " ".join(f"Fact {i}: the number {i} comes after {i - 1}." for i in range(1, 80))
    params = {"max_new_tokens": 2, "temperature": 0}

    def cached_tokens(question: str) -> tuple[int, int]:
        body = {"text": prefix + " " + question, "sampling_params": params}
        meta = requests.post(default_server.url + "/generate", json=body, timeout=120).json()["meta_info"]
        return meta["prompt_tokens"], meta["cached_tokens"]

    prompt_tokens, first = cached_tokens("What comes after 5?")
    assert prompt_tokens > 1000
    _, second = cached_tokens("What comes after 9?")
    assert first < 100
    # Everything but the new question came from the radix cache, except the prefill window's 32 tokens
    # (sparse mode recomputes them for their queries) rounded to a whole page.
    assert second >= prompt_tokens - 20 - 32 - 16


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"max_tokens": -1}, id="negative-max-tokens"),
        pytest.param({"messages": [{"role": "user", "content": "hello " * 9000}]}, id="longer-than-context"),
    ],
)
def test_bad_request_fails_alone(default_server: ServerProcess, body: dict) -> None:
    response = chat(default_server, **body)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    assert chat(default_server).status_code == 200  # the server keeps serving
    assert default_server.alive()


def test_serves_the_fastest_dtype_and_announces_a_request_to_try(default_server: ServerProcess) -> None:
    """With no --dtype the default server runs in the dtype this CPU computes fastest (float32 here, not
    SGLang's float16 for a float32 checkpoint), and once ready it prints its URL and a curl line that
    works as printed."""
    import shlex
    import subprocess
    import time

    from sglang_oasis.platform.cpu.capabilities import cpu_flags, fastest_dtype

    info = requests.get(default_server.url + "/get_server_info", timeout=30).json()
    assert info["dtype"] == fastest_dtype(cpu_flags()).dtype
    deadline = time.monotonic() + 30
    while "ready: " not in default_server.log_tail(100_000) and time.monotonic() < deadline:
        time.sleep(0.5)
    log = default_server.log_tail(100_000)
    assert f"ready: {default_server.url} (sparse mode)" in log
    curl = next(line.strip() for line in log.splitlines() if line.strip().startswith("curl -s "))
    reply = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=120, check=True)
    assert "Paris" in json.loads(reply.stdout)["choices"][0]["message"]["content"]


def test_the_default_server_selects_by_key_codes_and_holds_more_requests(
    default_server: ServerProcess,
) -> None:
    """The defaults: ``--oasis-selector codes`` at K = 16 on the eager decode step (the faster with codes on
    CPU). A prompt of more full blocks than K codes them (``key_code_pages`` grows) and decodes no captured
    pass; the device tier holds at least twice the working sets a ``--oasis-top-k 128`` server's (the
    summaries' K at dense's accuracy) holds in the same budget, by the launcher's own count."""
    import dataclasses

    from sglang_oasis.config import OasisConfig
    from sglang_oasis.evaluation.passkey import essays_text
    from sglang_oasis.launcher.sparse_mode import device_request_slots

    before = default_server.oasis_stats()
    text = " ".join(essays_text().split()[:600])  # ~800 tokens: ~50 full blocks, K = 16 selects
    body = {"model": "default", "prompt": text, "max_tokens": 8, "temperature": 0}
    response = requests.post(default_server.url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    after = default_server.oasis_stats()
    assert after["key_code_pages"] > before["key_code_pages"], (before, after)
    assert after["captured_decode_passes"] == before["captured_decode_passes"] == 0
    info = requests.get(default_server.url + "/get_server_info", timeout=30).json()
    argv = ["--model-path", info["model_path"], "--dtype", info["dtype"]]
    argv += ["--max-total-tokens", str(info["max_total_tokens"])]  # the host tier the launcher gave it
    wide = dataclasses.replace(OasisConfig(), top_k=128, selector="summaries")
    assert OasisConfig().top_k == 16 and OasisConfig().selector == "codes"
    held, wide_held = after["device_request_slots"], device_request_slots(argv, wide)
    assert wide_held is not None and held >= 2 * wide_held, (held, wide_held)
