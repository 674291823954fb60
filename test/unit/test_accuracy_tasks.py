"""benchmark/accuracy_tasks.py's generators and scorers, and the pure pieces of benchmark/bench_accuracy.py,
with a whitespace word count standing in for the tokenizer: determinism, token budgets, the needles
really in the haystacks, the answers right by construction, exact scores. No server, no model."""

from __future__ import annotations

import collections
import itertools
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from accuracy_tasks import (
    TASKS,
    CommonWords,
    ConversationQA,
    FrequentWords,
    Message,
    NeedleTask,
    Sample,
    VariableTracking,
    fit,
    mentions,
    set_score,
    spread_depth,
    weave,
)
from bench_accuracy import (
    BLOCK,
    PrefixCache,
    add_figures,
    cell_entry,
    common_prefix,
    config_summary,
    decode_figures,
    device_kv_tokens,
    estimate,
    lead_first,
    makespan,
    option_pairs,
    per_context,
    request_options,
    resumed,
    server_argv,
    server_configs,
    server_plans,
    table_rows,
)


def words(messages: Sequence[Message]) -> int:
    """The tokenizer's stand-in: whitespace words, plus 4 per message and 3 for the template."""
    return sum(len(m["content"].split()) + 4 for m in messages) + 3


def content(sample: Sample) -> str:
    return "\n".join(m["content"] for m in sample.prompt_messages)


# Small stand-in sources: the tasks' logic without reading the installed corpora.
SENTENCES = tuple(f"Sentence {i} says little of note here. " for i in range(400))
EXCHANGES = tuple((f"user line {i} about nothing much", f"assistant reply {i} also idle") for i in range(300))
VOCABULARY = tuple(f"word{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}{chr(97 + i // 676)}" for i in range(600))
SMALL_TASKS = {
    "single": NeedleTask("single", "number", haystack=lambda: SENTENCES),
    "uuid": NeedleTask("uuid", "uuid", haystack=lambda: SENTENCES),
    "multikey": NeedleTask("multikey", "number", keys=4, haystack=lambda: SENTENCES),
    "multivalue": NeedleTask("multivalue", "word", values_per_key=4, haystack=lambda: SENTENCES),
    "multiquery": NeedleTask("multiquery", "number", keys=4, queries=4, haystack=lambda: SENTENCES),
    "vt": VariableTracking(),
    "cwe": CommonWords(vocabulary=lambda: VOCABULARY),
    "fwe": FrequentWords(),
    "conversation": ConversationQA(exchanges=lambda: EXCHANGES),
}


# ---------------------------------------------------------------------------------------- the registry


@pytest.mark.parametrize("context", [300, 1500])
@pytest.mark.parametrize("name", list(TASKS))
def test_registered_tasks_are_deterministic_and_fill_their_budget(name: str, context: int) -> None:
    task = TASKS[name]
    sample = task.generate(3, context, words)
    assert sample == task.generate(3, context, words)
    assert task.generate(4, context, words).prompt_messages != sample.prompt_messages
    assert sample.prompt_tokens == words(sample.prompt_messages) <= context
    assert sample.prompt_tokens >= 0.9 * context  # whole haystack units short of the budget at most
    assert (sample.task, sample.seed, sample.context_tokens) == (name, 3, context)
    assert set(sample.expected) <= set(sample.candidates) and sample.expected
    assert sample.max_tokens >= 30
    assert sample.prompt_messages[-1]["role"] == "user"
    assert task.score(sample, " ".join(sample.expected)) == 1.0
    assert task.score(sample, "I do not know.") == 0.0


def test_the_registry_has_rulers_tasks() -> None:
    assert list(TASKS) == [
        "niah_single_number", "niah_single_word", "niah_single_uuid", "niah_multikey", "niah_multivalue",
        "niah_multiquery", "variable_tracking", "common_words", "frequent_words", "conversation_qa",
    ]  # fmt: skip


def test_needle_tasks_share_header_and_haystack_up_to_their_first_needle() -> None:
    """What the radix cache reuses: every needle task's prompt at a context is the same text up to the
    first needle, whatever the task and seed."""
    prompts = [TASKS[n].generate(s, 800, words) for n in TASKS if n.startswith("niah") for s in (0, 1)]
    texts = [content(p) for p in prompts]
    firsts = [t.index("One of the special magic") for t in texts]
    shortest = min(firsts)
    assert shortest > 0
    assert len({t[:shortest] for t in texts}) == 1


def test_a_seed_asks_the_same_question_at_every_context() -> None:
    task = TASKS["niah_multikey"]
    short, long = task.generate(5, 500, words), task.generate(5, 1500, words)
    assert short.expected == long.expected and short.candidates == long.candidates
    assert content(short).splitlines()[-1] == content(long).splitlines()[-1]


# ------------------------------------------------------------------------------------------ the needles


@pytest.mark.parametrize("name", ["single", "uuid", "multikey", "multivalue", "multiquery"])
def test_needles_are_in_the_haystack_at_their_depths(name: str) -> None:
    task = SMALL_TASKS[name]
    sample = task.generate(7, 1200, words)
    text = content(sample)
    assert len(sample.depths) == len(sample.candidates)
    body = text[text.index("\n\n") + 2 : text.rindex("\n\n")]
    sentences = len(re.findall(r"Sentence \d+ ", body))
    assert re.findall(r"Sentence (\d+) ", body) == [
        str(i) for i in range(sentences)
    ]  # the haystack, in order
    for value, depth in zip(sample.candidates, sample.depths, strict=True):
        needle = re.search(
            rf"One of the special magic \w+s for [a-z]+-[a-z]+ is: {re.escape(value)}\. ", body
        )
        assert needle is not None and body.count(value) == 1
        before = len(re.findall(r"Sentence \d+ ", body[: needle.start()]))
        assert before == round(depth * sentences)
    question = text[text.rindex("\n\n") + 2 :]
    keys = re.findall(r"[a-z]+-[a-z]+", question)
    asked = {m.group(2) for m in re.finditer(r"for ([a-z]+-[a-z]+) is: (\S+)\.", body) if m.group(1) in keys}
    assert asked == set(sample.expected)
    assert len(keys) == task.queries


def test_needle_values_have_their_kind() -> None:
    number = SMALL_TASKS["single"].generate(0, 600, words).expected[0]
    uuid = SMALL_TASKS["uuid"].generate(0, 600, words).expected[0]
    word = TASKS["niah_single_word"].generate(0, 600, words).expected[0]
    assert re.fullmatch(r"[1-9]\d{6}", number)
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", uuid)
    assert word.isalpha() and word.islower()


def test_multikey_distractors_are_candidates_not_expected() -> None:
    sample = SMALL_TASKS["multikey"].generate(2, 800, words)
    assert len(sample.expected) == 1 and len(sample.candidates) == 4
    wrong = next(c for c in sample.candidates if c not in sample.expected)
    assert SMALL_TASKS["multikey"].score(sample, f"It is {wrong}.") == 0.0
    assert SMALL_TASKS["multikey"].score(sample, " ".join(sample.candidates)) == 0.25


def test_first_depths_spread_over_seeds() -> None:
    depths = sorted(spread_depth(seed) for seed in range(10))
    assert depths[0] >= 0.05 and depths[-1] <= 0.95
    assert max(b - a for a, b in itertools.pairwise(depths)) < 0.15
    task = TASKS["niah_single_number"]
    assert (
        task.first_depth(0, 1000) != task.first_depth(0, 2000) != TASKS["niah_multikey"].first_depth(0, 2000)
    )


# ------------------------------------------------------------------------------- the other generators


def test_variable_tracking_expected_set_follows_the_assignments() -> None:
    task = SMALL_TASKS["vt"]
    sample = task.generate(11, 1000, words)
    text = content(sample)
    statements = re.findall(r"VAR ([A-Z]{5}) = ([A-Z]{5}|\d+)\.", text)
    assert len(statements) == 10 and {v for v, _ in statements} == set(sample.candidates)
    value = re.search(r"assigned the value (\d+)", text).group(1)
    # resolve every variable through the statements in text order
    resolved: dict[str, str] = {}
    for var, source in statements:
        resolved[var] = resolved.get(source, source)
    assert {v for v, r in resolved.items() if r == value} == set(sample.expected)
    assert len(sample.expected) == 5
    assert task.score(sample, ", ".join(sample.expected[:4])) == 0.8
    assert task.score(sample, ", ".join(sample.candidates)) == 0.5


def test_common_words_are_strictly_the_most_frequent() -> None:
    task = SMALL_TASKS["cwe"]
    sample = task.generate(2, 1500, words)
    text = content(sample)
    numbered = re.findall(r"(\d+)\. (\S+)", text)
    assert [int(i) for i, _ in numbered] == list(range(1, len(numbered) + 1))
    counts = collections.Counter(w for _, w in numbered)
    assert set(counts) == set(sample.candidates)
    least_common = min(counts[w] for w in sample.expected)
    assert least_common > max(c for w, c in counts.items() if w not in sample.expected)
    assert sum(counts[w] for w in sample.expected) == pytest.approx(0.3 * len(numbered), abs=task.common)
    assert task.score(sample, " ".join(sample.expected[:3])) == 0.6


def test_frequent_words_top_ranks_are_strict() -> None:
    task = SMALL_TASKS["fwe"]
    sample = task.generate(1, 1500, words)
    coded = content(sample).split("\n\n")[1].split()
    ranked = collections.Counter(coded).most_common()
    assert tuple(w for w, _ in ranked[:3]) == sample.expected
    assert ranked[2][1] > ranked[3][1]
    assert set(coded) == set(sample.candidates)
    assert all(re.fullmatch(r"([bdfghklmnprstvz][aeiou]){3}", w) for w in coded)


@pytest.mark.parametrize("n", [0, 10, 70, 71, 100, 499, 500, 3000])
def test_zipf_counts_have_the_asked_length_and_a_strict_top(n: int) -> None:
    counts = FrequentWords.counts(n)
    assert sum(counts) == max(n, FrequentWords.total(48))
    assert counts[0] > counts[1] > counts[2] > counts[3] >= max(counts[3:])
    assert all(c > 0 for c in counts)


def test_conversation_alternates_and_holds_the_facts() -> None:
    task = SMALL_TASKS["conversation"]
    sample = task.generate(4, 1500, words)
    roles = [m["role"] for m in sample.prompt_messages]
    assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
    facts = [m for m in sample.prompt_messages if m["content"].startswith("By the way, my ")]
    assert len(facts) == 3
    stated = [re.search(r"my (.+) is (\S+)\. Please", m["content"]).groups() for m in facts]
    assert {v for _, v in stated} == set(sample.candidates)
    thing = re.search(r"told you my (.+)\. What", sample.prompt_messages[-1]["content"]).group(1)
    assert sample.expected == tuple(v for t, v in stated if t == thing)
    assert sample.prompt_messages[0]["content"] == EXCHANGES[0][0] or facts[0] is sample.prompt_messages[0]


def test_real_sources_build_and_stay_within_the_budget() -> None:
    sample = TASKS["conversation_qa"].generate(0, 2000, words)
    assert 1800 <= sample.prompt_tokens <= 2000 and len(sample.prompt_messages) > 20
    listing = content(TASKS["common_words"].generate(0, 1000, words))
    assert not {"common", "words", "above"} & set(re.findall(r"\d+\. (\S+)", listing))


# --------------------------------------------------------------------------------------------- scoring


@pytest.mark.parametrize(
    ("expected", "candidates", "answer", "score"),
    [
        pytest.param(["4839201"], ["4839201"], "The special magic number is 4839201.", 1.0, id="number"),
        pytest.param(["4839201"], ["4839201"], "48392017", 0.0, id="number-inside-a-longer-one"),
        pytest.param(["4839201"], ["4839201"], "4,839,201", 0.0, id="separators-do-not-match"),
        pytest.param(["lantern"], ["lantern"], "LANTERN", 1.0, id="case-insensitive"),
        pytest.param(["lantern"], ["lantern"], "lanterns", 0.0, id="whole-word"),
        pytest.param(["a1-b2"], ["a1-b2"], "code: a1-b2!", 1.0, id="hyphenated"),
        pytest.param(["11", "22"], ["11", "22", "33"], "11", 0.5, id="half-the-values"),
        pytest.param(["11"], ["11", "22", "33", "44"], "11 22 33 44", 0.25, id="every-candidate"),
        pytest.param(["11", "22"], ["11", "22", "33"], "22 and 11, surely", 1.0, id="order-and-chatter-free"),
        pytest.param(["11", "22"], ["11", "22", "33"], "11 33", 0.5, id="one-right-one-wrong"),
        pytest.param(["11"], ["11"], "", 0.0, id="empty"),
    ],
)
def test_set_score(expected: list[str], candidates: list[str], answer: str, score: float) -> None:
    assert set_score(expected, candidates, answer) == score


def test_mentions_escapes_the_value() -> None:
    assert mentions("x.y", "x.y") and not mentions("xzy", "x.y")


@pytest.mark.parametrize("name", list(SMALL_TASKS))
def test_every_scorer_is_one_for_the_expected_answer_only(name: str) -> None:
    task = SMALL_TASKS[name]
    sample = task.generate(9, 900, words)
    assert task.score(sample, "Sure! The answer is: " + ", ".join(sample.expected) + ".") == 1.0
    wrong = [c for c in sample.candidates if c not in sample.expected]
    if len(sample.expected) > 1:
        assert task.score(sample, " ".join(sample.expected[1:])) < 1.0
    if wrong:
        assert task.score(sample, " ".join([*sample.expected, wrong[0]])) < 1.0
        assert task.score(sample, wrong[0]) == 0.0


# -------------------------------------------------------------------------------------------- fitting


def test_fit_finds_the_largest_fitting_count() -> None:
    calls = []

    def build(n: int) -> list[Message]:
        return [{"role": "user", "content": "head " + "a b c " * n}]

    def count(messages: Sequence[Message]) -> int:
        calls.append(1)
        return words(messages)

    n, messages, tokens = fit(build, count, budget=1000, available=10_000)
    assert (n, tokens) == ((1000 - 8) // 3, 8 + 3 * n) and messages == build(n)
    assert len(calls) <= 12
    with pytest.raises(ValueError, match="over the budget"):
        fit(build, count, budget=5, available=100)
    with pytest.raises(ValueError, match="make only"):
        fit(build, count, budget=1000, available=100)


def test_weave_places_inserts_before_their_unit() -> None:
    units = ["a. ", "b. ", "c. ", "d. "]
    assert weave(units, [(0.5, "X"), (0.0, "Y"), (1.0, "Z"), (0.49, "W")]) == "Y a. b. W X c. d. Z "
    assert weave([], [(0.3, "X")]) == "X "


def test_samples_record_what_the_json_keeps() -> None:
    sample = SMALL_TASKS["multikey"].generate(1, 500, words)
    record = sample.record()
    assert record["seed"] == 1 and record["expected"] == list(sample.expected)
    assert record["prompt_tokens"] == sample.prompt_tokens and len(record["depths"]) == 4


# ------------------------------------------------------------------------------- bench_accuracy pieces

SUMMARIES = ("--oasis-mode", "sparse", "--oasis-selector", "summaries")  # every sparse config's first words


def test_server_configs_dense_then_each_k_then_extras() -> None:
    configs = server_configs([16, 64], ["recall95=--oasis-recall-target 0.95", "wide=--oasis-top-k 256"])
    assert [(c.name, c.top_k) for c in configs] == [
        ("dense", None), ("k16", 16), ("k64", 64), ("recall95", 16), ("wide", 256),
    ]  # fmt: skip
    # the summaries' selector first (the rows results.md reports), the config's own words after: they win
    assert configs[3].args == (*SUMMARIES, "--oasis-recall-target", "0.95")
    coded = server_configs([], ["c16=--oasis-top-k 16 --oasis-selector codes"])[1]
    assert option_pairs(coded)["--oasis-selector"] == "codes"
    assert server_configs([], ["d2=--oasis-mode dense"])[1].top_k is None
    assert server_configs([], ["k8='--oasis-top-k=8'"])[1].top_k == 8
    with pytest.raises(ValueError, match="NAME=ARGS"):
        server_configs([], ["no-equals-sign"])
    with pytest.raises(ValueError, match="repeat"):
        server_configs([32], ["k32=--oasis-top-k 32"])


def test_server_argv_sizes_the_pools() -> None:
    dense, k32 = server_configs([32])
    base = ["--model-path", "m"]
    assert server_argv(dense, base, 32768, 5) == [
        *base,
        "--max-total-tokens",
        "32768",
        "--oasis-mode",
        "dense",
    ]
    sparse = server_argv(k32, base, 32768, 5)
    assert sparse[2:6] == ["--oasis-host-kv-tokens", "32768", "--oasis-device-kv-tokens", "6144"]
    assert sparse[6:8] == ["--oasis-warm-start", "false"]  # admission figures that do not depend on timing
    warm = server_configs([32], ["warm=--oasis-top-k 32 --oasis-warm-start true"])[-1]
    assert server_argv(warm, base, 32768, 5).count("--oasis-warm-start") == 1
    # summaries of 32768 tokens (2048) + 5 working sets of 34 blocks of 16 and the captured step's padding
    # slot (3264), 10% more (5843), in 1024s; key codes add at most a 16th of a token per token (2048)
    assert device_kv_tokens(32768, 32, 5) == 6144 >= 1.1 * (2048 + 6 * 34 * BLOCK)
    assert device_kv_tokens(32768, 32, 5, codes=True) == 8192 >= 1.1 * (2048 + 6 * 34 * BLOCK + 2048)
    codes = server_configs([16], ["c=--oasis-top-k 16 --oasis-selector codes"])[-1]
    assert server_argv(codes, base, 32768, 5)[5] == str(device_kv_tokens(32768, 16, 5, codes=True))


def test_per_context_counts() -> None:
    assert per_context([3], [1000, 2000]) == {1000: 3, 2000: 3}
    assert per_context([2, 1], [1000, 2000]) == {1000: 2, 2000: 1}
    with pytest.raises(ValueError):
        per_context([1, 2, 3], [1000, 2000])


def test_common_prefix_and_the_lead() -> None:
    assert common_prefix([1, 2, 3, 4], [1, 2, 9]) == 2
    assert common_prefix([], [1]) == 0 and common_prefix([5, 6], [5, 6]) == 2
    haystack = list(range(100))
    # needles after 10, 80 and 40 tokens: the 80 one shares the most with the others
    prompts = [
        [*haystack[:10], -1, *haystack[10:]],
        [*haystack[:80], -2, *haystack[80:]],
        [*haystack[:40], -3],
    ]
    assert lead_first(prompts) == [1, 0, 2]
    assert lead_first([]) == []


def test_prefix_cache_matches_whole_blocks_of_the_nearest_prompt() -> None:
    cache = PrefixCache()
    assert cache.cached(list(range(50))) == 0
    cache.add(list(range(100)))
    cache.add([*range(20), -1])
    assert cache.cached([*range(40), -5]) == 32  # 40 shared, whole blocks of 16
    assert cache.cached(list(range(100))) == 96  # the last token is always computed
    assert cache.cached([7, 8]) == 0


def sample_with(ids: list[int], max_tokens: int = 10) -> tuple[Sample, list[int]]:
    sample = Sample("t", 0, len(ids), [{"role": "user", "content": ""}], ("1",), ("1",), max_tokens, len(ids))
    return sample, ids


def test_estimate_reuses_prefixes_from_each_groups_lead() -> None:
    shared = list(range(1000, 1400))
    groups = [
        [sample_with([1, 2, 3])],  # shares nothing
        [sample_with([*shared[:200], -3]), sample_with([*shared[:300], -2])],  # the second one leads
        [sample_with([*shared[:100], -1])],
    ]
    plan = estimate(groups, configs_per_server=[1, 1], concurrency=4, layers=30)
    assert plan["requests_per_server"] == 4
    assert plan["prompt_tokens_per_server"] == 3 + 201 + 301 + 101
    # group 0 all 3; group 1's lead 301, its other sample 201 - 192; group 2 101 - 96
    assert plan["prefilled_tokens_per_server"] == 3 + 301 + 9 + 5
    assert plan["minutes"] == pytest.approx(2 * plan["seconds_per_server"] / 60, abs=0.1)
    # A shared server of three configs prefills once: far less than three servers, more than one.
    shared = estimate(groups, configs_per_server=[1, 3], concurrency=4, layers=30)["seconds_by_server"]
    assert shared[0] == plan["seconds_per_server"] < shared[1] < 3 * shared[0]
    # Two servers at once: the run takes the longer one's time.
    both = estimate(groups, configs_per_server=[1, 3], concurrency=4, layers=30, at_once=2)
    assert both["minutes"] == pytest.approx(max(both["seconds_by_server"]) / 60, abs=0.1)


def test_makespan_starts_each_job_when_one_before_it_ends() -> None:
    assert makespan([10, 20, 5], 1) == 35
    assert makespan([10, 20, 5], 2) == 20  # 5 follows 10 on the first: 15
    assert makespan([10, 20, 30], 2) == 40  # 30 follows 10
    assert makespan([10, 20], 4) == 20


def test_sparse_configs_share_a_server_when_a_requests_options_can_set_them() -> None:
    configs = server_configs([16, 64], ["target=--oasis-top-k 16 --oasis-recall-target 0.9 --oasis-recall-max-top-k 64",
                                        "small=--oasis-top-k 16 --oasis-recall-target 0.9 --oasis-recall-max-top-k 32",
                                        "nowin=--oasis-top-k 16 --oasis-prefill-window 0"])  # fmt: skip
    by_name = {c.name: c for c in configs}
    assert request_options(by_name["dense"]) is None and request_options(by_name["nowin"]) is None
    assert request_options(by_name["k64"]) == {"oasis_top_k": 64, "oasis_recall_target": 0.0}
    assert request_options(by_name["target"]) == {"oasis_top_k": 16, "oasis_recall_target": 0.9}
    plans = server_plans(configs)
    assert [[c.name for c in p.configs] for p in plans] == [
        ["dense"],
        ["k16", "k64", "target"],
        ["small"],
        ["nowin"],
    ]
    shared = plans[1].server
    assert shared.top_k == 16 and shared.reserve == 64  # the largest K any request may take
    assert shared.args == (*SUMMARIES, "--oasis-top-k", "16", "--oasis-recall-max-top-k", "64")
    assert plans[1].options == tuple(request_options(c) for c in plans[1].configs)
    assert [len(p.configs) for p in server_plans(configs, separate=True)] == [1] * 6
    assert [len(p.configs) for p in server_plans(server_configs([16]))] == [1, 1]  # one sparse: its own


def test_the_oracle_arm_shares_a_server_of_its_own() -> None:
    """``--oracle-top-ks``: the oracle's configs share one server (``--oasis-selector oracle``, evaluation
    only), each request carrying its K, beside the runtime's shared server; a lone oracle config has its own."""
    configs = server_configs([16, 32], [], [16, 64])
    assert [c.name for c in configs] == ["dense", "k16", "k32", "oracle16", "oracle64"]
    assert request_options(configs[4]) == {"oasis_top_k": 64, "oasis_recall_target": 0.0}
    plans = server_plans(configs)
    assert [[c.name for c in p.configs] for p in plans] == [
        ["dense"],
        ["k16", "k32"],
        ["oracle16", "oracle64"],
    ]
    assert plans[2].server.args == (
        "--oasis-mode", "sparse", "--oasis-selector", "oracle", "--oasis-evaluation-only", "true",
        "--oasis-top-k", "16", "--oasis-recall-max-top-k", "64",
    )  # fmt: skip
    assert plans[1].server.args == (*SUMMARIES, "--oasis-top-k", "16", "--oasis-recall-max-top-k", "32")
    lone = server_plans(server_configs([16, 32], [], [32]))
    assert [p.server.name for p in lone] == ["dense", "shared-k16-k32", "oracle32"]
    assert "oracle" in lone[2].server.args


def test_a_configs_decode_figures_sum_its_requests_own() -> None:
    sums: dict[str, float] = {}
    add_figures(sums, {"decode_steps": 10, "decode_blocks_loaded": 30, "decode_bytes_host_to_device": 3000,
                       "admission_blocks_loaded": 5, "admission_bytes_host_to_device": 500,
                       "recall_samples": 4, "recall_mean": 0.5})  # fmt: skip
    add_figures(sums, {"decode_steps": 5, "decode_blocks_loaded": 0, "decode_bytes_host_to_device": 0,
                       "admission_blocks_loaded": 10, "admission_bytes_host_to_device": 1000,
                       "recall_samples": 0, "recall_mean": None})  # never sampled  # fmt: skip
    add_figures(sums, None)  # a dense server's reply carries none
    figures = decode_figures(sums)
    assert figures["request_figures"] == {"decode_steps": 15, "decode_blocks_loaded": 30,
                                          "decode_bytes_host_to_device": 3000, "admission_blocks_loaded": 15,
                                          "admission_bytes_host_to_device": 1500, "recall_samples": 4}  # fmt: skip
    assert figures["decode_bytes_per_step"] == 200 and figures["decode_blocks_per_step"] == 2
    assert figures["bytes_per_step"] == 300  # (3000 + 1500) / 15
    assert figures["recall_mean"] == 0.5  # weighted by samples: the unsampled request adds none
    assert decode_figures({})["decode_bytes_per_step"] is None


def test_cells_summaries_and_table() -> None:
    tasks = {
        "a": {
            "1000": {"dense": cell_entry([1.0, 0.5], ["x", "y"]), "k16": cell_entry([0.5, None], ["x", "E"])}
        },
        "b": {"1000": {"dense": cell_entry([0.0], ["z"]), "k16": cell_entry([0.5], ["z"])}},
    }
    assert tasks["a"]["1000"]["k16"] == {
        "score": 0.5,
        "scores": [0.5, None],
        "errors": 1,
        "answers": ["x", "E"],
    }
    dense, k16 = config_summary(tasks, "dense"), config_summary(tasks, "k16")
    assert dense == {"mean_score": 0.375, "by_context": {"1000": 0.375}, "by_task": {"a": 0.75, "b": 0.0}}
    assert k16["mean_score"] == 0.5 and k16["vs_dense"] == pytest.approx(((0.5 - 0.75) + 0.5) / 2)
    rows = table_rows(tasks, ["dense", "k16"], ["1000"])
    assert rows == [
        ["a", "1000", "0.75", "0.50"], ["b", "1000", "0.00", "0.50"],
        ["mean", "1000", "0.38", "0.50"], ["mean", "all", "0.38", "0.50"],
    ]  # fmt: skip


def test_resume_keeps_the_configs_an_earlier_run_of_the_same_plan_finished(tmp_path: Path) -> None:
    settings = {"tasks": ["a"], "contexts": [1000], "samples_per_context": {"1000": 1}, "num_layers": 30,
                "dtype": "float32", "model": "m"}  # fmt: skip
    cell = {"score": 1.0, "scores": [1.0], "errors": 0, "answers": ["x"]}
    earlier = {
        "settings": settings,
        "configs": {"dense": {"mean_score": 1.0}, "k16": {"error": "did not start"}},
        "tasks": {"a": {"1000": {"dense": cell}}},
    }
    path = tmp_path / "accuracy.json"
    path.write_text(json.dumps(earlier))
    results: dict = {"settings": dict(settings), "configs": {}, "tasks": {"a": {"1000": {}}}}
    assert resumed(path, results) == {"dense"}  # k16 failed: run again
    assert results["configs"] == {"dense": {"mean_score": 1.0}} and results["tasks"]["a"]["1000"] == {
        "dense": cell
    }
    assert resumed(tmp_path / "absent.json", results) == set()
    results["settings"]["contexts"] = [2000]
    with pytest.raises(SystemExit, match="different plan"):
        resumed(path, results)
