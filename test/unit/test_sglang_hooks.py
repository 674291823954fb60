"""The SGLang hooks (``sglang_oasis.sglang_hooks``), one test per numbered hook of its docstring (hook 7,
six hooks in one, one test per target): each target still resolves with the parameters the hook relies on
(an SGLang upgrade that moves or reshapes one fails here), and each hook does what it claims.

In this process, on SGLang as the other unit tests import it (off its CPU engine): every check but one
behaves the same there. Hook 2's verification needs SGLang's CPU engine, which SGLang reads once per
process as it imports, so it runs in a child (``sglang_hooks_cpu_engine.py``). State a hook changes
outside its arguments (a class attribute, an environment variable, a module's table) is restored after
its test by ``monkeypatch``.
"""

from __future__ import annotations

import inspect
import json
import pkgutil
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import numpy as np
import pytest
import torch

from sglang_oasis import sglang_contract as contract
from sglang_oasis import sglang_hooks as hooks
from sglang_oasis.config import OasisConfig
from sglang_oasis.disaggregation import send_plan
from sglang_oasis.disaggregation.decode_admission import Origin
from sglang_oasis.disaggregation.send_plan import SendPlans
from sglang_oasis.server_process import child_env

CPU_ENGINE_CHECK = Path(__file__).with_name("sglang_hooks_cpu_engine.py")
VOCAB_SIZE = 32000


def params_of(target: str) -> list[str]:
    """The parameter names of what the dotted path ``target`` resolves to."""
    return list(inspect.signature(pkgutil.resolve_name(target)).parameters)


def assert_params(target: str, expected: list[str]) -> None:
    """``target`` resolves, and its parameters start with ``expected``."""
    found = params_of(target)
    assert found[: len(expected)] == expected, (target, found)


def source_of(target: Any) -> str:
    return inspect.getsource(target)


def test_hook_1_draft_extend_backend() -> None:
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    assert_params(hooks.DRAFT_EXTEND_TARGET, ["self"])
    # The hook reads the configured backends where SGLang's own factory does.
    assert "attention_backends" in source_of(DraftBackendFactory._create_backend)


def test_hook_2_reject_drafts() -> None:
    """The draft token equals the target's prediction: SGLang accepts it; behind the hook nothing is
    accepted and the target's token for the real row is emitted."""
    assert_params(
        hooks.VERIFY_GREEDY_TARGET,
        ["predicts", "accept_index", "accept_token_num", "candidates", "retrieve_index",
         "retrieve_next_token", "retrieve_next_sibling", "target_predict"],
    )  # fmt: skip
    env = child_env({"SGLANG_USE_CPU_ENGINE": "1"})
    result = subprocess.run(
        [sys.executable, str(CPU_ENGINE_CHECK)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout.splitlines()[-1])
    # (predicts, accept_index, accept_token_num); compared whole, so one failure shows all three.
    rejected = [[42, -5], [[0, -1]], [0]]
    expected = {
        "sglang": [[42, 9], [[0, 1]], [1]],
        "reject_positional": rejected,
        "reject_keywords": rejected,
    }
    assert outcomes == expected


def test_hook_3_last_loc_on_cpu() -> None:
    assert_params(hooks.LAST_LOC_TARGET, ["req_to_token", "req_pool_indices_tensor", "prefix_lens_tensor"])
    req_to_token = torch.arange(40, dtype=torch.int32).view(4, 10)
    got = hooks.last_loc_on_cpu(None, req_to_token, torch.tensor([2, 0]), torch.tensor([3, 0]))
    assert got.tolist() == [22, -1], got


def test_hook_4_abort_failed_transfers() -> None:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler

    from sglang_oasis.attention.transfer_failures import TransferFailures

    assert_params(hooks.PROCESS_RESULT_TARGET, ["self", "batch", "result"])
    assert_params("sglang.srt.managers.schedule_batch.FINISH_ABORT", ["message", "status_code", "err_type"])
    # What the hook touches on SGLang's scheduler and requests still exists.
    assert callable(Scheduler.collect_inflight_reqs)
    req_init = source_of(Req.__init__)
    assert "self.to_finish" in req_init and "self.skip_radix_cache_insert" in req_init
    assert "update_finish_state" in source_of(Req) and "self.to_finish" in source_of(Req.update_finish_state)

    backend = NS(failures=TransferFailures())
    backend.failures.report(3, 7, "boom")

    def request(slot: int) -> NS:
        return NS(
            rid=f"r{slot}", kv=NS(req_pool_idx=slot), to_finish=None, skip_radix_cache_insert=False,
            finished=lambda: False,
        )  # fmt: skip

    failing, other = request(3), request(4)
    scheduler = NS(
        tp_worker=NS(model_runner=NS(attn_backend=backend)),
        req_to_token_pool=NS(req_generation=torch.tensor([0, 0, 0, 7, 2])),
        collect_inflight_reqs=lambda: [other],
    )
    out = hooks.abort_failed_transfers(lambda s, b, r: "processed", scheduler, NS(reqs=[failing, other]), 1)
    assert out == "processed"
    assert failing.to_finish is not None and failing.to_finish.message == "boom", failing.to_finish
    assert int(failing.to_finish.status_code) == 500 and failing.skip_radix_cache_insert
    assert other.to_finish is None and not backend.failures


def _tensor_parallel_rank(rank: int, init: str, out: Any) -> None:
    """One of two ranks of ``test_hook_4_under_tensor_parallelism`` (a real gloo group)."""
    import torch.distributed as dist

    from sglang_oasis.attention.transfer_failures import TransferFailures
    from sglang_oasis.request_ledger import RequestFigures, sum_over_ranks

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    backend = NS(failures=TransferFailures())
    if rank == 1:
        backend.failures.report(
            3, 7, "rank 1's own message"
        )  # request "a": first in one order, last in the other
    reqs = [
        NS(rid=rid, kv=NS(req_pool_idx=slot), to_finish=None, skip_radix_cache_insert=False, finished=lambda: False)
        for rid, slot in (("a", 3), ("b", 4), ("c", 5))
    ]  # fmt: skip
    inflight = reqs if rank == 0 else reqs[::-1]  # SGLang's set: any order, per process
    scheduler = NS(
        tp_worker=NS(model_runner=NS(attn_backend=backend)), tp_size=2, tp_cpu_group=dist.group.WORLD,
        req_to_token_pool=NS(req_generation=torch.tensor([0, 0, 0, 7, 2, 1]), size=6),
        collect_inflight_reqs=lambda: inflight,
    )  # fmt: skip
    hooks.abort_failed_transfers(lambda s, b, r: None, scheduler, NS(reqs=[]), None)
    aborted = {req.rid: req.to_finish.message for req in reqs if req.to_finish is not None}
    mine = RequestFigures(decode_steps=5, decode_blocks_loaded=10 + rank, recall_samples=2, recall_sum=1.5)
    summed = sum_over_ranks(scheduler, [mine, None])
    out.put((rank, aborted, summed))
    dist.destroy_process_group()


def test_hook_4_under_tensor_parallelism(tmp_path: Path) -> None:
    """Two ranks over a real gloo group: a failure on rank 1 only aborts the request on both ranks at the
    same step (rank 0 with a message naming rank 1), whatever order each lists its in-flight requests in;
    a finished request's figures are summed over the ranks, its steps counted once."""
    import multiprocessing

    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    scheduler_init = source_of(Scheduler)
    assert "self.tp_cpu_group = " in scheduler_init and "self.tp_size = " in scheduler_init
    assert "self.size = size" in source_of(ReqToTokenPool.__init__)  # the agreement's room
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"
    ranks = [context.Process(target=_tensor_parallel_rank, args=(rank, init, out)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    results = dict(
        (rank, (aborted, summed)) for rank, aborted, summed in (out.get(timeout=120) for _ in ranks)
    )
    for process in ranks:
        process.join(timeout=30)
        assert process.exitcode == 0
    assert results[1][0] == {"a": "rank 1's own message"}
    assert results[0][0] == {"a": "oasis: a block transfer failed on tensor-parallel rank 1"}
    for _, summed in results.values():
        figures, absent = summed
        assert absent is None
        assert (figures.decode_steps, figures.decode_blocks_loaded) == (5, 21)
        assert (figures.recall_samples, figures.recall_sum) == (4, 3.0)


def test_hook_5_cap_prefix_match() -> None:
    """SGLang's own limit (input - 1, or the logprob start), then at most input - window."""
    from sglang.srt.managers.schedule_batch import Req

    assert params_of(hooks.PREFIX_LIMIT_TARGET) == ["self", "input_len"]
    assert "self._compute_max_prefix_len(input_len)" in source_of(Req.init_next_round_input)

    def capped(req: NS, input_len: int) -> int:
        return int(hooks.cap_prefix_match(32, Req._compute_max_prefix_len, req, input_len))

    plain = NS(dllm_config=None, return_logprob=False, logprob_start_len=-1, is_dllm=lambda: False)
    assert Req._compute_max_prefix_len(plain, 100) == 99 and capped(plain, 100) == 68
    assert capped(plain, 20) == 0
    logprobs = NS(dllm_config=None, return_logprob=True, logprob_start_len=10, is_dllm=lambda: False)
    assert capped(logprobs, 100) == 10


def test_hook_6_cpu_disaggregation(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender attribute and the early-send switch are still what prefill reads; the patch turns both
    off."""
    from sglang.srt.disaggregation import prefill
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
    from sglang.srt.environ import envs

    source = source_of(prefill)
    assert f'"{hooks.HOST_INDICES_ATTRIBUTE}"' in source and hooks.EARLY_SEND_ENV in source
    assert MooncakeKVSender.supports_host_tensor_indices is True
    # Both restored after this test: the patch changes the class and this process's environment.
    monkeypatch.setattr(MooncakeKVSender, hooks.HOST_INDICES_ATTRIBUTE, True)
    monkeypatch.delenv(hooks.EARLY_SEND_ENV, raising=False)
    hooks.patch_cpu_disaggregation()
    assert MooncakeKVSender.supports_host_tensor_indices is False
    assert getattr(envs, hooks.EARLY_SEND_ENV).get() is False


# Hook 7 (remote partial fetching under PD disaggregation): one test per target.


class FakeStager:
    """A prefill node's stager as the send plans see it: decode sessions known to fetch, a staging cap
    of ``room`` prompts, and what was staged or handed over (``disaggregation/send_plan.py``)."""

    def __init__(self, known: set[str], room: int = 10) -> None:
        self.ready, self.known, self.room = threading.Event(), known, room
        self.ready.set()
        self.staged: list[tuple[int, ...]] = []
        self.handed: list[int] = []
        self.counted: dict[str, int] = defaultdict(int)
        stats = NS(add=lambda name, n=1: self.counted.__setitem__(name, self.counted[name] + n))
        self.sends = SendPlans(self, stats)  # type: ignore[arg-type]

    def fetch(self, sessions: Any) -> bool:
        return bool(set(sessions)) and set(sessions) <= self.known

    def reserve(self, room: int, tokens: int) -> bool:
        self.room -= 1
        return self.room >= 0

    def stage(self, room: int, *stage: int) -> None:
        self.staged.append((room, *stage))

    def hand_over_whole(self, room: int, *stage: int) -> None:
        self.handed.append(room)


def test_hook_7_prefill_send_kv_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hook hands each send to the stager's plans (its room, destinations and prompt, at the last
    chunk its slot, tokens and the decode node's cached prefix): staged only when every decode session
    it goes to has asked for a hand-off before; the others go whole, with a hand-off of their first
    selection (which a fetching decode node asks for, and so introduces itself). SGLang's send runs for
    every request, and the stager goes on SGLang's KV manager, nothing on its sender."""
    from sglang.srt.disaggregation import prefill
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    assert_params(hooks.PREFILL_SEND_TARGET, ["self", "req", "last_chunk", "end_idx"])
    # What the hook hands to the stager is read where SGLang's send reads it.
    send_source = source_of(prefill.SchedulerDisaggregationPrefillMixin._send_kv_chunk)
    assert "req.extend_end" in send_source and "req.disagg_decode_prefix_len" in send_source
    # A request's destinations: the decode nodes' transfer sessions, known before its first send.
    assert "self.transfer_infos[room][mooncake_session_id] = (" in source_of(MooncakeKVManager)

    stager = FakeStager({"10.0.0.2:17000"})
    monkeypatch.setattr(hooks, "_pd_part", lambda scheduler, name: stager if name == "stager" else None)
    monkeypatch.setattr(send_plan, "is_mooncake_sender", lambda sender: True)

    def send(room: int, sessions: list[str]) -> Any:
        sender = NS(bootstrap_room=room, kv_mgr=NS(transfer_infos={room: dict.fromkeys(sessions)}))
        req = NS(disagg_kv_sender=sender, origin_input_ids=[1] * 40, rid=f"r{room}", kv=NS(req_pool_idx=3),
                 extend_end=40, disagg_decode_prefix_len=16)  # fmt: skip
        sent: list[Any] = []
        hooks.mark_staged_send(lambda *a, **k: sent.append(a[1]), NS(), req, last_chunk=True)
        assert sent == [req]  # SGLang's send runs, for every request
        return sender

    fetching = send(1, ["10.0.0.2:17000"])
    for room, sessions in ((2, ["10.0.0.3:17000"]), (3, ["10.0.0.2:17000", "x:1"])):  # unknown, mixed
        send(room, sessions)
    staged = stager.sends.get(1)
    assert staged is not None and not staged.whole and staged.stage == (3, 40, 16)
    assert getattr(fetching.kv_mgr, contract.STAGER_ATTRIBUTE) is stager  # for test_hook_7_peer_registration
    assert vars(fetching).keys() == {"bootstrap_room", "kv_mgr"}  # nothing of ours on SGLang's sender
    assert stager.sends.get(2) is None and stager.sends.get(3) is None  # handed over whole: done
    assert stager.handed == [2, 3] and stager.counted == {"staging_unknown_decoder_sends": 2}


def test_hook_7_send_last_page_only() -> None:
    """Earlier chunks send nothing, the last stages and sends only the last page; an unstaged request is
    untouched; a staging failure fails the request's transfer."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import CommonKVManager, CommonKVSender

    assert_params(hooks.SEND_INDICES_TARGET, ["self", "kv_indices", "state_indices"])
    assert "self._prepare_send_indices(" in source_of(CommonKVSender.send)
    assert "self.curr_idx == self.num_kv_indices" in source_of(CommonKVSender._prepare_send_indices)
    assert callable(CommonKVManager.record_failure) and callable(CommonKVManager.update_status)

    stager = FakeStager({"d:1"})
    stager.sends.decide(9, ["d:1"], 40, "r9")
    stager.sends.last_chunk(9, 5, 40, 16)
    sender = NS(kv_mgr=NS(**{contract.STAGER_ATTRIBUTE: stager}), bootstrap_room=9)

    def chunk(kv: list[int], index_slice: slice, last: bool) -> Any:
        original = lambda s, k, *a: (k, index_slice, last, False)  # noqa: E731
        return hooks.send_last_page_only(original, sender, np.asarray(kv, dtype=np.int32))

    kv, sl, last, skip = chunk([10, 11], slice(0, 2), False)
    assert len(kv) == 0 and sl == slice(2, 2) and not last and not skip and stager.staged == []
    kv, sl, last, skip = chunk([], slice(2, 2), True)  # a last chunk without new pages
    assert kv.tolist() == [11] and sl == slice(1, 2) and last and not skip, (kv, sl)
    assert stager.staged == [(9, 5, 40, 16)] and stager.sends.get(9) is None

    plain = NS(kv_mgr=sender.kv_mgr, bootstrap_room=3)  # not staged: untouched
    out = hooks.send_last_page_only(lambda s, k, *a: (k, slice(0, 2), True, False), plain, np.asarray([1, 2]))
    assert out[0].tolist() == [1, 2] and out[1] == slice(0, 2)

    failures: dict[int, str] = {}
    statuses: list[tuple[int, Any]] = []

    def broken(*args: Any) -> None:
        raise RuntimeError("no memory")

    stager.stage = broken  # type: ignore[method-assign]
    stager.sends.decide(4, ["d:1"], 2, "r4")
    stager.sends.last_chunk(4, 1, 2, 0)
    kv_mgr = NS(
        **{contract.STAGER_ATTRIBUTE: stager},
        record_failure=failures.__setitem__,
        update_status=lambda r, s: statuses.append((r, s)),
    )
    failing = NS(bootstrap_room=4, kv_mgr=kv_mgr)
    out = hooks.send_last_page_only(lambda s, k, *a: (k, slice(0, 1), True, False), failing, np.asarray([7]))
    assert out[3] is True and "no memory" in failures[4] and statuses == [(4, KVPoll.Failed)]


def test_hook_7_bootstrap_routes() -> None:
    from aiohttp import web

    from sglang_oasis.disaggregation.side_channel import ENDPOINT_ROUTE

    assert_params(hooks.BOOTSTRAP_ROUTES_TARGET, ["self"])
    server = NS(app=web.Application())
    hooks.remote_fetch_routes(lambda s: None, server)
    assert ENDPOINT_ROUTE in [route.resource.canonical for route in server.app.router.routes()]


def test_hook_7_bootstrap_routes_keep_each_tensor_parallel_ranks_handoffs() -> None:
    """Each prefill rank registers its own hand-off URL (it stages its own KV heads) and the node's
    --tp-size; a decode rank looks up the prefill rank of its own number."""
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from sglang_oasis.disaggregation.side_channel import ENDPOINT_ROUTE

    server = NS(app=web.Application())
    hooks.remote_fetch_routes(lambda s: None, server)

    async def exchange() -> list[tuple[int, Any]]:
        async with TestClient(TestServer(server.app, host="127.0.0.1")) as client:
            for rank in (1, 0):
                body = {"engine_rank": rank, "tp_size": 2, "url": f"http://127.0.0.1:{9000 + rank}"}
                assert (await client.put(ENDPOINT_ROUTE, json=body)).status == 200
            answers = []
            for query in ("?engine_rank=0", "?engine_rank=1", "", "?engine_rank=2"):
                response = await client.get(ENDPOINT_ROUTE + query)
                answers.append((response.status, await response.json()))
            return answers

    first, second, default, missing = asyncio.run(exchange())
    assert first == (200, {"url": "http://127.0.0.1:9000", "tp_size": 2})
    assert second == (200, {"url": "http://127.0.0.1:9001", "tp_size": 2})
    assert default == first  # a decode node that names no rank: rank 0
    assert missing[0] == 404


def test_hook_7_peer_registration() -> None:
    """A decode session that registers with the prefill node's KV manager (a new decode process, perhaps a
    restarted node at the same address that does not fetch) is forgotten by the stager, after SGLang's
    own registration ran; before any request used the stager there is nothing to forget."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    assert_params(hooks.PEER_REGISTRATION_TARGET, ["self", "mooncake_session_id", "decode_kv_args"])
    # SGLang publishes every decode registration through it (the bootstrap thread's registration branch).
    assert "self._publish_peer_registration(" in source_of(MooncakeKVManager)
    calls: list[str] = []
    kv_mgr = NS()
    stager = NS(forget=lambda session: calls.append(f"forget {session}"))

    def publish(manager: Any, session: str, args: Any) -> None:
        calls.append(f"register {session}")

    assert hooks.forget_reregistered_sessions(publish, kv_mgr, "10.0.0.2:17000", NS()) is None
    assert calls == ["register 10.0.0.2:17000"]
    setattr(kv_mgr, contract.STAGER_ATTRIBUTE, stager)  # what hook 7's prefill send sets
    hooks.forget_reregistered_sessions(publish, kv_mgr, "10.0.0.2:17000", NS())
    assert calls[1:] == ["register 10.0.0.2:17000", "forget 10.0.0.2:17000"]


def decode_request(port: int) -> NS:
    return NS(
        req=NS(bootstrap_host="127.0.0.1", bootstrap_port=port, bootstrap_room=7, finished=lambda: False,
               return_logprob=False, finished_reason=None, skip_radix_cache_insert=False)
    )  # fmt: skip


def test_hook_7_decode_commit() -> None:
    """A decode server that does not fetch commits every request as SGLang does: the handshake keeps a
    staging prefill node from sending it anything but whole requests (``test_hook_7_prefill_...``)."""
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.mem_cache.common import release_kv_cache

    assert_params(hooks.DECODE_COMMIT_TARGET, ["self", "decode_req"])
    assert_params("sglang.srt.disaggregation.utils.prepare_abort", ["req", "error_message", "status_code"])
    assert_params("sglang.srt.mem_cache.common.release_kv_cache", ["req", "tree_cache"])
    # The queue's tree cache, and its checkpoint on release, that the radix-cache wrapper relies on.
    assert "self.tree_cache = tree_cache" in source_of(DecodeTransferQueue.__init__)
    assert "tree_cache.checkpoint(req, up_to=" in source_of(release_kv_cache)
    queue = NS(scheduler=NS(tp_worker=NS(model_runner=NS(attn_backend=NS(pd=NS(remote=None))))))
    whole = decode_request(9)
    committed: list[Any] = []
    hooks.fetch_admission_blocks(lambda q, d: committed.append(d), queue, whole)
    assert committed == [whole]
    assert whole.req.finished_reason is None


def test_hook_7_decode_pollers() -> None:
    """A transferred request polls ``Transferring`` until its admission is over; a request that is not
    a PD arrival (fake transfer, finished) and every other state pass through; no fetcher: no gate. (The
    real path, with a prefill node that answers late: ``test_pd.py::test_a_slow_handoff_...``.)"""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    assert_params(hooks.DECODE_POLLERS_TARGET, ["self"])
    assert "self._pollers()" in source_of(DecodeTransferQueue._poll_with_metadata_gate)
    assert "poller.poll()" in source_of(
        pkgutil.resolve_name("sglang.srt.disaggregation.utils._poll_with_failure_injection")
    )

    # A failed admission polls Failed: SGLang MIN-reduces the ranks' polls, so every rank fails it then.
    assert "ReduceOp.MIN" in source_of(
        pkgutil.resolve_name("sglang.srt.disaggregation.utils._all_reduce_polls")
    )
    assert KVPoll.Failed < min(
        KVPoll.Bootstrapping, KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success
    )

    class Remote:
        def __init__(self) -> None:
            self.over: set[int] = set()
            self.asked: list[tuple[int, int, str, int, int, str]] = []
            self.errors: dict[int, str] = {}

        def admission_error(self, slot: int, generation: int) -> str | None:
            return self.errors.get(slot)

        def admission_done(self, slot: int, generation: int, origin: Origin) -> bool:
            self.asked.append((slot, generation, *origin))
            return slot in self.over

    def entry(slot: int, state: KVPoll, host: str = "127.0.0.1", finished: bool = False) -> Any:
        req = NS(kv=NS(req_pool_idx=slot), bootstrap_host=host, bootstrap_port=8998, bootstrap_room=100 + slot,
                 finished=lambda: finished)  # fmt: skip
        kv_mgr = NS(get_session_id=lambda: "10.0.0.2:17000", record_failure=failures.__setitem__)
        return NS(req=req, kv_receiver=NS(poll=lambda: state, kv_mgr=kv_mgr))

    failures: dict[int, str] = {}  # bootstrap room -> reason, as SGLang's KV manager records them

    remote = Remote()
    queue = NS(
        queue=[entry(0, KVPoll.Success), entry(1, KVPoll.Transferring), entry(2, KVPoll.Success, FAKE_BOOTSTRAP_HOST),
               entry(3, KVPoll.Success, finished=True), entry(4, KVPoll.Failed)],
        scheduler=NS(req_to_token_pool=NS(req_generation=torch.tensor([5, 6, 7, 8, 9])),
                     tp_worker=NS(model_runner=NS(attn_backend=NS(pd=NS(remote=remote))))),
    )  # fmt: skip
    original = lambda q: [e.kv_receiver for e in q.queue]  # noqa: E731
    polls = [p.poll() for p in hooks.wait_for_admissions(original, queue)]
    assert polls == [KVPoll.Transferring, KVPoll.Transferring, KVPoll.Success, KVPoll.Success, KVPoll.Failed]
    assert remote.asked == [(0, 5, "127.0.0.1", 8998, 100, "10.0.0.2:17000")]  # this node's session named
    remote.over.add(0)
    assert hooks.wait_for_admissions(original, queue)[0].poll() == KVPoll.Success
    remote.errors[0] = "oasis: remote partial fetching failed (no hand-off)"
    assert hooks.wait_for_admissions(original, queue)[0].poll() == KVPoll.Failed
    assert failures == {100: remote.errors[0]}  # the reason SGLang's failure_exception() reports
    queue.scheduler.tp_worker.model_runner.attn_backend.pd.remote = None
    assert hooks.wait_for_admissions(original, queue) == original(queue)


def test_hook_7_decode_free() -> None:
    """SGLang frees the row, then the pool's listener hears which, with the request's bootstrap address
    (none for a request no real prefill node sent)."""
    from sglang.srt.disaggregation.decode import DecodeReqToTokenPool
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
    from sglang.srt.mem_cache.common import release_kv_cache

    assert_params(hooks.DECODE_FREE_TARGET, ["self", "req"])
    assert "tree_cache.req_to_token_pool.free(req)" in source_of(release_kv_cache)
    freed: list[tuple[int, Any]] = []
    pool = NS(
        free_slots=[], **{contract.FREED_ROW_LISTENER: lambda row, address: freed.append((row, address))}
    )
    for host, row in (("10.0.0.5", 7), (FAKE_BOOTSTRAP_HOST, 8), (None, 9)):
        request = NS(kv=NS(req_pool_idx=row, holds_kv=True), bootstrap_host=host, bootstrap_port=8998,
                     bootstrap_room=1234)  # fmt: skip
        hooks.release_freed_rows(DecodeReqToTokenPool.free, pool, request)
        assert request.kv.req_pool_idx is None
    assert pool.free_slots == [7, 8, 9]
    assert freed == [(7, ("10.0.0.5", 8998, 1234)), (8, None), (9, None)]


def test_hook_7_complete_before_backup() -> None:
    """A retracted request's remote blocks are read before SGLang backs it up; if they cannot be, SGLang
    hears "cannot be backed up" (and aborts it) and nothing is backed up. Once the backup is whole, the
    backend keeps the request's selection state (row, key, tokens, backed up)."""
    from sglang.srt.mem_cache.common import backup_kv_cache

    assert_params(
        hooks.BACKUP_TARGET,
        ["req", "tree_cache", "req_to_token_pool", "token_to_kv_pool_allocator", "backend"],
    )
    assert "return False" in source_of(backup_kv_cache)  # False: SGLang aborts the request
    calls: list[str] = []

    def backup(req: Any, tree_cache: Any, req_to_token_pool: Any, allocator: Any, backend: Any) -> bool:
        calls.append("backup")
        return True

    for whole, expected in ((True, ["complete 3", "backup"]), (False, ["complete 3"])):
        calls.clear()

        def complete(row: int, whole: bool = whole) -> bool:
            calls.append(f"complete {row}")
            return whole

        pool = NS(**{contract.BEFORE_BACKUP_LISTENER: complete})
        request = NS(kv=NS(req_pool_idx=3), rid="r")
        answer = hooks.complete_before_backup(backup, request, None, pool, None, "cpu_tensor")
        assert answer is whole and calls == expected

    kept: list[tuple[Any, ...]] = []
    pool = NS(
        **{
            contract.BEFORE_BACKUP_LISTENER: lambda row: True,
            contract.RETRACT_LISTENER: lambda *a: kept.append(a),
        }
    )
    request = NS(kv=NS(req_pool_idx=3), rid="r", origin_input_ids=[1, 2, 3], output_ids=[4])
    assert hooks.complete_before_backup(backup, request, None, pool, None, "cpu_tensor") is True
    key = getattr(request, contract.RETRACTION_KEY)  # stamped on the request object: its rid, made unique
    assert key.startswith("r#") and kept == [(3, key, 4, True)], kept
    # Retracted again (SGLang resumed it and retracted it before a step): the same key, so the state its
    # first retraction kept is found (before, a new key orphaned it and the resume started afresh).
    assert hooks.complete_before_backup(backup, request, None, pool, None, "cpu_tensor") is True
    assert kept[1] == (3, key, 4, True)
    other = NS(kv=NS(req_pool_idx=3), rid="r", origin_input_ids=[1, 2, 3], output_ids=[4])
    hooks.complete_before_backup(backup, other, None, pool, None, "cpu_tensor")
    assert getattr(other, contract.RETRACTION_KEY) != key  # another request object with the same rid


def test_hook_8_keep_before_release() -> None:
    """``release_req`` (keyword arguments only) keeps an unfinished request's state (not backed up)."""
    from sglang.srt.managers import schedule_batch

    assert_params(hooks.RELEASE_TARGET, ["req", "remaing_req_count", "req_to_token_pool"])
    params = inspect.signature(pkgutil.resolve_name(hooks.RELEASE_TARGET)).parameters
    assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in ("req", "req_to_token_pool"))
    assert "reset_for_retract" in source_of(schedule_batch.release_req)

    kept: list[tuple[Any, ...]] = []
    released: list[str] = []
    pool = NS(**{contract.RETRACT_LISTENER: lambda *a: kept.append(a)})
    requests = [
        NS(kv=NS(req_pool_idx=5), rid=f"r{finished}", origin_input_ids=[1, 2], output_ids=[3, 4],
           finished=lambda finished=finished: finished)
        for finished in (False, True)
    ]  # fmt: skip
    for request in requests:
        hooks.keep_before_release(
            lambda **kw: released.append(kw["req"].rid), req=request, req_to_token_pool=pool
        )
    unfinished, finished = requests
    key = getattr(unfinished, contract.RETRACTION_KEY)
    assert key.startswith("rFalse#") and not hasattr(finished, contract.RETRACTION_KEY)
    assert kept == [(5, key, 4, False)] and released == ["rFalse", "rTrue"], (kept, released)


def test_hook_9_carry_request_params(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request's ``custom_params`` (and retraction key) noted by rid as a forward batch is built.
    ``ForwardBatch.init_new`` is a classmethod taking (batch, model_runner) whose batch has the requests
    (it reads their rids, which the batch the backend gets carries)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from sglang_oasis.attention import request_options
    from sglang_oasis.attention.request_options import batch_params, retraction_keys

    assert isinstance(ForwardBatch.__dict__["init_new"], classmethod)
    assert_params(hooks.FORWARD_BATCH_TARGET, ["batch", "model_runner"])
    assert "rids=[req.rid for req in batch.reqs]" in source_of(ForwardBatch.init_new)

    monkeypatch.setattr(request_options, "_noted", {})  # the hook replaces the module's table: restored
    reqs = [
        NS(rid=rid, sampling_params=NS(custom_params=p))
        for rid, p in (("a", {"oasis_top_k": 8}), ("b", None))
    ]
    setattr(reqs[1], contract.RETRACTION_KEY, "b#1")
    built = hooks.carry_request_params(lambda cls, batch, runner: "built", ForwardBatch, NS(reqs=reqs), None)
    assert built == "built" and batch_params(["b", "a", "c"]) == [None, {"oasis_top_k": 8}, None]
    assert retraction_keys(["b", "a", "c"]) == ["b#1", None, None]


def test_hook_10_report_request_figures() -> None:
    """A finished request's own figures go out with its last output (``meta_info["oasis"]``)."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from sglang_oasis.request_ledger import RequestLedger

    assert params_of(hooks.STREAMER_TARGET) == ["self"]
    assert "self.get_output_streamer_class()(" in source_of(Scheduler)
    assert SchedulerOutputStreamer.has_additional_customized_info is False
    streamer_source = source_of(SchedulerOutputStreamer._stream_output_generation)
    assert "build_additional_customized_info(" in streamer_source, "SGLang no longer asks for fields"
    assert "customized_info" in source_of(TokenizerManager.update_request_meta_info)

    ledger = RequestLedger()
    ledger.begin([1, 2], [0, 0], ["done", "running"], decode=True)
    scheduler = NS(
        rust_server=None, tp_worker=NS(model_runner=NS(attn_backend=NS(stats=NS(requests=ledger))))
    )
    cls = hooks.report_request_figures(lambda s: SchedulerOutputStreamer, scheduler)
    assert issubclass(cls, SchedulerOutputStreamer) and cls.has_additional_customized_info
    reqs = [NS(rid="done", finished=lambda: True), NS(rid="running", finished=lambda: False)]
    info = cls.build_additional_customized_info(None, reqs)
    assert list(info) == ["oasis"], info  # meta_info["oasis"]: what clients read
    done, running = info["oasis"]
    assert len(done) == 1 and running == [], info
    assert done[0]["decode_steps"] == 1 and ledger.take("done") is None

    rust = NS(rust_server=object())  # SGLang's Rust egress takes no additional fields: class unchanged
    assert hooks.report_request_figures(lambda s: SchedulerOutputStreamer, rust) is SchedulerOutputStreamer


def test_hook_11_extend_override() -> None:
    """The oasis backend's dense extend overrides SGLang's torch_native one by name and parameters."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from sglang_oasis.attention.extend_attention import CachedPrefixExtend

    theirs = list(inspect.signature(TorchNativeAttnBackend._run_sdpa_forward_extend).parameters)
    ours = list(inspect.signature(CachedPrefixExtend._run_sdpa_forward_extend).parameters)
    assert theirs == ours, (theirs, ours)
    assert "self._run_sdpa_forward_extend(" in source_of(TorchNativeAttnBackend.forward_extend)


def test_hook_12_check_request_options() -> None:
    """SGLang's checks, then the request's ``oasis_*`` options: a ``ValueError`` (HTTP 400) naming what
    is wrong."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    assert params_of(hooks.VERIFY_PARAMS_TARGET) == ["self", "vocab_size"]
    config = OasisConfig(top_k=4)

    def verify(params: SamplingParams) -> Any:
        return hooks.check_request_options(config, SamplingParams.verify, params, VOCAB_SIZE)

    with pytest.raises(ValueError, match="custom_params: must be a JSON object"):
        verify(SamplingParams(custom_params=["oasis_top_k", 3]))
    with pytest.raises(ValueError, match="custom_params: oasis_top_k='abc'"):
        verify(SamplingParams(custom_params={"oasis_top_k": "abc"}))
    assert verify(SamplingParams(custom_params={"oasis_top_k": 2})) is None
    assert verify(SamplingParams(custom_params=None)) is None
    with pytest.raises(ValueError, match="temperature must be"):  # SGLang's own checks still run
        verify(SamplingParams(temperature=-1))


def test_register_checks_request_options_in_sparse_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.sampling.sampling_params import SamplingParams

    registered: dict[str, list[tuple[Callable[..., Any], HookType]]] = defaultdict(list)

    def record(target: str, hook: Callable[..., Any], hook_type: HookType = HookType.AFTER, **_: Any) -> None:
        registered[target].append((hook, hook_type))

    monkeypatch.setattr(HookRegistry, "register", record)  # SGLang's registry itself stays untouched
    hooks.register(OasisConfig(mode="sparse"))
    assert hooks.GRAPH_RUN_TARGET not in registered  # the CPU engine replays no CUDA graph
    [(hook, hook_type)] = registered[hooks.VERIFY_PARAMS_TARGET]
    assert hook_type is HookType.AROUND
    with pytest.raises(ValueError, match="custom_params"):
        hook(SamplingParams.verify, SamplingParams(custom_params=["oasis_top_k", 3]), VOCAB_SIZE)
    registered.clear()
    hooks.register(OasisConfig(mode="sparse", cuda_untested=True))
    assert registered[hooks.GRAPH_RUN_TARGET] == [(hooks.ask_backend_to_replay, HookType.AROUND)]
    registered.clear()
    hooks.register(OasisConfig(mode="dense"))
    assert hooks.VERIFY_PARAMS_TARGET not in registered


def test_hook_13_without_nccl() -> None:
    """On the CPU engine every model-parallel group is built without PyNccl: SGLang builds one whenever
    ``use_pynccl`` is true, and defaults it to true for its in-tree CPU platform (the test fails when
    SGLang stops doing either, and the hook may go)."""
    from sglang.srt.distributed import parallel_state

    assert_params(hooks.PARALLEL_GROUP_TARGET, ["group_ranks", "local_rank", "backend", "use_pynccl"])
    assert "use_pynccl = not (_is_npu or _is_xpu" in source_of(parallel_state.init_model_parallel_group)
    assert "if use_pynccl and self.world_size > 1:" in source_of(parallel_state.GroupCoordinator.__init__)
    seen: list[dict[str, Any]] = []
    hooks.without_nccl(lambda *a, **k: seen.append(k), [[0, 1]], 0, "gloo", use_pynccl=True, group_name="tp")
    hooks.without_nccl(lambda *a, **k: seen.append(k), [[0, 1]], 0, "gloo")
    assert seen == [{"use_pynccl": False, "group_name": "tp"}, {"use_pynccl": False}]


def test_hook_14_ask_backend_to_replay() -> None:
    """SGLang's model runner replays a decode graph whenever its runner's ``can_run_graph`` says so, and the
    runner prepares a replay through the backend's ``init_forward_metadata_out_graph`` (the test fails when
    SGLang moves either); the hook asks a backend with ``graph_ready`` only after SGLang's checks pass."""
    from sglang.srt.model_executor import model_runner
    from sglang.srt.model_executor.runner import decode_cuda_graph_runner as runner_module

    assert_params(hooks.GRAPH_RUN_TARGET, ["self", "forward_batch"])
    assert "self.decode_cuda_graph_runner.can_run_graph(forward_batch)" in source_of(model_runner)
    runner_source = source_of(runner_module)
    assert "attn_backend.init_forward_metadata_out_graph(forward_batch, in_capture=True)" in runner_source
    assert "attn_backend.init_forward_metadata_out_graph(fb_view)" in runner_source
    assert "self.attn_backend = attn_backend or model_runner.attn_backend" in runner_source
    asked: list[object] = []

    def ready(forward_batch: object) -> bool:
        asked.append(forward_batch)
        return forward_batch == "plain"

    runner = NS(attn_backend=NS(graph_ready=ready))
    assert not hooks.ask_backend_to_replay(lambda r, fb: False, runner, "plain") and asked == []
    assert hooks.ask_backend_to_replay(lambda r, fb: True, runner, "plain")
    assert not hooks.ask_backend_to_replay(lambda r, fb: True, runner, "admits")
    assert asked == ["plain", "admits"]
    assert hooks.ask_backend_to_replay(lambda r, fb: True, NS(attn_backend=object()), "any")


def test_hooks_15_and_16_targets() -> None:
    """SGLang builds the target's MHA KV pool through ``_build_mha_kv_pool`` with the class it chose and
    sizes it from ``_profile_available_bytes`` (the test fails when SGLang moves either); on a CPU
    configurator both hooks leave SGLang's answer alone. On a fake CUDA device: test_fake_cuda.py."""
    from sglang.srt.mem_cache import kv_cache_configurator as module
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from sglang_oasis.memory import host_kv_pool

    assert_params(hooks.POOL_BUILD_TARGET, ["self", "max_total_num_tokens", "mha_pool_class", "quant_method"])
    assert_params(hooks.POOL_BUDGET_TARGET, ["self", "pre_model_load_memory"])
    source = source_of(module)
    assert "available_bytes = self._profile_available_bytes(pre_model_load_memory)" in source
    assert "token_to_kv_pool = self._build_mha_kv_pool(\n                    max_total_num_tokens=" in source
    assert "mha_pool_class=mha_pool_class,\n                    quant_method=quant_method," in source
    cpu = NS(is_draft_worker=False, device="cpu")
    built: list[dict[str, Any]] = []

    def build(configurator: Any, **kwargs: Any) -> str:
        built.append(kwargs)
        return "sglang's pool"

    measured = host_kv_pool.GpuKVBytes()
    pool = host_kv_pool.build_pool(
        measured, build, cpu, max_total_num_tokens=64, mha_pool_class=MHATokenToKVPool
    )
    assert pool == "sglang's pool"
    assert built == [{"max_total_num_tokens": 64, "mha_pool_class": MHATokenToKVPool, "quant_method": None}]
    assert (
        host_kv_pool.host_tier_bytes(OasisConfig(), measured, lambda configurator, memory: 123, cpu, 5) == 123
    )
    draft = NS(is_draft_worker=True, device="cuda")  # the EAGLE-3 draft's pool stays SGLang's, on the GPU
    assert (
        host_kv_pool.host_tier_bytes(OasisConfig(), measured, lambda configurator, memory: 123, draft, 5)
        == 123
    )
    assert measured.take(cpu) is None and measured.take(draft) is None
