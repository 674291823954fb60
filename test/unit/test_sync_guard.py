"""The sync guard (``attention/sync_guard.py``) catches every way a step can make a GPU wait for the host
or copy between them, by op on the real tensors and by data on fake ones, and passes the real captured
program (plain, verify and recall-sample passes)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_decode_program import admitted, captured_inputs, configs, stop, verify_inputs

from sglang_oasis.attention.decode_program import COUNTS, decode_layer
from sglang_oasis.attention.sync_guard import HostSyncError, SyncGuard, fake_run, guarded

# One leak each, after the real program: what a careless edit of the step could add.
LEAKS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "item": lambda out, counts: counts.sum().item(),
    "int": lambda out, counts: int(counts[0, 0]),
    "bool": lambda out, counts: bool((counts > 0).any()),
    "tolist": lambda out, counts: counts.tolist(),
    "cpu": lambda out, counts: counts.cpu(),
    "numpy": lambda out, counts: counts.numpy(),
    "to cpu": lambda out, counts: counts.to("cpu") if counts.device.type != "cpu" else counts.cpu(),
    "nonzero": lambda out, counts: counts.nonzero(),
    "boolean mask": lambda out, counts: out[out > 0],
    "masked write": lambda out, counts: out.__setitem__(out > 0, 0.0),
    "bincount": lambda out, counts: torch.bincount(counts.flatten().clamp(min=0)),
    "repeat_interleave": lambda out, counts: torch.repeat_interleave(counts.flatten().clamp(min=0, max=2)),
    "a Python list index": lambda out, counts: counts[:, [0, 2]],
    "torch.tensor": lambda out, counts: torch.tensor([1, 2]),
}


@pytest.fixture(scope="module")
def backend() -> Any:
    config, own_k, pins = configs("k_sparse_capped")
    oasis = admitted(config, own_k, pins)
    yield oasis
    stop(oasis)


def _leaking(leak: Callable[[torch.Tensor, torch.Tensor], Any]) -> Callable[..., Any]:
    def program(*args: Any) -> Any:
        out, counts = decode_layer(*args)
        leak(out, counts)
        return out, counts

    return program


@pytest.mark.parametrize("leak", LEAKS)
def test_every_leak_is_caught_by_op_and_the_value_reads_by_data_too(leak: str, backend: Any) -> None:
    inputs = captured_inputs(backend, 0)
    with pytest.raises(HostSyncError), SyncGuard():
        _leaking(LEAKS[leak])(*inputs)
    with pytest.raises(HostSyncError):
        guarded(_leaking(LEAKS[leak]))(*captured_inputs(backend, 0))
    if leak in ("item", "int", "bool", "tolist", "nonzero", "boolean mask", "bincount", "repeat_interleave"):
        with pytest.raises(HostSyncError, match="data"):  # on fake tensors, whatever the op's name
            fake_run(_leaking(LEAKS[leak]), *captured_inputs(backend, 0))


@pytest.mark.parametrize("kind", ["plain", "verify"])
def test_the_captured_program_passes_both_checks(kind: str, backend: Any) -> None:
    inputs = captured_inputs(backend, 1) if kind == "plain" else verify_inputs(backend, 1)
    fake_run(decode_layer, *inputs)  # nothing written: the real run below still sees the same state
    with SyncGuard() as guard:
        out, counts = decode_layer(*inputs)
    assert guard.ops > 100 and torch.isfinite(out).all() and counts.shape[1] == len(COUNTS)
