"""Entry point of the ``sglang.srt.plugins`` group: SGLang calls :func:`load` in every server process.

The server's scheduler and detokenizer are spawned, so anything registered only in the launcher would
be lost there; registrations belong here.
"""

from __future__ import annotations

import logging

from sglang_oasis.config import OasisConfig
from sglang_oasis.platform.cpu.import_hook import install_if_cpu_engine

logger = logging.getLogger(__name__)

BACKEND_NAME = "oasis"


def register_attention_backend() -> None:
    """``--attention-backend oasis``: the factory (used in the scheduler) and the CLI choice."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend as register

    from sglang_oasis.attention.oasis_backend import create_oasis_backend

    register(BACKEND_NAME)(create_oasis_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])


def load() -> None:
    # Normally already done at interpreter start-up (sglang_oasis_startup.pth); repeated here for
    # environments where site .pth files are skipped (python -S).
    cpu = install_if_cpu_engine()
    register_attention_backend()
    if cpu:
        from sglang_oasis.sglang_hooks import patch_cpu_disaggregation

        patch_cpu_disaggregation()
    config = OasisConfig.from_env()
    if config is not None:
        from sglang_oasis import sglang_hooks

        sglang_hooks.register(config)
    logger.info("sglang-oasis plugin loaded (cpu stand-in: %s, config: %s)", cpu, config)
