"""The launcher's CPU choices: the dtype the CPU computes fastest and the intra-op thread count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_oasis.launcher.argv import model_ranks, option_value
from sglang_oasis.launcher.cpu_engine import (
    CPU_BIND_ENV,
    TP_MEMORY_CHECK_ENV,
    cpu_binding_env,
    cpu_dtype_args,
    cpu_memory_check_env,
    cpu_threads_env,
)
from sglang_oasis.memory.host_tier import kv_footprint
from sglang_oasis.platform.cpu import capabilities
from sglang_oasis.platform.cpu.capabilities import (
    cgroup_cpu_limit,
    cpu_flags,
    fastest_dtype,
    intra_op_threads,
)
from sglang_oasis.server_process import child_env


@pytest.mark.parametrize(
    ("flags", "dtype"),
    [
        (set(), "float32"),
        ({"fma", "avx", "f16c", "avx2"}, "float32"),  # these machines: AVX2 converts halves, no arithmetic
        ({"avx2", "avx512f", "avx512bw"}, "float32"),  # AVX-512 without BF16/FP16 instructions
        ({"avx512f", "avx512_bf16"}, "bfloat16"),
        ({"avx512f", "avx512_fp16"}, "float16"),
        ({"amx_tile", "amx_bf16", "amx_fp16", "avx512_fp16"}, "bfloat16"),
        ({"amx_fp16"}, "float16"),
    ],
)
def test_fastest_dtype_follows_native_half_precision_support(flags: set[str], dtype: str) -> None:
    choice = fastest_dtype(frozenset(flags))
    assert choice.dtype == dtype
    assert choice.reason  # printed by the launcher


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 amx_bf16\n\nflags : other\n"
    )
    assert cpu_flags(cpuinfo) == frozenset({"fpu", "avx2", "amx_bf16"})
    arm = tmp_path / "arm"
    arm.write_text("processor : 0\nFeatures : fp asimd bf16\n")
    assert "bf16" in cpu_flags(arm)
    assert cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.parametrize(
    ("text", "cores"), [("max 100000\n", None), ("150000 100000\n", 2), ("50000 100000", 1)]
)
def test_cgroup_quota_bounds_the_cores(tmp_path: Path, text: str, cores: int | None) -> None:
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(text)
    assert cgroup_cpu_limit(cpu_max) == cores
    assert cgroup_cpu_limit(tmp_path / "none") is None


def test_threads_share_the_cores_between_ranks() -> None:
    assert intra_op_threads(2) == 2
    assert intra_op_threads(2, ranks=2) == 1
    assert intra_op_threads(1, ranks=4) == 1
    assert intra_op_threads(16, ranks=3) == 5
    assert model_ranks([]) == 1
    assert model_ranks(["--tp-size", "2", "--dp", "2"]) == 4
    assert model_ranks(["--tensor-parallel-size=3"]) == 3


def test_dtype_is_chosen_only_when_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sglang_oasis.launcher.cpu_engine.cpu_flags", lambda: frozenset({"avx2"}))
    assert cpu_dtype_args([]) == ["--dtype", "float32"]
    monkeypatch.setattr("sglang_oasis.launcher.cpu_engine.cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert cpu_dtype_args([]) == ["--dtype", "bfloat16"]
    assert cpu_dtype_args(["--dtype", "float16"]) == []
    assert cpu_dtype_args(["--dtype=auto"]) == []  # SGLang's own rule, asked for by name


def test_threads_are_chosen_only_when_not_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sglang_oasis.launcher.cpu_engine.usable_cores", lambda: 2)
    monkeypatch.setenv("OMP_NUM_THREADS", "unset")  # restored as it was after the test (see below)
    monkeypatch.delenv("OMP_NUM_THREADS")
    cpu_threads_env(["--tp-size", "2"])
    assert os.environ["OMP_NUM_THREADS"] == "1"
    monkeypatch.delenv("OMP_NUM_THREADS")
    cpu_threads_env([])
    assert os.environ["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    cpu_threads_env([])
    assert os.environ["OMP_NUM_THREADS"] == "7"


def test_the_host_tier_is_sized_in_the_chosen_dtype(tiny_qwen3_dir: Path) -> None:
    """The launcher's whole preparation (in a fresh process, as at start-up): the dtype it picks for this
    CPU is on SGLang's command line, and the host tier it announces is sized in that dtype's bytes."""
    script = (
        "import json, os, sys; from sglang_oasis.launch_server import prepare; "
        "_, argv = prepare(sys.argv[1:]); print(json.dumps([argv, os.environ['OMP_NUM_THREADS']]))"
    )
    env = {key: value for key, value in child_env().items() if key != "OMP_NUM_THREADS"}
    result = subprocess.run(
        [sys.executable, "-c", script, "--model-path", str(tiny_qwen3_dir), "--device", "cpu"],
        capture_output=True, text=True, timeout=120, env=env, check=True,
    )  # fmt: skip
    argv, threads = json.loads(result.stdout.splitlines()[-1])
    dtype = fastest_dtype(cpu_flags()).dtype
    assert option_value(argv, "--dtype") == dtype
    footprint = kv_footprint(tiny_qwen3_dir, dtype=dtype)
    assert footprint is not None
    assert f"at {footprint.bytes_per_token} KV bytes per token" in result.stderr
    assert f"dtype {dtype}: " in result.stderr
    assert threads == str(intra_op_threads(capabilities.usable_cores()))


def test_ranks_are_bound_to_shares_of_the_usable_cores() -> None:
    """SGLang's ``SGLANG_CPU_OMP_THREADS_BIND`` (one core list per rank, ``|``-separated): equal shares of
    consecutive cores; with more ranks than cores, one core each in turn, so ranks share a core."""
    assert capabilities.rank_core_binding([0, 1], 3) == "0|1|0"
    assert capabilities.rank_core_binding([0, 1], 2) == "0|1"
    assert capabilities.rank_core_binding(list(range(16)), 2) == "0-7|8-15"
    assert capabilities.rank_core_binding(list(range(16)), 3) == "0-4|5-9|10-14"
    assert capabilities.rank_core_binding([0, 2, 4, 6], 2) == "0,2|4,6"
    with pytest.raises(ValueError, match="no cores"):
        capabilities.rank_core_binding([], 2)


def test_numa_nodes_are_counted_from_sysfs(tmp_path: Path) -> None:
    for name in ("node0", "node1", "possible", "has_cpu"):
        (tmp_path / name).mkdir()
    assert capabilities.numa_nodes(tmp_path) == 2
    assert capabilities.numa_nodes(tmp_path / "absent") == 1


def test_ranks_are_bound_only_when_they_outnumber_the_numa_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """More ranks than NUMA nodes: SGLang refuses to start without a binding, so the launcher makes one
    (unless one is set); up to one rank per node SGLang binds each rank to its node itself."""
    monkeypatch.setattr("sglang_oasis.launcher.cpu_engine.usable_cores", lambda: 2)
    monkeypatch.setattr("sglang_oasis.launcher.cpu_engine.numa_nodes", lambda: 1)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    # setenv first: monkeypatch then restores the variable as it was (absent) after the test, also after
    # cpu_binding_env set it (a delenv of an absent variable records nothing, and the binding leaked into
    # the servers later tests start)
    monkeypatch.setenv(CPU_BIND_ENV, "unset")
    monkeypatch.delenv(CPU_BIND_ENV)
    cpu_binding_env([])
    assert CPU_BIND_ENV not in os.environ
    cpu_binding_env(["--tp-size", "3"])
    assert os.environ[CPU_BIND_ENV] == "0|1|0"
    monkeypatch.setenv(CPU_BIND_ENV, "1|1|1")
    cpu_binding_env(["--tp-size", "3"])
    assert os.environ[CPU_BIND_ENV] == "1|1|1"
    monkeypatch.delenv(CPU_BIND_ENV)
    monkeypatch.setattr("sglang_oasis.launcher.cpu_engine.numa_nodes", lambda: 2)
    cpu_binding_env(["--tp-size", "2"])
    assert CPU_BIND_ENV not in os.environ


def test_tensor_parallel_ranks_on_the_cpu_warn_of_a_memory_imbalance_instead_of_failing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """All CPU ranks read the same host RAM at different instants: SGLang's balance check (fail when the
    least free memory any rank read is under 90% of this rank's reading) failed a TP start whenever a
    process allocated in between (CI, with the other lane's server starting). The launcher turns it into
    SGLang's warning for more than one rank, unless set; SGLang must still read that variable."""
    from sglang.srt.distributed import bootstrap

    monkeypatch.setenv(TP_MEMORY_CHECK_ENV, "unset")  # restored as absent afterwards (see above)
    monkeypatch.delenv(TP_MEMORY_CHECK_ENV)
    cpu_memory_check_env([])
    assert TP_MEMORY_CHECK_ENV not in os.environ
    cpu_memory_check_env(["--tp-size", "2"])
    assert os.environ[TP_MEMORY_CHECK_ENV] == "false"
    bootstrap._check_tp_memory_balance(pre_model_load_memory=14.3, local_gpu_memory=16.8)  # CI's reading
    monkeypatch.setenv(TP_MEMORY_CHECK_ENV, "true")
    cpu_memory_check_env(["--tp-size", "2"])
    assert os.environ[TP_MEMORY_CHECK_ENV] == "true"
    with pytest.raises(RuntimeError, match="memory capacity is unbalanced"):
        bootstrap._check_tp_memory_balance(pre_model_load_memory=14.3, local_gpu_memory=16.8)
