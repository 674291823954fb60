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
import math
import os
from dataclasses import dataclass, field
from typing import Any

ENV_VAR = "SGLANG_OASIS_CONFIG"
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
            "--max-total-tokens, lives in host memory); start-up fails if the host RAM available "
            "cannot hold it. Default: --oasis-host-memory-fraction of the available host RAM over the "
            "model's KV bytes per token (draft model included), in whole blocks; on CPU with the CPU "
            "defaults at most --oasis-cpu-max-total-tokens.",
        },
    )
    host_memory_fraction: float = field(
        default=0.5,
        metadata={
            "help": "Share of the host RAM available at start-up that the host KV tier takes when "
            "neither --oasis-host-kv-tokens nor --max-total-tokens is given (sparse mode).",
        },
    )
    device_kv_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Device-tier budget, as the tokens of KV a dense pool would hold in the same bytes "
            "(sparse mode): the device tier gets N x the served model's KV bytes per token and holds in "
            "them the block summaries of the whole host tier, then whole requests' working sets (K + "
            "sink blocks per layer and KV head, with their index tensors). --max-running-requests is "
            "set to the requests that fit, unless given; a larger value is refused. Start-up fails when "
            f"not even one request fits beside the summaries. Default: {DEFAULT_DEVICE_KV_TOKENS} on CPU; on "
            "CUDA the GPU memory SGLang would have given its KV pool (which lives in host memory here).",
        },
    )
    prefill_window: int = field(
        default=32,
        metadata={
            "help": "Tokens at the end of a prompt whose exact attention, computed by the dense prefill, "
            "chooses the first working set (sparse mode): each KV head starts from the top-K blocks by "
            "the attention mass the prompt's last N queries give them (an observation window, as in "
            "SnapKV; beyond the OasisKV paper), later steps select by the min/max summaries as usual. "
            "0: the first working set is chosen like every other, by the summaries and the last "
            "prompt token's query.",
        },
    )
    window_keep: float = field(
        default=0.25,
        metadata={
            "help": "Share of the top-K that the prefill window's best blocks keep for the whole request "
            "(sparse mode, with --oasis-prefill-window): ceil(share x top-k) blocks per layer and KV "
            "head stay selected at every decode step, the rest follow the summaries. 0: none stay "
            "(the window only chooses the first working set).",
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
    selector: str = field(
        default="summaries",
        metadata={
            "help": "What chooses the blocks a sparse layer's decode step attends. 'summaries': the min/max "
            "block summaries scored by the predicting query (--oasis-lookahead), the serving mode. 'codes': every "
            "key of a full block also kept in the device tier to 2 bits per channel within its block's min/max "
            "box (head_dim / 4 bytes per token and KV head, as much again as bf16 summaries), and blocks ranked "
            "by the predicting query's softmax over those keys (an estimate of each block's attention mass, not "
            "the summaries' bound); no remote partial fetching (a PD decode node's keys "
            "stay on the prefill node). 'oracle' "
            "(evaluation only: needs --oasis-evaluation-only): each step's own query's exact attention mass "
            "picks its top-K blocks per KV head (it computes dense attention's scores to choose), the best "
            "any selection of K blocks can do; eager decode step, no lookahead drafts. 'oracle-pooled': the same "
            "with a request's H x K blocks per layer shared among its KV heads by mass (a head-wise budget).",
            "choices": SELECTORS,
        },
    )
    code_candidates: int = field(
        default=0,
        metadata={
            "help": "With --oasis-selector codes: a request with more than m x top-K full blocks "
            "scores only each KV head's m x top-K best blocks by the min/max summaries' bound (m is this "
            "value), instead of every full block: the selection's cost follows top-K, not the context. "
            "0: every full block is scored.",
        },
    )
    evaluation_only: bool = field(
        default=False,
        metadata={
            "help": "Allow modes that exist to measure, not to serve (--oasis-selector oracle): they read "
            "the whole context every step.",
        },
    )
    fetch_ratio: float = field(
        default=0.05,
        metadata={
            "help": "Fetch cap per step (sparse mode): at most ceil(ratio x top-k) predicted blocks per "
            "request, layer and KV head are loaded from the host tier in one decode step, best summary "
            "score first; the rest wait for later steps (top-k: the working set's own, a request's "
            "oasis_top_k or what --oasis-recall-target grew it to). 1.0 loads every predicted block at once. "
            "Admission (the first working set after prefill) and blocks that just filled up are not "
            "capped.",
        },
    )
    adaptive_cap: bool = field(
        default=False,
        metadata={
            "help": "Let each layer's fetch cap follow the measured drift (sparse mode): cap = "
            "ceil(1.25 x moving average of predicted-but-missing blocks per head per step), kept "
            "between ceil(fetch-ratio x top-k) and ceil(min(1, 4 x fetch-ratio) x top-k).",
        },
    )
    recall_sample_every: int = field(
        default=32,
        metadata={
            "help": "Recall telemetry (sparse mode): every N decode steps, for up to 4 running requests, "
            "each sparse layer's query attends the whole context exactly (keys read from the host tier, "
            "counted in telemetry_bytes) to measure the attention mass the working set and the active "
            "tail captured, and how many of the step's true top-K blocks the previous step's prediction "
            "held: GET /oasis/stats recall_mean, recall_p10, recall_per_layer, lookahead_agreement. "
            "At 32 it cost 3.5% of decode time at batch 1 (SmolLM2, 1K context). 0: off.",
        },
    )
    recall_target: float = field(
        default=0.0,
        metadata={
            "help": "Hold a recall target (sparse mode; e.g. 0.9; 0: off): each request's first working set "
            "per layer is sized so that the top blocks hold this share of the prefill window's attention "
            "mass (--oasis-prefill-window), and at its first and every --oasis-recall-sample-every of its "
            "own decode steps "
            "each sparse layer's recall is measured exactly; a layer whose worst KV head falls below the "
            "target doubles its top-K (up to --oasis-recall-max-top-k) and halves it back after 3 samples "
            "well above. The fetch cap still holds; the device tier reserves --oasis-recall-max-top-k "
            "blocks per layer and KV head for every request slot, so fewer requests run at once.",
        },
    )
    recall_max_top_k: int = field(
        default=0,
        metadata={
            "help": "The largest top-K a layer's working set may take (sparse mode): what "
            "--oasis-recall-target may grow it to, and the most a request may ask for with "
            '"custom_params": {"oasis_top_k": K}. The device tier reserves this many blocks per layer '
            "and KV head for every request slot. 0: --oasis-top-k, or 4 x --oasis-top-k with a recall "
            "target.",
        },
    )
    warm_start: bool = field(
        default=True,
        metadata={
            "help": "A request whose prompt starts with blocks another request already holds in its "
            "working sets (the previous turn of a conversation, or a concurrent request with the same "
            "prefix, reused through the radix cache) starts from those resident blocks: only blocks "
            "its first selection adds are loaded from the host tier (sparse mode). 'false': every "
            "first working set loads from the host tier.",
        },
    )
    prefetch: str = field(
        default="async",
        metadata={
            "help": "How each layer's selection and block transfer run (sparse mode). 'async': in a "
            "background worker while later layers compute; the next step's attention at a layer waits "
            "only for that layer's transfer. 'sync': inline, right after the layer's attention.",
            "choices": PREFETCH_MODES,
        },
    )
    decode_step: str = field(
        default="eager",
        metadata={
            "help": "How a sparse layer's decode step runs (sparse mode). 'eager': torch ops sized by the data, "
            "the selection and its copies in the prefetch pipeline (--oasis-prefetch). 'captured': plain decode "
            "batches run one torch.compile'd program per layer on fixed shapes (batches padded to 1, 2, 4, 8... "
            "rows, blocks to 64, 128, 256...; no host sync), its next-step copies inside the step; compiled "
            "before the server is ready, once per batch bucket up to the running-request cap (or "
            "--cuda-graph-max-bs-decode; larger batches decode eagerly) and kind of pass (~15 s each on a CPU the "
            "first time, ~2 s once torch has cached it across starts), and one device request slot goes to "
            "padding rows. "
            "Verify passes (--oasis-lookahead's rows), recall samples and recall targets run it too. Steps it "
            "does not cover (extends, PD arrivals, passes of a request whose KV is still partly on the prefill "
            "node) run eagerly. Without the option the launcher's CPU defaults choose 'captured' (unless "
            "--oasis-adaptive-cap, or --oasis-fetch-ratio 1, where it loses; SGLANG_OASIS_CPU_DECODE_STEP=eager "
            "changes that default).",
            "choices": DECODE_STEPS,
        },
    )
    prefill_attention: str = field(
        default="auto",
        metadata={
            "help": "What computes a sparse-mode extend's dense attention (prefill, a suffix after a cached "
            "prefix, a chunk). 'torch': SGLang's torch_native backend (SDPA per request), the CPU path. "
            "'triton': SGLang's Triton attention backend, each layer's KV written into the host tier as "
            "it goes (on a GPU; on a CPU only under Triton's interpreter, TRITON_INTERPRET=1, which tests "
            "use). 'auto': triton on CUDA, torch otherwise.",
            "choices": PREFILL_ATTENTIONS,
        },
    )
    remote_fetch: bool = field(
        default=True,
        metadata={
            "help": "Remote partial fetching under PD disaggregation (sparse mode, mooncake transfer "
            "backend, both servers): the prefill node keeps each request's full KV staged in its host "
            "memory and the decode node reads only the blocks its working sets use (at admission the "
            "union over KV heads of the first selection, plus the block summaries; later misses when "
            "first needed). 'false': SGLang transfers the whole KV. Prefill and decode servers must "
            "agree; under tensor parallelism both run the same --tp-size, and each decode rank reads its "
            "own KV heads from the prefill rank of its number.",
        },
    )
    remote_fetch_ttl: int = field(
        default=3600,
        metadata={
            "help": "Seconds a prefill node keeps a request's staged KV when the decode node never "
            "releases it (it releases when the request finishes); remote partial fetching only.",
        },
    )
    remote_fetch_max_staged_mib: int = field(
        default=4096,
        metadata={
            "help": "Prefill node of remote partial fetching: at most this many MiB of staged KV and "
            "summaries held for decode nodes; a request that would go beyond it is sent whole, as "
            "without remote fetching (its decode node attends densely at its first step). 0: no cap.",
        },
    )
    advertise_host: str = field(
        default="",
        metadata={
            "help": "PD with remote partial fetching: the address other machines reach this server at, "
            "advertised in its hand-off URL and its Mooncake session. Empty: --host, unless that is a "
            "wildcard (0.0.0.0, ::); then a decode node reads from the address it reached the prefill "
            "node's bootstrap server at.",
        },
    )
    cpu_defaults: bool = field(
        default=True,
        metadata={
            "help": "Without a GPU, serve on SGLang's CPU engine with CPU-friendly settings "
            "(--device cpu, --oasis-decode-step captured, --attention-backend torch_native, --max-total-tokens "
            "<oasis-cpu-max-total-tokens>, --sleep-on-idle, --dtype: the type this CPU computes "
            "fastest, float32 unless it has native bf16/fp16 matrix support; OMP_NUM_THREADS: the "
            "usable cores per model rank). Any of them given explicitly wins; 'false' applies none "
            "except the CPU engine itself.",
        },
    )
    cuda_untested: bool = field(
        default=False,
        metadata={
            "help": "Let sparse mode start on a CUDA machine, where it has never run: the oasis backend "
            "on CUDA tensors, the host tier in pinned host memory read in place by the GPU, and the decode "
            "step in SGLang's CUDA graphs (docs/gpu.md says what is written and what is verified). "
            "Single GPU, no --oasis-dense-layers. 'false': the launcher refuses sparse mode on a GPU.",
        },
    )
    cpu_max_total_tokens: int = field(
        default=32768,
        metadata={"help": "KV cache cap (tokens) used on CPU when --max-total-tokens is not given."},
    )

    def __post_init__(self) -> None:
        for name, choices in (
            ("mode", MODES),
            ("lookahead", LOOKAHEADS),
            ("draft_policy", DRAFT_POLICIES),
            ("prefetch", PREFETCH_MODES),
            ("decode_step", DECODE_STEPS),
            ("prefill_attention", PREFILL_ATTENTIONS),
            ("selector", SELECTORS),
        ):
            if getattr(self, name) not in choices:
                raise OasisConfigError(
                    f"{_option(name)}: {getattr(self, name)!r} is not one of {', '.join(choices)}"
                )
        for name in ("block_size", "top_k", "device_kv_tokens", "cpu_max_total_tokens", "remote_fetch_ttl"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise OasisConfigError(f"{_option(name)}: must be positive, got {getattr(self, name)}")
        if not 0 <= self.window_keep <= 1:
            raise OasisConfigError(f"{_option('window_keep')}: must be in [0, 1], got {self.window_keep}")
        if not 0 < self.host_memory_fraction <= 1:
            raise OasisConfigError(
                f"{_option('host_memory_fraction')}: must be in (0, 1], got {self.host_memory_fraction}"
            )
        if not 0 < self.fetch_ratio <= 1:
            raise OasisConfigError(f"{_option('fetch_ratio')}: must be in (0, 1], got {self.fetch_ratio}")
        for name in (
            "sink_blocks",
            "prefill_window",
            "recall_sample_every",
            "remote_fetch_max_staged_mib",
            "code_candidates",
        ):
            if getattr(self, name) < 0:
                raise OasisConfigError(f"{_option(name)}: must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.recall_target < 1:
            raise OasisConfigError(
                f"{_option('recall_target')}: must be in [0, 1) (0: off), got {self.recall_target}"
            )
        if self.decode_step == "captured" and self.adaptive_cap:
            raise OasisConfigError(
                f"{_option('decode_step')} captured: --oasis-adaptive-cap follows the whole batch's drift, a "
                "host decision each step; use --oasis-fetch-ratio"
            )
        if self.oracle:
            self._check_oracle()
        if self.code_candidates and self.selector != "codes":
            raise OasisConfigError(f"{_option('code_candidates')}: needs --oasis-selector codes")
        if self.recall_target and self.recall_sample_every == 0:
            raise OasisConfigError(
                f"{_option('recall_target')}: needs recall samples; --oasis-recall-sample-every is 0"
            )
        if self.recall_max_top_k and self.recall_max_top_k < self.top_k:
            raise OasisConfigError(
                f"{_option('recall_max_top_k')}: must be at least --oasis-top-k ({self.top_k}), "
                f"got {self.recall_max_top_k}"
            )
        if self.host_kv_tokens is not None and self.host_kv_tokens < self.block_size:
            raise OasisConfigError(
                f"{_option('host_kv_tokens')}: must hold at least one block ({self.block_size}), "
                f"got {self.host_kv_tokens}"
            )
        if any(layer < 0 for layer in self.dense_layers):
            raise OasisConfigError(
                f"{_option('dense_layers')}: layer ids must be >= 0, got {self.dense_layers}"
            )
        if self.mode == "sparse" and self.device_tokens < self.working_set_tokens:
            raise OasisConfigError(
                f"{_option('device_kv_tokens')}: {self.device_tokens} tokens do not hold one request's "
                f"working set ((--oasis-top-k {self.max_top_k} + --oasis-sink-blocks {self.sink_blocks}) x "
                f"--oasis-block-size {self.block_size} = {self.working_set_tokens} tokens per layer and KV "
                "head): raise it or lower --oasis-top-k"
            )
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))

    @property
    def oracle(self) -> bool:
        """``--oasis-selector oracle`` or ``oracle-pooled``: an evaluation mode (``attention/oracle.py``)."""
        return self.selector in ("oracle", "oracle-pooled")

    def _check_oracle(self) -> None:
        """``--oasis-selector oracle[-pooled]``: evaluation only, on the eager step's plain decode passes."""
        name = f"{_option('selector')} {self.selector}"
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
    def device_tokens(self) -> int:
        """``--oasis-device-kv-tokens``, or its CPU default (on CUDA, unset, the budget is the GPU memory
        SGLang would have given its KV pool: ``DeviceTier.for_pool``)."""
        return DEFAULT_DEVICE_KV_TOKENS if self.device_kv_tokens is None else self.device_kv_tokens

    @property
    def fetch_cap(self) -> int | None:
        """Blocks per head and step the host tier may send (None: no cap)."""
        return self.fetch_cap_for(self.top_k)

    @property
    def window_blocks(self) -> int:
        """Blocks per layer and KV head that the prefill window keeps selected for the whole request."""
        return self.window_blocks_for(self.top_k)

    @property
    def fetch_cap_bounds(self) -> tuple[int, int]:
        """``--oasis-adaptive-cap``'s range for the per-layer cap."""
        return (
            math.ceil(self.fetch_ratio * self.top_k),
            math.ceil(min(1.0, 4 * self.fetch_ratio) * self.top_k),
        )

    @property
    def verify_rows(self) -> int:
        """Query rows per request of a verify step: the real token and one draft (0: no lookahead draft)."""
        return 0 if self.lookahead == "previous" else VERIFY_ROWS

    @property
    def max_top_k(self) -> int:
        """The most blocks a layer's working set may select by score (``--oasis-recall-max-top-k``): what
        a recall target may grow it to and a request may ask for; by default ``--oasis-top-k``, or 4 x K
        with ``--oasis-recall-target``."""
        if self.recall_max_top_k:
            return self.recall_max_top_k
        return 4 * self.top_k if self.recall_target else self.top_k

    def window_blocks_for(self, top_k: int) -> int:
        """Blocks per layer and KV head the prefill window keeps selected for a request of this top-K."""
        return math.ceil(self.window_keep * top_k) if self.prefill_window else 0

    def fetch_cap_for(self, top_k: int) -> int | None:
        """``fetch_cap`` for a request of this top-K (a request's own ``oasis_top_k``)."""
        return None if self.fetch_ratio >= 1 else math.ceil(self.fetch_ratio * top_k)

    @property
    def pin_slots(self) -> int:
        """Window pins the device tier stores per request slot, layer and KV head: room for the largest
        top-K a request may take."""
        return self.window_blocks_for(self.max_top_k)

    @property
    def slots_per_head(self) -> int:
        """Blocks the device tier reserves per request slot, layer and KV head."""
        return self.max_top_k + self.sink_blocks

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
            group.add_argument(_option(f.name), **kwargs)

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
