"""Remote partial fetching's data plane over the real Mooncake transfer engine (TCP on 127.0.0.1): what
admission reads, that a block is read at most once, that radix-cached blocks never move, batching, and
that a dead prefill peer fails only its own requests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sgl_kernel_oasis import build_block_summaries
from sgl_kernel_oasis.key_codes import encode_key_codes
from sglang_oasis.disaggregation.decode_admission import Origin
from sglang_oasis.disaggregation.prefill_stager import PrefillStager
from sglang_oasis.disaggregation.remote_fetch import RemotePartialFetcher
from sglang_oasis.disaggregation.staging import KVStagingArea, StagedKVLayout
from sglang_oasis.disaggregation.transfer_engine import MooncakeEndpoint, RemoteReadError
from sglang_oasis.server_process import child_env
from sglang_oasis.stats import OasisStats
from sglang_oasis_testing.staging_peer import seeded_kv

os.environ.setdefault("MC_TRANSFER_TIMEOUT", "5")

LAYERS, TOKENS, HEADS, DIM, B = 3, 70, 2, 8, 16  # 5 pages, the last holds 6 tokens
POOL_PAGES = 40


@pytest.fixture(scope="module")
def prefill() -> Iterator[KVStagingArea]:
    endpoint = MooncakeEndpoint()
    yield KVStagingArea(endpoint, B)
    endpoint.close()


@pytest.fixture(scope="module")
def decode_endpoint() -> MooncakeEndpoint:
    return MooncakeEndpoint()


class DecodeTier:
    """A decode node's host tier: pool buffers shaped like SGLang's, and summary tensors."""

    def __init__(self, endpoint: MooncakeEndpoint, layers: int = LAYERS) -> None:
        self.k = [torch.full((POOL_PAGES * B, HEADS, DIM), -7.0) for _ in range(layers)]
        self.v = [torch.full((POOL_PAGES * B, HEADS, DIM), -7.0) for _ in range(layers)]
        self.kmin = torch.zeros(layers, POOL_PAGES, HEADS, DIM)
        self.kmax = torch.zeros(layers, POOL_PAGES, HEADS, DIM)
        self.fetcher = RemotePartialFetcher(endpoint, self.k, self.v, B, self.kmin, self.kmax)

    def page(self, layer: int, local_page: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = slice(local_page * B, (local_page + 1) * B)
        return self.k[layer][rows], self.v[layer][rows]


def expected_page(
    keys: torch.Tensor, values: torch.Tensor, layer: int, block: int
) -> tuple[torch.Tensor, ...]:
    """A logical block as the decode pool holds it: the last one zero-padded."""
    rows = slice(block * B, (block + 1) * B)
    k, v = keys[layer, rows], values[layer, rows]
    pad = B - k.shape[0]
    return torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)), torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad))


def test_admission_reads_the_selected_union_the_last_block_and_the_summaries(
    prefill: KVStagingArea, decode_endpoint: MooncakeEndpoint
) -> None:
    keys, values = seeded_kv(1, 0, LAYERS, TOKENS, HEADS, DIM)
    layout = StagedKVLayout.from_dict(json.loads(json.dumps(prefill.stage("adm", keys, values).to_dict())))
    assert (layout.num_pages, layout.full_blocks) == (5, 4)
    tier = DecodeTier(decode_endpoint)
    local = torch.tensor([17, 3, 30, 8, 21])
    selected = torch.zeros(LAYERS, 5, dtype=torch.bool)
    selected[0, [0, 2]] = True
    selected[2, 1] = True
    before = decode_endpoint.bytes_read

    tier.fetcher.admit(4, layout, local, selected)

    read = {(0, 0), (0, 2), (2, 1), (0, 4), (1, 4), (2, 4)}  # the selection plus every layer's last block
    for layer in range(LAYERS):
        for block in range(5):
            k, v = tier.page(layer, int(local[block]))
            if (layer, block) in read:
                want_k, want_v = expected_page(keys, values, layer, block)
                assert torch.equal(k, want_k) and torch.equal(v, want_v), (layer, block)
            else:
                assert bool((k == -7).all() and (v == -7).all()), f"block {block} of layer {layer} moved"
        kmin, kmax = build_block_summaries(keys[layer], B)
        assert torch.equal(tier.kmin[layer, local], kmin) and torch.equal(tier.kmax[layer, local], kmax)
    counters = tier.fetcher.counters
    assert counters.admission_blocks == len(read)
    assert counters.admission_bytes == len(read) * 2 * layout.block_bytes
    assert counters.summary_bytes == layout.summary_bytes
    assert decode_endpoint.bytes_read - before == counters.total_bytes
    assert tier.fetcher.host_bytes(4) == len(read) * 2 * layout.block_bytes < layout.kv_bytes


def test_blocks_are_read_once_batched_across_requests(
    prefill: KVStagingArea, decode_endpoint: MooncakeEndpoint
) -> None:
    tier = DecodeTier(decode_endpoint)
    kv = {req: seeded_kv(2, req, LAYERS, TOKENS, HEADS, DIM) for req in (0, 1)}
    locals_ = {0: torch.tensor([0, 1, 2, 3, 4]), 1: torch.tensor([9, 8, 7, 6, 5])}
    for req in (0, 1):
        layout = prefill.stage(f"once{req}", *kv[req])
        tier.fetcher.admit(req, layout, locals_[req], torch.zeros(LAYERS, 5, dtype=torch.bool))
    batches, read = decode_endpoint.batches, decode_endpoint.bytes_read

    failed = tier.fetcher.ensure(
        1, {0: torch.tensor([0, 3, 4]), 1: torch.tensor([2, 2]), 7: torch.tensor([1])}
    )

    assert failed == {}
    assert decode_endpoint.batches == batches + 1, "both requests' misses go in one batch to their peer"
    block_bytes = B * HEADS * DIM * 4
    assert decode_endpoint.bytes_read - read == 3 * 2 * block_bytes  # block 4 was present; 2 asked twice
    for req, blocks in ((0, [0, 3]), (1, [2])):
        for block in blocks:
            got = tier.page(1, int(locals_[req][block]))
            want = expected_page(*kv[req], 1, block)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert tier.fetcher.counters.miss_blocks == 3

    assert tier.fetcher.ensure(1, {0: torch.tensor([0, 3]), 1: torch.tensor([2])}) == {}
    assert decode_endpoint.bytes_read - read == 3 * 2 * block_bytes, "a present block is never read again"
    assert decode_endpoint.batches == batches + 1


def test_a_release_waits_for_the_reads_into_the_requests_pages(
    prefill: KVStagingArea, decode_endpoint: MooncakeEndpoint
) -> None:
    """A decode-time read (delayed by injection) is writing into request 0's pages when SGLang frees its
    row: ``release`` (hook 7's listener, on the scheduler thread) returns only after that read ended, so
    the request that takes the same pages next (written right after the release) keeps its KV. Before,
    the release returned at once and the late read overwrote the new request's KV."""
    tier = DecodeTier(decode_endpoint)
    keys, values = seeded_kv(3, 0, LAYERS, TOKENS, HEADS, DIM)
    local = torch.tensor([10, 11, 12, 13, 14])
    tier.fetcher.admit(
        0, prefill.stage("fence", keys, values), local, torch.zeros(LAYERS, 5, dtype=torch.bool)
    )
    reading, read = threading.Event(), tier.fetcher.endpoint.read

    def slow_read(*args: object) -> None:  # the injected delay: the read is in flight for 1.5 s
        reading.set()
        time.sleep(1.5)
        read(*args)  # type: ignore[arg-type]

    tier.fetcher.endpoint.read = slow_read  # type: ignore[method-assign]
    try:
        worker = threading.Thread(target=tier.fetcher.ensure, args=(1, {0: torch.tensor([0, 1, 2, 3])}))
        worker.start()
        assert reading.wait(timeout=30)
        tier.fetcher.release(0)  # SGLang freed the row; its pages go to the next request
        for page in local[:4].tolist():  # the new request's KV in the same pages
            tier.page(1, page)[0].fill_(5.0)
            tier.page(1, page)[1].fill_(5.0)
        worker.join(timeout=60)
    finally:
        tier.fetcher.endpoint.read = read  # type: ignore[method-assign]
    assert not worker.is_alive()
    for page in local[:4].tolist():
        k, v = tier.page(1, page)
        assert bool((k == 5.0).all() and (v == 5.0).all()), f"a late read overwrote page {page}"
    assert 0 not in tier.fetcher.requests and not tier.fetcher._reading


def test_radix_cached_blocks_are_never_transferred(
    prefill: KVStagingArea, decode_endpoint: MooncakeEndpoint
) -> None:
    keys, values = seeded_kv(3, 0, LAYERS, TOKENS, HEADS, DIM)
    layout = prefill.stage("cached", keys, values)
    tier = DecodeTier(decode_endpoint)
    local = torch.tensor([10, 11, 12, 13, 14])
    sentinel = tier.kmin[:, 10:13].clone()
    tier.fetcher.admit(0, layout, local, torch.ones(LAYERS, 5, dtype=torch.bool), cached_blocks=3)

    counters = tier.fetcher.counters
    assert counters.cached_blocks == 3 * LAYERS
    assert counters.admission_blocks == 2 * LAYERS  # blocks 3 and 4 only
    assert counters.summary_bytes == 2 * LAYERS * 2 * layout.summary_row_bytes
    assert torch.equal(tier.kmin[:, 10:13], sentinel), "cached blocks' summaries are the decode node's own"
    for layer in range(LAYERS):
        assert bool((tier.page(layer, 10)[0] == -7).all())
    assert tier.fetcher.ensure(0, {0: torch.arange(5)}) == {}
    assert tier.fetcher.counters.miss_blocks == 0


def test_batches_hold_at_most_max_batch_requests(prefill: KVStagingArea) -> None:
    endpoint = MooncakeEndpoint(max_batch=7)
    tier = DecodeTier(endpoint)
    keys, values = seeded_kv(4, 0, LAYERS, TOKENS, HEADS, DIM)
    layout = prefill.stage("chunks", keys, values)
    local = torch.tensor([5, 6, 7, 8, 9])
    tier.fetcher.admit(0, layout, local, torch.zeros(LAYERS, 5, dtype=torch.bool))
    batches = endpoint.batches
    assert tier.fetcher.ensure(2, {0: torch.arange(4)}) == {}
    assert endpoint.batches - batches == 2  # 8 regions (K and V of 4 blocks) in batches of 7 + 1
    for block in range(4):
        want = expected_page(keys, values, 2, block)
        assert torch.equal(tier.page(2, int(local[block]))[0], want[0])


def test_kv_staged_without_summaries_is_read_whole_by_a_fetcher_without_summaries(
    prefill: KVStagingArea, decode_endpoint: MooncakeEndpoint
) -> None:
    """The EAGLE-3 draft model's KV: staged without summaries (nothing is selected over it)."""
    keys, values = seeded_kv(8, 0, 1, TOKENS, HEADS, DIM)
    before = prefill.nbytes
    layout = prefill.stage("draft", keys, values, summaries=False)
    assert layout.summary_address == 0
    assert prefill.nbytes - before == layout.kv_bytes  # the KV only
    k = [torch.full((POOL_PAGES * B, HEADS, DIM), -7.0)]
    v = [torch.full((POOL_PAGES * B, HEADS, DIM), -7.0)]
    fetcher = RemotePartialFetcher(decode_endpoint, k, v, B)
    local = torch.tensor([9, 1, 33, 4, 12])
    fetcher.admit(0, layout, local, torch.ones(1, 5, dtype=torch.bool))
    for block in range(5):
        rows = slice(int(local[block]) * B, (int(local[block]) + 1) * B)
        want_k, want_v = expected_page(keys, values, 0, block)
        assert torch.equal(k[0][rows], want_k) and torch.equal(v[0][rows], want_v)
    assert fetcher.counters.summary_bytes == 0
    with pytest.raises(ValueError, match="has no summaries"):
        DecodeTier(decode_endpoint, layers=1).fetcher.admit(
            1, layout, local, torch.ones(1, 5, dtype=torch.bool)
        )
    prefill.release("draft")
    assert prefill.nbytes == before


def test_key_codes_are_staged_with_the_summaries_and_read_for_the_full_blocks_not_cached(
    prefill: KVStagingArea, decode_endpoint: MooncakeEndpoint
) -> None:
    """``--oasis-selector codes`` under PD: the decode node ranks every full block by its codes, so they
    arrive at admission (but those of blocks its radix cache holds, coded there, and of the partial last
    block, never coded); a decode node that ranks by codes refuses KV staged without them."""
    keys, values = seeded_kv(11, 0, LAYERS, TOKENS, HEADS, DIM)
    before = prefill.nbytes
    layout = prefill.stage("codes", keys, values, codes=True)
    assert layout.code_address != 0 and layout.code_row_bytes == B * HEADS * DIM // 4
    codes_bytes = LAYERS * layout.num_pages * layout.code_row_bytes
    assert prefill.nbytes - before == layout.kv_bytes + layout.summary_bytes + codes_bytes
    tier = DecodeTier(decode_endpoint)
    codes = torch.full((LAYERS, POOL_PAGES, B, HEADS, DIM // 4), 0xAB, dtype=torch.uint8)
    fetcher = RemotePartialFetcher(decode_endpoint, tier.k, tier.v, B, tier.kmin, tier.kmax, codes)
    local = torch.tensor([6, 25, 2, 37, 14])
    reads = fetcher.admit(7, layout, local, torch.zeros(LAYERS, 5, dtype=torch.bool), cached_blocks=1)
    full = layout.full_blocks
    for layer in range(LAYERS):
        kmin, kmax = build_block_summaries(keys[layer], B)
        blocks = keys[layer, : full * B].view(full, B, HEADS, DIM)
        want = encode_key_codes(blocks, kmin[:full], kmax[:full])
        assert torch.equal(codes[layer, local[1:full]], want[1:]), layer
        assert bool((codes[layer, local[[0, full]]] == 0xAB).all()), "a cached or partial block's codes moved"
    assert reads.code_bytes == fetcher.counters.code_bytes == LAYERS * (full - 1) * layout.code_row_bytes
    plain = prefill.stage("no-codes", keys, values)
    with pytest.raises(ValueError, match="has no key codes"):
        fetcher.admit(8, plain, local, torch.zeros(LAYERS, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="stage them too"):
        prefill.stage("bad", keys, values, summaries=False, codes=True)
    fetcher.release(7)
    prefill.release("codes")
    prefill.release("no-codes")
    assert prefill.nbytes == before


def test_layout_mismatch_is_refused(prefill: KVStagingArea, decode_endpoint: MooncakeEndpoint) -> None:
    keys, values = seeded_kv(5, 0, LAYERS + 1, TOKENS, HEADS, DIM)
    layout = prefill.stage("mismatch", keys, values)
    tier = DecodeTier(decode_endpoint)
    with pytest.raises(ValueError, match="does not match the local pool"):
        tier.fetcher.admit(0, layout, torch.arange(5), torch.zeros(LAYERS + 1, 5, dtype=torch.bool))


def test_admission_from_a_released_staging_fails_that_request_only(prefill: KVStagingArea) -> None:
    keys, values = seeded_kv(6, 0, LAYERS, TOKENS, HEADS, DIM)
    layout = prefill.stage("gone", keys, values)
    prefill.release("gone")
    # Its own decode engine: after a batch of ~30 rejected reads, Mooncake 0.3.13 stalls the next read
    # to that peer for up to MC_TRANSFER_TIMEOUT and fails it, which would fail the later tests' reads.
    tier = DecodeTier(MooncakeEndpoint())
    with pytest.raises(RemoteReadError, match=layout.session):
        tier.fetcher.admit(3, layout, torch.arange(5), torch.zeros(LAYERS, 5, dtype=torch.bool))
    assert 3 not in tier.fetcher.requests and tier.fetcher.counters.failed_reads == 1


def test_a_dead_prefill_peer_fails_only_its_requests(
    prefill: KVStagingArea, decode_endpoint: MooncakeEndpoint
) -> None:
    peer = subprocess.Popen(
        [sys.executable, "-m", "sglang_oasis_testing.staging_peer", "--seed", "9", "--layers", str(LAYERS),
         "--tokens", str(TOKENS), "--kv-heads", str(HEADS), "--head-dim", str(DIM), "--block-size", str(B)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
        env=child_env({"MC_LOG_LEVEL": "ERROR"}),
    )  # fmt: skip
    try:
        assert peer.stdout is not None
        remote = StagedKVLayout.from_dict(json.loads(peer.stdout.readline())[0])
        tier = DecodeTier(decode_endpoint)
        keys, _ = seeded_kv(9, 0, LAYERS, TOKENS, HEADS, DIM)
        none = torch.zeros(LAYERS, 5, dtype=torch.bool)
        tier.fetcher.admit(0, remote, torch.arange(5), none)  # from the other process
        local_kv = seeded_kv(7, 0, LAYERS, TOKENS, HEADS, DIM)
        tier.fetcher.admit(1, prefill.stage("alive", *local_kv), torch.arange(10, 15), none)
        assert tier.fetcher.ensure(0, {0: torch.tensor([0])}) == {}
        assert torch.equal(tier.page(0, 0)[0], keys[0, :B]), "read across processes"

        os.killpg(peer.pid, signal.SIGKILL)
        peer.wait(timeout=30)
        failed = tier.fetcher.ensure(0, {0: torch.tensor([1, 2]), 1: torch.tensor([1, 2])})

        assert list(failed) == [0] and remote.session in failed[0]
        assert not bool(tier.fetcher.requests[0].present[0, 1:3].any())
        assert bool(tier.fetcher.requests[1].present[0, 1:3].all()), "the live peer's request was served"
        assert torch.equal(tier.page(0, 11)[0], local_kv[0][0, B : 2 * B])
        assert tier.fetcher.ensure(1, {1: torch.tensor([3])}) == {}, "the fetcher keeps working"
    finally:
        if peer.poll() is None:
            os.killpg(peer.pid, signal.SIGKILL)
            peer.wait(timeout=30)


class StagingBackend:
    """What ``PrefillStager`` reads of the attention backend: one request of TOKENS tokens in row 1."""

    block_size = B

    def __init__(self, fail_selection: bool = False) -> None:
        self.keys, self.values = seeded_kv(7, 0, LAYERS, TOKENS, HEADS, DIM)
        req_to_token = torch.zeros(2, 128, dtype=torch.int32)
        req_to_token[1, :TOKENS] = torch.arange(TOKENS, dtype=torch.int32)
        self.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
        self.token_to_kv_pool = SimpleNamespace(
            layer_num=LAYERS,
            get_key_buffer=lambda layer: self.keys[layer],
            get_value_buffer=lambda layer: self.values[layer],
        )
        self.stats = OasisStats(None, owner=False)
        self.fail_selection = fail_selection

    def finish_pending(self) -> None:
        pass

    def admission_selection(self, req: int, num_tokens: int) -> torch.Tensor:
        if self.fail_selection:
            raise RuntimeError("selection lost")
        return torch.ones((LAYERS, HEADS, num_tokens // B), dtype=torch.bool)

    def admission_pins(self, req: int, num_tokens: int) -> torch.Tensor | None:
        return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stager(backend: StagingBackend, ttl_s: float = 3600, max_bytes: int = 0) -> PrefillStager:
    # No bootstrap server listens on this port: the stager keeps retrying its registration quietly.
    return PrefillStager(backend, "127.0.0.1", free_port(), 0, ttl_s, max_bytes=max_bytes)


def test_staging_is_capped_swept_and_released_on_errors() -> None:
    """A byte cap (a request that would pass it goes whole), held across prompts admitted before any of
    them is staged; a periodic sweeper for hand-offs no decode node released (and reservations never
    staged); nothing left registered when staging fails half-way."""
    backend = StagingBackend()
    stager = _stager(backend, ttl_s=0.5)
    assert stager.reserve(11, TOKENS), "no cap: always room"
    stager.stage(room=11, slot=1, num_tokens=TOKENS, decode_prefix_len=0)
    one = stager.staging.nbytes
    assert one > 0 and stager.handoff(11) is not None
    assert stager.staging_bytes(TOKENS) == one, "the reservation is what staging takes"
    capped = _stager(StagingBackend(), max_bytes=one + one // 2)
    assert capped.reserve(12, TOKENS)
    # Decided before request 12 is staged (one batch's prompts): its reservation counts.
    assert not capped.reserve(14, TOKENS), "a second request would pass the cap"
    capped.stage(room=12, slot=1, num_tokens=TOKENS, decode_prefix_len=0)
    assert not capped.reserve(14, TOKENS), "staged, request 12 still counts (once)"
    assert capped.release(12) and capped.reserve(14, TOKENS)
    assert capped.backend.stats.snapshot()["staged_bytes_peak"] == one
    capped.expire(now=time.monotonic() + 7200)  # request 14 was admitted and never staged (aborted)
    assert capped.reserve(15, TOKENS), "an expired reservation frees its bytes"
    # The sweeper releases an unreleased hand-off after the TTL without any new request staged.
    deadline = time.monotonic() + 10
    while stager.handoff(11) is not None:
        assert time.monotonic() < deadline, "the hand-off never expired"
        time.sleep(0.2)
    assert stager.staging.nbytes == 0 and backend.stats.snapshot()["staged_bytes"] == 0
    # A failure after the KV was staged (here: the selection) releases what was registered.
    failing = _stager(StagingBackend(fail_selection=True))
    with pytest.raises(RuntimeError, match="selection lost"):
        failing.stage(room=13, slot=1, num_tokens=TOKENS, decode_prefix_len=0)
    assert failing.staging.nbytes == 0 and len(failing.staging) == 0 and failing.handoff(13) is None


def test_a_stager_with_key_codes_reserves_what_it_stages_and_hands_the_codes_over() -> None:
    """``--oasis-selector codes``: the staging cap counts the codes too (a reservation is what staging
    takes), and the hand-off's layout says where they are."""
    stager = PrefillStager(StagingBackend(), "127.0.0.1", free_port(), 0, 3600, key_codes=True)
    stager.stage(room=21, slot=1, num_tokens=TOKENS, decode_prefix_len=0)
    staged = stager.staging.nbytes
    assert staged == stager.staging_bytes(TOKENS) > _stager(StagingBackend()).staging_bytes(TOKENS)
    body = stager.handoff(21)
    assert body is not None and json.loads(body)["layout"]["code_address"] != 0
    assert stager.release(21) and stager.staging.nbytes == 0


def test_the_handoff_routes_take_only_the_deployments_callers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hand-off server hands out staged KV's addresses and releases it: with the deployment's token
    set (``launch_pd`` makes one) a caller without it gets 403 and the hand-off stays; with it, it is
    served and released."""
    import urllib.error
    import urllib.request

    from sglang_oasis.disaggregation.side_channel import TOKEN_ENV, TOKEN_HEADER

    monkeypatch.setenv(TOKEN_ENV, "s3cret")
    stager = _stager(StagingBackend())
    stager.stage(room=21, slot=1, num_tokens=TOKENS, decode_prefix_len=0)

    def call(method: str, headers: dict[str, str]) -> int:
        request = urllib.request.Request(f"{stager.url}/handoff/21", method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return int(response.status)
        except urllib.error.HTTPError as error:
            return int(error.code)

    for headers in ({}, {TOKEN_HEADER: "guess"}):
        assert call("GET", headers) == 403 and call("DELETE", headers) == 403
    assert stager.handoff(21) is not None and stager.staging.nbytes > 0
    assert call("GET", {TOKEN_HEADER: "s3cret"}) == 200
    assert call("DELETE", {TOKEN_HEADER: "s3cret"}) == 200 and stager.handoff(21) is None


def test_a_prefill_node_stages_only_for_decode_sessions_that_asked_for_a_handoff() -> None:
    """The handshake's prefill side: a decode node that fetches names its transfer session when it GETs
    a hand-off; from then on requests to it (and only to it) may be staged. A GET that names none, or a
    refused one, registers nothing."""
    import urllib.request

    from sglang_oasis.disaggregation.side_channel import DECODE_SESSION_HEADER

    stager = _stager(StagingBackend())
    stager.hand_over_whole(room=31, slot=1, num_tokens=TOKENS, decode_prefix_len=0)
    assert not stager.fetch(["10.0.0.2:17000"]) and not stager.fetch([])

    def get(headers: dict[str, str]) -> None:
        request = urllib.request.Request(f"{stager.url}/handoff/31", headers=headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200

    get({})
    assert not stager.fetch(["10.0.0.2:17000"])
    get({DECODE_SESSION_HEADER: "10.0.0.2:17000"})
    assert stager.fetch(["10.0.0.2:17000"])
    assert not stager.fetch(["10.0.0.2:17000", "10.0.0.3:17000"]) and not stager.fetch([])
    # The session registers with SGLang again (hook 7's forget_reregistered_sessions): a new process at
    # that address, perhaps one that does not fetch; it is staged for once it asks for a hand-off itself.
    stager.forget("10.0.0.2:17000")
    assert not stager.fetch(["10.0.0.2:17000"])
    get({DECODE_SESSION_HEADER: "10.0.0.2:17000"})
    assert stager.fetch(["10.0.0.2:17000"])


def test_releases_go_to_the_prefill_node_from_one_bounded_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """During a prefill outage releases cannot go through: they wait in one worker's queue of at most
    ``RELEASE_QUEUE``, and the rest are dropped (the prefill node's TTL expires them), instead of a thread
    per release piling up (as before). Every queued one is sent once the worker is free."""
    from sglang_oasis.disaggregation import decode_fetcher

    tier = DecodeTier(MooncakeEndpoint())
    backend = SimpleNamespace(
        token_to_kv_pool=SimpleNamespace(
            layer_num=LAYERS, get_key_buffer=tier.k.__getitem__, get_value_buffer=tier.v.__getitem__
        ),
        block_size=B, summaries=SimpleNamespace(kmin=tier.kmin, kmax=tier.kmax), codes=None,
    )  # fmt: skip
    monkeypatch.setattr(decode_fetcher, "RELEASE_QUEUE", 3)
    outage, entered, sent = threading.Event(), threading.Event(), []

    def release_remote(url: str, room: int) -> None:  # the prefill node is down until `outage` is set
        entered.set()
        outage.wait(timeout=60)
        sent.append(room)

    monkeypatch.setattr(decode_fetcher.DecodeFetcher, "_release_remote", staticmethod(release_remote))
    fetcher = decode_fetcher.DecodeFetcher(backend, "127.0.0.1")  # type: ignore[arg-type]
    before = set(threading.enumerate())  # others may end meanwhile (earlier tests' daemons): count new ones
    for slot in range(10):
        fetcher._staged[slot] = (0, "http://127.0.0.1:1", 100 + slot)
        fetcher.release_slot(slot)
        if slot == 0:  # the worker holds the first; three wait behind it, the other six are dropped
            assert entered.wait(timeout=30)
    assert set(threading.enumerate()) <= before, "a release started a thread"
    outage.set()
    deadline = time.monotonic() + 30
    while len(sent) < 4 and time.monotonic() < deadline:  # one in the worker's hands, three queued
        time.sleep(0.05)
    time.sleep(0.3)
    assert sent == [100, 101, 102, 103], sent
    assert fetcher.held() == 0


def _decode_fetcher(tier: DecodeTier) -> Any:
    """A ``DecodeFetcher`` over ``tier``'s buffers (what it reads of the attention backend)."""
    from sglang_oasis.disaggregation.decode_fetcher import DecodeFetcher

    backend = SimpleNamespace(
        token_to_kv_pool=SimpleNamespace(
            layer_num=LAYERS, get_key_buffer=tier.k.__getitem__, get_value_buffer=tier.v.__getitem__
        ),
        block_size=B, summaries=SimpleNamespace(kmin=tier.kmin, kmax=tier.kmax), codes=None,
        stats=OasisStats(None, owner=False),
    )  # fmt: skip
    return DecodeFetcher(backend, "127.0.0.1")  # type: ignore[arg-type]


def test_a_finishing_request_never_waits_for_its_remaining_blocks(prefill: KVStagingArea) -> None:
    """With the decode radix cache on, an admitted request's remaining blocks are read by the completion
    worker (``DecodeFetcher.complete_later``), and its finish asks ``whole`` only, which never reads:
    while a read is in flight (slowed to 1 s per layer by injection) it answers False at once (the KV is
    then not shared), and True once the worker is done, with every block as staged. Before, the finish
    read them itself, on the scheduler thread. A release during the completion stops it after the read
    in flight: the later layers' pages, another request's by then, are not written."""
    keys, values = seeded_kv(5, 0, LAYERS, TOKENS, HEADS, DIM)
    local = torch.tensor([20, 21, 22, 23, 24])
    for release_midway in (False, True):
        tier = DecodeTier(MooncakeEndpoint())
        remote = _decode_fetcher(tier)
        remote.fetcher.admit(0, prefill.stage(f"complete-{release_midway}", keys, values), local,
                             torch.zeros(LAYERS, 5, dtype=torch.bool), have_last=True)  # fmt: skip
        reading, read = threading.Event(), remote.fetcher.endpoint.read

        def slow_read(*args: object, read: Any = read, reading: threading.Event = reading) -> None:
            reading.set()
            time.sleep(1.0)
            read(*args)

        remote.fetcher.endpoint.read = slow_read
        remote.complete_later(0)
        assert reading.wait(timeout=30)
        started = time.monotonic()
        assert not remote.whole(0) and time.monotonic() - started < 0.5, "the finish waited for a read"
        if release_midway:
            remote.release_slot(0)  # SGLang freed the row: waits for the layer in flight only
            time.sleep(1.5)  # the worker would be one more layer on by now, had it gone on
            one_layer = 4 * 2 * remote.fetcher.block_bytes  # the read in flight ended; none started after
            assert remote.fetcher.counters.completion_bytes == one_layer, "it read on after the release"
            for page in local[:4].tolist():
                assert bool((tier.page(LAYERS - 1, page)[0] == -7.0).all()), "a released page was written"
            continue
        deadline = time.monotonic() + 30
        while not remote.whole(0):
            assert time.monotonic() < deadline, "the remaining blocks were never read"
            time.sleep(0.05)
        for layer in range(LAYERS):
            for block in range(4):
                got = tier.page(layer, int(local[block]))
                assert all(
                    torch.equal(a, b)
                    for a, b in zip(got, expected_page(keys, values, layer, block), strict=True)
                )
        counters, stats = remote.fetcher.counters, remote.backend.stats.snapshot()
        assert counters.completion_blocks == LAYERS * 4 and counters.miss_blocks == 0
        deadline = time.monotonic() + 10  # the worker adds its last layer's bytes just after it reads them
        while stats["remote_completion_bytes"] != LAYERS * 4 * 2 * remote.fetcher.block_bytes:
            assert time.monotonic() < deadline, stats["remote_completion_bytes"]
            time.sleep(0.05)
            stats = remote.backend.stats.snapshot()


def test_a_request_that_never_began_its_admission_is_released_by_its_bootstrap_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request freed before its admission read a hand-off here (its transfer failed on another
    tensor-parallel rank, its admission job was cancelled before it ran) left no record of its room;
    SGLang's free names its bootstrap address (hook 7), and its staging on a prefill node known to stage is
    released by it. Before, it stayed staged there until the TTL (CI at 10106b4: a room failed on decode
    rank 1 stayed held on prefill rank 0). A prefill node not known to stage is not looked up, and a request
    whose admission ran (and found no hand-off, or released its room itself on failing) sends nothing more."""
    from concurrent.futures import Future

    from sglang_oasis.disaggregation.decode_admission import _Admission, _Claim

    stager = _stager(StagingBackend())
    for room in (41, 42, 43, 44):
        stager.hand_over_whole(room=room, slot=1, num_tokens=TOKENS, decode_prefix_len=0)
    remote = _decode_fetcher(DecodeTier(MooncakeEndpoint()))
    known = ("127.0.0.1", 7001)
    remote.endpoints._urls[known] = stager.url

    def no_lookup(*args: object) -> None:
        raise AssertionError("a release looked a prefill node up")

    monkeypatch.setattr(remote.endpoints, "handoff_endpoint", no_lookup)
    remote.release_slot(3, (*known, 41))  # its transfer failed before its admission began
    cancelled: Future[Any] = Future()
    # queued behind others: cancelled at the free
    remote.admissions._admitting[4] = _Admission(0, cancelled, _Claim())
    remote.release_slot(4, (*known, 42))
    assert cancelled.cancelled()
    remote.release_slot(5, ("127.0.0.1", 7002, 43))  # a prefill node not known to stage
    ran: Future[Any] = Future()
    ran.set_result(None)  # its admission ran and found no hand-off
    remote.admissions._admitting[6] = _Admission(0, ran, _Claim())
    remote.release_slot(6, (*known, 44))
    deadline = time.monotonic() + 30
    while stager.handoff(41) is not None or stager.handoff(42) is not None:
        assert time.monotonic() < deadline, "a room was never released"
        time.sleep(0.05)
    time.sleep(0.3)  # the worker sends in order: anything queued after those has gone by now
    assert stager.handoff(43) is not None and stager.handoff(44) is not None
    assert remote.held() == 0


def test_a_release_never_waits_for_a_slow_handoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request freed while its admission waits for a slow hand-off (here 3 s late: a slow prefill node,
    a client that left) is released at once: the admission job had not claimed the request's pages
    (``_Claim``), so ``release_slot`` returns while the job still waits, and the job, once the hand-off
    comes, reads nothing into the pages (another request's by then) and releases the room itself. Before,
    the release waited for the job on SGLang's scheduler thread, every running request with it, up to
    twice ``HTTP_TIMEOUT_S``."""
    from sglang_oasis.disaggregation.prefill_stager import HANDOFF_DELAY_ENV

    monkeypatch.setenv(HANDOFF_DELAY_ENV, f"{TOKENS}:3")
    stager = _stager(StagingBackend())
    stager.stage(room=51, slot=1, num_tokens=TOKENS, decode_prefix_len=0)
    tier = DecodeTier(MooncakeEndpoint())
    remote = _decode_fetcher(tier)
    remote.endpoints._urls[("127.0.0.1", 7001)] = stager.url
    assert not remote.admission_done(3, 0, Origin("127.0.0.1", 7001, 51))
    job = remote.admissions._admitting[3].job
    time.sleep(0.3)  # the job is in the hand-off's GET
    remote.release_slot(3, ("127.0.0.1", 7001, 51))
    assert not job.done(), "the release waited for the hand-off"
    assert remote.held() == 0 and stager.handoff(51) is not None
    assert job.result(timeout=30) is None
    assert stager.handoff(51) is None and stager.staging.nbytes == 0, "the job did not release its room"
    assert 3 not in remote.fetcher.requests and remote.fetcher.counters.admission_bytes == 0
