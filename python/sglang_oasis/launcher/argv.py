"""The launcher's reading of a command line: SGLang's options as given (``given``, ``option_value``), the
model ranks they start, and how a launcher refusal (``LaunchError``) and a launcher note (``say``) look."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence

TENSOR_PARALLEL_OPTIONS = ("--tp-size", "--tensor-parallel-size", "--tp")


class LaunchError(ValueError):
    """Options that contradict each other; the message names them."""


def say(message: str) -> None:
    print(f"[sglang-oasis] {message}", file=sys.stderr, flush=True)


def given(argv: Sequence[str], option: str) -> bool:
    """Whether ``option`` appears on the command line (as ``--opt value`` or ``--opt=value``)."""
    return any(arg == option or arg.startswith(option + "=") for arg in argv)


def option_value(argv: Sequence[str], option: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
        if arg == option and i + 1 < len(argv):
            return argv[i + 1]
    return None


def option_values(argv: Sequence[str], option: str) -> list[str]:
    """The values of a list option (``--option a b c``, or ``--option=a``): the words after it up to the
    next option."""
    for i, arg in enumerate(argv):
        if arg.startswith(option + "="):
            return [arg.split("=", 1)[1]]
        if arg == option:
            return list(itertools.takewhile(lambda word: not word.startswith("--"), argv[i + 1 :]))
    return []


def first_option_value(argv: Sequence[str], options: Sequence[str]) -> str | None:
    """The value of the first of ``options`` (one option's spellings) that ``argv`` gives."""
    return next((v for v in (option_value(argv, o) for o in options) if v is not None), None)


def model_ranks(sglang_argv: Sequence[str]) -> int:
    """Model processes SGLang starts on this machine: tensor- times data-parallel ranks."""
    ranks = 1
    for options in (TENSOR_PARALLEL_OPTIONS, ("--dp-size", "--data-parallel-size", "--dp")):
        value = first_option_value(sglang_argv, options)
        if value is not None and value.isdigit():
            ranks *= max(1, int(value))
    return ranks
