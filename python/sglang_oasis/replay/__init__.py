"""Trace replay: Mooncake traces and multi-turn conversations against any SGLang-compatible server.

``python -m sglang_oasis.replay --trace FILE --url URL --out REPORT.json`` (see ``__main__``); in code,
:func:`run_replay` with a :class:`ReplayConfig`.
"""

from sglang_oasis.replay.runner import ReplayConfig, ReplaySetupError, run_replay
from sglang_oasis.replay.trace import TraceError, load_trace

__all__ = ["ReplayConfig", "ReplaySetupError", "TraceError", "load_trace", "run_replay"]
