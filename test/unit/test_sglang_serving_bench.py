"""The pure pieces of benchmark/bench_sglang_serving.py: the servers it compares differ only where they
should (no server is started here; the benchmark itself runs SGLang's bench_serving against real ones)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import pytest

from bench_sglang_serving import MODES, check_generated, prompt_tokens, server_args, server_groups


def test_sparse_servers_differ_only_in_the_decode_step() -> None:
    args = argparse.Namespace(
        num_prompts=4, input_len=3000, output_len=128, dtype="float32", top_k=32, code_candidates=4
    )
    argv = {mode: server_args(mode, Path("/m"), args) for mode in MODES}
    assert argv["dense"][argv["dense"].index("--oasis-mode") + 1] == "dense"
    assert "--oasis-top-k" not in argv["dense"] and "--oasis-decode-step" not in argv["dense"]
    eager, captured = argv["sparse_eager"], argv["sparse_captured"]
    assert eager[eager.index("--oasis-decode-step") + 1] == "eager"
    assert captured[captured.index("--oasis-decode-step") + 1] == "captured"
    assert [a for a in eager if a != "eager"] == [a for a in captured if a != "captured"]
    assert eager[eager.index("--oasis-top-k") + 1] == "32"
    assert eager[-2:] == [
        "--oasis-selector",
        "summaries",
    ]  # the rows results.md reports (the default is codes)
    codes = argv["sparse_codes"]  # the eager step with the codes selector
    assert codes == [*eager[:-1], "codes"]
    assert argv["sparse_codes_prefilter"] == [*codes, "--oasis-code-candidates", "4"]
    prefilter = argv["sparse_codes_prefilter"]
    assert argv["sparse_codes_captured"] == [a if a != "eager" else "captured" for a in prefilter]
    # every server holds the whole run's KV: 4 x (3000 + 128) tokens and a margin
    for mode, tokens in (("dense", "--max-total-tokens"), ("sparse_eager", "--oasis-host-kv-tokens")):
        assert int(argv[mode][argv[mode].index(tokens) + 1]) >= 4 * 3128
    # the context holds a prompt retokenized longer than its ids (7,000 ids: up to 7,461 tokens seen)
    context = int(argv["dense"][argv["dense"].index("--context-length") + 1])
    assert context == prompt_tokens(3000) + 128 and prompt_tokens(7000) >= 7461
    # the floor is the dense server itself; only its prompts are short (``main``'s input_len)
    assert argv["dense_floor"] == argv["dense"]


def test_the_floor_runs_on_the_dense_server_started_once() -> None:
    groups = [
        ["dense", "dense_floor"],
        ["sparse_eager"],
        ["sparse_captured"],
        ["sparse_codes"],
        ["sparse_codes_prefilter"],
        ["sparse_codes_captured"],
    ]
    assert server_groups(list(MODES)) == groups
    assert server_groups(["dense_floor", "sparse_captured"]) == [["dense_floor"], ["sparse_captured"]]


def test_a_run_whose_requests_the_server_rejected_fails() -> None:
    """What bench_serving wrote for 4 prompts past the context (7,000 ids at 7,384 tokens): ``completed``
    4 and 512 output tokens counted, no text: the run raises rather than report a TPOT of ~1 ms."""
    rejected = {
        "completed": 4,
        "total_output_tokens": 512,
        "total_output_tokens_retokenized": 0,
        "mean_tpot_ms": 0.97,
    }
    with pytest.raises(RuntimeError, match="rejected"):
        check_generated(rejected)
    check_generated({**rejected, "total_output_tokens_retokenized": 509})  # real text: no error
