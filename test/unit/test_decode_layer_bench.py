"""benchmark/bench_decode_layer.py at a few steps: both modes time both layers, eager and captured (dynamo's
eager backend here: no C++ compile in CI), at two batch sizes; the profile names the sparse path's parts
(it reads the oasis backend's real code; no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_layer_bench_writes_modes_and_a_profile(tmp_path: Path) -> None:
    out = tmp_path / "decode_layer.json"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmark" / "bench_decode_layer.py"), "--json", str(out),
         "--context-tokens", "100", "--steps", "5", "--batch", "1,3", "--compile-backend", "eager"],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result["batches"]) == {"1", "3"} and result["modes"] == result["batches"]["1"]
    for modes in result["batches"].values():
        assert set(modes) == {"k_covering", "k_sparse"}
        covering = modes["k_covering"]
        assert covering["top_k"] == (100 + 2 * (20 + 5)) // 16 + 1
        assert covering["dense_ms"] > 0 and covering["sparse_ms"] > 0 and covering["captured_ms"] > 0
        # the eager sparse step dispatches many small ops; counted, not timed
        assert modes["k_sparse"]["ops_sparse"] > modes["k_sparse"]["ops_dense"] > 0
        assert modes["k_sparse"]["key_code_pages"] == 0  # the summaries' selection codes nothing
    functions = [row["function"] for row in result["profile"]]
    assert any("oasis_backend.py" in name and "forward_decode" in name for name in functions)
    assert any("advance" in name for name in functions)


def test_with_key_codes_the_sparse_layer_codes_and_scores_its_blocks(tmp_path: Path) -> None:
    """``--selector codes --profile-mode k_sparse``: the sparse layer's eager step codes the blocks its
    requests fill as they decode (the admission's catch-up codes the prompt's; the summaries' run codes
    none), and both steps run."""
    out = tmp_path / "decode_layer_codes.json"
    command = [sys.executable, str(ROOT / "benchmark" / "bench_decode_layer.py"), "--json", str(out)]
    command += ["--context-tokens", "400", "--steps", "5", "--batch", "2", "--compile-backend", "eager"]
    subprocess.run([*command, "--selector", "codes", "--profile-mode", "k_sparse"], check=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["setting"]["selector"] == "codes" and result["setting"]["profile_mode"] == "k_sparse"
    sparse = result["modes"]["k_sparse"]
    assert sparse["key_code_pages"] >= 2 and sparse["captured_ms"] > 0  # 2 rows from 400 tokens past 416
