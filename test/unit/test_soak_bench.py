"""The pure pieces of the soak (``benchmark/soak.py``, ``benchmark/bench_soak.py``): the seeded workload,
the classification of outcomes against the solo run, and what fails a mode."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark"))

from bench_soak import failures
from soak import Excuses, Outcome, SoakRequest, compare, workload

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
    kept = {"flushed": True, "held_kept_retractions": 2, "held_fetch_requests": 1}  # aborted while retracted
    assert failures({**clean, "held_after_drain": kept}) == ["held_fetch_requests = 1 after the drain"]


def test_injected_requests_have_the_injected_length_and_leave_the_rest_of_the_seed_alone() -> None:
    plain = workload(3, 200, CORPUS, (80, 400), (4, 20))
    injected = workload(3, 200, CORPUS, (80, 400), (4, 20), inject_len=613)
    hit = [r for r in injected if len(r.input_ids) == 613]
    assert 5 < len(hit) < 50, len(hit)
    fresh = [r for r in hit if r.input_ids not in {x.input_ids for x in injected[: injected.index(r)]}]
    assert all(r.fate == "complete" for r in fresh)
    assert all(len(r.input_ids) != 613 for r in plain)
    assert workload(3, 200, CORPUS, (80, 400), (4, 20), inject_len=None) == plain


def test_a_fault_run_excuses_only_the_failures_its_faults_explain() -> None:
    excuses = Excuses(inject_len=2, grace_s=5.0)
    excuses.outages.append((100.0, 130.0))  # the prefill server was down from t = 100 s to 130 s
    reqs = [_request(i) for i in range(7)] + [SoakRequest("r7", (1, 2, 3), 3, False, "complete", 1.0)]
    injected = (
        "oasis: KV transfer for this request failed (injected transfer failure (X) for request slot(s) [3])"
    )
    outcomes = [
        Outcome("failed", error=f"HTTP 500: {injected}", started=10, ended=12),  # injected length: excused
        Outcome("failed", error="HTTP 502: no prefill", started=120, ended=121),  # during the outage
        Outcome(
            "failed", error="HTTP 500: remote KV read failed", started=90, ended=104
        ),  # in flight at the kill
        Outcome("failed", error="HTTP 500: late", started=136, ended=140),  # after up + grace: unexpected
        Outcome("aborted", error="HTTP 500: boom", started=10, ended=20),  # before the outage: unexpected
        Outcome("completed", [1, 2, 3], started=10, ended=20),
        Outcome("completed", [1, 2, 3], started=10, ended=20),  # its solo run failed (injected): unverified
        Outcome("failed", error=f"HTTP 500: {injected}", started=10, ended=12),  # 3 tokens: not injected
    ]
    solo = {(r.input_ids, 3): Outcome("completed", [1, 2, 3]) for r in reqs}
    solo[(reqs[6].input_ids, 3)] = Outcome("aborted", error=injected)
    report = compare(reqs, outcomes, solo, excuses)
    assert report["failed_injected"] == 1 and report["failed_prefill_restart"] == 2
    assert report["failed_as_expected"] == 3 and report["unverified"] == 1
    assert report["failed_unexpectedly"] == 3 and report["completed"] == 2, report
    assert [p.split(" ")[0] for p in report["problems"]] == ["r3", "r4", "r7"]
    # Without the faults' excuses every one of those failures is unexpected.
    assert compare(reqs, outcomes, solo)["failed_unexpectedly"] == 7
