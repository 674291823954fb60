"""benchmark/bench_accuracy.py end to end at CI size (issue 27): SmolLM2's first 6 layers (a truncated
model cannot answer, so scores are not the point), two tasks at ~1K tokens, one sample each, a dense
server and one shared sparse server for two configs: a K that covers every block and K = 8, each request
carrying its config's K in its custom_params (both configs' requests run at once, on prompts a 1-token
request prefilled), and the oracle arm at the same two K on a shared oracle server (``--oasis-selector
oracle``). Sparse with K covering the context answers exactly as dense, the oracle's too, so those
answers and scores must agree; each config's decode figures are the sums of its own requests' (their replies'
meta_info["oasis"]), and with the server's /oasis/stats deltas they account for every decode step; the
first working sets' loads at the extends are counted apart."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

import bench_accuracy

pytestmark = pytest.mark.server

TASKS = ("niah_single_number", "variable_tracking")
K = 72  # blocks of 16: every block of a ~1K prompt and its answer


@pytest.mark.usefixtures("smollm2_6l_dir")
def test_the_quick_accuracy_run_scores_dense_and_a_covering_k_alike(tmp_path: Path) -> None:
    out = tmp_path / "accuracy.json"
    argv = ["--json", str(out), "--quick", "--num-layers", "6", "--tasks", ",".join(TASKS),
            "--contexts", "1000", "--samples", "1", "--top-ks", f"{K},8", "--oracle-top-ks", f"{K},8",
            "--concurrency", "1"]  # fmt: skip
    assert bench_accuracy.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["num_layers"] == 6 and report["settings"]["quick"]
    # --quick adds no recall-target server
    assert list(report["configs"]) == ["dense", f"k{K}", "k8", f"oracle{K}", "oracle8"]
    assert report["servers"][f"shared-k{K}-k8"]["configs"] == [f"k{K}", "k8"]
    assert report["servers"][f"shared-oracle{K}-oracle8"]["configs"] == [f"oracle{K}", "oracle8"]
    assert report["configs"]["k8"]["request_options"] == {"oasis_top_k": 8, "oasis_recall_target": 0.0}
    for task in TASKS:
        cell = report["tasks"][task]["1000"]
        dense, sparse = cell["dense"], cell[f"k{K}"]
        assert dense["errors"] == sparse["errors"] == 0
        assert dense["answers"] == sparse["answers"] and dense["answers"][0].strip()
        assert dense["score"] == sparse["score"] is not None and 0 <= dense["score"] <= 1
        oracle, few = cell[f"oracle{K}"], cell["oracle8"]  # the oracle arm, on a real server
        assert oracle["answers"] == dense["answers"] and oracle["errors"] == few["errors"] == 0
        assert few["answers"][0].strip()
    figures = report["configs"][f"k{K}"]
    assert figures["request_figures"]["decode_steps"] > 0
    assert figures["decode_bytes_per_step"] == 0  # K covers every block: decode reads nothing from the host
    assert figures["recall_mean"] == pytest.approx(1.0, abs=1e-5)
    assert "decode_bytes_per_step" not in report["configs"]["dense"]
    assert figures["vs_dense"] == 0
    small = report["configs"]["k8"]  # K = 8 of ~60 blocks: decode loads blocks, recall below 1
    assert small["request_figures"]["decode_steps"] > 0 and small["decode_bytes_per_step"] > 0
    assert small["errors"] == 0 and small["recall_mean"] is not None and small["recall_mean"] < 1.0
    # Every request step is a server step of a batch (the settling request's aside: it decodes none);
    # no request's bytes are counted twice or lost but what their last steps' background jobs loaded.
    server = report["servers"][f"shared-k{K}-k8"]
    steps = figures["request_figures"]["decode_steps"] + small["request_figures"]["decode_steps"]
    assert 0 < server["stats"]["decode_steps"] <= steps
    unattributed = server["unattributed"]["decode_bytes_host_to_device"]
    assert 0 <= unattributed < small["request_figures"]["decode_bytes_host_to_device"]
    # The first working sets' loads at the requests' extends, in blocks of the decode loads' size, and
    # bytes_per_step adds them. The bench's sparse servers start every request cold (no warm start: with
    # one, both configs' requests would start from the priming request's slot and load what it lacks,
    # which depends on which of them claims it first), so the covering K loads every block and K = 8 its
    # own few; they are the server's admission loads, but for the priming and settling requests'.
    covering, few = figures["request_figures"], small["request_figures"]
    block_bytes = few["decode_bytes_host_to_device"] // few["decode_blocks_loaded"]
    assert server["stats"]["warm_starts"] == 0
    assert covering["admission_blocks_loaded"] > few["admission_blocks_loaded"] > 0
    admissions = server["stats"]["blocks_loaded"] - server["stats"]["decode_blocks_loaded"]
    assert covering["admission_blocks_loaded"] + few["admission_blocks_loaded"] <= admissions
    for own in (covering, few):
        assert own["admission_bytes_host_to_device"] == own["admission_blocks_loaded"] * block_bytes
    assert figures["bytes_per_step"] == covering["admission_bytes_host_to_device"] / covering["decode_steps"]
    assert (tmp_path / "accuracy.png").exists() and (tmp_path / "accuracy_bytes.png").exists()
    assert report["configs"]["oracle8"]["request_figures"]["decode_steps"] > 0
