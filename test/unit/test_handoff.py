"""The hand-off of remote partial fetching (``disaggregation/handoff.py``): what the prefill node
serves the decode node survives the trip exactly."""

from __future__ import annotations

import pytest
import torch

from sglang_oasis.disaggregation.handoff import Handoff
from sglang_oasis.disaggregation.side_channel import TOKEN_ENV, TOKEN_HEADER, authorized, reachable
from sglang_oasis.disaggregation.staging import StagedKVLayout


def test_handoff_round_trips_layout_selection_and_prefix() -> None:
    layout = StagedKVLayout(
        session="127.0.0.1:12345", kv_address=2**40 + 64, summary_address=2**41, num_layers=5,
        num_tokens=1000, block_size=16, num_kv_heads=3, head_dim=64, itemsize=2, code_address=2**42,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    selection = torch.rand((5, 3, 62), generator=generator) < 0.3  # 930 bits: not a whole number of bytes
    back = Handoff.from_json(Handoff(layout, selection, decode_prefix_len=320).to_json())
    assert back.layout == layout
    assert back.selection.dtype == torch.bool and torch.equal(back.selection, selection)
    assert back.decode_prefix_len == 320
    assert back.draft is None and back.pinned is None
    pinned = selection & (torch.rand(selection.shape, generator=generator) < 0.5)
    back = Handoff.from_json(Handoff(layout, selection, 320, pinned=pinned).to_json())
    assert back.pinned is not None and torch.equal(back.pinned, pinned)


def test_handoff_carries_the_draft_models_layout() -> None:
    layout = StagedKVLayout("h:1", 4096, 8192, 30, 300, 16, 3, 64, 2)
    draft = StagedKVLayout("h:1", 2**33, 2**34, 1, 300, 16, 3, 64, 2)
    back = Handoff.from_json(Handoff(layout, torch.ones((30, 3, 18), dtype=torch.bool), 0, draft).to_json())
    assert back.draft == draft and back.layout == layout


def test_handoff_of_a_prompt_without_full_blocks() -> None:
    layout = StagedKVLayout("h:1", 0, 0, 2, 9, 16, 1, 8, 4)
    back = Handoff.from_json(Handoff(layout, torch.zeros((2, 1, 0), dtype=torch.bool), 0).to_json())
    assert back.selection.shape == (2, 1, 0)


def test_handoff_of_a_request_sent_whole_carries_its_first_selection_only() -> None:
    selection = torch.rand((6, 3, 312), generator=torch.Generator().manual_seed(1)) < 0.1
    back = Handoff.from_json(Handoff(None, selection, 32, pinned=selection, whole_tokens=5000).to_json())
    assert back.layout is None and back.num_tokens == 5000 and back.decode_prefix_len == 32
    assert torch.equal(back.selection, selection) and back.pinned is not None
    layout = StagedKVLayout("h:1", 0, 0, 2, 9, 16, 1, 8, 4)
    assert Handoff(layout, torch.zeros((2, 1, 0), dtype=torch.bool), 0).num_tokens == 9


def test_only_the_deployments_callers_are_authorized(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)  # no token: callers on this machine only
    assert authorized({}, "127.0.0.1") and authorized({}, "::1")
    assert not authorized({}, "10.1.2.3") and not authorized({}, None) and not authorized({}, "bad")
    monkeypatch.setenv(TOKEN_ENV, "t0ken")  # a token: whoever sends it, from anywhere; nobody else
    assert authorized({TOKEN_HEADER: "t0ken"}, "10.1.2.3")
    assert not authorized({}, "127.0.0.1") and not authorized({TOKEN_HEADER: "t0ke"}, "127.0.0.1")


def test_a_wildcard_address_is_read_at_the_host_the_bootstrap_server_was_reached_at() -> None:
    """A prefill server bound to every interface (``--host 0.0.0.0``, no ``--oasis-advertise-host``)
    advertises a wildcard in its hand-off URL and Mooncake sessions; a decode node reads them at the host
    it reached the prefill's bootstrap server at. Any other address stays as advertised."""
    assert reachable("http://0.0.0.0:8000", "10.0.0.5") == "http://10.0.0.5:8000"
    assert reachable("0.0.0.0:15092", "10.0.0.5") == "10.0.0.5:15092"
    assert reachable("[::]:77", "fe80::1") == "[fe80::1]:77"
    assert reachable("http://10.1.1.1:5/x", "10.0.0.5") == "http://10.1.1.1:5/x"
    assert reachable("127.0.0.1:9", "10.0.0.5") == "127.0.0.1:9"
    layout = StagedKVLayout("0.0.0.0:4000", 0, 0, 2, 9, 16, 1, 8, 4)
    draft = StagedKVLayout("0.0.0.0:4000", 64, 0, 1, 9, 16, 1, 8, 4)
    handoff = Handoff(layout, torch.zeros((2, 1, 0), dtype=torch.bool), 0, draft)
    seen = handoff.reached_via("192.168.7.7")
    assert seen.layout is not None and seen.layout.session == "192.168.7.7:4000"
    assert seen.draft is not None and seen.draft.session == "192.168.7.7:4000" and seen.layout.kv_address == 0
