"""``SyncGuard``: fails on every op that would make a GPU wait for the host, or copy between them.

A CUDA graph replays kernels only: an op whose result's shape or value the host must read first
(``.item()``, ``nonzero``, boolean-mask indexing...) either breaks capture or stalls the stream, and a
tensor made from host data inside the step (``torch.tensor(...)``, a Python list as an index) is a
pageable copy the capture records once and never again. On CPU there is no stream to stall, so the guard
names them instead, in two ways that cover each other:

- **by op, on the real tensors** (``SyncGuard``, a torch function mode and a dispatch mode): the syncing
  aten ops (``SYNCING``, boolean masks, ``repeat_interleave`` without ``output_size``, copies between
  devices), and the Python-level reads that never dispatch an aten op on CPU (``.tolist()``, ``.numpy()``,
  ``.cpu()``, ``.to()`` another device, ``torch.tensor``/``as_tensor`` of host data, a Python list as an
  index);
- **by data, on fake tensors** (``fake_run``): the step again on torch's ``FakeTensorMode`` copies of its
  inputs, which have shapes and no values, so every op that needs a value (``DataDependentOutputException``)
  or a data-dependent shape (``DynamicOutputShapeException``) raises, whatever its name.

Every such op raises ``HostSyncError`` naming itself. Inputs of a fake CUDA device
(``sglang_oasis_testing.fake_cuda``) check devices too: ``test/unit/test_fake_cuda.py``.

``SGLANG_OASIS_SYNC_GUARD=1`` (a test and porting mode, read when the backend is built): the captured
decode step runs its program uncompiled, every call under the guard (``guarded``: the fake run once per
kind of call, then the real one under ``SyncGuard``), on a real server's passes, and so does the CUDA graph
path's program. A pass that syncs raises there, which the captured step logs and answers by decoding
eagerly from then on (``CapturedStep.decode``): a test sees it as passes that stopped being captured.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

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
    aten.bincount.default,  # its length is the data's largest value
    aten.equal.default,
    aten.is_nonzero.default,
    aten._assert_async.default,
}
# Python-level reads of a tensor's values by the host (on CPU they dispatch no aten op).
HOST_READS = {
    torch.Tensor.tolist: ".tolist()",
    torch.Tensor.numpy: ".numpy()",
    torch.Tensor.cpu: ".cpu(), a copy to the host",
    torch.Tensor.__array__: "a numpy conversion",
}
# Tensors made from host data: inside a captured step, a pageable copy recorded once.
FROM_HOST = {
    torch.tensor: "torch.tensor",
    torch.as_tensor: "torch.as_tensor",
    torch.from_numpy: "torch.from_numpy",
}


class HostSyncError(AssertionError):
    pass


def _bool_index(args: Any) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


def _lists_in(index: Any) -> bool:
    """Whether an index (``t[index]``) holds a Python list: torch builds a host tensor of it."""
    if isinstance(index, list):
        return True
    return isinstance(index, tuple) and any(isinstance(part, list) for part in index)


def _target_device(args: Sequence[Any], kwargs: dict[str, Any]) -> torch.device | None:
    """The device ``Tensor.to`` moves to (None: the same device)."""
    target = kwargs.get("device")
    for arg in args[1:]:
        if isinstance(arg, torch.device | str):
            target = arg
        elif isinstance(arg, torch.Tensor):
            target = arg.device
    return None if target is None else torch.device(target)


class _FunctionGuard(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in HOST_READS:
            raise HostSyncError(f"{HOST_READS[func]}: the host reads a tensor's values")
        if func in FROM_HOST and not (args and isinstance(args[0], torch.Tensor)):
            raise HostSyncError(f"{FROM_HOST[func]} of host data: a host tensor copied in at every step")
        if (
            func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__)
            and len(args) > 1
            and _lists_in(args[1])
        ):
            raise HostSyncError(f"{func.__name__} with a Python list: torch builds a host tensor of it")
        if func is torch.Tensor.to and args:
            target = _target_device(args, kwargs)
            if target is not None and target.type != args[0].device.type:
                raise HostSyncError(f".to({target}): a copy between {args[0].device.type} and {target.type}")
        return func(*args, **kwargs)


class _DispatchGuard(TorchDispatchMode):
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
            if target is not None and torch.device(target).type != source.device.type:
                raise HostSyncError(
                    f"{func}: a copy between {source.device.type} and {torch.device(target).type}"
                )
        return func(*args, **kwargs)


class SyncGuard:
    """``with SyncGuard(): step()`` raises ``HostSyncError`` on the first op that would synchronise or
    copy between host and device (see the module); ``ops`` counts the aten ops the step dispatched."""

    def __init__(self) -> None:
        self._function, self._dispatch = _FunctionGuard(), _DispatchGuard()

    @property
    def ops(self) -> int:
        return self._dispatch.ops

    def __enter__(self) -> SyncGuard:
        self._function.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._dispatch.__exit__(*exc)
        self._function.__exit__(*exc)


def fake_run(program: Callable[..., Any], *args: Any) -> Any:
    """``program(*args)`` on torch's ``FakeTensorMode`` copies of its tensor arguments (shapes and devices,
    no values, nothing written): an op that needs a value or makes a data-dependent shape raises
    ``HostSyncError`` naming it (and so does a Python-level read, as under ``SyncGuard``)."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorMode,
    )

    mode = FakeTensorMode()
    fakes = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, args)
    try:
        with _FunctionGuard(), mode:  # the Python-level reads are named as the real run names them
            return program(*fakes)
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise HostSyncError(f"{type(error).__name__}: {error} (its value or shape is the data's)") from error


def sync_guard_on() -> bool:
    """Whether ``SYNC_GUARD_ENV`` asks for the guard (1; unset or 0: off)."""
    value = os.environ.get(SYNC_GUARD_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{SYNC_GUARD_ENV}={value!r}: expected 1 (or 0, off)")
    return value == "1"


def guarded(program: Callable[..., Any]) -> Callable[..., Any]:
    """``program`` with every call under a ``SyncGuard``, after a ``fake_run`` once per kind of call (its
    tensors' shapes, dtypes and devices, and which optional ones it has)."""
    checked: set[tuple[Any, ...]] = set()

    def run(*args: Any) -> Any:
        kind = tuple(
            (tuple(t.shape), t.dtype, t.device.type) if isinstance(t, torch.Tensor) else t is None
            for t in tree_flatten(args)[0]
        )
        if kind not in checked:
            fake_run(program, *args)
            checked.add(kind)
        with SyncGuard():
            return program(*args)

    return run
