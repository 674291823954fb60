"""``OasisConfig``: every ``--oasis-*`` option, one frozen dataclass made of one per concern.

The concerns (``options/``: the tiers, the selection and its lookahead, the pipeline and PD, the platform)
each hold their options, their checks and what follows from them alone; ``OasisConfig`` is all of them,
plus the checks and figures that join two concerns. The command line is generated from the fields (name
``foo_bar`` -> ``--oasis-foo-bar``, help from the field's ``help`` metadata, default from the field), so
the CLI and the config cannot drift apart; a bad value raises ``OasisConfigError`` naming the option. The
config reaches SGLang's server subprocesses as JSON in ``SGLANG_OASIS_CONFIG`` (they are spawned, so the
environment is the one channel they share with the launcher).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any

from sglang_oasis.options import DECODE_STEPS, OasisConfigError, option
from sglang_oasis.options.pipeline import PDOptions, PipelineOptions
from sglang_oasis.options.selection import LookaheadOptions, SelectionOptions
from sglang_oasis.options.tiers import PlatformOptions, TierOptions

__all__ = ["DECODE_STEPS", "ENV_VAR", "OasisConfig", "OasisConfigError"]
ENV_VAR = "SGLANG_OASIS_CONFIG"


# The bases' fields come in reverse order: the tiers' first, the platform's last (the --help order).
@dataclass(frozen=True)
class OasisConfig(
    PlatformOptions, PDOptions, PipelineOptions, LookaheadOptions, SelectionOptions, TierOptions
):
    def __post_init__(self) -> None:
        self.check_tiers()
        self.check_selection()
        self.check_lookahead()
        self.check_pipeline()
        self.check_pd()
        self.check_platform()
        if self.oracle:
            self._check_oracle()
        if self.mode == "sparse" and self.device_tokens < self.working_set_tokens:
            raise OasisConfigError(
                f"{option('device_kv_tokens')}: {self.device_tokens} tokens do not hold one request's "
                f"working set ((--oasis-top-k {self.max_top_k} + --oasis-sink-blocks {self.sink_blocks}) x "
                f"--oasis-block-size {self.block_size} = {self.working_set_tokens} tokens per layer and KV "
                "head): raise it or lower --oasis-top-k"
            )

    def _check_oracle(self) -> None:
        """``--oasis-selector oracle[-pooled]``: evaluation only, on the eager step's plain decode passes."""
        name = f"{option('selector')} {self.selector}"
        if not self.evaluation_only:
            raise OasisConfigError(
                f"{name}: reads every key of the context at every step, an evaluation mode, not a "
                "serving one; add --oasis-evaluation-only true to run it"
            )
        if self.decode_step == "captured":
            raise OasisConfigError(f"{name}: replaces the eager step's attention; --oasis-decode-step eager")
        if self.lookahead != "previous":
            raise OasisConfigError(f"{name}: attends plain decode passes only; --oasis-lookahead previous")

    @property
    def fetch_cap(self) -> int | None:
        """Blocks per head and step the host tier may send (None: no cap)."""
        return self.fetch_cap_for(self.top_k)

    @property
    def fetch_cap_bounds(self) -> tuple[int, int]:
        """``--oasis-adaptive-cap``'s range for the per-layer cap."""
        return (
            math.ceil(self.fetch_ratio * self.top_k),
            math.ceil(min(1.0, 4 * self.fetch_ratio) * self.top_k),
        )

    @property
    def working_set_tokens(self) -> int:
        """Tokens one request's working set holds per layer and KV head (the active tail aside), at the
        largest the recall target may grow it."""
        return self.slots_per_head * self.block_size

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
            elif f.type in ("float", float):
                kwargs["type"] = float
            elif f.type in ("tuple[int, ...]",):
                kwargs.update(type=_parse_int_list, metavar="L1,L2,...")
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            group.add_argument(option(f.name), **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> OasisConfig:
        return cls(**{f.name: getattr(args, f"oasis_{f.name}") for f in dataclasses.fields(cls)})

    # --- hand-off to server subprocesses ------------------------------------------------------

    def to_env(self) -> None:
        os.environ[ENV_VAR] = json.dumps(dataclasses.asdict(self))

    @classmethod
    def for_backend(cls) -> OasisConfig:
        """The configuration the ``oasis`` backend serves with. The plugin sets one in every process whose
        command line chooses the backend (and registers the hooks it needs); anywhere else (an offline
        engine, say) none is set and the backend refuses, naming how to start it."""
        config = cls.from_env()
        if config is None:
            raise RuntimeError(
                "the oasis attention backend needs hooks into SGLang that this process did not register: "
                "start the server with python -m sglang_oasis.launch_server, or python -m "
                f"sglang.launch_server --attention-backend oasis, or set {ENV_VAR} (JSON of OasisConfig)"
            )
        return config

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
