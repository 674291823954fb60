"""How the selected blocks move: the fetch cap and pipeline, the decode step, and remote partial fetching
under PD disaggregation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sglang_oasis.options import (
    DECODE_STEPS,
    PREFETCH_MODES,
    PREFILL_ATTENTIONS,
    OasisConfigError,
    check_choice,
    check_non_negative,
    check_positive,
    option,
)


@dataclass(frozen=True)
class PipelineOptions:
    """How the blocks move and the decode step runs: the fetch cap, warm starts, the prefetch pipeline,
    the decode step and the extend's attention."""

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
            "batches run one torch.compile'd program per layer on fixed shapes (batches padded to 1, 2, 4, "
            "8... rows, blocks to a first bucket then every 16 more on CPU; no host sync), its next-step "
            "copies inside the step; compiled before the server is ready for every batch bucket up to the "
            "running-request cap (or --cuda-graph-max-bs-decode; larger batches decode eagerly) and kind of "
            "pass, as two graphs per kind (one row; every larger bucket: the batch dimension is symbolic; "
            "~20 s each on a CPU the first time, ~2 s once torch has cached it across starts), and one device "
            "request slot goes to padding rows. Verify passes (--oasis-lookahead's rows), recall samples and "
            "recall targets run it too. Steps it does not cover (extends, PD arrivals, passes of a request "
            "whose KV is still partly on the prefill node) run eagerly. Without the option the launcher's "
            "CPU defaults choose 'captured' with --oasis-selector summaries and 'eager' with codes (faster "
            "there: the pipeline's thread scores the codes beside the model's) (the eager step also with "
            "--oasis-adaptive-cap, or --oasis-fetch-ratio 1, where captured loses; "
            "SGLANG_OASIS_CPU_DECODE_STEP=eager or captured changes that default).",
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

    def check_pipeline(self) -> None:
        check_choice(self, "prefetch", PREFETCH_MODES)
        check_choice(self, "decode_step", DECODE_STEPS)
        check_choice(self, "prefill_attention", PREFILL_ATTENTIONS)
        if not 0 < self.fetch_ratio <= 1:
            raise OasisConfigError(f"{option('fetch_ratio')}: must be in (0, 1], got {self.fetch_ratio}")
        if self.decode_step == "captured" and self.adaptive_cap:
            raise OasisConfigError(
                f"{option('decode_step')} captured: --oasis-adaptive-cap follows the whole batch's drift, a "
                "host decision each step; use --oasis-fetch-ratio"
            )

    def fetch_cap_for(self, top_k: int) -> int | None:
        """``fetch_cap`` for a request of this top-K (a request's own ``oasis_top_k``)."""
        return None if self.fetch_ratio >= 1 else math.ceil(self.fetch_ratio * top_k)


@dataclass(frozen=True)
class PDOptions:
    """Remote partial fetching under SGLang's prefill/decode disaggregation."""

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

    def check_pd(self) -> None:
        check_positive(self, "remote_fetch_ttl")
        check_non_negative(self, "remote_fetch_max_staged_mib")
