"""The launcher on SGLang's CPU engine: whether to use it, and the defaults it adds there (each given
option overrides its default): device, attention backend, KV cap, idle sleep, the dtype the CPU computes
fastest, intra-op threads and their core binding, the captured decode step and what it compiles before
the server is ready."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from sglang_oasis.config import DECODE_STEPS, OasisConfig
from sglang_oasis.launcher.argv import LaunchError, given, model_ranks, option_value, option_values, say
from sglang_oasis.paths import cache_root
from sglang_oasis.platform.cpu.capabilities import (
    cpu_flags,
    fastest_dtype,
    intra_op_threads,
    numa_nodes,
    rank_core_binding,
    usable_cores,
)
from sglang_oasis.platform.cpu.import_hook import CPU_ENGINE_ENV

CPU_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"  # SGLang's per-rank core lists, "|"-separated
TP_MEMORY_CHECK_ENV = "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"  # SGLang's spelling
DECODE_STEP_ENV = "SGLANG_OASIS_CPU_DECODE_STEP"
WARMUP_TIMEOUT_ENV = "SGLANG_WARMUP_TIMEOUT"  # SGLang's: seconds its warm-up request may take (600 unset)
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def gpu_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def wants_cpu(sglang_argv: Sequence[str]) -> bool:
    """CPU engine when asked for (``--device cpu`` or ``SGLANG_USE_CPU_ENGINE=1``) or when there is no GPU."""
    device = option_value(sglang_argv, "--device")
    if device is not None:
        return device == "cpu"
    return os.environ.get(CPU_ENGINE_ENV) == "1" or not gpu_available()


def cpu_defaults(sglang_argv: Sequence[str], config: OasisConfig) -> list[str]:
    """SGLang arguments to add on CPU: only those the user did not give."""
    extra: list[str] = []
    if not given(sglang_argv, "--device"):
        extra += ["--device", "cpu"]
    if (
        option_value(sglang_argv, "--disaggregation-mode") == "decode"
        and not given(sglang_argv, "--disaggregation-decode-retraction-backup")
        and not given(sglang_argv, "--disaggregation-decode-enable-radix-cache")
    ):
        # SGLang's default backup for retracted PD-decode requests is a CUDA-registered host pool.
        extra += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    if not config.cpu_defaults:
        return extra
    if not given(sglang_argv, "--attention-backend"):
        # SGLang's CPU default backend (intel_amx) needs AMX, which these machines lack.
        extra += ["--attention-backend", "torch_native"]
    if not (given(sglang_argv, "--max-total-tokens") or given(sglang_argv, "--mem-fraction-static")):
        # Uncapped, SGLang's CPU engine takes ~72% of RAM for the KV pool.
        extra += ["--max-total-tokens", str(config.cpu_max_total_tokens)]
    if not given(sglang_argv, "--sleep-on-idle"):
        # Otherwise the idle scheduler spins a whole core.
        extra += ["--sleep-on-idle"]
    return extra


def cpu_dtype_args(sglang_argv: Sequence[str]) -> list[str]:
    """``--dtype`` the CPU computes fastest, unless one is given (SGLang's ``auto`` serves a float32
    checkpoint in float16, ~3.5x slower than float32 on CPUs without native half-precision matrices)."""
    if given(sglang_argv, "--dtype"):
        return []
    choice = fastest_dtype(cpu_flags())
    say(f"dtype {choice.dtype}: {choice.reason} (--dtype overrides)")
    return ["--dtype", choice.dtype]


def cpu_decode_step(argv: Sequence[str], config: OasisConfig) -> OasisConfig:
    """The CPU default of ``--oasis-decode-step`` (sparse mode), or ``$SGLANG_OASIS_CPU_DECODE_STEP``:
    ``captured`` with the summaries (its TPOT 0.69-0.93x the eager step's, docs/results.md), ``eager``
    with ``--oasis-selector codes`` (the eager step scores the codes on the pipeline's thread beside the
    model's, the captured step inline: 4 x 3K, TPOT against dense cold / warm 0.68 / 0.76 against 0.75 /
    0.78 in one run, 0.78 / 0.77 against 0.81 / 0.78 in another; and no compiles before ready); none
    where the option is given, with ``--oasis-adaptive-cap`` or ``--oasis-selector oracle`` (which the
    captured step refuses) or with no fetch cap
    (``--oasis-fetch-ratio 1``: its fixed shape then copies a whole working set per head every step, 1.68x
    dense against the eager step's ~1.3x). Its compiles (``compile_plan``)
    go to a cache that outlives reboots (``$TORCHINDUCTOR_CACHE_DIR``, unless set: torch's under the
    project's cache)."""
    if config.decode_step == "captured" and config.fetch_ratio >= 1:
        say(
            "--oasis-decode-step captured with --oasis-fetch-ratio 1: the fixed shape copies a whole working set "
            "per KV head every step (1.68x dense's TPOT measured, the eager step ~1.3x); a fetch cap is faster"
        )
    eager_only = config.adaptive_cap or config.oracle  # the captured step refuses
    if given(argv, "--oasis-decode-step") or eager_only or config.fetch_ratio >= 1:
        return config
    chosen = os.environ.get(DECODE_STEP_ENV)
    step = chosen or ("eager" if config.selector == "codes" else "captured")
    if step not in DECODE_STEPS:
        raise LaunchError(f"{DECODE_STEP_ENV}={step!r} is not one of {', '.join(DECODE_STEPS)}")
    if chosen:
        say(f"--oasis-decode-step {step} ({DECODE_STEP_ENV})")
    elif step == "eager":
        say(
            "--oasis-decode-step eager: with --oasis-selector codes the eager step is the faster on CPU (its "
            "pipeline's thread scores the codes beside the model's); --oasis-decode-step captured compiles one"
        )
    return dataclasses.replace(config, decode_step=step)


def compile_plan(sglang_argv: Sequence[str], config: OasisConfig) -> str:
    """What the captured step compiles before the server is ready (``attention/compile_ahead.py``), and
    about how long it takes, for the launcher to say; SGLang's warm-up (where it compiles) may take that
    long (``SGLANG_WARMUP_TIMEOUT``, unless set)."""
    # first: importing torch._dynamo (compile_ahead does) sets torch's default (/tmp/torchinductor_$USER);
    # a parent process that imported it (pytest, a script) passes that default on: no choice of the user's
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get(INDUCTOR_CACHE_ENV) == os.path.abspath(default_cache_dir()):
        del os.environ[INDUCTOR_CACHE_ENV]
    cache = os.environ.setdefault(INDUCTOR_CACHE_ENV, str(cache_root() / "torchinductor"))
    from sglang_oasis.attention.compile_ahead import buckets_ahead, graphs_ahead, kinds_ahead
    from sglang_oasis.attention.step_plan import powers_of_two

    running = option_value(sglang_argv, "--max-running-requests")
    cap = int(running) if running and running.isdigit() else 1
    max_bs = option_value(sglang_argv, "--cuda-graph-max-bs-decode")
    sizes = [int(n) for n in option_values(sglang_argv, "--cuda-graph-bs-decode") if n.isdigit()]
    buckets = buckets_ahead(
        powers_of_two(1, cap), cap, int(max_bs) if max_bs and max_bs.isdigit() else None, sizes
    )  # as the server will (CompileAhead.for_server)
    kinds = kinds_ahead(config.verify_rows > 0, config.recall_sample_every > 0)
    programs, graphs = len(buckets) * len(kinds), graphs_ahead(buckets, kinds)
    os.environ.setdefault(WARMUP_TIMEOUT_ENV, str(max(600, 60 * programs)))
    return (
        f"--oasis-decode-step captured: {programs} programs compile before the server is ready (batch buckets "
        f"{', '.join(map(str, buckets))}; {' and '.join(kinds)} passes) as {graphs} graphs: ~20 s each the "
        f"first time on 2 cores, ~2 s each from {cache} (--cuda-graph-max-bs-decode N compiles fewer: larger "
        "batches decode eagerly; --oasis-decode-step eager compiles none)"
    )


def cpu_threads_env(sglang_argv: Sequence[str]) -> None:
    """``OMP_NUM_THREADS`` (inherited by SGLang's spawned processes) from the usable cores, unless set."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores, ranks = usable_cores(), model_ranks(sglang_argv)
    threads = intra_op_threads(cores, ranks)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    say(
        f"{threads} intra-op thread(s) per model rank: {cores} usable core(s), {ranks} rank(s) (OMP_NUM_THREADS overrides)"
    )


def cpu_binding_env(sglang_argv: Sequence[str]) -> None:
    """``SGLANG_CPU_OMP_THREADS_BIND`` from the usable cores when SGLang would need it (more model ranks
    than NUMA nodes: it binds one rank per node by itself otherwise), unless set."""
    ranks = model_ranks(sglang_argv)
    if ranks <= numa_nodes() or CPU_BIND_ENV in os.environ:
        return
    cores = sorted(os.sched_getaffinity(0))[: usable_cores()]
    os.environ[CPU_BIND_ENV] = binding = rank_core_binding(cores, ranks)
    shared = " (ranks share cores: more ranks than cores)" if ranks > len(cores) else ""
    say(f"{CPU_BIND_ENV}={binding}: {ranks} ranks on cores {cores}{shared} ({CPU_BIND_ENV} overrides)")


def cpu_memory_check_env(sglang_argv: Sequence[str]) -> None:
    """SGLang's tensor-parallel memory balance check as a warning, not a start-up failure, unless set.

    It compares the least memory any rank found free with this rank's own reading and fails below 90%:
    on a GPU, another process holds one of the devices. On the CPU engine every rank reads the same host
    RAM at a different instant, so any process allocating between two readings failed the start (CI
    did, with a server of the other test lane starting beside it)."""
    if model_ranks(sglang_argv) > 1:
        os.environ.setdefault(TP_MEMORY_CHECK_ENV, "false")


def check_cpu_graphs(sglang_argv: Sequence[str], config: OasisConfig) -> None:
    """``--enable-torch-compile`` on SGLang's CPU engine runs its CPU graph runner, which needs the
    attention backend's CPU graph hooks (``init_cpu_graph_state``...): neither torch_native (dense mode)
    nor oasis (sparse: its decode step is not a captured graph yet) has them, and the server would crash
    as it starts. Refused here, by name."""
    if not given(sglang_argv, "--enable-torch-compile"):
        return
    why = (
        "sparse mode's decode step does not run under SGLang's CPU graph runner yet"
        if config.mode == "sparse"
        else "SGLang's torch_native attention backend (dense mode on CPU) has no CPU graph support"
    )
    raise LaunchError(f"--enable-torch-compile: {why}; serve without it (the CPU engine runs eagerly)")
