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
MODES = ("sparse", "dense")
LOOKAHEADS = ("previous", "eagle3", "ngram")
DRAFT_POLICIES = ("reject", "verify")


class OasisConfigError(ValueError):
    """A bad ``--oasis-*`` value; the message names the option."""


def _option(name: str) -> str:
    return "--oasis-" + name.replace("_", "-")


@dataclass(frozen=True)
class OasisConfig:
    mode: str = field(
        default="sparse",
        metadata={
            "help": "KV caching mode. 'sparse': full KV in the host tier, decode attends over per-KV-head "
            "working sets (the oasis attention backend). 'dense' serves plain SGLang through this entry "
            "point (the baseline for every comparison).",
            "choices": MODES,
        },
    )
    block_size: int = field(
        default=16,
        metadata={"help": "Tokens per KV block (sparse mode; becomes SGLang's --page-size)."},
    )
    top_k: int = field(
        default=128,
        metadata={
            "help": "Blocks selected per request, layer and KV head for decode attention (sparse mode)."
        },
    )
    sink_blocks: int = field(
        default=0,
        metadata={
            "help": "Leading blocks always kept in every working set, besides the top-K (sparse mode)."
        },
    )
    dense_layers: tuple[int, ...] = field(
        default=(),
        metadata={"help": "Comma-separated layer ids that decode densely (sparse mode); empty: none."},
    )
    host_kv_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Capacity of the host KV tier in tokens (sparse mode: SGLang's KV pool, i.e. "
            "--max-total-tokens, lives in host memory). Default: SGLang's own sizing, or "
            "--oasis-cpu-max-total-tokens on CPU.",
        },
    )
    device_kv_tokens: int = field(
        default=65536,
        metadata={
            "help": "Device budget for working sets, in tokens (sparse mode). Sets --max-running-requests "
            "to budget // ((top-k + sink blocks) * block size) unless that is given.",
        },
    )
    lookahead: str = field(
        default="previous",
        metadata={
            "help": "Query that selects each step's blocks for the next step (sparse mode). 'previous': "
            "the step's own query. 'eagle3': the query of an EAGLE-3 draft token, attended in the same "
            "call as the real token (SGLang's EAGLE3 worker with one draft step; the draft model is "
            "--speculative-draft-model-path, or the head shipped for the default model). 'ngram': the "
            "same with SGLang's NGRAM drafter (no draft model).",
            "choices": LOOKAHEADS,
        },
    )
    draft_policy: str = field(
        default="reject",
        metadata={
            "help": "What happens to the draft token of --oasis-lookahead eagle3/ngram. 'reject': it only "
            "predicts blocks and is never accepted (one token per step, as in the OasisKV paper). "
            "'verify': normal speculative acceptance, so accepted drafts are extra tokens per step.",
            "choices": DRAFT_POLICIES,
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
        for name, choices in (("mode", MODES), ("lookahead", LOOKAHEADS), ("draft_policy", DRAFT_POLICIES)):
            if getattr(self, name) not in choices:
                raise OasisConfigError(
                    f"{_option(name)}: {getattr(self, name)!r} is not one of {', '.join(choices)}"
                )
        for name in ("block_size", "top_k", "device_kv_tokens", "cpu_max_total_tokens"):
            if getattr(self, name) <= 0:
                raise OasisConfigError(f"{_option(name)}: must be positive, got {getattr(self, name)}")
        if self.sink_blocks < 0:
            raise OasisConfigError(f"{_option('sink_blocks')}: must be >= 0, got {self.sink_blocks}")
        if self.host_kv_tokens is not None and self.host_kv_tokens < self.block_size:
            raise OasisConfigError(
                f"{_option('host_kv_tokens')}: must hold at least one block ({self.block_size}), "
                f"got {self.host_kv_tokens}"
            )
        if any(layer < 0 for layer in self.dense_layers):
            raise OasisConfigError(
                f"{_option('dense_layers')}: layer ids must be >= 0, got {self.dense_layers}"
            )
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))

    @property
    def working_set_tokens(self) -> int:
        """Tokens one request's working set holds per layer and KV head (the active tail aside)."""
        return (self.top_k + self.sink_blocks) * self.block_size

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
            elif f.type in ("int", int, "int | None"):
                kwargs["type"] = int
            elif f.type in ("tuple[int, ...]",):
                kwargs.update(type=_parse_int_list, metavar="L1,L2,...")
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
        if not raw:
            return None
        values = json.loads(raw)
        values["dense_layers"] = tuple(values.get("dense_layers", ()))
        return cls(**values)


def _parse_int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
