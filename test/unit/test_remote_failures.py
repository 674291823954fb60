"""Remembered failures of remote partial fetching (issue 25 item 8): a bad peer or an unreachable
bootstrap server costs the decode scheduler one timeout, not one per layer, request or arrival.

The fetcher runs against a stand-in Mooncake endpoint (a fake is fine here: the logic under test is
which reads are attempted; ``test/integration/test_remote_fetch.py`` runs the real engine)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from sglang_oasis.disaggregation import side_channel
from sglang_oasis.disaggregation.remote_fetch import RemotePartialFetcher, RemoteRequest
from sglang_oasis.disaggregation.side_channel import EndpointDirectory, RemoteFetchError
from sglang_oasis.disaggregation.staging import StagedKVLayout
from sglang_oasis.disaggregation.transfer_engine import RemoteReadError

LAYERS, BLOCK, HEADS, DIM = 4, 4, 2, 8


class Endpoint:
    """Records each read; reads from ``failing`` sessions fail, after ``delay_s``."""

    def __init__(self, failing: set[str], delay_s: float = 0.0) -> None:
        self.failing, self.delay_s = failing, delay_s
        self.reads: list[str] = []

    def register(self, tensor: torch.Tensor) -> None:
        pass

    def read(self, session: str, local: list[int], remote: list[int], lengths: list[int]) -> None:
        self.reads.append(session)
        if session in self.failing:
            time.sleep(self.delay_s)
            raise RemoteReadError(session, len(local), sum(lengths), -1)


def _fetcher(endpoint: Endpoint, hung_after_s: float) -> RemotePartialFetcher:
    k = [torch.zeros(64, HEADS, DIM) for _ in range(LAYERS)]
    v = [torch.zeros(64, HEADS, DIM) for _ in range(LAYERS)]
    fetcher = RemotePartialFetcher(endpoint, k, v, BLOCK)  # type: ignore[arg-type]
    fetcher.hung_after_s = hung_after_s
    for req, session in enumerate(["good:1", "hung:1", "hung:1"]):
        layout = StagedKVLayout(session, 1 << 20, 0, LAYERS, 8 * BLOCK, BLOCK, HEADS, DIM, 4)
        present = torch.zeros(LAYERS, 8, dtype=torch.bool)
        fetcher.requests[req] = RemoteRequest(layout, torch.arange(8) + 8 * req, present)
    return fetcher


def test_a_hung_peer_costs_one_timeout_then_its_requests_fail_at_once() -> None:
    endpoint = Endpoint({"hung:1"}, delay_s=0.05)
    fetcher = _fetcher(endpoint, hung_after_s=0.04)
    wanted = {req: torch.tensor([1, 2]) for req in range(3)}
    failed = fetcher.ensure(0, wanted)
    assert set(failed) == {1, 2} and "hung:1" in fetcher.dead_peers
    # The batched read timed out on the hung peer; the per-request retries read the good peer again and
    # failed requests 1 and 2 without reading the hung one.
    assert endpoint.reads.count("hung:1") == 1 and endpoint.reads.count("good:1") == 2
    assert "timed out before" in failed[1] and "timed out before" in failed[2]
    before = len(endpoint.reads)
    failed = fetcher.ensure(1, wanted)  # the next layer: requests 1 and 2 fail without a read
    assert set(failed) == {1, 2} and endpoint.reads[before:] == ["good:1"]
    assert fetcher.counters.failed_reads == 2  # each request's failure counted once
    fetcher.release(1)
    assert 1 not in fetcher.failed


def test_a_refused_read_condemns_its_request_not_its_peer() -> None:
    """A fast failure (released staging, an unregistered address) is the request's own: the same peer's
    other requests go on reading; the failed request is not read again at later layers."""
    endpoint = Endpoint({"hung:1"})
    fetcher = _fetcher(endpoint, hung_after_s=10.0)
    assert set(fetcher.ensure(0, {1: torch.tensor([3])})) == {1}
    assert not fetcher.dead_peers and set(fetcher.failed) == {1}
    endpoint.failing.clear()
    assert fetcher.ensure(0, {2: torch.tensor([3])}) == {}  # same peer, another request: read
    before = len(endpoint.reads)
    assert set(fetcher.ensure(1, {1: torch.tensor([3])})) == {1} and len(endpoint.reads) == before


def test_an_unreachable_bootstrap_server_is_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def unreachable(address: str, timeout: float) -> None:
        calls.append(address)
        raise OSError("connection refused")

    monkeypatch.setattr(side_channel.urllib.request, "urlopen", unreachable)
    directory = EndpointDirectory()
    for _ in range(3):
        with pytest.raises(RemoteFetchError, match="unreachable"):
            directory.handoff_endpoint("127.0.0.1", 9)
    assert len(calls) == 1  # asked once; the rest were answered from memory
    directory.unreachable_ttl_s = 0.0
    with pytest.raises(RemoteFetchError):
        directory.handoff_endpoint("127.0.0.1", 9)
    assert len(calls) == 2  # after the TTL it is asked again


def test_a_decode_rank_reads_from_the_prefill_rank_of_its_number_only_at_the_same_tp_size(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Under tensor parallelism a decode rank asks the bootstrap server for the prefill rank of its own
    number; a prefill node with another --tp-size holds other KV heads per rank, so its requests arrive
    whole (None: no hand-off is asked for), with one error logged per prefill node."""
    asked: list[str] = []

    class Answer:
        def __init__(self, body: bytes) -> None:
            self.body = body

        def read(self) -> bytes:
            return self.body

        def __enter__(self) -> Answer:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    def answer(request: Any, timeout: float) -> Answer:
        asked.append(request.full_url)
        return Answer(b'{"url": "http://127.0.0.1:7001", "tp_size": 2}')

    monkeypatch.setattr(side_channel.urllib.request, "urlopen", answer)
    assert EndpointDirectory(rank=1, tp_size=2).handoff_endpoint("127.0.0.1", 9) == "http://127.0.0.1:7001"
    assert asked[-1].endswith("?engine_rank=1")
    mismatched = EndpointDirectory(rank=0, tp_size=1)
    with caplog.at_level("ERROR"):
        assert mismatched.handoff_endpoint("127.0.0.1", 9) is None
        assert mismatched.handoff_endpoint("127.0.0.1", 9) is None
    errors = [r.getMessage() for r in caplog.records if "--tp-size 2" in r.getMessage()]
    assert len(errors) == 1 and "arrive whole" in errors[0], errors
