"""The two Mooncake wheels and the rule that only one may be installed.

``mooncake-transfer-engine`` (CUDA build; extra ``mooncake-cuda``) and
``mooncake-transfer-engine-non-cuda`` (extra ``mooncake-cpu``) both install the same top-level
``mooncake`` package: with both, whichever was installed last wins, and uninstalling either breaks the
other. pip does not prevent it, so sglang-oasis checks when it starts and when its disaggregation code
is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

CPU_BUILD = "mooncake-transfer-engine-non-cuda"
CUDA_BUILD = "mooncake-transfer-engine"


class ConflictingMooncakeBuilds(ImportError):
    pass


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_single_mooncake_build(installed: Callable[[str], str | None] = _installed) -> str | None:
    """Returns the installed build's name (None if neither); raises if both are installed."""
    cpu, cuda = installed(CPU_BUILD), installed(CUDA_BUILD)
    if cpu and cuda:
        raise ConflictingMooncakeBuilds(
            f"both Mooncake builds are installed ({CPU_BUILD}=={cpu} and {CUDA_BUILD}=={cuda}); they ship "
            f"the same 'mooncake' package, so keep one: pip uninstall -y {CPU_BUILD} {CUDA_BUILD}, then "
            "install sglang-oasis[mooncake-cpu] (no GPU) or sglang-oasis[mooncake-cuda] (GPU)"
        )
    return CPU_BUILD if cpu else CUDA_BUILD if cuda else None


# Shared libraries the Mooncake transfer engine loads that no wheel ships: (soname, Debian package).
SYSTEM_LIBRARIES = (("libibverbs.so.1", "libibverbs1"),)


class MissingSystemLibrary(ImportError):
    pass


def _loadable(soname: str) -> bool:
    import ctypes

    try:
        ctypes.CDLL(soname)
    except OSError:
        return False
    return True


def check_system_libraries(loadable: Callable[[str], bool] | None = None) -> None:
    """Raises naming the Debian package to install when a library the transfer engine needs is missing
    (without it, SGLang's mooncake backend fails deep inside start-up with "Please install mooncake")."""
    loadable = loadable or _loadable
    missing = [(soname, package) for soname, package in SYSTEM_LIBRARIES if not loadable(soname)]
    if missing:
        sonames = ", ".join(soname for soname, _ in missing)
        packages = " ".join(package for _, package in missing)
        raise MissingSystemLibrary(
            f"the Mooncake transfer engine (prefill/decode disaggregation) needs {sonames}, which this "
            f"machine lacks: apt-get install -y {packages}  (as root; scripts/bootstrap.sh does it when run as root)"
        )
