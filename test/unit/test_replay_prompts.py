"""Prompt synthesis: equal hash ids give equal token blocks, lengths match, the same in every process."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_oasis.models.default_model import prepare_default_model
from sglang_oasis.replay.prompts import BLOCK_TOKENS, BlockPrompts, ChatPrompts, corpus_token_ids, scaled
from sglang_oasis.replay.schedule import conversation_sessions, mooncake_sessions
from sglang_oasis.replay.trace import Conversation, TraceRequest

REPO = Path(__file__).resolve().parents[2]
SHARED_TRACE = REPO / "data" / "traces" / "mooncake_conversation_trace.head2000.jsonl"  # shipped
SAMPLE = [((0, 1, 2, 3), 1900), ((0, 1, 7, 8, 9), 2300), ((5,), 300), ((0, 1), 1024)]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(prepare_default_model())


@pytest.fixture(scope="module")
def corpus(tokenizer) -> list[int]:
    return corpus_token_ids(tokenizer)


def test_shared_hash_ids_share_exactly_those_blocks(corpus: list[int]) -> None:
    prompts = BlockPrompts(corpus)
    a = prompts.prompt([0, 1, 2, 3], 1900, "a")
    b = prompts.prompt([0, 1, 7, 8], 1900, "b")
    two = 2 * BLOCK_TOKENS
    assert a[:two] == b[:two]
    assert a[two : two + BLOCK_TOKENS] != b[two : two + BLOCK_TOKENS]
    assert a[:BLOCK_TOKENS] == prompts.block(0, 0) and a[BLOCK_TOKENS:two] == prompts.block(1, 1)
    assert prompts.block(0) != prompts.block(1)
    # the same block at a different position is the same tokens (hash id -> content, not position)
    c = prompts.prompt([9, 1], 1024, "c")
    assert c[BLOCK_TOKENS:] == prompts.block(1)


@pytest.mark.parametrize("scale", [1.0, 0.05, 0.3333, 2.5])
def test_lengths_are_exact_and_within_one_block_of_the_hash_ids(corpus: list[int], scale: float) -> None:
    prompts = BlockPrompts(corpus, scale)
    assert prompts.block_tokens == round(BLOCK_TOKENS * scale)
    for key, (hash_ids, length) in enumerate(SAMPLE):
        ids = prompts.prompt(hash_ids, length, str(key))
        assert len(ids) == max(1, round(length * scale))
        # every hash id is used: the prompt ends inside its last block
        assert prompts.boundary(len(hash_ids) - 1) <= len(ids) <= prompts.boundary(len(hash_ids))
    # shared blocks stay shared at every scale
    a, b = prompts.prompt((0, 1, 2, 3), 1900, "a"), prompts.prompt((0, 1, 7, 8, 9), 2300, "b")
    two, three = prompts.boundary(2), prompts.boundary(3)
    assert abs(two - 2 * prompts.block_tokens) <= 1
    assert a[:two] == b[:two]
    assert a[two:three] != b[two:three]


def test_targets_longer_than_the_blocks_get_a_private_tail(corpus: list[int]) -> None:
    prompts = BlockPrompts(corpus, 0.1)
    a = prompts.prompt([4], 700, "line1")  # one 51-token block, 70 tokens asked
    b = prompts.prompt([4], 700, "line2")
    assert len(a) == len(b) == 70
    assert a[:51] == b[:51] == prompts.block(4)
    assert a[51:] != b[51:]
    assert prompts.prompt([], 20, "x") == prompts.prompt([], 20, "x")


def test_shared_trace_lengths_and_output_scaling(corpus: list[int]) -> None:
    from sglang_oasis.replay.trace import load_trace

    requests = load_trace(SHARED_TRACE).requests[:200]
    prompts = BlockPrompts(corpus, 0.05)
    sessions = mooncake_sessions(requests, prompts, speedup=0, max_requests=150)
    assert len(sessions) == 150
    for request, session in zip(requests, sessions, strict=False):
        (turn,) = session.turns
        ids = turn.build([])
        assert len(ids) == round(request.input_length * 0.05)
        n = len(request.hash_ids)
        assert prompts.boundary(n - 1) <= len(ids) <= prompts.boundary(n)
        assert turn.max_new_tokens == max(1, round(request.output_length * 0.05))


PRINT_PROMPTS = """
import json, sys
from transformers import AutoTokenizer
from sglang_oasis.replay.prompts import BlockPrompts, corpus_token_ids
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
prompts = BlockPrompts(corpus_token_ids(tokenizer), float(sys.argv[2]))
sample = json.loads(sys.argv[3])
print(json.dumps([prompts.prompt(h, n, str(i)) for i, (h, n) in enumerate(sample)]))
"""


def test_prompts_are_identical_in_another_process(corpus: list[int]) -> None:
    sample = [[list(h), n] for h, n in SAMPLE]
    env = {
        **os.environ,
        "PYTHONHASHSEED": "12345",  # a differently salted hash() must not matter
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", PRINT_PROMPTS, str(prepare_default_model()), "0.25", json.dumps(sample)],
        capture_output=True, text=True, timeout=300, env=env, check=True,
    )  # fmt: skip
    theirs = json.loads(done.stdout)
    prompts = BlockPrompts(corpus, 0.25)
    assert theirs == [prompts.prompt(h, n, str(i)) for i, (h, n) in enumerate(sample)]


def test_scaled_keeps_at_least_one_token() -> None:
    assert scaled(3, 0.05) == 1
    assert scaled(500, 0.05) == 25
    assert scaled(10, 1.0) == 10


def test_conversation_turns_carry_the_earlier_turns(tokenizer) -> None:
    messages = (
        {"role": "user", "content": "Hello there, how was the weekend?"},
        {"role": "assistant", "content": "Great, I went hiking in the hills."},
        {"role": "user", "content": "Which hills?"},
        {"role": "assistant", "content": "The ones north of town."},
        {"role": "user", "content": "Nice."},
    )
    chat = ChatPrompts(tokenizer)
    (recorded,) = conversation_sessions([Conversation(1, 0.0, messages, None)], chat, speedup=0)
    assert [t.turn for t in recorded.turns] == [0, 1, 2]
    prompts = [t.build([]) for t in recorded.turns]
    for earlier, later in itertools.pairwise(prompts):
        assert later[: len(earlier)] == earlier  # turn n's prompt is a prefix of turn n+1's
    assert recorded.turns[0].max_new_tokens == chat.count(messages[1]["content"])
    assert recorded.turns[2].max_new_tokens == 64  # no recorded reply: the default

    (generated,) = conversation_sessions(
        [Conversation(1, 0.0, messages, 7)], chat, speedup=0, history="generated", length_scale=0.5
    )
    assert all(t.max_new_tokens == 4 for t in generated.turns)
    with_reply = generated.turns[1].build(["Mostly sleeping."])
    assert "Mostly sleeping." in tokenizer.decode(with_reply)
    assert "hiking" not in tokenizer.decode(with_reply)
    assert generated.stop_after_error and not recorded.stop_after_error

    limited = conversation_sessions(
        [Conversation(1, 0.0, messages, None)] * 3, chat, speedup=0, max_requests=4
    )
    assert [len(s.turns) for s in limited] == [3, 1]


def test_mooncake_sessions_are_keyed_by_trace_line(corpus: list[int]) -> None:
    prompts = BlockPrompts(corpus, 0.1)
    requests = [TraceRequest(10, 0.0, 700, 50, (3,)), TraceRequest(11, 2000.0, 700, 50, (3,))]
    first, second = mooncake_sessions(requests, prompts, speedup=2)
    assert (first.start_s, second.start_s) == (0.0, 1.0)
    a, b = first.turns[0].build([]), second.turns[0].build([])
    assert a[: prompts.block_tokens] == b[: prompts.block_tokens] and a != b
    assert first.turns[0].max_new_tokens == 5
