"""Where sglang-oasis keeps what it prepares once per machine (models, venvs)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SGLANG_OASIS_CACHE"


def cache_root() -> Path:
    """``$SGLANG_OASIS_CACHE`` or ``~/.cache/sglang-oasis``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sglang-oasis")
