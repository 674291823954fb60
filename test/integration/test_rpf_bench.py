"""benchmark/bench_rpf.py at toy sizes (SmolLM2's first 6 layers, real Mooncake reads): its byte counts
follow from what was selected, K covering every block moves exactly the full KV plus the summaries, and
a cached prefix is never transferred."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import bench_rpf

LAYERS, KV_HEADS, HEAD_DIM, B = 6, 3, 64, 16
ROW = KV_HEADS * HEAD_DIM * 4  # one block's min (or max) summary, float32
BLOCK = B * ROW  # one block of K (or V)


def run(tmp_path: Path, top_k: int) -> list[dict]:
    out = tmp_path / f"rpf-{top_k}.json"
    bench_rpf.main(["--json", str(out), "--contexts", "200", "--steps", "6", "--top-k", str(top_k),
                    "--num-layers", str(LAYERS), "--fetch-ratios", "0.25", "1.0", "--prefix-share", "0.5"])  # fmt: skip
    report = json.loads(out.read_text())
    assert report["settings"]["num_layers"] == LAYERS
    cold = [r for r in report["results"] if r["cached_prefix_tokens"] == 0]
    assert report["longest_context"]["admission_ratio"] == cold[0]["admission_ratio"]
    assert report["longest_context"]["total_ratio_fetch_0.25"] == cold[0]["total_ratio"]
    return report["results"]


@pytest.mark.usefixtures("smollm2_6l_dir")
def test_partial_fetch_moves_less_than_the_full_kv(tmp_path: Path) -> None:
    rows = run(tmp_path, top_k=3)
    pages = -(-200 // B)  # 13, the last holds 8 tokens
    assert {(r["cached_prefix_tokens"], r["fetch_ratio"]) for r in rows} == {
        (0, 0.25),
        (0, 1.0),
        (96, 0.25),
        (96, 1.0),
    }
    for r in rows:
        cached = r["cached_prefix_tokens"] // B
        assert r["full_bytes"] == LAYERS * 2 * (pages - cached) * BLOCK
        assert r["summary_bytes"] == LAYERS * 2 * (pages - cached) * ROW
        assert r["rpf_admission_bytes"] == r["admission_blocks"] * 2 * BLOCK + r["summary_bytes"]
        assert r["rpf_total_bytes"] == r["rpf_admission_bytes"] + r["miss_blocks"] * 2 * BLOCK
        # at most 3 heads x 3 blocks per layer, plus the last block, minus nothing: fewer than all pages
        assert LAYERS <= r["admission_blocks"] <= LAYERS * (3 * 3 + 1)
        assert r["rpf_admission_bytes"] < r["full_bytes"]
        assert r["rpf_host_bytes"] == (r["admission_blocks"] + r["miss_blocks"] + LAYERS * cached) * 2 * BLOCK
    capped, uncapped = (next(r for r in rows if r["cached_prefix_tokens"] == 0 and r["fetch_ratio"] == f)
                        for f in (0.25, 1.0))  # fmt: skip
    assert capped["admission_blocks"] == uncapped["admission_blocks"]  # admission is never capped


@pytest.mark.usefixtures("smollm2_6l_dir")
def test_k_covering_every_block_moves_the_full_kv_and_the_summaries(tmp_path: Path) -> None:
    for r in run(tmp_path, top_k=64):
        assert r["miss_blocks"] == 0
        assert r["rpf_admission_bytes"] == r["full_bytes"] + r["summary_bytes"]
        assert r["rpf_total_bytes"] == r["rpf_admission_bytes"]
