"""Serve ``import sgl_kernel`` from the pure-torch stand-in when SGLang runs on its CPU engine.

Installed at interpreter start-up (``sglang_oasis/_startup.py``) and again by the SGLang plugin, so it
is in place in every server process. Stays import-light: torch is only imported when SGLang itself
imports ``sgl_kernel``.

Names that the stand-in implements resolve to the implementation; any other name behaves as absent
(an ImportError / AttributeError), so SGLang's own fallbacks for missing kernels take over.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
STANDIN_ROOT = "sgl_kernel"
_IMPLEMENTATION = "sglang_oasis.platform.cpu.sgl_kernel_ops"


def cpu_engine_requested() -> bool:
    """True when SGLang will take its CPU path (the same test as ``sglang.srt.utils.is_cpu``)."""
    return os.environ.get(CPU_ENGINE_ENV, "0") == "1"


class StandinModule(types.ModuleType):
    """``sgl_kernel`` or one of its submodules: the implemented names; every other name is absent."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        ops = importlib.import_module(_IMPLEMENTATION)
        if name in ops.__all__:
            return getattr(ops, name)
        # Anything else behaves as absent, so SGLang's own ImportError fallbacks take over.
        if os.environ.get("SGLANG_OASIS_TRACE_STANDIN"):
            print(f"[sglang-oasis] sgl_kernel stand-in: no {self.__name__}.{name}", file=sys.stderr)
        raise AttributeError(
            f"module {self.__name__!r} has no attribute {name!r} (sglang-oasis CPU stand-in)"
        )


def real_submodule_names() -> frozenset[str]:
    """Module names inside the installed (CUDA-only) ``sgl_kernel`` package, found without importing it.

    The stand-in answers for exactly these, so ``from sgl_kernel.x import y`` with a missing ``y``
    fails as an ImportError (Python would otherwise retry ``sgl_kernel.x.y`` as a submodule).
    """
    spec = importlib.machinery.PathFinder.find_spec(STANDIN_ROOT)
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    names = set()
    for location in spec.submodule_search_locations:
        for entry in os.listdir(location):
            stem = entry.split(".", 1)[0]
            if stem.isidentifier() and not stem.startswith("_"):
                names.add(f"{STANDIN_ROOT}.{stem}")
    return frozenset(names)


class SglKernelStandinFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Meta-path finder answering for ``sgl_kernel`` and its first-level submodules."""

    def __init__(self) -> None:
        self._submodules: frozenset[str] | None = None

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == STANDIN_ROOT:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        if not fullname.startswith(STANDIN_ROOT + "."):
            return None
        if self._submodules is None:
            self._submodules = real_submodule_names()
        if fullname not in self._submodules:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=False)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = StandinModule(spec.name)
        if spec.submodule_search_locations is not None:
            module.__path__ = []
        module.__version__ = "sglang-oasis-cpu-standin"  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def installed() -> bool:
    return any(isinstance(finder, SglKernelStandinFinder) for finder in sys.meta_path)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (idempotent).

    A real ``sgl_kernel`` already imported in this process (it only imports where CUDA works) is left
    alone.
    """
    if installed():
        return
    sys.meta_path.insert(0, SglKernelStandinFinder())


def install_if_cpu_engine() -> bool:
    """Install the stand-in only on SGLang's CPU engine; returns whether it is active."""
    if not cpu_engine_requested():
        return False
    install()
    return True
