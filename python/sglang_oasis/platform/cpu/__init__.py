"""CPU support: a pure-torch stand-in for the ``sgl_kernel`` names SGLang's CPU engine uses.

The PyPI ``sglang-kernel`` wheel is CUDA-only (it fails to import without ``libcuda.so.1``), and the
upstream CPU build needs Intel AMX. With ``SGLANG_USE_CPU_ENGINE=1`` an import hook serves
``sgl_kernel`` (and its submodules) from :mod:`sglang_oasis.platform.cpu.sgl_kernel_ops` instead.
Nothing here is active unless SGLang runs on its CPU engine.
"""
