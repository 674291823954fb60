"""``--oasis-decode-step captured`` on a real server: the compiled decode step answers as the eager one.

Two sparse servers on the tiny Qwen3 (4 layers, 2 KV heads), float32, K = 4 with a fetch cap of 1 block
per head and step, requests' own K up to 64: one runs plain decode passes through the compiled program
(``attention/captured_step.py``), the other eagerly. Three requests at once (batches of 1 to 3 rows: the
batch buckets 1, 2 and 4, each compiled at first use) must give the same greedy tokens on both; with a
request's K covering every block both must give what transformers gives (dense attention). A third server
runs the program uncompiled under the sync guard: no pass syncs with the host, and with a recall target
(its samples and decisions inside the program) it answers and grows as the eager one. Its own
servers (compiling costs the first requests about half a minute per shape here): the unit lane runs it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import requests
import torch

from sglang_oasis.attention.sync_guard import SYNC_GUARD_ENV
from sglang_oasis.server_process import ServerProcess, greedy_body

pytestmark = pytest.mark.server

NEW_TOKENS = 24
PROMPTS = (333, 517, 700)  # tokens: 20 to 43 full blocks, none a multiple of the block


def _serve(
    model_dir: Path, logs: Path, decode_step: str, env: dict[str, str] | None = None, name: str = ""
) -> Iterator[ServerProcess]:
    args = [
        "--model-path", str(model_dir), "--dtype", "float32", "--oasis-top-k", "4", "--oasis-fetch-ratio", "0.25",
        "--oasis-recall-max-top-k", "64", "--oasis-host-kv-tokens", "8192", "--oasis-device-kv-tokens", "8192",
        "--oasis-recall-sample-every", "16", "--oasis-decode-step", decode_step,
    ]  # fmt: skip
    log = logs / f"tiny-qwen3-{name or decode_step}.log"
    # the captured server compiles its programs before it is ready: 8 of them (batch buckets 1 to 8, decode
    # and sample passes), ~2 minutes without torch's cache
    with ServerProcess(args, log_path=log, env=env, ready_timeout_s=600) as server:
        yield server


@pytest.fixture(scope="module")
def captured_server(
    tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    yield from _serve(tiny_qwen3_dir, tmp_path_factory.mktemp("logs"), "captured")


# At most two servers at once (about 3 GiB each; the other test lane runs PD pairs meanwhile): the eager
# and the guarded servers serve one test each and stop after it.
@pytest.fixture()
def eager_server(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _serve(tiny_qwen3_dir, tmp_path_factory.mktemp("logs"), "eager")


@pytest.fixture()
def guarded_server(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The captured server's program uncompiled, every call under the sync guard (``SYNC_GUARD_ENV``)."""
    logs, env = tmp_path_factory.mktemp("logs"), {SYNC_GUARD_ENV: "1"}
    yield from _serve(tiny_qwen3_dir, logs, "captured", env, name="guarded")


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate_all(server: ServerProcess, options: dict[str, Any] | None = None) -> list[list[int]]:
    """The three prompts at once; each request's greedy tokens."""

    def one(length: int) -> list[int]:
        body = greedy_body(prompt(length, seed=length), NEW_TOKENS)
        if options:
            body["sampling_params"]["custom_params"] = options
        response = requests.post(server.url + "/generate", json=body, timeout=600)
        assert response.status_code == 200, response.text
        return list(response.json()["output_ids"])

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def test_the_programs_compile_before_the_server_is_ready_and_never_while_it_serves(
    captured_server: ServerProcess,
) -> None:
    """SGLang's warm-up request (before ``/health`` answers) compiled every program the server runs: each
    batch bucket up to its running-request cap (8), decode and sample passes, as four graphs (one row; two
    rows, whose graph serves 4 and 8: the batch dimension is symbolic). Then bursts of requests at
    five concurrencies and a context of 4,200 tokens compile nothing more and run every pass captured (none
    left to the eager step)."""
    first = captured_server.oasis_stats()
    log = captured_server.log_path.read_text()
    compiled = log.index("the captured decode step's 8 programs compiled in")
    assert first["captured_compile_ms"] > 0 and compiled < log.index("The server is fired up and ready")
    assert re.search(r"the captured decode step's 8 programs compiled in [0-9.]+ s, 4 graphs", log)
    for rows in (1, 2):
        assert f"captured decode step, {rows} rows (decode+sample): compiled in" in log, rows
    for rows in (4, 8):
        assert f"captured decode step, {rows} rows (decode+sample): served by the graph of fewer rows" in log
    for concurrency in (1, 2, 3, 5, 8):
        lengths = [40 + 17 * i for i in range(concurrency)]
        with ThreadPoolExecutor(concurrency) as pool:
            done = list(pool.map(lambda n: captured_server.generate(prompt(n, seed=n), 12), lengths))
        assert all(len(answer["output_ids"]) == 12 for answer in done)
    # a context past 4,096 tokens (257+ blocks: the next block bucket, and a sample pass's sums over more
    # than 4,096 positions, where torch's float sums guard on the length) compiles nothing either
    samples = captured_server.oasis_stats()["recall_samples"]
    assert len(captured_server.generate(prompt(4200, seed=4200), 20)["output_ids"]) == 20
    after = captured_server.oasis_stats()
    assert after["recall_samples"] > samples
    assert after["captured_compile_ms"] == first["captured_compile_ms"], "a compile while serving"
    assert after["captured_uncompiled_passes"] == first["captured_uncompiled_passes"] == 0
    assert after["captured_decode_passes"] - first["captured_decode_passes"] >= 5 * 10


def test_captured_server_answers_as_the_eager_one_and_as_dense_with_k_covering(
    captured_server: ServerProcess, eager_server: ServerProcess, tiny_qwen3_dir: Path
) -> None:
    """K = 4 of 20 to 43 blocks: the eager server's tokens, every decode pass captured but the sample
    passes; then K covering every block (a request's own ``oasis_top_k``): dense attention's tokens."""
    before = captured_server.oasis_stats()
    captured = generate_all(captured_server)
    after = captured_server.oasis_stats()
    assert captured == generate_all(eager_server)
    passes = after["captured_decode_passes"] - before["captured_decode_passes"]
    steps = after["decode_steps"] - before["decode_steps"]
    # every decode pass ran the compiled step, those a recall sample was due in (one in 16) too
    assert steps - 2 <= passes <= steps, (passes, steps)
    assert after["recall_samples"] > before["recall_samples"]
    assert after["blocks_deferred"] > before["blocks_deferred"]  # K = 4 of 20+ blocks, cap 1: it selects
    assert eager_server.oasis_stats()["captured_decode_passes"] == 0
    from transformers import AutoModelForCausalLM

    covering = {"oasis_top_k": 64}  # 64 blocks hold every prompt here: dense attention
    captured = generate_all(captured_server, covering)
    assert captured == generate_all(eager_server, covering)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    for length, tokens in zip(PROMPTS, captured, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt(length, seed=length)]), max_new_tokens=NEW_TOKENS, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        assert tokens == out[0, length:].tolist(), length


def test_no_captured_pass_syncs_with_the_host_on_a_real_model(
    guarded_server: ServerProcess, captured_server: ServerProcess
) -> None:
    """On the tiny Qwen3's real weights, every captured pass's program under the sync guard (a pass that
    synced would raise there and leave the server decoding eagerly: passes no longer captured): batches
    of 1 to 3 rows, recall samples, and each request's own recall target (0.9) growing its working sets
    as the compiled program's grow them (test_decode_program.py checks those against the eager step's);
    the answers are the compiled program's."""
    for options in (None, {"oasis_recall_target": 0.9}):
        ours = [server.oasis_stats() for server in (guarded_server, captured_server)]
        assert generate_all(guarded_server, options) == generate_all(captured_server, options)
        theirs = [server.oasis_stats() for server in (guarded_server, captured_server)]
        before, after = ours[0], theirs[0]
        passes, steps = (after[name] - before[name] for name in ("captured_decode_passes", "decode_steps"))
        assert steps - 2 <= passes <= steps, (options, passes, steps)
        assert after["recall_samples"] > before["recall_samples"], options
        grows = [
            t["recall_target_grows"] - o["recall_target_grows"] for o, t in zip(ours, theirs, strict=True)
        ]
        assert grows[0] == grows[1] and (grows[0] > 0) == bool(options), grows
    assert "captured decode step failed" not in guarded_server.log_path.read_text()


def test_captured_soak_serves_every_surviving_request_as_alone(
    captured_server: ServerProcess, tiny_qwen3_dir: Path
) -> None:
    """The soak's mix (``benchmark/soak.py``: mixed lengths, shared stems, repeats, streaming, client
    disconnects and aborts), 40 requests 8 at a time, on the captured server: every completed request
    answers as alone (batches padded to other buckets than a lone request's must not change a row's
    tokens), nothing fails unexpectedly, nothing is held after the drain."""
    import sys

    from transformers import AutoTokenizer

    from sglang_oasis.evaluation.passkey import essays_text

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))
    from soak import HELD, compare, drain, nothing_held, run_mix, solo_outputs, workload

    corpus = AutoTokenizer.from_pretrained(tiny_qwen3_dir).encode(essays_text(), add_special_tokens=False)
    reqs = workload(seed=39, count=40, corpus=corpus, prompt_tokens=(80, 700), new_tokens=(8, 40))
    before = captured_server.oasis_stats()
    outcomes = run_mix(captured_server.url, reqs, 8)
    held = drain(captured_server.url, sparse=True)
    report = {**compare(reqs, outcomes, solo_outputs(captured_server.url, reqs, outcomes)), "held": held}
    after = captured_server.oasis_stats()
    print(report)
    assert report["failed_unexpectedly"] == 0 and report["differing"] == 0, report["problems"]
    assert report["completed"] >= 20, report
    assert nothing_held(held) == {} and len(held) == len(HELD) + 1, held
    assert after["captured_decode_passes"] - before["captured_decode_passes"] > 100, after
