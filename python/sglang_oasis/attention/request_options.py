"""Per-request sparse settings, through SGLang's ``custom_params`` (native API: in ``sampling_params``;
OpenAI API: a top-level field, ``extra_body`` in the openai client)::

    "custom_params": {"oasis_top_k": 64, "oasis_recall_target": 0.9}

- ``oasis_top_k`` (an integer from 1 to ``--oasis-recall-max-top-k``): the blocks per layer and KV head
  the request's working sets select by score, instead of ``--oasis-top-k``. Its fetch cap
  (``--oasis-fetch-ratio`` x its K) and prefill-window pins (``--oasis-window-keep`` x its K) follow, as
  on a server started with that K; ``--oasis-adaptive-cap`` stays per layer, the same for every request.
- ``oasis_recall_target`` (a number in [0, 1); above 0 it needs ``--oasis-recall-sample-every`` > 0): the
  request's recall target instead of ``--oasis-recall-target`` (0: none). Its working sets grow from its
  top-K up to ``--oasis-recall-max-top-k``.

Unknown ``oasis_*`` keys, values of the wrong type or out of range, a ``custom_params`` that is not a JSON
object, a target whose working sets could not grow (the request's K already at
``--oasis-recall-max-top-k``) and any ``oasis_*`` key under PD disaggregation (the prefill node's first
selection would have to match the decode node's) fail the request alone with HTTP 400 naming the key:
hook 12 (``sglang_hooks.py``) checks them where SGLang verifies a request's sampling parameters, before
it is queued. The scheduler checks them again (``read_options``) and fails a bad row alone there too.
Dense mode ignores them. SGLang hands the attention backend no request parameters: hook 9 notes each
request's ``custom_params`` by rid as SGLang builds a forward batch.

A target's recall samples are bounded per request, not per pass: a request is sampled at its first and
every ``--oasis-recall-sample-every``-th of its own decode steps (``recall_probe.py``), whatever other
requests ask; a per-pass cap would make its working sets (and answer) depend on the batch it ran in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from sglang_oasis.options.selection import SelectionOptions

TOP_K = "oasis_top_k"
RECALL_TARGET = "oasis_recall_target"


class NotedRequest(NamedTuple):
    """What hook 9 notes of a request of the forward batch SGLang is building."""

    custom_params: Any
    retraction_key: str | None  # set by hooks 7 and 8 on the request object it retracted (None: never)


_noted: dict[str, NotedRequest] = {}  # rid -> the requests of the forward batch built last (hook 9)


def note_requests(by_rid: dict[str, NotedRequest]) -> None:
    """Hook 9: the requests of the forward batch SGLang is building."""
    global _noted
    _noted = by_rid


class RequestOptions(NamedTuple):
    top_k: torch.Tensor | None  # [bs] int64, None: every row takes the server's
    target: torch.Tensor | None  # [bs] float
    errors: dict[int, str]  # batch row -> why its options are refused


def batch_params(rids: Sequence[str] | None) -> list[Any] | None:
    """The ``custom_params`` of a forward batch's requests, by their ``rids`` (None: unknown)."""
    return None if rids is None else [_noted_of(rid).custom_params for rid in rids]


def retraction_keys(rids: Sequence[str] | None) -> list[str | None] | None:
    """The retraction key of each of a forward batch's requests (None: never retracted). A request's kept
    selection state is found by it, not by its rid: a client may send a new request with the rid of one
    that was retracted and never resumed (aborted while it waited)."""
    return None if rids is None else [_noted_of(rid).retraction_key for rid in rids]


def _noted_of(rid: str) -> NotedRequest:
    return _noted.get(str(rid)) or NotedRequest(None, None)


def read_options(
    params: Sequence[Any] | None, config: SelectionOptions, disaggregated: bool
) -> RequestOptions:
    """Each row's top-K and recall target from its ``custom_params`` (the server's where it sets none); a
    row whose ``custom_params`` ``check`` refuses gets the server's and an error."""
    if not params or not any(p is not None and _oasis_options(p) != {} for p in params):
        return RequestOptions(None, None, {})
    top_k = torch.full((len(params),), config.top_k, dtype=torch.int64)
    target = torch.full((len(params),), float(config.recall_target))
    errors: dict[int, str] = {}
    for row, given in enumerate(params):
        try:
            checked = check(given, config, disaggregated)
        except ValueError as error:
            errors[row] = str(error)
            continue
        if checked is not None:
            top_k[row], target[row] = checked
    return RequestOptions(top_k, target, errors)


def disaggregated() -> bool:
    """Whether this server is either node of a PD pair (SGLang's runtime context, in any process)."""
    try:
        from sglang.srt.runtime_context import get_disagg

        return str(get_disagg().disaggregation_mode) in ("prefill", "decode")
    except Exception:  # no context published in this process: the scheduler checks again
        return False


def check(custom_params: Any, config: SelectionOptions, disaggregated: bool) -> tuple[int, float] | None:
    """The top-K and recall target a request's ``custom_params`` sets (None: it sets neither). Raises
    ``ValueError`` ("oasis: bad custom_params: ...", naming the key) for anything this server refuses."""
    options = _oasis_options(custom_params)
    if options is None:
        raise ValueError(
            f"oasis: bad custom_params: must be a JSON object (e.g. {{{TOP_K!r}: 32}}), got "
            f"{type(custom_params).__name__} {_short(custom_params)}"
        )
    if not options:
        return None
    try:
        return _checked(options, config, disaggregated)
    except ValueError as error:
        raise ValueError(f"oasis: bad custom_params: {error}") from None


def _oasis_options(custom_params: Any) -> dict[str, Any] | None:
    """The ``oasis_*`` entries of ``custom_params`` ({} for None); None if it is not a mapping."""
    if custom_params is None:
        return {}
    if not isinstance(custom_params, Mapping):
        return None
    return {str(key): value for key, value in custom_params.items() if str(key).startswith("oasis_")}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _checked(options: dict[str, Any], config: SelectionOptions, disaggregated: bool) -> tuple[int, float]:
    unknown = sorted(set(options) - {TOP_K, RECALL_TARGET})
    if unknown:
        raise ValueError(f"unknown {', '.join(unknown)} (known: {TOP_K}, {RECALL_TARGET})")
    if disaggregated:
        raise ValueError(f"{', '.join(sorted(options))}: not supported with PD disaggregation")
    top_k = options.get(TOP_K, config.top_k)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= config.max_top_k:
        raise ValueError(
            f"{TOP_K}={_short(top_k)}: must be an integer from 1 to {config.max_top_k} (this server's "
            "--oasis-recall-max-top-k)"
        )
    target = options.get(RECALL_TARGET, config.recall_target)
    if isinstance(target, bool) or not isinstance(target, int | float) or not 0 <= target < 1:
        raise ValueError(f"{RECALL_TARGET}={_short(target)}: must be a number in [0, 1) (0: none)")
    if target and not config.recall_sample_every:
        raise ValueError(
            f"{RECALL_TARGET}: needs recall samples; this server runs --oasis-recall-sample-every 0"
        )
    if options.get(RECALL_TARGET) and top_k >= config.max_top_k:
        raise ValueError(
            f"{RECALL_TARGET}={target!r}: the working sets cannot grow: {TOP_K} {top_k} is already this "
            f"server's --oasis-recall-max-top-k ({config.max_top_k})"
        )
    return top_k, float(target)
