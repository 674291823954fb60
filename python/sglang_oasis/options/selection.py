"""What a sparse layer's decode step attends: the selection of blocks, and the lookahead that predicts it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sglang_oasis.options import (
    DRAFT_POLICIES,
    LOOKAHEADS,
    SELECTORS,
    VERIFY_ROWS,
    OasisConfigError,
    check_choice,
    check_non_negative,
    check_positive,
    option,
)


@dataclass(frozen=True)
class SelectionOptions:
    """Which blocks each layer's KV heads attend: top-K, sinks, dense layers, the prefill window, the
    selector, and the recall telemetry and target that size K."""

    top_k: int = field(
        default=16,
        metadata={
            "help": "Blocks selected per request, layer and KV head for decode attention (sparse mode). "
            "The default, 16, is sized for the default --oasis-selector codes (within 0.02 of dense on the "
            "accuracy suite); --oasis-selector summaries needs ~128 for the same."
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
    selector: str = field(
        default="codes",
        metadata={
            "help": "What chooses the blocks a sparse layer's decode step attends. 'summaries': the min/max "
            "block summaries' bound scored by the predicting query (--oasis-lookahead); for dense's accuracy it "
            "needs a larger --oasis-top-k (on the accuracy suite K = 128 is within a sample of dense, K = 16 "
            "loses 0.15). 'codes' (the default): every "
            "key of a full block also kept in the device tier to 2 bits per channel within its block's min/max "
            "box (head_dim / 4 bytes per token and KV head, as much again as bf16 summaries), and blocks ranked "
            "by the predicting query's softmax over those keys (an estimate of each block's attention mass, not "
            "the summaries' bound; at K = 16 within 0.02 of dense on the suite, at a third of K = 128's bytes); "
            "under PD remote partial fetching the prefill node stages the codes with "
            "the summaries and the decode node reads them at admission (both nodes need it). 'oracle' "
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

    def check_selection(self) -> None:
        check_choice(self, "selector", SELECTORS)
        check_positive(self, "top_k")
        check_non_negative(self, "sink_blocks", "prefill_window", "recall_sample_every", "code_candidates")
        if not 0 <= self.window_keep <= 1:
            raise OasisConfigError(f"{option('window_keep')}: must be in [0, 1], got {self.window_keep}")
        if not 0 <= self.recall_target < 1:
            raise OasisConfigError(
                f"{option('recall_target')}: must be in [0, 1) (0: off), got {self.recall_target}"
            )
        if self.code_candidates and self.selector != "codes":
            raise OasisConfigError(f"{option('code_candidates')}: needs --oasis-selector codes")
        if self.recall_target and self.recall_sample_every == 0:
            raise OasisConfigError(
                f"{option('recall_target')}: needs recall samples; --oasis-recall-sample-every is 0"
            )
        if self.recall_max_top_k and self.recall_max_top_k < self.top_k:
            raise OasisConfigError(
                f"{option('recall_max_top_k')}: must be at least --oasis-top-k ({self.top_k}), got {self.recall_max_top_k}"
            )
        if any(layer < 0 for layer in self.dense_layers):
            raise OasisConfigError(
                f"{option('dense_layers')}: layer ids must be >= 0, got {self.dense_layers}"
            )
        object.__setattr__(self, "dense_layers", tuple(sorted(set(self.dense_layers))))

    @property
    def oracle(self) -> bool:
        """``--oasis-selector oracle`` or ``oracle-pooled``: an evaluation mode (``attention/oracle.py``)."""
        return self.selector in ("oracle", "oracle-pooled")

    @property
    def max_top_k(self) -> int:
        """The most blocks a layer's working set may select by score (``--oasis-recall-max-top-k``): what
        a recall target may grow it to and a request may ask for; by default ``--oasis-top-k``, or 4 x K
        with ``--oasis-recall-target``."""
        if self.recall_max_top_k:
            return self.recall_max_top_k
        return 4 * self.top_k if self.recall_target else self.top_k

    @property
    def window_blocks(self) -> int:
        """Blocks per layer and KV head that the prefill window keeps selected for the whole request."""
        return self.window_blocks_for(self.top_k)

    def window_blocks_for(self, top_k: int) -> int:
        """Blocks per layer and KV head the prefill window keeps selected for a request of this top-K."""
        return math.ceil(self.window_keep * top_k) if self.prefill_window else 0

    @property
    def pin_slots(self) -> int:
        """Window pins the device tier stores per request slot, layer and KV head: room for the largest
        top-K a request may take."""
        return self.window_blocks_for(self.max_top_k)

    @property
    def slots_per_head(self) -> int:
        """Blocks the device tier reserves per request slot, layer and KV head."""
        return self.max_top_k + self.sink_blocks


@dataclass(frozen=True)
class LookaheadOptions:
    """The query that predicts the next step's blocks, and what happens to its draft token."""

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

    def check_lookahead(self) -> None:
        check_choice(self, "lookahead", LOOKAHEADS)
        check_choice(self, "draft_policy", DRAFT_POLICIES)

    @property
    def verify_rows(self) -> int:
        """Query rows per request of a verify step: the real token and one draft (0: no lookahead draft)."""
        return 0 if self.lookahead == "previous" else VERIFY_ROWS
