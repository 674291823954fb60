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
