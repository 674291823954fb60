"""``python -m sglang_oasis.launch_server``: SGLang's server with sglang-oasis options and defaults.

Takes every SGLang server argument plus the ``--oasis-*`` options of :class:`OasisConfig`:

- without ``--model-path`` it serves the embedded default model (SmolLM2-135M-Instruct from PyPI,
  converted once into the cache);
- without a GPU (or with ``--device cpu``) it runs SGLang's CPU engine with CPU-friendly defaults,
  each of which an explicit argument overrides;
- a bad option stops start-up with a message naming it (exit status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from sglang_oasis.attention.triton_prefill import TritonPrefillError, wants_triton
from sglang_oasis.config import DECODE_STEPS, OasisConfig, OasisConfigError
from sglang_oasis.memory.device_layout import DeviceTierError, TierShape, budget_bytes
from sglang_oasis.memory.device_layout import layout as device_tier_layout
from sglang_oasis.memory.host_tier import (
    HostTierError,
    KVFootprint,
    available_host_memory,
    check_fits,
    default_host_kv_tokens,
    gib,
    kv_footprint,
    model_config,
)
from sglang_oasis.paths import cache_root
from sglang_oasis.platform.cpu.capabilities import (
    cpu_flags,
    fastest_dtype,
    intra_op_threads,
    numa_nodes,
    rank_core_binding,
    usable_cores,
)
from sglang_oasis.platform.cpu.import_hook import CPU_ENGINE_ENV, install
from sglang_oasis.serving_gates import Serving, ServingRefused, check_sparse_serving

PROG = "python -m sglang_oasis.launch_server"
CPU_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"  # SGLang's per-rank core lists, "|"-separated
TP_MEMORY_CHECK_ENV = "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK"  # SGLang's spelling


def build_oasis_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    OasisConfig.add_cli_args(parser)
    return parser


def given(argv: Sequence[str], option: str) -> bool:
    """Whether ``option`` appears on the command line (as ``--opt value`` or ``--opt=value``)."""
    return any(arg == option or arg.startswith(option + "=") for arg in argv)


def option_value(argv: Sequence[str], option: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
        if arg == option and i + 1 < len(argv):
            return argv[i + 1]
    return None


def option_values(argv: Sequence[str], option: str) -> list[str]:
    """The values of a list option (``--option a b c``, or ``--option=a``): the words after it up to the
    next option."""
    for i, arg in enumerate(argv):
        if arg.startswith(option + "="):
            return [arg.split("=", 1)[1]]
        if arg == option:
            return list(itertools.takewhile(lambda word: not word.startswith("--"), argv[i + 1 :]))
    return []


def first_option_value(argv: Sequence[str], options: Sequence[str]) -> str | None:
    """The value of the first of ``options`` (one option's spellings) that ``argv`` gives."""
    return next((v for v in (option_value(argv, o) for o in options) if v is not None), None)


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


def say(message: str) -> None:
    print(f"[sglang-oasis] {message}", file=sys.stderr, flush=True)


def cpu_dtype_args(sglang_argv: Sequence[str]) -> list[str]:
    """``--dtype`` the CPU computes fastest, unless one is given (SGLang's ``auto`` serves a float32
    checkpoint in float16, ~3.5x slower than float32 on CPUs without native half-precision matrices)."""
    if given(sglang_argv, "--dtype"):
        return []
    choice = fastest_dtype(cpu_flags())
    say(f"dtype {choice.dtype}: {choice.reason} (--dtype overrides)")
    return ["--dtype", choice.dtype]


DECODE_STEP_ENV = "SGLANG_OASIS_CPU_DECODE_STEP"
WARMUP_TIMEOUT_ENV = "SGLANG_WARMUP_TIMEOUT"  # SGLang's: seconds its warm-up request may take (600 unset)
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def cpu_decode_step(argv: Sequence[str], config: OasisConfig) -> OasisConfig:
    """The CPU default of ``--oasis-decode-step`` (sparse mode): ``captured`` where it wins (its TPOT
    0.69-0.93x the eager step's, docs/results.md), or ``$SGLANG_OASIS_CPU_DECODE_STEP``; none where the
    option is given, with ``--oasis-adaptive-cap`` or ``--oasis-selector oracle`` (which the captured step
    refuses) or with no fetch cap (``--oasis-fetch-ratio 1``: its fixed shape then copies a whole working
    set per head every step, 1.68x dense against the eager step's ~1.3x). Its compiles (``compile_plan``)
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
    step = os.environ.get(DECODE_STEP_ENV) or "captured"
    if step not in DECODE_STEPS:
        raise LaunchError(f"{DECODE_STEP_ENV}={step!r} is not one of {', '.join(DECODE_STEPS)}")
    if step == "eager":
        say(f"--oasis-decode-step eager ({DECODE_STEP_ENV})")
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
    from sglang_oasis.attention.compile_ahead import buckets_ahead, kinds_ahead
    from sglang_oasis.attention.step_plan import powers_of_two

    running = option_value(sglang_argv, "--max-running-requests")
    cap = int(running) if running and running.isdigit() else 1
    max_bs = option_value(sglang_argv, "--cuda-graph-max-bs-decode")
    sizes = [int(n) for n in option_values(sglang_argv, "--cuda-graph-bs-decode") if n.isdigit()]
    buckets = buckets_ahead(
        powers_of_two(1, cap), cap, int(max_bs) if max_bs and max_bs.isdigit() else None, sizes
    )  # as the server will (CompileAhead.for_server)
    kinds = kinds_ahead(config.verify_rows > 0, config.recall_sample_every > 0)
    programs = len(buckets) * len(kinds)
    os.environ.setdefault(WARMUP_TIMEOUT_ENV, str(max(600, 60 * programs)))
    return (
        f"--oasis-decode-step captured: {programs} programs compile before the server is ready (batch buckets "
        f"{', '.join(map(str, buckets))}; {' and '.join(kinds)} passes): ~15 s each the first time on 2 cores, "
        f"~2 s each from {cache} (--cuda-graph-max-bs-decode N compiles fewer: larger batches decode eagerly; "
        "--oasis-decode-step eager compiles none)"
    )


TENSOR_PARALLEL_OPTIONS = ("--tp-size", "--tensor-parallel-size", "--tp")


def model_ranks(sglang_argv: Sequence[str]) -> int:
    """Model processes SGLang starts on this machine: tensor- times data-parallel ranks."""
    ranks = 1
    for options in (TENSOR_PARALLEL_OPTIONS, ("--dp-size", "--data-parallel-size", "--dp")):
        value = first_option_value(sglang_argv, options)
        if value is not None and value.isdigit():
            ranks *= max(1, int(value))
    return ranks


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


# SGLang's options that start more than one model rank: sparse mode serves tensor parallelism only.
UNSERVED_PARALLEL_OPTIONS = (
    "--dp-size", "--data-parallel-size", "--dp", "--pp-size", "--pipeline-parallel-size",
)  # fmt: skip


class LaunchError(ValueError):
    """Options that contradict each other; the message names them."""


def check_untested_cuda(argv: Sequence[str], sglang_argv: Sequence[str], config: OasisConfig) -> OasisConfig:
    """Sparse mode on a GPU only with ``--oasis-cuda-untested true``, which says loudly that it never ran
    there, and only where it is written (``serving_gates.py``: the backend asks the same); the decode step
    in SGLang's CUDA graphs is the captured one unless ``--oasis-decode-step`` is given."""
    graphs = not given(sglang_argv, "--disable-cuda-graph")
    if graphs and not given(argv, "--oasis-decode-step"):
        config = dataclasses.replace(config, decode_step="captured")
    serving = Serving(
        "cuda", tp_size=model_ranks(sglang_argv), cuda_graphs=graphs,
        torch_compile=given(sglang_argv, "--enable-torch-compile"),
    )  # fmt: skip
    try:
        check_sparse_serving(config, serving)
    except ServingRefused as error:
        raise LaunchError(str(error)) from None
    say(
        "WARNING: --oasis-cuda-untested: sparse mode on CUDA has NEVER RUN ON A GPU; its outputs are not "
        "verified there (docs/gpu.md)"
    )
    return config


def sparse_mode_args(sglang_argv: Sequence[str], config: OasisConfig, on_cpu: bool = True) -> list[str]:
    """SGLang arguments sparse mode needs: the oasis backend, pages = blocks, the host-tier size, and a
    running-request cap that fits the working sets in the device budget."""
    extra: list[str] = []
    backend = option_value(sglang_argv, "--attention-backend")
    if backend not in (None, "oasis"):
        raise LaunchError(
            f"--attention-backend {backend}: sparse mode uses the oasis backend (or pass --oasis-mode dense)"
        )
    if backend is None:
        extra += ["--attention-backend", "oasis"]
    for option in UNSERVED_PARALLEL_OPTIONS:
        value = option_value(sglang_argv, option)
        if value is not None and value.isdigit() and int(value) > 1:
            raise LaunchError(
                f"{option} {value}: sparse mode runs one engine replica with all layers per rank (data "
                "parallelism would need a device tier, a counters block and Mooncake identities per replica, "
                "pipeline parallelism a selection split across stages; neither is built, docs/design.md); "
                "use --tp-size, or serve it with --oasis-mode dense"
            )
    if given(sglang_argv, "--enable-mixed-chunk"):  # decode rows would go through the extend path
        raise LaunchError(
            "--enable-mixed-chunk: sparse mode decodes over working sets and cannot batch decode rows with "
            "a prefill chunk (or pass --oasis-mode dense)"
        )
    page_size = option_value(sglang_argv, "--page-size")
    if page_size is not None and page_size != str(config.block_size):
        raise LaunchError(
            f"--page-size {page_size}: sparse mode pages the KV by --oasis-block-size {config.block_size}"
        )
    if page_size is None:
        extra += ["--page-size", str(config.block_size)]
    if config.host_kv_tokens is not None:
        if given(sglang_argv, "--max-total-tokens"):
            raise LaunchError(
                "--max-total-tokens and --oasis-host-kv-tokens both set the host KV tier: give one"
            )
        extra += ["--max-total-tokens", str(config.host_kv_tokens)]
    extra += lookahead_args(sglang_argv, config)
    # prefill runs eagerly; decode too, but on CUDA, where SGLang's runner captures it (graph_hooks.py)
    for phase in ("prefill",) if not on_cpu else ("decode", "prefill"):
        if not given(sglang_argv, f"--cuda-graph-backend-{phase}"):
            extra += [f"--cuda-graph-backend-{phase}", "disabled"]
    return extra


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


def check_sparse_model(sglang_argv: Sequence[str], config: OasisConfig) -> None:
    """Refuse, naming the reason, a model that sparse mode would serve wrongly: dense-layer ids it does
    not have, MLA (compressed latent KV, no per-head keys to summarise) and sliding-window attention
    (the window and the working sets would each drop different tokens). Models without a readable
    ``config.json`` are left to SGLang."""
    path = option_value(sglang_argv, "--model-path")
    model = model_config(Path(path)) if path else None
    if model is None:
        return
    text = model.get("text_config") or model
    layers = text.get("num_hidden_layers")
    if isinstance(layers, int) and config.dense_layers and config.dense_layers[-1] >= layers:
        raise LaunchError(
            f"--oasis-dense-layers {config.dense_layers[-1]}: the model has {layers} layers (ids 0..{layers - 1})"
        )
    kind = text.get("model_type") or model.get("model_type") or "this model"
    if text.get("kv_lora_rank"):
        raise LaunchError(
            f"{kind} uses multi-head latent attention (MLA), which sparse mode does not serve: pass --oasis-mode dense"
        )
    layer_types = text.get("layer_types")
    sliding = (
        any("sliding" in str(t) for t in layer_types)
        if isinstance(layer_types, list)
        else bool(text.get("sliding_window")) and text.get("use_sliding_window", True) is not False
    )
    if sliding:
        raise LaunchError(
            f"{kind} uses sliding-window attention (sliding_window {text.get('sliding_window')}), which sparse "
            "mode does not serve: pass --oasis-mode dense"
        )


def served_footprint(sglang_argv: Sequence[str], model_option: str = "--model-path") -> KVFootprint | None:
    """The KV shape of the model ``model_option`` names, in the ``--dtype`` / ``--kv-cache-dtype`` it is
    served in (None: no such option, or a model ``memory/host_tier.py`` cannot read)."""
    path = option_value(sglang_argv, model_option)
    if path is None:
        return None
    dtype = option_value(sglang_argv, "--dtype") or "auto"
    return kv_footprint(Path(path), dtype, option_value(sglang_argv, "--kv-cache-dtype") or "auto")


def host_tier_args(
    sglang_argv: Sequence[str], config: OasisConfig, on_cpu: bool, available: int | None = None
) -> list[str]:
    """The host tier's ``--max-total-tokens`` when none is given (sparse mode): the share
    ``--oasis-host-memory-fraction`` of the available host RAM (``available`` bytes; None: measured
    now) over the served model's and its draft model's KV bytes per token, at most
    ``--oasis-cpu-max-total-tokens`` on CPU with the CPU defaults. A size that is given must fit the
    available RAM. Models whose KV shape ``memory/host_tier.py`` cannot read are left to SGLang."""
    models = [opt for opt in ("--model-path", "--speculative-draft-model-path") if given(sglang_argv, opt)]
    try:
        footprints = [served_footprint(sglang_argv, model) for model in models]
        if not footprints or any(footprint is None for footprint in footprints):
            return []
        per_token = sum(footprint.bytes_per_token for footprint in footprints if footprint)
        available = available_host_memory() if available is None else available
        size = option_value(sglang_argv, "--max-total-tokens")
        if size is not None:
            option = "--oasis-host-kv-tokens" if config.host_kv_tokens is not None else "--max-total-tokens"
            if size.isdigit():
                check_fits(int(size), per_token, available, option)
            return []
        if given(sglang_argv, "--mem-fraction-static"):
            return []
        tokens = default_host_kv_tokens(per_token, available, config.host_memory_fraction, config.block_size)
    except HostTierError as error:
        raise LaunchError(str(error)) from None
    note = f"{config.host_memory_fraction} of {gib(available)} available host RAM"
    if on_cpu and config.cpu_defaults and tokens > config.cpu_max_total_tokens:
        tokens, note = config.cpu_max_total_tokens, f"--oasis-cpu-max-total-tokens; {note} holds {tokens}"
    say(
        f"host KV tier: {tokens} tokens, {gib(tokens * per_token)} at {per_token} KV bytes per token ({note})"
    )
    return ["--max-total-tokens", str(tokens)]


def device_request_slots(sglang_argv: Sequence[str], config: OasisConfig) -> int | None:
    """How many requests' working sets the device tier holds (``memory/device_tier.py``), from the served
    model's KV shape and the host tier's size (its summaries); None when either is unknown here."""
    footprint, host = served_footprint(sglang_argv), option_value(sglang_argv, "--max-total-tokens")
    if footprint is None or host is None or not host.isdigit():
        return None
    shape = TierShape.of(
        config,
        num_layers=footprint.num_layers,
        num_kv_heads=footprint.num_kv_heads,
        head_dim=footprint.head_dim,
        element_bytes=footprint.element_bytes,
        host_pages=int(host) // config.block_size + 3,  # SGLang's padding pages, and one to spare
    )
    try:
        return device_tier_layout(budget_bytes(config, shape), shape).request_slots
    except DeviceTierError as error:
        raise LaunchError(f"{error} (--oasis-device-kv-tokens {config.device_tokens})") from None


def running_cap_args(sglang_argv: Sequence[str], config: OasisConfig, on_cpu: bool = True) -> list[str]:
    """``--max-running-requests`` (sparse mode, unless given): the requests the device tier holds working
    sets for, so SGLang's own admission keeps the others waiting. The backend refuses a larger cap. On
    CUDA without ``--oasis-device-kv-tokens`` the budget is the GPU memory SGLang measures as it starts:
    the device tier caps SGLang's running requests there itself (``DeviceTier.cap_running_requests``)."""
    if given(sglang_argv, "--max-running-requests") or (not on_cpu and config.device_kv_tokens is None):
        return []
    slots = device_request_slots(sglang_argv, config)
    if slots is None:  # the model's shape is unknown here: the budget over one request's working sets
        slots = config.device_tokens // config.working_set_tokens
    else:
        say(
            f"device tier: {slots} running requests' working sets in --oasis-device-kv-tokens {config.device_tokens}"
        )
    return ["--max-running-requests", str(slots)]


def check_tiers_fit(sglang_argv: Sequence[str], config: OasisConfig, available: int | None = None) -> None:
    """On CPU both tiers are host RAM: the host tier (``--max-total-tokens``) and the device budget
    (``--oasis-device-kv-tokens``) of the served model's KV must fit the RAM available (``available``
    bytes; None: measured now), or the working sets' allocation fails later without naming an option."""
    footprint, host = served_footprint(sglang_argv), option_value(sglang_argv, "--max-total-tokens")
    if footprint is None or host is None or not host.isdigit():
        return
    host_bytes = int(host) * footprint.bytes_per_token
    device_bytes = config.device_tokens * footprint.bytes_per_token
    available = available_host_memory() if available is None else available
    if host_bytes + device_bytes > available:
        raise LaunchError(
            f"--oasis-device-kv-tokens {config.device_tokens}: on CPU the working sets ({gib(device_bytes)}) "
            f"and the host KV tier ({gib(host_bytes)}) are both host RAM, more than the {gib(available)} "
            "available: lower --oasis-device-kv-tokens or the host tier"
        )


def lookahead_args(sglang_argv: Sequence[str], config: OasisConfig) -> list[str]:
    """SGLang's speculative worker set up as the lookahead source: one draft step, top-k 1, two verify
    tokens (the real token and the draft token, attended in one call by the oasis backend)."""
    if given(sglang_argv, "--speculative-algorithm"):
        raise LaunchError(
            "--speculative-algorithm: in sparse mode the draft source is chosen with --oasis-lookahead "
            "(eagle3 or ngram) and --oasis-draft-policy"
        )
    if config.lookahead == "previous":
        if given(sglang_argv, "--speculative-draft-model-path"):
            raise LaunchError("--speculative-draft-model-path needs --oasis-lookahead eagle3")
        return []
    shape = ["--speculative-num-draft-tokens", str(config.verify_rows)]
    if config.lookahead == "ngram":
        return ["--speculative-algorithm", "NGRAM", "--speculative-ngram-max-bfs-breadth", "1", *shape]
    extra = [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-num-steps",
        "1",
        "--speculative-eagle-topk",
        "1",
    ]
    if not given(sglang_argv, "--speculative-draft-model-path"):
        if given(sglang_argv, "--model-path"):
            raise LaunchError(
                "--oasis-lookahead eagle3 needs --speculative-draft-model-path (an EAGLE-3 head for "
                "--model-path); the shipped head fits only the default model"
            )
        from sglang_oasis.models.default_model import DefaultModelUnavailable, default_draft_dir

        try:
            extra += ["--speculative-draft-model-path", str(default_draft_dir())]
        except DefaultModelUnavailable as error:
            raise LaunchError(f"--oasis-lookahead eagle3: {error}") from None
    return [*extra, *shape]


def split_argv(argv: Sequence[str]) -> tuple[OasisConfig, list[str]]:
    """Separate ``--oasis-*`` options (validated into an OasisConfig) from SGLang's arguments."""
    parser = build_oasis_parser()
    namespace, rest = parser.parse_known_args(list(argv))
    unknown = [arg.split("=", 1)[0] for arg in rest if arg.startswith("--oasis-")]
    if unknown:
        parser.error(f"unrecognized sglang-oasis option: {unknown[0]} (see --help)")
    try:
        return OasisConfig.from_cli_args(namespace), rest
    except OasisConfigError as error:
        parser.error(str(error))
    raise AssertionError("unreachable")


def print_help() -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    OasisConfig.add_cli_args(parser)
    ServerArgs.add_cli_args(parser)
    parser.print_help()


def prepare(argv: Sequence[str]) -> tuple[OasisConfig, list[str]]:
    """Everything before SGLang parses its arguments: oasis config, platform, defaults, model path."""
    config, sglang_argv = split_argv(argv)
    on_cpu = wants_cpu(sglang_argv)
    if config.mode == "sparse":
        try:
            if on_cpu and config.cpu_defaults:
                config = cpu_decode_step(argv, config)
            if not on_cpu:
                config = check_untested_cuda(argv, sglang_argv, config)
            wants_triton(config.prefill_attention, "cpu" if on_cpu else "cuda")  # raises, naming the option
            decode_node = option_value(sglang_argv, "--disaggregation-mode") == "decode"
            if decode_node and (config.oracle or (config.selector == "codes" and config.remote_fetch)):
                raise LaunchError(f"--oasis-selector {config.selector}: reads every key from the local KV pool; "
                                  "a PD decode node's blocks stay on the prefill node until read (codes: "
                                  "--oasis-remote-fetch false)")  # fmt: skip
            sglang_argv += sparse_mode_args(sglang_argv, config, on_cpu)
        except (LaunchError, TritonPrefillError) as error:
            build_oasis_parser().error(str(error))
    if on_cpu:
        # Both must be in the environment before SGLang is imported: its modules read them at import
        # time, and the server subprocesses (spawned) inherit them.
        os.environ[CPU_ENGINE_ENV] = "1"
        if config.cpu_defaults:
            cpu_threads_env(sglang_argv)
            cpu_binding_env(sglang_argv)
            cpu_memory_check_env(sglang_argv)
            sglang_argv += cpu_dtype_args(sglang_argv)
        install()
    if not given(sglang_argv, "--model-path"):
        from sglang_oasis.models.default_model import prepare_default_model

        sglang_argv += ["--model-path", str(prepare_default_model())]
    if config.mode == "sparse":
        try:
            check_sparse_model(sglang_argv, config)
            sglang_argv += host_tier_args(sglang_argv, config, on_cpu)
        except LaunchError as error:
            build_oasis_parser().error(str(error))
    if on_cpu:
        sglang_argv += cpu_defaults(sglang_argv, config)
        try:
            check_cpu_graphs(sglang_argv, config)
            if config.mode == "sparse":
                check_tiers_fit(sglang_argv, config)
        except LaunchError as error:
            build_oasis_parser().error(str(error))
    if config.mode == "sparse":
        try:
            sglang_argv += running_cap_args(sglang_argv, config, on_cpu)
        except LaunchError as error:
            build_oasis_parser().error(str(error))
        if on_cpu and config.decode_step == "captured":
            say(compile_plan(sglang_argv, config))
    config.to_env()
    return config, sglang_argv


def client_url(host: str, port: int) -> str:
    """The URL a client on this machine uses for a server bound to ``host``."""
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def try_it_line(url: str) -> str:
    """A ready-made chat request against the server at ``url`` (the README's first request)."""
    body = '{"model": "default", "temperature": 0, "messages": [{"role": "user", "content": "What is the capital of France?"}]}'
    return f"curl -s {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"


def announce_when_ready(url: str, mode: str, period_s: float = 1.0) -> threading.Thread:
    """Once the server answers ``/health`` (SGLang's warm-up done), print its URL and a request to try."""
    import urllib.error
    import urllib.request

    def wait() -> None:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=10) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(period_s)
        say(f"ready: {url} ({mode} mode). Try:\n  {try_it_line(url)}")

    thread = threading.Thread(target=wait, name="oasis-announce", daemon=True)
    thread.start()
    return thread


def uses_mooncake(argv: Sequence[str]) -> bool:
    """A prefill or decode server of SGLang's PD disaggregation over its (default) mooncake backend."""
    mode = option_value(argv, "--disaggregation-mode")
    backend = option_value(argv, "--disaggregation-transfer-backend") or "mooncake"
    return mode in ("prefill", "decode") and backend == "mooncake"


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print_help()
        return
    from sglang_oasis.disaggregation.mooncake_builds import (
        ConflictingMooncakeBuilds,
        MissingSystemLibrary,
        check_single_mooncake_build,
        check_system_libraries,
    )

    try:
        check_single_mooncake_build()
        if uses_mooncake(argv):
            check_system_libraries()
    except (ConflictingMooncakeBuilds, MissingSystemLibrary) as error:
        sys.exit(f"{PROG}: error: {error}")
    config, sglang_argv = prepare(argv)

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from sglang_oasis.http_routes import add_oasis_routes
    from sglang_oasis.stats import OasisStats

    load_plugins()  # registers the oasis attention backend and its CLI choice
    server_args = prepare_server_args(sglang_argv)
    stats = OasisStats.create(server_args.port, ranks=server_args.tp_size)
    add_oasis_routes(stats)
    if option_value(sglang_argv, "--disaggregation-mode") in (None, "null"):  # launch_pd announces its router
        announce_when_ready(client_url(server_args.host, server_args.port), config.mode)
    try:
        run_server(server_args)
    finally:
        stats.close()
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
