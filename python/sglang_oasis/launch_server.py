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
import threading
import time
from collections.abc import Sequence

from sglang_oasis.attention.triton_prefill import TritonPrefillError, wants_triton
from sglang_oasis.config import OasisConfig, OasisConfigError
from sglang_oasis.launcher.argv import LaunchError, given, option_value, say
from sglang_oasis.launcher.cpu_engine import (
    check_cpu_graphs,
    compile_plan,
    cpu_binding_env,
    cpu_decode_step,
    cpu_defaults,
    cpu_dtype_args,
    cpu_memory_check_env,
    cpu_threads_env,
    wants_cpu,
)
from sglang_oasis.launcher.sparse_mode import (
    check_sparse_model,
    check_tiers_fit,
    check_untested_cuda,
    host_tier_args,
    running_cap_args,
    sparse_mode_args,
)
from sglang_oasis.platform.cpu.import_hook import CPU_ENGINE_ENV, install

PROG = "python -m sglang_oasis.launch_server"


def build_oasis_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, add_help=False, allow_abbrev=False)
    OasisConfig.add_cli_args(parser)
    return parser


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
            if decode_node and config.oracle:
                raise LaunchError(f"--oasis-selector {config.selector}: reads every key from the local KV pool; "
                                  "a PD decode node's blocks stay on the prefill node until read")  # fmt: skip
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
