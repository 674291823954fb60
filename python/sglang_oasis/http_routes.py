"""HTTP routes sglang-oasis adds to SGLang's server (in the launcher process, which serves HTTP)."""

from __future__ import annotations

from sglang_oasis.config import OasisConfig
from sglang_oasis.stats import LAYER_FIELDS, OasisStats


def counters_and_gauges(values: dict[str, int]) -> dict[str, object]:
    """``OasisStats.snapshot()`` as ``GET /oasis/stats`` reports it: the per-layer recall fields folded
    into ``recall_per_layer`` (layer id -> mean recall, sampled layers only), and the recall figures
    (``recall_mean``, ``recall_p10``, ``lookahead_agreement``) as fractions, None before any sample."""
    report: dict[str, object] = {name: value for name, value in values.items() if name not in LAYER_FIELDS}
    sampled = values["recall_samples"] > 0
    for name in ("recall_mean", "recall_p10", "lookahead_agreement"):
        report[name] = values[f"{name}_ppm"] / 1e6 if sampled else None
    report["recall_per_layer"] = {
        str(layer): (values[field] - 1) / 1e6 for layer, field in enumerate(LAYER_FIELDS) if values[field] > 0
    }
    return report


def add_oasis_routes(stats: OasisStats) -> None:
    from fastapi.responses import ORJSONResponse
    from sglang.srt.entrypoints.http_server import app

    config = OasisConfig.from_env() or OasisConfig()

    async def oasis_stats() -> ORJSONResponse:
        """sglang-oasis counters and gauges (see sglang_oasis/stats.py for their meaning): every rank's
        together, and under tensor parallelism each rank's in ``ranks``."""
        values = stats.snapshot()
        steps = max(1, values["decode_steps"])
        per_step = {
            name: values[name] / steps
            for name in ("decode_bytes_host_to_device", "decode_blocks_loaded", "blocks_deferred",
                         "blocks_just_filled", "foreground_wait_us")
        }  # fmt: skip
        per_step["bytes_host_to_device"] = per_step.pop("decode_bytes_host_to_device")
        report = {"mode": config.mode, **counters_and_gauges(values), "per_decode_step": per_step}
        if stats.ranks > 1:  # tensor parallelism: each rank's own (its KV heads), by rank
            report["ranks"] = [counters_and_gauges(rank) for rank in stats.rank_snapshots()]
        return ORJSONResponse(report)

    app.add_api_route("/oasis/stats", oasis_stats, methods=["GET"])
