"""Run at interpreter start-up by ``sglang_oasis_startup.pth`` in site-packages.

SGLang's CPU path imports ``sgl_kernel`` at module import time in every server process (the
scheduler and detokenizer are started with ``spawn``), before any SGLang plugin hook runs. The only
place early enough to provide the CPU stand-in in all of them is interpreter start-up. This module
must stay cheap: it reads one environment variable and, on the CPU engine only, adds an import hook.
"""

from sglang_oasis.platform.cpu.import_hook import install_if_cpu_engine

install_if_cpu_engine()
