"""benchmark/bench_decode_layer.py at a few steps: both modes time both layers, and the profile names the
sparse path's parts (it reads the oasis backend's real code; no timing is asserted)."""

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
         "--context-tokens", "100", "--steps", "5"],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert set(result["modes"]) == {"k_covering", "k_sparse"}
    covering = result["modes"]["k_covering"]
    assert covering["top_k"] == (100 + 5) // 16 + 1 and covering["dense_ms"] > 0 and covering["sparse_ms"] > 0
    functions = [row["function"] for row in result["profile"]]
    assert any("oasis_backend.py" in name and "forward_decode" in name for name in functions)
    assert any("advance" in name for name in functions)
