"""``OasisConfig``: every ``--oasis-*`` option, in one frozen dataclass.

The command line is generated from the fields (name ``foo_bar`` -> ``--oasis-foo-bar``, help from the
field's ``help`` metadata, default from the field), so the CLI and the config cannot drift apart.
Validation lives in ``__post_init__`` and names the offending option. The config reaches SGLang's
server subprocesses as JSON in ``SGLANG_OASIS_CONFIG`` (they are spawned, so the environment is the
one channel they share with the launcher).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

ENV_VAR = "SGLANG_OASIS_CONFIG"
MODES = ("dense",)


class OasisConfigError(ValueError):
    """A bad ``--oasis-*`` value; the message names the option."""


def _option(name: str) -> str:
    return "--oasis-" + name.replace("_", "-")


@dataclass(frozen=True)
class OasisConfig:
    mode: str = field(
        default="dense",
        metadata={
            "help": "KV caching mode. 'dense' serves plain SGLang through this entry point (the baseline "
            "for every comparison).",
            "choices": MODES,
        },
    )
    cpu_defaults: bool = field(
        default=True,
        metadata={
            "help": "Without a GPU, serve on SGLang's CPU engine with CPU-friendly settings "
            "(--device cpu, --attention-backend torch_native, --max-total-tokens "
            "<oasis-cpu-max-total-tokens>, --sleep-on-idle, OMP_NUM_THREADS=1). Any of them given "
            "explicitly wins; 'false' applies none except the CPU engine itself.",
        },
    )
    cpu_max_total_tokens: int = field(
        default=32768,
        metadata={"help": "KV cache cap (tokens) used on CPU when --max-total-tokens is not given."},
    )

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise OasisConfigError(f"{_option('mode')}: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.cpu_max_total_tokens <= 0:
            raise OasisConfigError(
                f"{_option('cpu_max_total_tokens')}: must be a positive number of tokens, "
                f"got {self.cpu_max_total_tokens}"
            )

    # --- command line -------------------------------------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("sglang-oasis options")
        for f in dataclasses.fields(cls):
            kwargs: dict[str, Any] = {
                "dest": f"oasis_{f.name}",
                "default": f.default,
                "help": f.metadata["help"],
            }
            if f.type in ("bool", bool):
                kwargs.update(type=_parse_bool, metavar="{true,false}")
            elif f.type in ("int", int):
                kwargs["type"] = int
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            group.add_argument(_option(f.name), **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> OasisConfig:
        return cls(**{f.name: getattr(args, f"oasis_{f.name}") for f in dataclasses.fields(cls)})

    # --- hand-off to server subprocesses ------------------------------------------------------

    def to_env(self) -> None:
        os.environ[ENV_VAR] = json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_env(cls) -> OasisConfig | None:
        raw = os.environ.get(ENV_VAR)
        return cls(**json.loads(raw)) if raw else None


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
