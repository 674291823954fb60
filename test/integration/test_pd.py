"""Prefill/decode disaggregation on CPU through ``python -m sglang_oasis.launch_pd``: real SGLang prefill
and decode servers (sparse mode, remote partial fetching) exchanging KV over the real Mooncake transfer
engine (TCP on 127.0.0.1), behind SGLang's router. The tests run in file order; the last one kills the
prefill server.

K = 32 blocks of 16 tokens: the 300-token prompt is covered whole (PD output = dense), the 1100-token one
is sparse (PD output = the same sparse configuration served without disaggregation)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from sglang_oasis.disaggregation.prefill_stager import HANDOFF_DELAY_ENV
from sglang_oasis.server_process import GenerateError, ServerProcess
from sglang_oasis_testing.pd_launch import PDLaunch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from soak import HELD, Excuses, compare, drain, nothing_held, run_mix, solo_outputs, workload

PROMPTS = {"short": 300, "long": 1100}  # tokens
# Staging cap: the prompts above and the prefill-kill test's 4000-token one (with the short one beside it)
# are staged; an OVER_CAP-token prompt (5000 x 9216 B of KV x 17/16 with its summaries: 46.7 MiB) goes whole.
STAGING_CAP_MIB, OVER_CAP = 44, 5000
FAULT_PROMPT = 1500  # tokens: the servers fail decode-time KV transfers of prompts this long (injected)
SLOW_PROMPT, SLOW_S = 2222, 8.0  # the prefill node answers hand-offs of prompts this long this late
TOP_K, BLOCK = 32, 16
LAYERS, KV_HEADS, HEAD_DIM, ITEMSIZE = 6, 3, 64, 4  # SmolLM2's first 6 layers, float32
BLOCK_BYTES = BLOCK * KV_HEADS * HEAD_DIM * ITEMSIZE  # one block of K (or V) of one layer
SPARSE_ARGS = ["--dtype", "float32", "--oasis-top-k", str(TOP_K), "--oasis-selector", "summaries",
               "--oasis-host-kv-tokens", "16384", "--oasis-device-kv-tokens", "16384"]  # fmt: skip


def prompt(tokens: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 200 for i in range(tokens)]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def delta(after: dict[str, Any], before: dict[str, Any], name: str) -> int:
    return int(after[name]) - int(before[name])


@pytest.fixture(scope="module")
def pd(smollm2_6l_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDLaunch]:
    launch = PDLaunch(
        [
            "--model-path",
            str(smollm2_6l_dir),
            *SPARSE_ARGS,
            "--oasis-remote-fetch-max-staged-mib",
            str(STAGING_CAP_MIB),
            "--router-args=--disable-retries --disable-circuit-breaker",
            "--prefill-args=--enable-metrics",  # sglang:kv_transfer_total_mb: bytes sent per request
            "--decode-args=--disaggregation-decode-enable-radix-cache",
        ],
        tmp_path_factory.mktemp("pd"),
        env={
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60",
            "SGLANG_OASIS_INJECT_TRANSFER_FAILURE": str(FAULT_PROMPT),
            HANDOFF_DELAY_ENV: f"{SLOW_PROMPT}:{SLOW_S}",
        },
    )
    try:
        yield launch
    finally:
        launch.stop()


@pytest.fixture(scope="module")
def sparse_reference(
    smollm2_6l_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """The same sparse configuration without disaggregation."""
    args = ["--model-path", str(smollm2_6l_dir), *SPARSE_ARGS]
    with ServerProcess(args, log_path=tmp_path_factory.mktemp("logs") / "pd-reference.log") as server:
        yield server


def summary_bytes(tokens: int) -> int:
    return LAYERS * 2 * -(-tokens // BLOCK) * KV_HEADS * HEAD_DIM * ITEMSIZE


def test_pd_sparse_serving_equals_non_disaggregated_sparse_and_reads_only_selected_blocks(
    pd: PDLaunch, smollm2_dense_server: ServerProcess, sparse_reference: ServerProcess
) -> None:
    before, sent_before = pd.decode.oasis_stats(), pd.transferred_mb()
    short, long = prompt(PROMPTS["short"], 0), prompt(PROMPTS["long"], 1)
    got = pd.router.generate(short, 24)["output_ids"]
    assert got == smollm2_dense_server.generate(short, 24)["output_ids"], "K covers every block: dense"
    assert got == sparse_reference.generate(short, 24)["output_ids"]
    after_short = pd.decode.oasis_stats()
    got = pd.router.generate(long, 24)["output_ids"]
    assert got == sparse_reference.generate(long, 24)["output_ids"], "1100 tokens, K = 32 blocks"
    after = pd.decode.oasis_stats()

    assert delta(after, before, "remote_requests") == 2
    assert delta(after, before, "decode_steps") > 0 and delta(after, before, "blocks_loaded") > 0
    # The decode node's device tier holds working sets for its running cap only (not for SGLang's
    # pre-allocation rows), inside its budget of 16384 tokens' KV bytes.
    assert 0 < after["device_bytes_capacity"] <= 16384 * LAYERS * 2 * BLOCK_BYTES // BLOCK
    assert after["device_request_slots"] == sparse_reference.oasis_stats()["device_request_slots"]
    # every block summary was read, for each request and layer
    assert delta(after, before, "remote_summary_bytes") == summary_bytes(300) + summary_bytes(1100)
    # admission: the union over KV heads of the first selection (the last, partly filled page comes with
    # SGLang's own transfer): every full block for the covered prompt, 32..68 of 68 for the long one
    assert delta(after, before, "remote_admission_bytes") == 2 * BLOCK_BYTES * delta(
        after, before, "remote_admission_blocks"
    )
    assert delta(after_short, before, "remote_admission_blocks") == LAYERS * (300 // BLOCK)
    long_blocks = delta(after, after_short, "remote_admission_blocks")
    assert LAYERS * TOP_K <= long_blocks <= LAYERS * (1100 // BLOCK), long_blocks
    # SGLang's own transfer carried one page per request, not the KV (1100 tokens: 10.2 MB)
    sent, count = pd.transferred_mb()
    assert count - sent_before[1] == 2
    assert (sent - sent_before[0]) * 2**20 <= 2 * 1.05 * 2 * LAYERS * BLOCK_BYTES, sent - sent_before[0]
    # the prefill node released the staged KV once the decode node was done
    deadline = time.monotonic() + 30
    while pd.prefill.oasis_stats()["staged_bytes"] != 0:
        assert time.monotonic() < deadline, "staged KV never released"
        time.sleep(0.5)
    assert pd.prefill.oasis_stats()["staged_requests"] >= 2


def remote_bytes(stats: dict[str, Any]) -> int:
    names = ("remote_admission_bytes", "remote_summary_bytes", "remote_miss_bytes", "remote_completion_bytes")
    return sum(int(stats[name]) for name in names)


def test_a_prefix_the_decode_radix_cache_holds_is_never_read_again(
    pd: PDLaunch, sparse_reference: ServerProcess
) -> None:
    """The first request's remaining blocks are read in the background while it decodes (the completion
    worker), so its KV is whole at its finish and enters the decode radix cache; a second request sharing
    its 800-token prefix reads none of those 50 blocks."""
    shared = prompt(800, 11)
    first_ids, second_ids = [*shared, *prompt(40, 12)], [*shared, *prompt(40, 13)]
    stats = [pd.decode.oasis_stats()]
    for ids in (first_ids, second_ids):  # 16 tokens: the completion (~7 MB on loopback) is done well before
        assert pd.router.generate(ids, 16)["output_ids"] == sparse_reference.generate(ids, 16)["output_ids"]
        deadline = time.monotonic() + 30
        while pd.prefill.oasis_stats()["staged_bytes"] != 0:  # finished and released
            assert time.monotonic() < deadline
            time.sleep(0.5)
        stats.append(pd.decode.oasis_stats())
    first = remote_bytes(stats[1]) - remote_bytes(stats[0])
    second = remote_bytes(stats[2]) - remote_bytes(stats[1])
    assert delta(stats[1], stats[0], "remote_unshared_finishes") == 0, "finished before its KV was whole"
    assert delta(stats[1], stats[0], "remote_completion_bytes") > 0
    assert delta(stats[2], stats[1], "remote_cached_blocks") == LAYERS * (800 // BLOCK)
    assert delta(stats[1], stats[0], "remote_cached_blocks") == 0
    # 840 tokens read the first time (all of it: it entered the radix cache); then only the 40 new ones
    assert first >= 2 * LAYERS * (840 // BLOCK) * BLOCK_BYTES, first
    assert 0 < second < first / 8, (first, second)


def test_a_prompt_over_the_staging_cap_goes_whole_and_answers_as_without_pd(
    pd: PDLaunch, sparse_reference: ServerProcess
) -> None:
    """Over ``--oasis-remote-fetch-max-staged-mib`` the prefill node sends a request whole (SGLang's own
    transfer) and hands over only its first selection: the decode node loads it from the KV that arrived
    and the answer is the same server's without PD (K = 32 of 312 blocks). Before, the decode node asked
    for a hand-off that did not exist and the request failed with a 500."""
    ids = prompt(OVER_CAP, 31)
    before_prefill, before = pd.prefill.oasis_stats(), pd.decode.oasis_stats()
    sent_before = pd.transferred_mb()
    got = pd.router.generate(ids, 16)["output_ids"]
    assert got == sparse_reference.generate(ids, 16)["output_ids"]
    after_prefill, after = pd.prefill.oasis_stats(), pd.decode.oasis_stats()
    assert delta(after_prefill, before_prefill, "staging_whole_sends") == 1
    assert delta(after_prefill, before_prefill, "staged_requests") == 0
    assert delta(after, before, "remote_whole_requests") == 1
    assert (
        delta(after, before, "remote_admission_bytes") == 0 and delta(after, before, "remote_miss_bytes") == 0
    )
    sent, count = pd.transferred_mb()  # SGLang carried the whole KV: 5000 tokens x 9216 bytes
    assert count - sent_before[1] == 1 and (sent - sent_before[0]) * 2**20 >= OVER_CAP * 9216
    assert after_prefill["staged_bytes"] == 0


def test_prompts_staged_at_once_stay_within_the_staging_cap(
    pd: PDLaunch, sparse_reference: ServerProcess
) -> None:
    """Three 2,000-token prompts sent at once (18.7 MiB of KV and summaries each; all three: 56 MiB, over
    the 44 MiB cap): the prefill node admits to staging only what fits beside what it admitted before
    (prompts decided in one batch reserve their bytes before any is staged), the rest go whole; every
    answer is the same server's without PD, and the staged bytes never passed the cap (the cap used to
    be checked against the staged bytes alone, which prompts decided in one batch all saw the same)."""
    prompts = {f"at-once-{seed}": prompt(2000, seed) for seed in (41, 42, 43)}
    before = pd.prefill.oasis_stats()
    got: dict[str, list[int]] = {}

    def send(name: str) -> None:
        got[name] = pd.router.generate(prompts[name], 8)["output_ids"]

    threads = [threading.Thread(target=send, args=(name,)) for name in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == {name: sparse_reference.generate(ids, 8)["output_ids"] for name, ids in prompts.items()}
    after = pd.prefill.oasis_stats()
    assert after["staged_bytes_peak"] <= STAGING_CAP_MIB * 2**20
    assert delta(after, before, "staging_whole_sends") >= 1
    assert delta(after, before, "staged_requests") + delta(after, before, "staging_whole_sends") == 3


def test_a_slow_handoff_holds_only_its_own_request(pd: PDLaunch, sparse_reference: ServerProcess) -> None:
    """The prefill node answers the hand-off of a ``SLOW_PROMPT``-token prompt ``SLOW_S`` late. Its
    admission (hand-off, Mooncake reads) runs off the decode scheduler's thread, so a request sent after
    it is admitted, decodes its 24 tokens and answers while the slow one still waits for its hand-off
    (before, the scheduler thread sat in the hand-off's HTTP call and the quick request waited behind
    it); then the slow one answers as the same sparse server without PD."""
    slow, quick = prompt(SLOW_PROMPT, 51), prompt(PROMPTS["short"], 52)
    expected = {"slow": sparse_reference.generate(slow, 4)["output_ids"],
                "quick": sparse_reference.generate(quick, 24)["output_ids"]}  # fmt: skip
    got: dict[str, Any] = {}
    done: dict[str, float] = {}

    def send(name: str, ids: list[int], new_tokens: int) -> None:
        got[name] = pd.router.generate(ids, new_tokens)["output_ids"]
        done[name] = time.monotonic()

    staged = pd.prefill.oasis_stats()["staged_requests"]
    slow_thread = threading.Thread(target=send, args=("slow", slow, 4))
    slow_thread.start()
    deadline = time.monotonic() + 120
    while pd.prefill.oasis_stats()["staged_requests"] == staged:  # its hand-off is waiting from here on
        assert time.monotonic() < deadline, "the slow request was never staged"
        time.sleep(0.05)
    sent = time.monotonic()
    send("quick", quick, 24)
    slow_thread.join(timeout=120)
    assert got == expected
    assert done["quick"] < done["slow"], (done["quick"] - sent, done["slow"] - sent)


def test_openai_chat_through_the_router(pd: PDLaunch, smollm2_dense_server: ServerProcess) -> None:
    body = {"model": "default", "temperature": 0, "max_tokens": 12,
            "messages": [{"role": "user", "content": "Name three colours."}]}  # fmt: skip
    status, text = pd.router.post("/v1/chat/completions", body)
    assert status == 200, text
    _, reference = smollm2_dense_server.post("/v1/chat/completions", body)
    content = json.loads(text)["choices"][0]["message"]["content"]
    assert content == json.loads(reference)["choices"][0]["message"]["content"]


PD_BAD_OPTIONS: list[tuple[Any, str]] = [
    ({"oasis_top_k": 16}, "oasis_top_k: not supported with PD disaggregation"),  # valid without PD
    ({"oasis_top_k": "many"}, "oasis_top_k"),
    ({"oasis_unknown": 1}, "oasis_unknown"),
    ("top_k=16", "custom_params"),  # the OpenAI API's schema refuses it first ("a valid dictionary")
]


def test_request_options_under_pd_answer_400_through_the_router_and_the_pair_serves_on(
    pd: PDLaunch, sparse_reference: ServerProcess
) -> None:
    """docs/faults.md: an ``oasis_*`` option (or a ``custom_params`` that is not a JSON object) under PD
    answers HTTP 400 naming it through ``launch_pd``'s router on ``/v1/completions``, and both servers
    serve on. SGLang's router (sglang-router 0.3.2) drops ``custom_params`` from ``/generate``'s
    ``sampling_params`` and from ``/v1/chat/completions`` before they reach the servers: such requests
    are served with the servers' settings, as if they set none (asserted, so a router that forwards
    them shows here)."""
    ids = prompt(PROMPTS["long"], seed=11)
    for options, named in PD_BAD_OPTIONS:
        body = {"model": "default", "prompt": "Hello", "max_tokens": 2, "custom_params": options}
        status, text = pd.router.post("/v1/completions", body)
        assert status == 400 and named in text, (options, status, text)
    messages = [{"role": "user", "content": "Hi"}]
    chat = {"model": "default", "max_tokens": 2, "messages": messages, "custom_params": {"oasis_top_k": 8}}
    status, text = pd.router.post("/v1/chat/completions", chat)
    assert status == 200, (status, text)
    assert healthy(pd.prefill.url) and healthy(pd.decode.url)
    expected = sparse_reference.generate(ids, 8)["output_ids"]
    params = {"max_new_tokens": 8, "temperature": 0, "custom_params": {"oasis_top_k": 4}}
    status, text = pd.router.post("/generate", {"input_ids": ids, "sampling_params": params})
    assert status == 200 and json.loads(text)["output_ids"] == expected, (status, text)
    assert pd.router.generate(ids, 8)["output_ids"] == expected


def test_killing_the_prefill_server_fails_only_requests_that_need_it(
    pd: PDLaunch, smollm2_dense_server: ServerProcess, sparse_reference: ServerProcess
) -> None:
    """Two requests decoding when the prefill server dies. The one whose blocks were all read at admission
    (K covers its prompt) finishes correctly. The sparse one (4000 tokens: its first selection holds at
    most 3 heads x 32 of 250 blocks) still has blocks on the dead node: if a decode step needs one it fails
    with a clear error; if not, it finishes but the read of its remaining blocks before the radix cache
    takes its KV fails, so its KV is never shared. Either way a read failed and nothing is reused. (The
    decode server pauses generation while the prefill server is killed, so the sparse request cannot have read
    all its blocks first.) A new request fails instead of hanging; the launcher restarts the prefill
    server and the same decode server serves the sparse prompt again correctly, from scratch.

    A soak mix goes through the router too (``benchmark/soak.py``: mixed lengths, streaming or not,
    client aborts and disconnects; some prompts ``FAULT_PROMPT`` tokens long, whose decode-time
    transfers the servers fail), sent while the prefill server is down: a request fails only when it
    was in flight during the outage or carries an injected failure, naming it. Sent again after the
    restart, they complete and answer as served alone, but the injected ones, which fail naming the
    injected failure; both servers hold nothing after the drain. (``bench_soak.py --pd-faults`` is the
    long variant: there the kill comes in the middle of a mix.)"""
    covered, sparse = prompt(PROMPTS["short"], 7), prompt(4000, 8)
    new_tokens = 400
    expected = {"covered": smollm2_dense_server.generate(covered, new_tokens)["output_ids"],
                "sparse": sparse_reference.generate(sparse, 16)["output_ids"]}  # fmt: skip
    results: dict[str, Any] = {}
    urls = [pd.prefill.url, pd.decode.url]
    mix = workload(41, 16, prompt(6000, 21), (100, 900), (8, 24), inject_len=FAULT_PROMPT, inject_share=0.25)
    assert sum(len(r.input_ids) == FAULT_PROMPT for r in mix) >= 2
    mixed: list[Any] = []

    def in_flight(name: str, ids: list[int]) -> None:
        try:
            results[name] = pd.router.generate(ids, new_tokens)["output_ids"]
        except Exception as error:  # reported below
            results[name] = error

    before = pd.decode.oasis_stats()
    threads = []
    for admitted, (name, ids) in enumerate((("covered", covered), ("sparse", sparse)), start=1):
        threads.append(threading.Thread(target=in_flight, args=(name, ids)))
        threads[-1].start()
        deadline = time.monotonic() + 120
        while pd.decode.oasis_stats()["remote_requests"] < before["remote_requests"] + admitted:
            assert time.monotonic() < deadline, f"the {name} request never reached the decode node"
            time.sleep(0.02)
    status, text = pd.decode.post("/pause_generation", {"mode": "in_place"})
    assert status == 200, text
    try:
        down = time.monotonic()
        os.killpg(int(pd.info["prefill"]["pid"]), signal.SIGKILL)
        time.sleep(1.0)
    finally:
        status, text = pd.decode.post("/continue_generation", {})
    assert status == 200, text
    threads.append(threading.Thread(target=lambda: mixed.extend(run_mix(pd.router.url, mix, 3, urls))))
    threads[-1].start()  # the soak mix, sent while the prefill server is down
    for thread in threads:
        thread.join(timeout=300)

    assert results["covered"] == expected["covered"], (
        f"the covered request must finish: {results['covered']!r}"
    )
    if isinstance(results["sparse"], Exception):
        error = str(results["sparse"])
        assert "HTTP 500" in error and "remote KV read" in error, error
    else:  # (not compared token for token: batched with the other request, sparse numerics may differ)
        assert len(results["sparse"]) == new_tokens
    assert pd.decode.oasis_stats()["remote_failed_reads"] > before["remote_failed_reads"]
    with pytest.raises(GenerateError):  # no prefill server: an error, not a hang
        pd.router.generate(prompt(200, 9), 8, timeout_s=120)
    assert healthy(pd.decode.url)

    # The launcher restarts the prefill server (a request routed while it is down waits on the decode
    # node for SGLANG_DISAGGREGATION_WAITING_TIMEOUT, so wait until it is up).
    deadline = time.monotonic() + 300
    while not healthy(pd.info["prefill"]["url"]):
        assert time.monotonic() < deadline, "the prefill server was not restarted"
        time.sleep(2)
    excuses = Excuses(FAULT_PROMPT)
    excuses.outages.append((down, time.monotonic()))
    again = pd.decode.oasis_stats()
    while True:
        try:
            got = pd.router.generate(sparse, 16, timeout_s=120)["output_ids"]
            break
        except (GenerateError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(5)
    assert got == expected["sparse"]
    assert delta(pd.decode.oasis_stats(), again, "remote_cached_blocks") == 0, "incomplete KV was shared"
    assert "restarting it" in pd.launcher_log.read_text()

    retry = [replace(r, rid=f"{r.rid}-retry", fate="complete") for r, o in zip(mix, mixed, strict=True)
             if excuses(r, o) == "prefill_restart"]  # fmt: skip
    retried = run_mix(pd.router.url, retry, 3, urls)
    held = {url: drain(url, sparse=True) for url in urls}
    solo = solo_outputs(pd.router.url, [*mix, *retry], [*mixed, *retried])
    report, after = compare(mix, mixed, solo, excuses), compare(retry, retried, solo, Excuses(FAULT_PROMPT))
    print({"mix": report, "after_restart": after, "held": held})
    assert report["failed_unexpectedly"] == 0 and report["differing"] == 0, report["problems"]
    assert after["failed_unexpectedly"] == 0 and after["differing"] == 0, after["problems"]
    assert after["completed"] + after.get("failed_injected", 0) == len(retry)
    assert report.get("failed_injected", 0) + after.get("failed_injected", 0) >= 1, (report, after)
    for server_held in held.values():
        assert nothing_held(server_held) == {} and len(server_held) == len(HELD) + 1, held
