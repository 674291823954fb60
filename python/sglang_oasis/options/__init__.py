"""The ``--oasis-*`` options by concern: one frozen dataclass each, with its own checks and what follows
from its options alone (``tiers``: ``TierOptions``, ``PlatformOptions``; ``selection``:
``SelectionOptions``, ``LookaheadOptions``; ``pipeline``: ``PipelineOptions``, ``PDOptions``).
``OasisConfig`` (``config.py``) is all of them at once, plus the checks across concerns; a component that
reads one concern can say so by taking that class.

Each option's help is its field's ``help`` metadata, its default the field's (``config.py`` turns them
into the command line: ``foo_bar`` -> ``--oasis-foo-bar``). Here: the choices, the error, the checks.
"""

from __future__ import annotations

from typing import Any

MODES = ("sparse", "dense")
LOOKAHEADS = ("previous", "eagle3", "ngram")
DRAFT_POLICIES = ("reject", "verify")
VERIFY_ROWS = 2  # --speculative-num-draft-tokens of the lookahead: the real token and one draft
PREFETCH_MODES = ("async", "sync")
DECODE_STEPS = ("eager", "captured")
SELECTORS = ("summaries", "codes", "oracle", "oracle-pooled")
PREFILL_ATTENTIONS = ("auto", "torch", "triton")
DEFAULT_DEVICE_KV_TOKENS = 65536  # --oasis-device-kv-tokens on CPU when unset


class OasisConfigError(ValueError):
    """A bad ``--oasis-*`` value; the message names the option."""


def option(name: str) -> str:
    """The command-line spelling of field ``name``."""
    return "--oasis-" + name.replace("_", "-")


def check_choice(options: Any, name: str, choices: tuple[str, ...]) -> None:
    if getattr(options, name) not in choices:
        raise OasisConfigError(
            f"{option(name)}: {getattr(options, name)!r} is not one of {', '.join(choices)}"
        )


def check_positive(options: Any, *names: str) -> None:
    for name in names:
        if getattr(options, name) is not None and getattr(options, name) <= 0:
            raise OasisConfigError(f"{option(name)}: must be positive, got {getattr(options, name)}")


def check_non_negative(options: Any, *names: str) -> None:
    for name in names:
        if getattr(options, name) < 0:
            raise OasisConfigError(f"{option(name)}: must be >= 0, got {getattr(options, name)}")
