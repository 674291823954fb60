"""Entry point of the ``sglang.srt.plugins`` group: SGLang calls :func:`load` in every server process.

The server's scheduler and detokenizer are spawned, so anything registered only in the launcher would
be lost there; registrations belong here.

A server started by SGLang itself (``python -m sglang.launch_server --attention-backend oasis``, or
``sglang serve``) gets what the launcher would give it: the ``--oasis-*`` defaults (or the configuration
in ``SGLANG_OASIS_CONFIG``, JSON), the hooks it needs, and ``GET /oasis/stats``; the device tier caps
SGLang's running requests itself. Only the launcher's CPU defaults and start-up checks are missing.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
from collections.abc import Sequence
from pathlib import Path

from sglang_oasis.config import OasisConfig
from sglang_oasis.platform.cpu.import_hook import install_if_cpu_engine
from sglang_oasis.sglang_contract import BACKEND_NAME

logger = logging.getLogger(__name__)


def register_attention_backend() -> None:
    """``--attention-backend oasis``: the factory (used in the scheduler) and the CLI choice."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend as register

    from sglang_oasis.attention.oasis_backend import create_oasis_backend

    register(BACKEND_NAME)(create_oasis_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])


def serves_oasis_backend(argv: Sequence[str]) -> bool:
    """Whether this command line (a server process inherits its launcher's) chooses the oasis backend."""
    options = ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")
    for index, word in enumerate(argv):
        name, _, value = word.partition("=")
        if name in options and (value or (argv[index + 1] if index + 1 < len(argv) else "")) == BACKEND_NAME:
            return True
    return False


def launched_by_oasis(argv: Sequence[str]) -> bool:
    """Whether this process runs ``python -m sglang_oasis.launch_server`` (which makes the counters' block
    and the stats route itself), rather than a server SGLang starts."""
    return bool(argv) and Path(argv[0]).parts[-2:] == ("sglang_oasis", "launch_server.py")


def started_by_sglang(argv: Sequence[str], config: OasisConfig | None) -> OasisConfig:
    """The configuration of a server SGLang started itself with the oasis backend: the one in
    ``SGLANG_OASIS_CONFIG``, else the defaults, for every process of the server (the environment its
    children inherit); in the main process (once), the counters' shared block and ``GET /oasis/stats``."""
    if config is None:
        config = OasisConfig()
        config.to_env()
    if multiprocessing.parent_process() is None and not _kept:
        from sglang_oasis.http_routes import add_oasis_routes
        from sglang_oasis.launcher.argv import TENSOR_PARALLEL_OPTIONS, first_option_value, option_value
        from sglang_oasis.stats import OasisStats

        port = option_value(argv, "--port") or "30000"
        tp = first_option_value(argv, TENSOR_PARALLEL_OPTIONS) or "1"
        stats = OasisStats.create(int(port), ranks=int(tp) if tp.isdigit() else 1)
        _kept.append(stats)
        add_oasis_routes(stats)
        logger.warning(
            "sglang-oasis: the oasis backend started without python -m sglang_oasis.launch_server (%s): no "
            "CPU defaults or start-up checks",
            "SGLANG_OASIS_CONFIG" if config != OasisConfig() else "--oasis-* defaults",
        )
    return config


_kept: list[object] = []  # the counters' block this process owns (kept open while it serves)


def load() -> None:
    # Normally already done at interpreter start-up (sglang_oasis_startup.pth); repeated here for
    # environments where site .pth files are skipped (python -S).
    cpu = install_if_cpu_engine()
    register_attention_backend()
    if cpu:
        from sglang_oasis.sglang_hooks import patch_cpu_disaggregation, register_cpu_engine

        patch_cpu_disaggregation()
        register_cpu_engine()
    config = OasisConfig.from_env()
    if serves_oasis_backend(sys.argv) and not launched_by_oasis(sys.argv):
        config = started_by_sglang(sys.argv, config)
    if config is not None:
        from sglang_oasis import sglang_hooks

        sglang_hooks.register(config)
    logger.info("sglang-oasis plugin loaded (cpu stand-in: %s, config: %s)", cpu, config)
