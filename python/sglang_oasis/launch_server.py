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
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from sglang_oasis.config import OasisConfig, OasisConfigError
from sglang_oasis.memory.host_tier import (
    HostTierError,
    available_host_memory,
    check_fits,
    default_host_kv_tokens,
    gib,
    kv_footprint,
)
from sglang_oasis.platform.cpu.import_hook import CPU_ENGINE_ENV, install

PROG = "python -m sglang_oasis.launch_server"


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


class LaunchError(ValueError):
    """Options that contradict each other; the message names them."""


def sparse_mode_args(sglang_argv: Sequence[str], config: OasisConfig) -> list[str]:
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
    if not given(sglang_argv, "--max-running-requests"):
        extra += ["--max-running-requests", str(max(1, config.device_kv_tokens // config.working_set_tokens))]
    extra += lookahead_args(sglang_argv, config)
    for phase in ("decode", "prefill"):  # the backend runs eagerly
        if not given(sglang_argv, f"--cuda-graph-backend-{phase}"):
            extra += [f"--cuda-graph-backend-{phase}", "disabled"]
    return extra


def host_tier_args(
    sglang_argv: Sequence[str], config: OasisConfig, on_cpu: bool, available: int | None = None
) -> list[str]:
    """The host tier's ``--max-total-tokens`` when none is given (sparse mode): the share
    ``--oasis-host-memory-fraction`` of the available host RAM (``available`` bytes; None: measured
    now) over the served model's and its draft model's KV bytes per token, at most
    ``--oasis-cpu-max-total-tokens`` on CPU with the CPU defaults. A size that is given must fit the
    available RAM. Models whose KV shape ``memory/host_tier.py`` cannot read are left to SGLang."""
    paths = [option_value(sglang_argv, opt) for opt in ("--model-path", "--speculative-draft-model-path")]
    dtype = option_value(sglang_argv, "--dtype") or "auto"
    kv_cache_dtype = option_value(sglang_argv, "--kv-cache-dtype") or "auto"
    try:
        footprints = [kv_footprint(Path(path), dtype, kv_cache_dtype) for path in paths if path]
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
    print(
        f"[sglang-oasis] host KV tier: {tokens} tokens, {gib(tokens * per_token)} at {per_token} KV bytes "
        f"per token ({note})",
        file=sys.stderr,
        flush=True,
    )
    return ["--max-total-tokens", str(tokens)]


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
    shape = ["--speculative-num-draft-tokens", "2"]
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
            if not on_cpu:
                raise LaunchError(
                    "--oasis-mode sparse runs on SGLang's CPU engine only so far (the CUDA host tier and "
                    "kernels are open work): pass --oasis-mode dense on a GPU"
                )
            sglang_argv += sparse_mode_args(sglang_argv, config)
        except LaunchError as error:
            build_oasis_parser().error(str(error))
    if on_cpu:
        # Both must be in the environment before SGLang is imported: its modules read them at import
        # time, and the server subprocesses (spawned) inherit them.
        os.environ[CPU_ENGINE_ENV] = "1"
        if config.cpu_defaults:
            os.environ.setdefault("OMP_NUM_THREADS", "1")
        install()
    if not given(sglang_argv, "--model-path"):
        from sglang_oasis.models.default_model import prepare_default_model

        sglang_argv += ["--model-path", str(prepare_default_model())]
    if config.mode == "sparse":
        try:
            sglang_argv += host_tier_args(sglang_argv, config, on_cpu)
        except LaunchError as error:
            build_oasis_parser().error(str(error))
    if on_cpu:
        sglang_argv += cpu_defaults(sglang_argv, config)
    config.to_env()
    return config, sglang_argv


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print_help()
        return
    from sglang_oasis.disaggregation.mooncake_builds import (
        ConflictingMooncakeBuilds,
        check_single_mooncake_build,
    )

    try:
        check_single_mooncake_build()
    except ConflictingMooncakeBuilds as error:
        sys.exit(f"{PROG}: error: {error}")
    _config, sglang_argv = prepare(argv)

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from sglang_oasis.http_routes import add_oasis_routes
    from sglang_oasis.stats import OasisStats

    load_plugins()  # registers the oasis attention backend and its CLI choice
    server_args = prepare_server_args(sglang_argv)
    stats = OasisStats.create(server_args.port)
    add_oasis_routes(stats)
    try:
        run_server(server_args)
    finally:
        stats.close()
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
