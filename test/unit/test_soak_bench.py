"""The pure pieces of the soak (``benchmark/soak.py``, ``benchmark/bench_soak.py``): the seeded workload,
the classification of outcomes against the solo run, and what fails a mode."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from bench_soak import failures
from soak import Outcome, SoakRequest, compare, workload

CORPUS = list(range(1000, 5000))


def test_the_workload_is_seeded_and_mixes_what_the_soak_claims() -> None:
    reqs = workload(3, 200, CORPUS, (80, 400), (4, 20))
    assert reqs == workload(3, 200, CORPUS, (80, 400), (4, 20)) and reqs != workload(
        4, 200, CORPUS, (80, 400), (4, 20)
    )
    assert all(80 <= len(r.input_ids) <= 400 and 4 <= r.max_new_tokens <= 20 for r in reqs)
    assert len({r.rid for r in reqs}) == 200
    fates = {fate: sum(r.fate == fate for r in reqs) for fate in ("complete", "disconnect", "abort")}
    assert all(count > 10 for count in fates.values()), fates
    assert all(r.stream for r in reqs if r.fate == "disconnect")
    assert any(r.stream for r in reqs if r.fate == "complete") and any(not r.stream for r in reqs)
    prompts = [r.input_ids for r in reqs]
    assert len(set(prompts)) < len(prompts)  # exact repeats
    stems = {p[:40] for p in prompts}
    assert any(sum(p[:40] == stem for p in prompts) > 5 for stem in stems)  # shared stems


def _request(i: int, fate: str = "complete") -> SoakRequest:
    return SoakRequest(f"r{i}", (i, i + 1), 3, False, fate, 1.0)


def test_outcomes_are_classified_against_the_solo_run() -> None:
    reqs = [_request(0), _request(1), _request(2, "abort"), _request(3, "disconnect"), _request(4), _request(5),
            _request(6)]  # fmt: skip
    outcomes = [
        Outcome("completed", [1, 2, 3]),
        Outcome("completed", [9, 9, 9]),  # differs from solo
        Outcome("aborted", error="aborted by the client"),
        Outcome("disconnected", [1]),
        Outcome("completed", [7, 7, 7], retractions=1),  # differs, but SGLang retracted it
        Outcome("failed", error="HTTP 500: boom"),
        Outcome("aborted", error="transfer failed"),  # aborted by the server, not by the client
    ]
    solo = {(r.input_ids, 3): Outcome("completed", [1, 2, 3]) for r in reqs}
    report = compare(reqs, outcomes, solo)
    assert {k: v for k, v in report.items() if k != "problems"} == {
        "sent": 7, "completed": 3, "aborted": 1, "disconnected": 1, "failed_as_expected": 2,
        "failed_unexpectedly": 2, "retracted": 1, "differing": 1, "differing_retracted": 1,
        "differing_requests": ["r1", "r4"],
    }  # fmt: skip
    assert len(report["problems"]) == 3 and "r1: output differs" in report["problems"][0]
    # A solo run that was itself retracted is no reference: its request's difference counts apart.
    solo[(reqs[1].input_ids, 3)] = Outcome("completed", [1, 2, 3], retractions=2)
    report = compare(reqs, outcomes, solo)
    assert (report["differing"], report["differing_retracted"], report["retracted"]) == (0, 2, 1)


def test_a_mode_fails_on_unexpected_failures_differences_and_held_memory() -> None:
    clean = {"failed_unexpectedly": 0, "differing": 0, "differing_retracted": 2,
             "held_after_drain": {"flushed": True, "running_requests": 0, "staged_bytes": 0}}  # fmt: skip
    assert failures(clean) == []
    assert failures({**clean, "differing": 1}) == ["differing = 1"]
    leaked = {**clean, "held_after_drain": {"flushed": True, "staged_bytes": 4096}}
    assert failures(leaked) == ["staged_bytes = 4096 after the drain"]
    assert failures({**clean, "held_after_drain": {"flushed": False}}) == [
        "the radix cache could not be flushed"
    ]
    assert failures({"error": "RuntimeError: no server"}) == ["RuntimeError: no server"]
