"""``FakeCuda``: a CUDA device on a machine without one, carrying real values, that names every place
where the code would cross between host and device.

``with FakeCuda() as cuda:`` tensors made on (or moved to) ``"cuda"`` are ``FakeCudaTensor``s: they report
``cuda:0`` and hold a real CPU tensor, so the code runs to its results as it would on a GPU, while the
mode checks each op for what CUDA would refuse or pay:

- **device mismatch** (``DeviceMismatch``, raised): an op mixing CPU and CUDA tensors, as CUDA refuses
  it. Allowed as CUDA allows: 0-dim CPU tensors (scalars), copies (``copy_``, ``.to``), a CPU index
  tensor into a CUDA tensor (recorded: a hidden host-to-device copy).
- **crossings** (``cuda.crossings``, recorded): every sync (``.item()``, ``int()``, ``bool()``,
  ``.tolist()``, ``nonzero``, a boolean mask, ``repeat_interleave`` without ``output_size``, a stream or
  event synchronised) and every host<->device copy, each with its op and the tensor's shape.
- **replays** (``with cuda.replay("what"):``): a crossing inside raises ``Crossing`` naming the op and
  the tensor, as a CUDA graph replay (kernels only) would not do it.

Pinned host memory: ``torch.empty(..., pin_memory=True)``, ``.pin_memory()`` and the CUDA driver's
``cudaHostRegister`` mark memory pinned (``is_pinned()``); ``sglang_oasis.memory.pinned_host``'s device
view of pinned memory is a ``FakeCudaTensor`` over the same memory (unified addressing), so writes
through either side are seen by the other. Streams and events are no-ops whose ``synchronize`` is a sync.

What it does not model: timing, the CUDA caching allocator's memory, kernels (the sgl-kernel-oasis ops
take their torch forms: Triton cannot launch here), CUDA graph capture itself (a replay region runs the
Python again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
aten = torch.ops.aten

# Ops whose output's shape or value the host must read from the device first.
SYNCING = {
    aten._local_scalar_dense.default: "a value read by the host (.item(), int(), bool(), float())",
    aten.nonzero.default: "nonzero (its shape is the data's)",
    aten.masked_select.default: "masked_select (its shape is the data's)",
    aten._unique2.default: "unique (its shape is the data's)",
    aten.unique_consecutive.default: "unique_consecutive (its shape is the data's)",
    aten.unique_dim.default: "unique (its shape is the data's)",
    aten.bincount.default: "bincount (its length is the data's)",
    aten.equal.default: "equal (a value read by the host)",
    aten.is_nonzero.default: "a value read by the host (bool())",
}
COPIES = (aten._to_copy.default, aten.copy_.default)
INDEXING = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)


class DeviceMismatch(RuntimeError):
    """An op CUDA would refuse: its tensors on both the host and the device."""


class Crossing(AssertionError):
    """A host<->device crossing inside a replay region."""


@dataclass(frozen=True)
class Event:
    kind: str  # "sync", "host_to_device", "device_to_host"
    op: str
    what: str  # the tensor's shape and dtype, and why it crosses
    nbytes: int = 0
    region: str | None = None  # the innermost ``FakeCuda.region`` it happened in

    def __str__(self) -> str:
        return f"{self.kind} in {self.op}: {self.what}" + (f" (in {self.region})" if self.region else "")


def describe(t: torch.Tensor) -> str:
    return f"{t.device.type} tensor {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"


class FakeCudaTensor(torch.Tensor):
    """A tensor on the fake ``cuda:0``; its values are ``elem``'s, a CPU tensor."""

    elem: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl
    active: FakeCuda | None = None  # the mode in force (for the methods that never dispatch)

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> FakeCudaTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device=CUDA, requires_grad=elem.requires_grad,
        )  # fmt: skip
        wrapper.elem = elem
        return wrapper

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(f"{func} on a fake CUDA tensor outside FakeCuda")

    def __repr__(self) -> str:  # type: ignore[override]
        return f"FakeCudaTensor({self.elem!r})"

    def data_ptr(self) -> int:
        return self.elem.data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        return self.elem.untyped_storage()

    def tolist(self) -> Any:
        self._crossing(Event("sync", "tolist", f"{describe(self)} read by the host"))
        return self.elem.tolist()

    def numpy(self, *, force: bool = False) -> Any:
        raise TypeError(f"can't convert {describe(self)} to numpy: copy it to the host first (.cpu())")

    def _crossing(self, event: Event) -> None:
        if FakeCudaTensor.active is not None:
            FakeCudaTensor.active.cross(event)


def values(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a CPU tensor (a fake CUDA tensor's own; any other tensor itself), anywhere."""
    return t.elem if isinstance(t, FakeCudaTensor) else t


def _unwrap(t: Any) -> Any:
    return t.elem if isinstance(t, FakeCudaTensor) else t


def _is_cuda(device: Any) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class FakeStream:
    """``torch.cuda.Stream``: work is done in order at once; ``synchronize`` is a sync."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = CUDA

    def wait_event(self, event: Any) -> None: ...
    def wait_stream(self, stream: Any) -> None: ...

    def record_event(self, event: Any = None) -> FakeEvent:
        return event or FakeEvent()

    def synchronize(self) -> None:
        _sync("Stream.synchronize")

    def query(self) -> bool:
        return True


class FakeEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None: ...
    def record(self, stream: Any = None) -> None: ...
    def wait(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None:
        _sync("Event.synchronize")

    def query(self) -> bool:
        return True


def _sync(op: str) -> None:
    if FakeCudaTensor.active is not None:
        FakeCudaTensor.active.cross(Event("sync", op, "the host waits for the device"))


class FakeCuda(TorchDispatchMode):
    """See the module. ``crossings``: every crossing so far (outside replays); ``pinned``: the pinned
    host storages (their data pointers and sizes); ``device_bytes``: what was allocated on the device."""

    def __init__(self) -> None:
        super().__init__()
        self.crossings: list[Event] = []
        self.pinned: dict[int, int] = {}  # start address -> bytes
        self.device_bytes = 0  # bytes of the tensors made on the device (views of host memory aside)
        self._replay: str | None = None
        self._regions: list[str] = []
        self._patches = contextlib.ExitStack()

    # --- what a test asks -------------------------------------------------------------------------

    @contextlib.contextmanager
    def replay(self, what: str) -> Iterator[None]:
        """A region that runs as a CUDA graph replay: any crossing raises ``Crossing``."""
        before, self._replay = self._replay, what
        try:
            yield
        finally:
            self._replay = before

    @contextlib.contextmanager
    def region(self, name: str) -> Iterator[None]:
        """Crossings inside are tagged ``name`` (a place where the design names the copies it makes)."""
        self._regions.append(name)
        try:
            yield
        finally:
            self._regions.pop()

    def take(self) -> list[Event]:
        """The crossings recorded since the last ``take``."""
        taken, self.crossings = self.crossings, []
        return taken

    def cross(self, event: Event) -> None:
        if self._replay is not None:
            raise Crossing(f"{self._replay}: {event}")
        if self._regions:
            event = dataclasses.replace(event, region=self._regions[-1])
        self.crossings.append(event)

    def is_pinned(self, t: torch.Tensor) -> bool:
        address = t.untyped_storage().data_ptr()
        return any(start <= address < start + size for start, size in self.pinned.items())

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """Mark ``t``'s host memory pinned (``cudaHostRegister``)."""
        storage = t.untyped_storage()
        self.pinned[storage.data_ptr()] = storage.nbytes()
        return t

    # --- the mode ---------------------------------------------------------------------------------

    def __enter__(self) -> FakeCuda:
        patches = self._patches
        cuda = torch.cuda
        patches.enter_context(mock.patch.object(cuda, "_lazy_init", lambda: None))
        patches.enter_context(mock.patch.object(cuda, "is_available", lambda: True))
        patches.enter_context(mock.patch.object(cuda, "device_count", lambda: 1))
        patches.enter_context(mock.patch.object(cuda, "current_device", lambda: 0))
        patches.enter_context(mock.patch.object(cuda, "Stream", FakeStream))
        patches.enter_context(mock.patch.object(cuda, "Event", FakeEvent))
        patches.enter_context(mock.patch.object(cuda, "current_stream", lambda device=None: FakeStream()))
        patches.enter_context(mock.patch.object(cuda, "stream", lambda stream=None: contextlib.nullcontext()))
        patches.enter_context(
            mock.patch.object(cuda, "synchronize", lambda device=None: _sync("synchronize"))
        )
        patches.enter_context(mock.patch.object(cuda, "cudart", lambda: self._cudart()))
        # sgl-kernel-oasis's Triton kernels cannot launch here: its ops take the torch forms
        from sgl_kernel_oasis import ops

        patches.enter_context(mock.patch.object(ops, "uses_triton", lambda tensor: False))
        patches.enter_context(mock.patch.object(ops, "_impl", lambda tensor: None))
        from sglang_oasis.memory import pinned_host

        patches.enter_context(mock.patch.object(pinned_host, "cuda_view", self._cuda_view))
        torch._C._ensureCUDADeviceGuardSet()
        self._lift = torch._C._only_lift_cpu_tensors()
        torch._C._set_only_lift_cpu_tensors(True)  # torch.tensor(..., device="cuda"): made on the host
        FakeCudaTensor.active = self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        FakeCudaTensor.active = None
        torch._C._set_only_lift_cpu_tensors(self._lift)
        self._patches.close()

    def _cudart(self) -> SimpleNamespace:
        """The two CUDA runtime calls page-locking needs, on the fake device."""

        def register(address: int, nbytes: int, flags: int) -> int:
            self.pinned[address] = nbytes
            return 0

        return SimpleNamespace(cudaHostRegister=register, cudaHostUnregister=lambda address: 0)

    def _cuda_view(self, host: torch.Tensor) -> torch.Tensor:
        """``pinned_host.cuda_view``: the device's view of pinned ``host`` memory, the same memory."""
        if not self.is_pinned(host):
            raise RuntimeError(f"cuda_view of {describe(host)}: not pinned (CUDA refuses the pointer)")
        return FakeCudaTensor(host)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_cuda = [t for t in flat if isinstance(t, FakeCudaTensor)]
        on_cpu = [t for t in flat if not isinstance(t, FakeCudaTensor) and t.dim() > 0]
        if func is aten.is_pinned.default:
            return not on_cuda and self.is_pinned(args[0])
        if func is aten._pin_memory.default:
            return self.pin(args[0].clone())
        target = kwargs.get("device")
        pinned = bool(kwargs.pop("pin_memory", None))
        if _is_cuda(target):
            kwargs["device"] = torch.device("cpu")
        self._check(func, name, args, on_cuda, on_cpu, target)
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if pinned and isinstance(out, torch.Tensor):
            self.pin(out)
        if _is_cuda(target) and isinstance(out, torch.Tensor):  # made on the device (not a view)
            self.device_bytes += out.nbytes
        if func is aten._to_copy.default:
            cuda_out = _is_cuda(target) if target is not None else bool(on_cuda)
        else:
            cuda_out = bool(on_cuda) or _is_cuda(target)
        if not cuda_out:
            return out
        wrappers = {id(t.elem): t for t in on_cuda}  # an in-place op returns its argument itself

        def wrap(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            same = wrappers.get(id(t))
            return FakeCudaTensor(t) if same is None else same

        return tree_map(wrap, out)

    def _check(
        self, func: Any, name: str, args: Any, on_cuda: list[torch.Tensor], on_cpu: list[torch.Tensor],
        target: Any,
    ) -> None:  # fmt: skip
        """Raise what CUDA would refuse; record what it would pay."""
        if func in COPIES:
            source, dest = (args[1], args[0]) if func is aten.copy_.default else (args[0], None)
            to_cuda = isinstance(dest, FakeCudaTensor) if dest is not None else _is_cuda(target)
            to_host = (dest is not None and not isinstance(dest, FakeCudaTensor)) or (
                dest is None and target is not None and not _is_cuda(target)
            )
            if isinstance(source, FakeCudaTensor) and to_host:
                self.cross(Event("device_to_host", name, describe(source), source.nbytes))
            elif not isinstance(source, FakeCudaTensor) and to_cuda and isinstance(source, torch.Tensor):
                self.cross(Event("host_to_device", name, describe(source), source.nbytes))
            return
        if not on_cuda:
            return
        if func in SYNCING:
            self.cross(Event("sync", name, f"{SYNCING[func]} of {describe(on_cuda[0])}"))
        if func is aten.repeat_interleave.Tensor and args and isinstance(args[0], FakeCudaTensor):
            self.cross(Event("sync", name, f"repeat_interleave without output_size of {describe(args[0])}"))
        if func in INDEXING:
            self._check_index(func, name, args)
            return
        if on_cpu:
            raise DeviceMismatch(
                f"{name}: tensors on two devices, {', '.join(describe(t) for t in [*on_cuda, *on_cpu])}"
            )

    def _check_index(self, func: Any, name: str, args: Any) -> None:
        source, indices = args[0], [i for i in (args[1] or ()) if isinstance(i, torch.Tensor)]
        values = args[2] if func is not aten.index.Tensor and len(args) > 2 else None
        if not isinstance(source, FakeCudaTensor):
            if any(isinstance(i, FakeCudaTensor) for i in [*indices, values]):
                raise DeviceMismatch(f"{name}: a host tensor {describe(source)} indexed by device tensors")
            return
        if isinstance(values, torch.Tensor) and not isinstance(values, FakeCudaTensor) and values.dim() > 0:
            raise DeviceMismatch(f"{name}: {describe(values)} written into {describe(source)}")
        for index in indices:
            if index.dtype == torch.bool and isinstance(index, FakeCudaTensor):
                self.cross(Event("sync", name, f"a boolean mask {describe(index)} (its shape is the data's)"))
            elif not isinstance(index, FakeCudaTensor):
                what = f"a host index {describe(index)} into {describe(source)}"
                self.cross(Event("host_to_device", name, what, index.nbytes))


@functools.cache
def available() -> bool:
    """Whether this torch can make fake CUDA tensors (a CUDA build; torch's CPU build has no CUDA guard)."""
    try:
        with FakeCuda():
            torch.zeros(1, device="cuda")
        return True
    except Exception:
        return False
