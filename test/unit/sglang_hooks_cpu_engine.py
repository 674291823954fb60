"""Hook 2's behaviour on SGLang's CPU engine, run by ``test_sglang_hooks.py`` in a child process
(``python test/unit/sglang_hooks_cpu_engine.py`` with ``SGLANG_USE_CPU_ENGINE=1``, under which the venv's
start-up hook installs the ``sgl_kernel`` stand-in before anything imports SGLang).

Why a child: ``verify_tree_greedy_func`` picks its kernel when its module is first imported (from
``is_cpu()``, cached for the process), and the pytest process imports SGLang off the CPU engine (other
unit test modules import it while pytest collects them), where the function leaves CPU tensors untouched.
Setting the CPU engine for the whole pytest process would switch every other unit test to SGLang's CPU
platform.

Prints one JSON object: what SGLang's verification, and the same behind ``reject_drafts`` (called with
positional arguments and with keywords, as SGLang's ``eagle_utils`` calls it), leave in ``predicts``,
``accept_index`` and ``accept_token_num``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from sglang_oasis import sglang_hooks as hooks

Outcome = tuple[list[int], list[list[int]], list[int]]


def verify_one_request(verify: Callable[..., Any], keywords: bool) -> Outcome:
    """One request with its real token 7 and one draft token 42; the target predicts 42 after 7 (the
    draft is right), then 9."""
    predicts = torch.full((2,), -5, dtype=torch.int64)
    accept_index = torch.full((1, 2), -1, dtype=torch.int64)
    accept_token_num = torch.zeros(1, dtype=torch.int64)
    arguments = {
        "predicts": predicts,
        "accept_index": accept_index,
        "accept_token_num": accept_token_num,
        "candidates": torch.tensor([[7, 42]]),
        "retrieve_index": torch.tensor([[0, 1]]),
        "retrieve_next_token": torch.tensor([[1, -1]]),
        "retrieve_next_sibling": torch.tensor([[-1, -1]]),
        "target_predict": torch.tensor([[42, 9]]),
    }
    if keywords:
        verify(**arguments)
    else:
        verify(*arguments.values())
    return predicts.tolist(), accept_index.tolist(), accept_token_num.tolist()


def main() -> None:
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_func

    def rejecting(*args: Any, **kwargs: Any) -> Any:
        return hooks.reject_drafts(verify_tree_greedy_func, *args, **kwargs)

    outcomes = {
        "sglang": verify_one_request(verify_tree_greedy_func, keywords=True),
        "reject_positional": verify_one_request(rejecting, keywords=False),
        "reject_keywords": verify_one_request(rejecting, keywords=True),
    }
    print(json.dumps(outcomes))


if __name__ == "__main__":
    main()
