"""Per-request sparse settings (``attention/request_options.py``): what a request's ``custom_params`` may
set, and the message a bad one fails with (pure logic; served in test/integration/test_sparse_equivalence.py)."""

from __future__ import annotations

import pytest

from sglang_oasis.attention.request_options import check, read_options
from sglang_oasis.config import OasisConfig

CONFIG = OasisConfig(top_k=4, recall_max_top_k=32)


def test_rows_without_options_take_the_servers_and_a_batch_without_any_costs_nothing() -> None:
    assert read_options(None, CONFIG, False) == (None, None, {})
    assert read_options([None, {"other": 1}], CONFIG, False) == (None, None, {})
    options = read_options(
        [None, {"oasis_top_k": 16, "oasis_recall_target": 0.9}, {"oasis_top_k": 1}], CONFIG, False
    )
    assert options.top_k is not None and options.target is not None
    assert options.top_k.tolist() == [4, 16, 1]
    assert options.target.tolist() == pytest.approx([0.0, 0.9, 0.0])
    assert options.errors == {}
    # The server's target is the default of a row that sets only its K.
    targeted = OasisConfig(top_k=4, recall_target=0.8)
    options = read_options([{"oasis_top_k": 8}, {"oasis_recall_target": 0}], targeted, False)
    assert options.target is not None and options.target.tolist() == pytest.approx([0.8, 0.0])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"oasis_top_k": 33}, "oasis_top_k=33: must be an integer from 1 to 32"),
        ({"oasis_top_k": 0}, "oasis_top_k=0: must be an integer"),
        ({"oasis_top_k": 8.0}, "oasis_top_k=8.0: must be an integer"),
        ({"oasis_top_k": True}, "oasis_top_k=True: must be an integer"),
        ({"oasis_recall_target": 1.0}, "oasis_recall_target=1.0: must be a number in [0, 1)"),
        ({"oasis_recall_target": "0.9"}, "oasis_recall_target='0.9': must be a number"),
        ({"oasis_topk": 8}, "unknown oasis_topk"),
        ({"oasis_top_k": {"k": 8}}, "oasis_top_k={'k': 8}: must be an integer"),
        ({"oasis_top_k": [8]}, "oasis_top_k=[8]: must be an integer"),
        ({"oasis_recall_target": float("nan")}, "oasis_recall_target=nan: must be a number"),
        (
            {"oasis_top_k": 32, "oasis_recall_target": 0.9},
            "oasis_recall_target=0.9: the working sets cannot grow",
        ),
        (["oasis_top_k", 3], "custom_params: must be a JSON object (e.g. {'oasis_top_k': 32}), got list"),
        ("oasis_top_k=3", "custom_params: must be a JSON object"),
        (7, "custom_params: must be a JSON object (e.g. {'oasis_top_k': 32}), got int 7"),
    ],
)
def test_a_bad_option_fails_its_row_alone_naming_it(params: object, message: str) -> None:
    options = read_options([{"oasis_top_k": 8}, params], CONFIG, False)
    assert list(options.errors) == [1] and message in options.errors[1], options.errors
    assert options.errors[1].startswith("oasis: bad custom_params: ")
    assert options.top_k is not None and options.top_k.tolist() == [8, 4]  # the bad row: the server's
    with pytest.raises(ValueError, match=r"^oasis: bad custom_params: ") as raised:  # hook 12's check
        check(params, CONFIG, False)
    assert message in str(raised.value)


def test_a_target_that_can_grow_is_taken_and_a_server_without_room_refuses_any() -> None:
    assert check({"oasis_top_k": 31, "oasis_recall_target": 0.9}, CONFIG, False) == (31, 0.9)
    assert check({"oasis_top_k": 32}, CONFIG, False) == (32, 0.0)  # no target: K up to the reserve
    assert check({"other": [1]}, CONFIG, False) is None and check(None, CONFIG, False) is None
    no_room = OasisConfig(top_k=4)  # reserves exactly --oasis-top-k
    with pytest.raises(ValueError, match="oasis_top_k 4 is already this server's --oasis-recall-max-top-k"):
        check({"oasis_recall_target": 0.5}, no_room, False)
    assert check({"oasis_recall_target": 0}, no_room, False) == (4, 0.0)


def test_a_target_needs_recall_samples_and_pd_refuses_every_option() -> None:
    unsampled = OasisConfig(top_k=4, recall_sample_every=0)
    assert "needs recall samples" in read_options([{"oasis_recall_target": 0.9}], unsampled, False).errors[0]
    assert read_options([{"oasis_recall_target": 0}], unsampled, False).errors == {}
    errors = read_options([{"oasis_top_k": 8}, None], CONFIG, True).errors
    assert list(errors) == [0] and "not supported with PD disaggregation" in errors[0]


def test_the_device_tier_reserves_the_largest_k_a_request_may_ask_for() -> None:
    assert CONFIG.max_top_k == 32 and CONFIG.slots_per_head == 32 + CONFIG.sink_blocks
    assert OasisConfig(top_k=4).max_top_k == 4 and OasisConfig(top_k=4, recall_target=0.9).max_top_k == 16
    assert CONFIG.pin_slots == CONFIG.window_blocks_for(32) > CONFIG.window_blocks
