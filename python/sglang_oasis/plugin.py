"""Entry point of the ``sglang.srt.plugins`` group: SGLang calls :func:`load` in every server process.

The server's scheduler and detokenizer are spawned, so anything registered only in the launcher would
be lost there; registrations belong here.
"""

from __future__ import annotations

import logging

from sglang_oasis.config import OasisConfig
from sglang_oasis.platform.cpu.import_hook import install_if_cpu_engine

logger = logging.getLogger(__name__)


def load() -> None:
    # Normally already done at interpreter start-up (sglang_oasis_startup.pth); repeated here for
    # environments where site .pth files are skipped (python -S).
    cpu = install_if_cpu_engine()
    config = OasisConfig.from_env()
    logger.info("sglang-oasis plugin loaded (cpu stand-in: %s, config: %s)", cpu, config)
