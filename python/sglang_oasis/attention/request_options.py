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

Unknown ``oasis_*`` keys and values out of range fail the request alone, naming the key; so does any of
them under PD disaggregation (the prefill node's first selection would have to match the decode node's).
Dense mode ignores them. SGLang hands the attention backend no request parameters: hook 9
(``sglang_hooks.py``) notes each request's ``custom_params`` by rid as SGLang builds a forward batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from sglang_oasis.config import OasisConfig

TOP_K = "oasis_top_k"
RECALL_TARGET = "oasis_recall_target"
_noted: dict[str, Any] = {}  # rid -> custom_params of the requests of the forward batch built last (hook 9)


def note_params(by_rid: dict[str, Any]) -> None:
    """Hook 9: the ``custom_params`` of the requests of the forward batch SGLang is building."""
    global _noted
    _noted = by_rid


class RequestOptions(NamedTuple):
    top_k: torch.Tensor | None  # [bs] int64, None: every row takes the server's
    target: torch.Tensor | None  # [bs] float
    errors: dict[int, str]  # batch row -> why its options are refused


def batch_params(rids: Sequence[str] | None) -> list[Any] | None:
    """The ``custom_params`` of a forward batch's requests, by their ``rids`` (None: unknown)."""
    return None if rids is None else [_noted.get(str(rid)) for rid in rids]


def read_options(
    params: Sequence[Mapping[str, Any] | None] | None, config: OasisConfig, disaggregated: bool
) -> RequestOptions:
    """Each row's top-K and recall target from its ``custom_params`` (the server's where it sets none)."""
    if not params or not any(p and any(str(key).startswith("oasis_") for key in p) for p in params):
        return RequestOptions(None, None, {})
    top_k = torch.full((len(params),), config.top_k, dtype=torch.int64)
    target = torch.full((len(params),), float(config.recall_target))
    errors: dict[int, str] = {}
    for row, given in enumerate(params):
        options = {key: value for key, value in (given or {}).items() if str(key).startswith("oasis_")}
        if not options:
            continue
        try:
            top_k[row], target[row] = _checked(options, config, disaggregated)
        except ValueError as error:
            errors[row] = f"oasis: bad custom_params: {error}"
    return RequestOptions(top_k, target, errors)


def _checked(options: dict[str, Any], config: OasisConfig, disaggregated: bool) -> tuple[int, float]:
    unknown = sorted(set(options) - {TOP_K, RECALL_TARGET})
    if unknown:
        raise ValueError(f"unknown {', '.join(unknown)} (known: {TOP_K}, {RECALL_TARGET})")
    if disaggregated:
        raise ValueError(f"{', '.join(sorted(options))}: not supported with PD disaggregation")
    top_k = options.get(TOP_K, config.top_k)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= config.max_top_k:
        raise ValueError(
            f"{TOP_K}={top_k!r}: must be an integer from 1 to {config.max_top_k} (this server's "
            "--oasis-recall-max-top-k)"
        )
    target = options.get(RECALL_TARGET, config.recall_target)
    if isinstance(target, bool) or not isinstance(target, int | float) or not 0 <= target < 1:
        raise ValueError(f"{RECALL_TARGET}={target!r}: must be a number in [0, 1) (0: none)")
    if target and not config.recall_sample_every:
        raise ValueError(
            f"{RECALL_TARGET}: needs recall samples; this server runs --oasis-recall-sample-every 0"
        )
    return top_k, float(target)
