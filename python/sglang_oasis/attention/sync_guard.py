"""``SyncGuard``: fails on every op that would make a GPU wait for the host (or the host for the GPU).

A CUDA graph replays kernels only: an op whose result's shape or value the host must read first
(``.item()``, ``nonzero``, boolean-mask indexing...) either breaks capture or stalls the stream. On CPU
there is no stream to stall, so the guard names the ops instead: run a step under it and every such op
raises ``HostSyncError`` naming itself.

``SGLANG_OASIS_SYNC_GUARD=1`` (a test and porting mode, read when the backend is built): the captured
decode step runs its program uncompiled, every call under the guard (``guarded``), on a real server's
passes. A pass that syncs raises there, which the captured step logs and answers by decoding eagerly
from then on (``CapturedStep.decode``): a test sees it as passes that stopped being captured.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SYNC_GUARD_ENV = "SGLANG_OASIS_SYNC_GUARD"

# Ops whose output shape or value the host must know: each would synchronise a GPU stream.
SYNCING = {
    aten._local_scalar_dense.default,  # .item(), int(t), bool(t), float(t)
    aten.nonzero.default,
    aten.nonzero_static.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_consecutive.default,
    aten.unique_dim.default,
    aten.equal.default,
    aten.is_nonzero.default,
    aten._assert_async.default,
}


class HostSyncError(AssertionError):
    pass


def _bool_index(args: Any) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class SyncGuard(TorchDispatchMode):
    """``with SyncGuard(): step()`` raises on the first op that would synchronise; ``ops`` counts the
    ops the step dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        if func in SYNCING:
            raise HostSyncError(f"{func} synchronises with the host")
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and _bool_index(args):
            raise HostSyncError(f"{func} with a boolean mask: its shape depends on the data")
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            raise HostSyncError("repeat_interleave without output_size: its shape depends on the data")
        if func in (aten._to_copy.default, aten.copy_.default):
            source = args[1] if func is aten.copy_.default else args[0]
            target = args[0].device if func is aten.copy_.default else kwargs.get("device")
            if target is not None and source.device.type != "cpu" and torch.device(target).type == "cpu":
                raise HostSyncError(f"{func}: a copy to the host")
        return func(*args, **kwargs)


def sync_guard_on() -> bool:
    """Whether ``SYNC_GUARD_ENV`` asks for the guard (1; unset or 0: off)."""
    value = os.environ.get(SYNC_GUARD_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{SYNC_GUARD_ENV}={value!r}: expected 1 (or 0, off)")
    return value == "1"


def guarded(program: Callable[..., Any]) -> Callable[..., Any]:
    """``program`` with every call under a ``SyncGuard``."""

    def run(*args: Any) -> Any:
        with SyncGuard():
            return program(*args)

    return run
