"""sglang-oasis: OasisKV-style lookahead sparse KV caching for the SGLang runtime.

Kept import-light on purpose: ``sglang_oasis._startup`` runs at every interpreter start (see
``platform/cpu/import_hook.py``), so nothing here may import torch or SGLang.
"""

__version__ = "0.1.0"
