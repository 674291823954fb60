"""What this CPU computes fastest: the served dtype and the intra-op thread count on SGLang's CPU engine.

A checkpoint stored in float32 is served in float16 by SGLang's ``--dtype auto`` rule. On a CPU without
native half-precision matrix arithmetic, torch computes float16 and bfloat16 matrix products by
converting to float32 on the fly, ~3.5x slower than plain float32 (on an AVX2 CPU a 3.4K-token prompt on
SmolLM2-135M takes 181 s in float16 and 51 s in float32). So the launcher serves float32 unless the CPU
has native support for a half type: AMX (``amx_bf16`` / ``amx_fp16``) or AVX-512 with BF16 / FP16
instructions.

The thread count is the number of cores this process may use (CPU affinity and a cgroup CPU quota both
bound it), split across model ranks. Prefill dominates a long prompt's time and scales with threads (on
2 cores, 2 threads prefill 1.6-1.9x faster than 1, while decode gains at 4K contexts and loses at 1K:
``benchmark/bench_cpu_serving.py --threads 2,1``), so every core it is.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import NamedTuple

# Native half-precision matrix support, by torch dtype name, best first: (flag, dtype).
_HALF_FLAGS = (
    ("amx_bf16", "bfloat16"),
    ("avx512_bf16", "bfloat16"),
    ("amx_fp16", "float16"),
    ("avx512_fp16", "float16"),
)


class DtypeChoice(NamedTuple):
    dtype: str
    reason: str


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The instruction-set flags of the first CPU in ``cpuinfo`` (empty when it cannot be read)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):  # x86, arm64
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def fastest_dtype(flags: frozenset[str]) -> DtypeChoice:
    """The dtype that matrix work on a CPU with these flags computes fastest, and why."""
    for flag, dtype in _HALF_FLAGS:
        if flag in flags:
            return DtypeChoice(dtype, f"the CPU has native {dtype} matrix support ({flag})")
    return DtypeChoice(
        "float32",
        "the CPU has no native bfloat16/float16 matrix support (no AMX, AVX512-BF16 or AVX512-FP16), "
        "where float16 runs ~3.5x slower than float32",
    )


def cgroup_cpu_limit(cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int | None:
    """Cores allowed by a cgroup v2 CPU quota (``quota period``, rounded up), or None if unlimited."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, math.ceil(int(quota) / int(period)))


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, bounded by a cgroup quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return min(cores, limit) if limit is not None else cores


def intra_op_threads(cores: int, ranks: int = 1) -> int:
    """OpenMP threads per model rank: every usable core, shared evenly between the ranks."""
    return max(1, cores // max(1, ranks))


def numa_nodes(root: Path = Path("/sys/devices/system/node")) -> int:
    """NUMA nodes of this machine (1 when it cannot be read)."""
    try:
        return max(
            1,
            sum(1 for entry in root.iterdir() if entry.name[4:].isdigit() and entry.name.startswith("node")),
        )
    except OSError:
        return 1


def rank_core_binding(cores: list[int], ranks: int) -> str:
    """SGLang's ``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` model ranks on these cores: consecutive
    equal shares (``"0-7|8-15"``); with more ranks than cores, one core each, taken in turn, so ranks
    share a core (2 cores, 3 ranks: ``"0|1|0"``)."""
    if not cores or ranks < 1:
        raise ValueError(f"no cores ({cores}) or no ranks ({ranks}) to bind")
    per_rank = max(1, len(cores) // ranks)
    shares = []
    for rank in range(ranks):
        start = (rank * per_rank) % len(cores)
        share = cores[start : start + per_rank]
        contiguous = share == list(range(share[0], share[0] + len(share)))
        if len(share) == 1:
            shares.append(str(share[0]))
        else:
            shares.append(f"{share[0]}-{share[-1]}" if contiguous else ",".join(map(str, share)))
    return "|".join(shares)
