"""``scripts/run_lanes.py``, the whole suite as two pytest processes at once: every test module runs in
exactly one lane, a lane's failure fails the run, and the yielding lane's servers wait for memory."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import run_lanes

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_module_runs_in_exactly_one_lane() -> None:
    plan = run_lanes.lanes()
    paths = [path for lane in plan.values() for path in lane]
    assert len(paths) == len(set(paths))
    integration = {f"test/integration/{p.name}" for p in (ROOT / "test" / "integration").glob("test_*.py")}
    assert {p for p in paths if p.startswith("test/integration/")} == integration
    assert "test/unit" in paths
    assert all(lane for lane in plan.values()), "no lane is empty"


def test_a_lane_reports_its_pytest_exit_status_and_summary(tmp_path: Path) -> None:
    (tmp_path / "test_passes.py").write_text("def test_one():\n    assert True\n")
    (tmp_path / "test_fails.py").write_text("def test_one():\n    assert False\n")
    results: dict[str, tuple] = {}
    out = threading.Lock()
    finished: dict[str, str] = {}
    run_lanes.run_lane("good", [str(tmp_path / "test_passes.py")], 4, out, results, None, finished)
    run_lanes.run_lane("bad", [str(tmp_path / "test_fails.py")], 4, out, results)
    assert results["good"][0] == 0 and "1 passed" in results["good"][2]
    assert results["bad"][0] == 1 and "1 failed" in results["bad"][2]
    assert list(finished) == ["good"] and finished["good"].endswith("test_passes.py")  # as pytest names it
    timeline: list[tuple[str, float]] = []
    run_lanes.run_lane("timed", [str(tmp_path)], 4, out, results, None, None, timeline)
    assert [module.rsplit("/", 1)[-1] for module, _ in timeline] == ["test_fails.py", "test_passes.py"]
    assert 0 < timeline[0][1] <= timeline[1][1]


def test_a_lane_adds_up_its_servers_waits_for_memory_from_their_logs(tmp_path: Path) -> None:
    (tmp_path / "logs0").mkdir()
    (tmp_path / "logs0" / "a.log").write_text(
        "[server_process] waited 48 s for 9 GiB of available memory\nup\n"
    )
    (tmp_path / "b.log").write_text("start\n[server_process] waited 12 s for 3.5 GiB of available memory\n")
    (tmp_path / "c.log").write_text("no wait\n")
    assert run_lanes.gate_waits(str(tmp_path)) == (60.0, 2)
    assert run_lanes.gate_waits(str(tmp_path / "none")) == (0.0, 0)


def test_a_lanes_slowest_modules_are_the_longest_spans_between_their_ends() -> None:
    timeline = [("test/unit/test_a.py", 60.0), ("test/integration/test_b.py", 600.0), ("test_c.py", 630.0)]
    assert run_lanes.slowest(timeline, 2) == "test_b.py 9.0, test_a.py 1.0"
    assert run_lanes.slowest([]) == ""


def test_the_yielding_lane_waits_for_memory_then_starts_anyway() -> None:
    from sglang_oasis.server_process import wait_for_memory

    readings = iter([2.0, 3.5, 9.5, 12.0])
    slept: list[float] = []
    assert wait_for_memory(9.0, 60.0, lambda: next(readings), slept.append) == 4.0  # two waits, then 9.5
    assert slept == [2.0, 2.0]
    slept.clear()
    assert wait_for_memory(9.0, 6.0, lambda: 1.0, slept.append) == 6.0  # never enough: it gives up
    assert wait_for_memory(9.0, 60.0, lambda: None, slept.append) == 0.0  # unreadable: no wait


def test_both_lanes_gate_their_servers_the_servers_lane_briefly() -> None:
    from sglang_oasis.server_process import spawn_gate

    assert spawn_gate("") is None
    assert spawn_gate(str(run_lanes.UNIT_LANE_WAITS_FOR_GIB)) == (9.0, 1200.0)
    gib, seconds = spawn_gate(run_lanes.SERVERS_LANE_WAITS) or (0.0, 0.0)
    assert 3.0 <= gib < run_lanes.UNIT_LANE_WAITS_FOR_GIB and seconds <= 300  # room for one server, minutes


def test_only_model_servers_wait_for_memory_not_the_pd_router(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lane's memory gate holds back model servers; SGLang's router (launch_pd starts it once both
    servers are ready) starts at once: waiting for the unit lane's 9 GiB it let test_pd_retraction's
    start deadline pass with both servers ready (in the full suite)."""
    from sglang_oasis import server_process
    from sglang_oasis.server_process import SPAWN_WAIT_ENV, ServerProcess

    waits: list[tuple[float, float]] = []
    monkeypatch.setenv(SPAWN_WAIT_ENV, "1000:5")
    monkeypatch.setattr(
        server_process, "wait_for_memory", lambda gib, seconds: waits.append((gib, seconds)) or 0.0
    )
    monkeypatch.setattr(server_process.subprocess, "Popen", lambda *args, **kwargs: None)
    ServerProcess([], tmp_path / "router.log", module="sglang_router.launch_router").spawn()
    assert waits == []
    ServerProcess([], tmp_path / "server.log").spawn()
    assert waits == [(1000.0, 5.0)]


def test_the_memory_low_point_says_when_and_where_each_lane_was() -> None:
    """The summary's lowest available memory comes with its time and the module each lane had last
    finished then (read from pytest's progress lines), so a run near empty says where to look."""
    assert (
        run_lanes.finished_module("test/integration/test_pd.py ..s     [ 42%]\n")
        == "test/integration/test_pd.py"
    )
    assert run_lanes.finished_module("=== 3 passed in 1.0s ===") is None
    assert run_lanes.finished_module("E   assert x.py == 1") is None
    readings = iter([5.0, 0.4, 2.0])
    finished = {"unit": "test/unit/test_a.py"}
    memory = run_lanes.LowestMemory(finished, read=lambda: next(readings))
    memory.sample()
    finished.update({"unit": "test/unit/test_b.py", "servers": "test/integration/test_pd.py"})
    memory.sample()  # the low point: the lanes' modules now
    finished.update({"unit": "test/unit/test_c.py"})
    memory.sample()
    report = memory.report()
    assert report.startswith("  lowest available memory while they ran: 0.4 GiB at 0.0 min")
    assert "servers after test/integration/test_pd.py, unit after test/unit/test_b.py" in report
