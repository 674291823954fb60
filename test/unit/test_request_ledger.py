"""``RequestLedger``: each request's own decode figures, attributed by the row it holds."""

from __future__ import annotations

from sglang_oasis.request_ledger import RequestLedger


def test_figures_follow_the_request_that_holds_the_row() -> None:
    ledger = RequestLedger()
    ledger.begin([3, 5], [1, 1], ["a", "b"], decode=False)  # an extend: no step yet
    ledger.begin([3, 5], [1, 1], ["a", "b"], decode=True)
    ledger.add_bytes([3, 5], [100, 7])
    ledger.add_loads([(3, 1, 2), (5, 1, 1)], bytes_per_block=10)
    ledger.add_loads([(5, 1, 3)], bytes_per_block=10, admission=True)  # the extend's job, a step late
    ledger.add_recall(5, 4, 3.0, 2.0)
    ledger.begin([5], [1], ["b"], decode=True)
    a, b = ledger.take("a"), ledger.take("b")
    assert a == {"decode_steps": 1, "decode_blocks_loaded": 2, "decode_bytes_host_to_device": 120,
                 "admission_blocks_loaded": 0, "admission_bytes_host_to_device": 0,
                 "recall_samples": 0, "recall_mean": None, "lookahead_agreement_mean": None}  # fmt: skip
    assert b == {"decode_steps": 2, "decode_blocks_loaded": 1, "decode_bytes_host_to_device": 17,
                 "admission_blocks_loaded": 3, "admission_bytes_host_to_device": 30,
                 "recall_samples": 4, "recall_mean": 0.75, "lookahead_agreement_mean": 0.5}  # fmt: skip
    assert ledger.take("a") is None  # taken once


def test_a_late_job_of_a_rows_former_owner_is_not_billed_to_the_next() -> None:
    ledger = RequestLedger()
    ledger.begin([2], [4], ["old"], decode=True)
    ledger.begin([2], [5], ["new"], decode=True)  # the row freed and given to another request
    ledger.add_loads([(2, 4, 9)], bytes_per_block=1)  # launched for "old": dropped
    ledger.add_loads([(2, 5, 1)], bytes_per_block=1)
    assert ledger.take("new")["decode_blocks_loaded"] == 1  # type: ignore[index]
    ledger.add_bytes([2], [50])  # after its figures were taken: dropped, not a new entry
    assert ledger.take("new") is None


def test_no_rids_no_figures_and_the_oldest_go_beyond_the_cap() -> None:
    ledger = RequestLedger(keep=2)
    ledger.begin([0], [0], None, decode=True)
    ledger.add_bytes([0], [10])
    assert ledger.take("x") is None
    for i, rid in enumerate(["r0", "r1", "r2"]):
        ledger.begin([i], [0], [rid], decode=True)
    assert ledger.take("r0") is None and ledger.take("r2") is not None
