"""The prefill node's send decisions (``disaggregation/send_plan.py``): once per bootstrap room, after the
stager is ready; the handshake and the staging cap decide whole or staged; a staged send's last chunk
stages with its last page; records of requests that never finish expire."""

from __future__ import annotations

import numpy as np
import pytest
from test_sglang_hooks import FakeStager


def test_nothing_is_decided_before_decode_nodes_can_find_the_handoffs() -> None:
    stager = FakeStager({"d:1"})
    stager.ready.clear()
    assert stager.sends.decide(1, ["d:1"], 40, "r1") is None and len(stager.sends) == 0
    stager.sends.last_chunk(1, 0, 40, 0)  # an undecided room: SGLang sends it as it would
    assert stager.sends.pages(1, np.asarray([3]), True) is None and stager.handed == []
    stager.ready.set()
    send = stager.sends.decide(1, ["d:1"], 40, "r1")  # decided at the first chunk once ready
    assert send is not None and not send.whole


def test_a_send_is_decided_once_and_the_cap_sends_the_rest_whole() -> None:
    stager = FakeStager({"d:1"}, room=1)
    first = stager.sends.decide(1, ["d:1"], 40, "r1")
    assert first is not None and not first.whole
    assert stager.sends.decide(1, ["other:2"], 40, "r1") is first  # later chunks keep the decision
    over = stager.sends.decide(2, ["d:1"], 40, "r2")  # the cap's room is taken
    assert over is not None and over.whole and stager.counted == {"staging_whole_sends": 1}
    assert stager.sends.pages(2, np.asarray([5]), False) is None  # whole: every page goes


def test_a_staged_send_stages_at_its_last_chunk_with_its_last_page() -> None:
    stager = FakeStager({"d:1"})
    stager.sends.decide(7, ["d:1"], 40, "r7")
    assert stager.sends.pages(7, np.asarray([10, 11]), False) == -1  # nothing sent yet
    with pytest.raises(RuntimeError, match="without its stage"):  # a last chunk never announced
        stager.sends.pages(7, np.asarray([12]), True)
    assert stager.sends.get(7) is None and stager.staged == []
    stager.sends.decide(8, ["d:1"], 40, "r8")
    stager.sends.pages(8, np.asarray([20, 21]), False)
    stager.sends.last_chunk(8, 2, 40, 16)
    assert stager.sends.pages(8, np.asarray([], dtype=np.int32), True) == 21
    assert stager.staged == [(8, 2, 40, 16)] and len(stager.sends) == 0


def test_records_of_sends_that_never_finish_expire() -> None:
    stager = FakeStager({"d:1"})
    old = stager.sends.decide(1, ["d:1"], 40, "r1")
    assert old is not None
    stager.sends.decide(2, ["d:1"], 40, "r2")
    stager.sends.expire(ttl_s=60, now=old.since + 61)
    assert len(stager.sends) == 0


def test_a_decode_node_that_asks_before_the_prefill_registered_gets_its_requests_whole() -> None:
    """The hand-off endpoint race: a prefill scheduler registers its hand-off URL with its bootstrap
    server (SGLang's, with hook 7's route) only after both started. A decode node that looks it up
    before finds none (404: nothing cached, the request arrives whole) and the prefill node stages
    nothing meanwhile (its plans decide nothing before it registered); once the registration (retried
    until the server answers) lands, the next look-up finds it and requests are staged."""
    import asyncio
    import socket
    import threading

    from aiohttp import web

    from sglang_oasis import sglang_hooks as hooks
    from sglang_oasis.disaggregation.side_channel import EndpointDirectory, register_handoffs

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = type("BootstrapServer", (), {"app": web.Application()})()
    hooks.remote_fetch_routes(lambda s: None, server)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(server.app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        directory, stager = EndpointDirectory(), FakeStager({"d:1"})
        stager.ready.clear()
        assert directory.url("127.0.0.1", port) is None and directory.known("127.0.0.1", port) is None
        assert stager.sends.decide(1, ["d:1"], 40, "r1") is None  # sent whole, as SGLang sends it
        url = "http://127.0.0.1:9"
        register = threading.Thread(
            target=register_handoffs, args=("127.0.0.1", port, 0, 1, url, stager.ready)
        )
        register.start()
        register.join(timeout=30)
        assert stager.ready.is_set()
        assert directory.url("127.0.0.1", port) == url == directory.known("127.0.0.1", port)
        send = stager.sends.decide(2, ["d:1"], 40, "r2")
        assert send is not None and not send.whole
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
