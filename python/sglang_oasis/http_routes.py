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
        return ORJSONResponse({"mode": config.mode, **stats.snapshot()})

    app.add_api_route("/oasis/stats", oasis_stats, methods=["GET"])
