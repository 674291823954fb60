"""HTTP routes sglang-oasis adds to SGLang's server (in the launcher process, which serves HTTP)."""

from __future__ import annotations

from sglang_oasis.config import OasisConfig
from sglang_oasis.stats import OasisStats


def add_oasis_routes(stats: OasisStats) -> None:
    from fastapi.responses import ORJSONResponse
    from sglang.srt.entrypoints.http_server import app

    config = OasisConfig.from_env() or OasisConfig()

    async def oasis_stats() -> ORJSONResponse:
        """sglang-oasis counters and gauges (see sglang_oasis/stats.py for their meaning)."""
        values = stats.snapshot()
        steps = max(1, values["decode_steps"])
        per_step = {
            name: values[name] / steps
            for name in ("decode_bytes_host_to_device", "decode_blocks_loaded", "blocks_deferred",
                         "blocks_just_filled", "foreground_wait_us")
        }  # fmt: skip
        per_step["bytes_host_to_device"] = per_step.pop("decode_bytes_host_to_device")
        return ORJSONResponse({"mode": config.mode, **values, "per_decode_step": per_step})

    app.add_api_route("/oasis/stats", oasis_stats, methods=["GET"])
