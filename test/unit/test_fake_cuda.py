"""The CUDA path without a GPU: the oasis backend on a fake CUDA device (``sglang_oasis_testing.fake_cuda``).

On CPU the device and host tiers are the same memory, so nothing else here can see the discipline a GPU
needs. On the fake device every ``"cuda"`` tensor reports ``cuda:0`` and holds real values; an op mixing
devices raises, and every sync and host<->device copy is recorded (inside a replay region: raises).

The backend is built over SGLang's own pools on the fake device (its ``ReqToTokenPool``, and its
``MHATokenToKVPool`` as the host tier in page-locked host memory, ``PinnedHostKVPool``) and driven as
SGLang drives it: extends through ``init_forward_metadata`` and ``forward_extend``; decode passes through
its CUDA graph runner's calls (``init_cuda_graph_state``, a capture on padding rows, then per pass hook 14's
``can_run_graph``, and either ``init_forward_metadata_out_graph`` and the replay, or the eager pass). The
same driver runs the eager step on the CPU; outputs, tables and counters must agree, so the fake device
checks devices, syncs and copies while the values are checked against the step every CPU test checks.
What only a GPU can check (speed, CUDA graph capture itself, the Triton kernels compiled, page-locking
real memory): docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_oasis import sglang_hooks as hooks
from sglang_oasis.attention.captured_step import CapturedStep
from sglang_oasis.attention.decode_program import decode_layer
from sglang_oasis.attention.graphed_step import GraphedStep
from sglang_oasis.attention.oasis_backend import OasisAttnBackend
from sglang_oasis.attention.request_options import NotedRequest, note_requests
from sglang_oasis.config import OasisConfig
from sglang_oasis.memory.host_kv_pool import PinnedHostKVPool
from sglang_oasis.server_process import child_env
from sglang_oasis.sglang_contract import RETRACT_LISTENER
from sglang_oasis_testing import fake_cuda
from sglang_oasis_testing.fake_cuda import Crossing, DeviceMismatch, Event, FakeCuda, values

pytestmark = pytest.mark.skipif(not fake_cuda.available(), reason="this torch has no CUDA build to fake")

BLOCK, KV_HEADS, Q_HEADS, DIM, LAYERS = 16, 2, 4, 16, 2
ROWS, CONTEXT, POOL = 4, 2048, 4 * 2048  # SGLang's request rows (and its padding row 0), tokens
GRAPH_BS = 4  # the captured batch size every decode pass pads to


# --- the fake device itself ----------------------------------------------------------------------


def test_the_fake_device_refuses_mixed_devices_and_names_every_crossing() -> None:
    with FakeCuda() as cuda:
        a = torch.zeros(4, 3, device="cuda")
        a[1:].add_(1)  # a view's in-place op writes the tensor's memory
        assert a.is_cuda and float(a.sum()) == 9.0
        with pytest.raises(DeviceMismatch, match="add: tensors on two devices"):
            a + torch.ones(4, 3)
        assert (a + torch.tensor(2.0)).is_cuda  # a 0-dim host tensor is a scalar, as on CUDA
        cuda.take()
        a[torch.tensor([0, 2])]  # allowed, but a host index is a hidden copy
        a.cpu()
        torch.arange(3, device="cuda").tolist()
        torch.arange(3, device="cuda").nonzero()
        kinds = [(e.kind, e.op) for e in cuda.take()]
        assert kinds == [("host_to_device", "index"), ("device_to_host", "_to_copy"), ("sync", "tolist"),
                         ("sync", "nonzero")]  # fmt: skip
        with pytest.raises(TypeError, match="numpy"):
            a.numpy()


def test_a_replay_region_fails_on_any_crossing_and_regions_name_the_others() -> None:
    with FakeCuda() as cuda:
        x = torch.arange(5, device="cuda")
        with cuda.replay("a replay"):
            x.mul_(2)  # device work only
            for sync in (lambda: int(x[1]), lambda: x[x > 2], lambda: x.to("cpu"), lambda: x.tolist()):
                with pytest.raises(Crossing, match="a replay"):
                    sync()
        with cuda.region("the plan upload"):
            torch.ones(2).to("cuda", non_blocking=True)
        assert [e.region for e in cuda.take()] == ["the plan upload"]


def test_page_locked_host_memory_and_its_device_view_are_one_memory() -> None:
    from sglang_oasis.memory import pinned_host

    with FakeCuda():
        host = pinned_host.page_locked((3, 4), torch.float32)
        assert host.is_pinned() and not torch.zeros(2).is_pinned()
        view, in_place = pinned_host.device_view(host)
        assert in_place and view.is_cuda
        view[1] = 7.0  # a kernel writing through the view writes host memory
        assert float(host[1].sum()) == 28.0
        plain, in_place = pinned_host.device_view(torch.zeros(2))
        assert not in_place and not plain.is_cuda  # memory nobody locked stays the host's


# --- the device tier on the device -------------------------------------------------------------


def test_every_device_tier_tensor_is_on_the_device_and_the_host_plan_keeps_mirrors() -> None:
    with FakeCuda():
        server = Server("cuda", config())
        tier = server.oasis.tier
        assert {name: t.device.type for name, t in tier.tensors().items()} == dict.fromkeys(
            tier.tensors(), "cuda"
        )
        assert all(t.device.type == "cpu" for t in tier.host_tensors().values())
        assert server.oasis.captured is not None
        static = server.oasis.captured
        assert isinstance(static, GraphedStep)
        assert all(t.is_cuda for t in static.static if t is not None) and static.static_counts.is_cuda
        pool = server.oasis.token_to_kv_pool
        assert isinstance(pool, PinnedHostKVPool) and pool.in_host_memory()
        assert all(b.is_cuda and not b.is_pinned() for b in pool.k_buffer)  # what SGLang's kernels see
        server.stop()


def test_tier_tables_upload_and_download_only_the_batch_rows_in_one_copy_each() -> None:
    with FakeCuda() as cuda:
        tables = Server("cuda", config()).oasis.tier.tables
        slots = torch.tensor([2, 0])
        tables.host["covered"][2] = 5
        tables.host["recall"][0] = 0.25
        cuda.take()
        tables.upload(slots)
        assert [e.kind for e in cuda.take() if e.nbytes > 16] == ["host_to_device"]  # the packed rows
        assert int(tables.device["covered"][2, 0]) == 5 and float(tables.device["recall"][0].sum()) > 0
        tables.device["slot_block"][0, 1, 1, 2] = 11
        tables.device["covered"][3] = 9  # not a batch row: not read back
        counts = torch.arange(6, device="cuda").view(2, 3)
        cuda.take()
        back = tables.download(slots, counts)
        assert [e.kind for e in cuda.take() if e.nbytes > 16] == [
            "device_to_host"
        ]  # rows and counts, one copy
        assert back is not None and back.tolist() == [[0, 1, 2], [3, 4, 5]]
        assert int(tables.host["slot_block"][0, 1, 1, 2]) == 11 and int(tables.host["covered"][3, 0]) == 0


# --- the gates, in the backend as in the launcher ----------------------------------------------

REFUSED = {  # the launcher's command line (what SGLang parses) -> the oasis options, SGLang's options
    "has never run on a GPU": ([], {"cuda_untested": False}, {}),
    "--tp-size 2 with CUDA graphs": (["--tp-size", "2"], {}, {"tp_size": 2}),
    "--oasis-dense-layers on CUDA": (["--oasis-dense-layers", "0"], {"dense_layers": (0,)}, {}),
    "--oasis-lookahead ngram on CUDA": (["--oasis-lookahead", "ngram"], {"lookahead": "ngram"}, {}),
    "--oasis-decode-step eager on CUDA": (["--oasis-decode-step", "eager"], {"decode_step": "eager"}, {}),
    "--enable-torch-compile": (["--enable-torch-compile"], {}, {"enable_torch_compile": True}),
}


@pytest.mark.parametrize("why", REFUSED)
def test_a_plain_sglang_start_on_cuda_is_refused_by_name_as_the_launcher_refuses(
    why: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m sglang.launch_server --attention-backend oasis`` never meets the launcher: the plugin
    hands the backend its configuration (``SGLANG_OASIS_CONFIG``) and the backend asks the same gates."""
    from sglang_oasis.attention.oasis_backend import create_oasis_backend
    from sglang_oasis.config import ENV_VAR
    from sglang_oasis.launch_server import split_argv
    from sglang_oasis.launcher.argv import LaunchError
    from sglang_oasis.launcher.sparse_mode import check_untested_cuda
    from sglang_oasis.serving_gates import ServingRefused

    argv, options, sglang_options = REFUSED[why]
    untested = [] if "cuda_untested" in options else ["--oasis-cuda-untested", "true"]
    launcher_config, sglang_argv = split_argv(["--device", "cuda", *untested, *argv])
    with pytest.raises(LaunchError, match=why) as launcher:
        check_untested_cuda([*untested, *argv], sglang_argv, launcher_config)
    monkeypatch.setenv(ENV_VAR, json.dumps(dataclasses.asdict(config(**options))))
    with FakeCuda():
        server = Server("cuda", config(), graphs=False)  # SGLang's pools and a runner, on the device
        runner = server.oasis_runner
        runner.server_args = NS(**{**vars(runner.server_args), "disable_cuda_graph": False, **sglang_options})
        with pytest.raises(ServingRefused, match=why) as backend:
            create_oasis_backend(runner)
        server.stop()
    assert str(backend.value) == str(launcher.value)


# --- the host tier sized by host RAM (hooks 15 and 16) -------------------------------------------


def test_a_40_gib_gpu_on_a_256_gib_host_gets_a_host_tier_larger_than_any_dense_pool_there() -> None:
    """SGLang's own profiling and pool builder (``fake_cuda_host_tier.py``, in a child): on a GPU with 40
    GiB free and 256 GiB of host RAM, a dense pool would get what SGLang measures on the GPU; the host
    tier gets half the host RAM (``--oasis-host-memory-fraction``) in page-locked host memory, nothing of
    it on the GPU, and the GPU bytes SGLang measured become the device tier's budget."""
    script = Path(__file__).with_name("fake_cuda_host_tier.py")
    env = {**child_env(), "SGLANG_USE_CPU_ENGINE": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    dense, host, per_token = found["dense_bytes"], found["host_bytes"], found["bytes_per_token"]
    assert 30 * 2**30 < dense < 40 * 2**30  # SGLang's: the GPU's free memory less its slack
    assert host == 128 * 2**30 and host // per_token > 3 * (dense // per_token)  # tokens a dense pool holds
    assert found["kept_gpu_bytes"] == found["pool_gpu_kv_bytes"] == found["device_budget"] == dense
    assert found["pool_class"] == "PinnedHostKVPool" and found["in_host_memory"]
    assert found["pool_buffers_on"] == "cuda" and found["device_tensors_on"] == ["cuda"]
    assert found["pool_device_bytes"] <= 48 * 30 < found["pool_host_bytes"]  # SGLang's pointer tables only
    assert "serves SGLang's plain MHA pool only; SGLang chose PinnedHostKVPool" in found["refused"]


# --- the backend's CUDA path, driven as SGLang drives it -------------------------------------------


def config(**changes: Any) -> OasisConfig:
    base = OasisConfig(
        block_size=BLOCK, top_k=4, fetch_ratio=0.25, device_kv_tokens=4096, decode_step="captured",
        cuda_untested=True, prefill_attention="torch", prefetch="sync", selector="summaries",
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def layer(layer_id: int) -> NS:
    return NS(
        layer_id=layer_id, tp_q_head_num=Q_HEADS, tp_k_head_num=KV_HEADS, qk_head_dim=DIM, v_head_dim=DIM,
        scaling=DIM**-0.5, is_cross_attention=False, attn_type=None, sliding_window_size=None,
    )  # fmt: skip


class Server:
    """One oasis backend over SGLang's pools on ``device``, driven as SGLang's scheduler and decode graph
    runner would (``graphs``: CUDA graphs on; off, the captured step runs uncompiled). Inputs are random,
    the same on every device for the same pass; ``passes`` records each pass's outputs, and on the fake
    device ``replayed`` the crossings of each replayed pass."""

    def __init__(self, device: str, config: OasisConfig, graphs: bool = True, cuda: FakeCuda | None = None):
        self.device, self.cuda, self.graphs = device, cuda, graphs
        req_pool = ReqToTokenPool(ROWS, CONTEXT, device, False)
        for row in range(1, ROWS + 1):  # row r's tokens: pool locations from (r - 1) * CONTEXT + BLOCK on
            start = (row - 1) * CONTEXT + BLOCK
            req_pool.req_to_token[row] = torch.arange(start, start + CONTEXT, dtype=torch.int32).to(device)
        pool_class = PinnedHostKVPool if device == "cuda" else MHATokenToKVPool
        pool = pool_class(POOL, BLOCK, torch.float32, KV_HEADS, DIM, LAYERS, device, False)
        args = NS(port=0, enable_metrics=False, max_running_requests=ROWS, tp_size=1, disable_cuda_graph=not graphs,
                  enable_torch_compile=False)  # fmt: skip
        runner = NS(device=device, req_to_token_pool=req_pool, token_to_kv_pool=pool, server_args=args)
        self.oasis, self.oasis_runner = OasisAttnBackend(runner, config), runner
        self.passes: list[list[torch.Tensor]] = []
        self.replayed: list[list[Event]] = []
        self.rids: dict[int, str] = {}
        if graphs:
            self.capture()
        elif config.decode_step == "captured":  # uncompiled: torch.compile needs a GPU for CUDA tensors
            assert isinstance(self.oasis.captured, CapturedStep)
            self.oasis.captured.program = self.in_replay(decode_layer)

    def in_replay(self, program: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            with self._replay("the captured program"):
                return program(*args)

        return run

    def _replay(self, what: str) -> contextlib.AbstractContextManager[None]:
        return self.cuda.replay(what) if self.cuda else contextlib.nullcontext()

    def inputs(self, rows: int, per_row: int = 1) -> list[tuple[torch.Tensor, ...]]:
        """Each layer's q, k, v for ``rows`` x ``per_row`` tokens (SGLang's shapes), the pass's own."""
        generator = torch.Generator().manual_seed(1000 + len(self.passes))
        n = rows * per_row
        shapes = ((n, Q_HEADS * DIM), (n, KV_HEADS, DIM), (n, KV_HEADS, DIM))  # as RadixAttention hands them
        return [
            tuple(torch.randn(shape, generator=generator).to(self.device) for shape in shapes)
            for _ in range(LAYERS)
        ]

    def capture(self) -> None:
        """SGLang's runner: ``init_cuda_graph_state``, then the graph of ``GRAPH_BS`` rows warmed up and
        captured (padding rows only; no crossing)."""
        self.oasis.init_cuda_graph_state(GRAPH_BS, GRAPH_BS)
        self.oasis.init_forward_metadata_out_graph(NS(batch_size=GRAPH_BS), in_capture=True)
        shapes = ((GRAPH_BS, Q_HEADS * DIM), (GRAPH_BS, KV_HEADS, DIM), (GRAPH_BS, KV_HEADS, DIM))
        zeros = [torch.zeros(shape).to(self.device) for shape in shapes]
        with self._replay("capture"):
            for _ in range(2):
                for layer_id in range(LAYERS):
                    self.oasis.forward_decode(*zeros, layer(layer_id), NS(batch_size=GRAPH_BS))

    def _note(self, rows: list[int], keys: dict[int, str] | None = None) -> list[str]:
        """Hook 9's note of the forward batch's requests (their retraction keys)."""
        rids = [self.rids.setdefault(row, f"rid-{row}-{len(self.passes)}") for row in rows]
        note_requests(
            {rid: NotedRequest(None, (keys or {}).get(row)) for row, rid in zip(rows, rids, strict=True)}
        )
        return rids

    def forward_batch(
        self, mode: ForwardMode, rows: list[int], seq_lens: list[int], locs: torch.Tensor, **more: Any
    ) -> NS:
        return NS(
            forward_mode=mode, batch_size=len(rows), req_pool_indices=torch.tensor(rows).to(self.device),
            req_pool_indices_cpu=torch.tensor(rows), seq_lens=torch.tensor(seq_lens).to(self.device),
            seq_lens_cpu=torch.tensor(seq_lens), out_cache_loc=locs, encoder_lens=None, spec_info=None, **more,
        )  # fmt: skip

    def extend(
        self, rows: list[int], seq_lens: list[int], prefix_lens: list[int], keys: dict[int, str] | None = None
    ) -> None:
        table = self.oasis.req_to_token_pool.req_to_token
        new = [n - p for n, p in zip(seq_lens, prefix_lens, strict=True)]
        locs = torch.cat(
            [table[row, p:n] for row, p, n in zip(rows, prefix_lens, seq_lens, strict=True)]
        ).long()
        batch = self.forward_batch(
            ForwardMode.EXTEND, rows, seq_lens, locs, rids=self._note(rows, keys),
            extend_prefix_lens=torch.tensor(prefix_lens).to(self.device), extend_seq_lens=torch.tensor(new).to(self.device),
            extend_prefix_lens_cpu=prefix_lens, extend_seq_lens_cpu=new,
        )  # fmt: skip
        self.oasis.init_forward_metadata(batch)
        outs = []
        for layer_id, (q, k, v) in enumerate(self.inputs(sum(new))):
            outs.append(self.oasis.forward_extend(q, k, v, layer(layer_id), batch))
        self.passes.append(outs)

    def decode(self, rows: list[int], seq_lens: list[int]) -> bool:
        """A decode pass (``seq_lens`` count its token); True if it replayed."""
        table = self.oasis.req_to_token_pool.req_to_token
        locs = torch.stack([table[row, n - 1] for row, n in zip(rows, seq_lens, strict=True)]).long()
        batch = self.forward_batch(ForwardMode.DECODE, rows, seq_lens, locs, rids=self._note(rows))
        inputs = self.inputs(len(rows))
        if self.cuda:
            self.cuda.take()
        replays = self.graphs and hooks.ask_backend_to_replay(
            lambda r, f: True, NS(attn_backend=self.oasis), batch
        )
        outs = []
        if replays:
            self.oasis.init_forward_metadata_out_graph(
                NS(batch_size=GRAPH_BS, forward_mode=ForwardMode.DECODE)
            )
            pad = GRAPH_BS - len(rows)
            with self._replay("a decode graph's replay"):
                for layer_id, tensors in enumerate(inputs):
                    q, k, v = (torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) for t in tensors)
                    outs.append(self.oasis.forward_decode(q, k, v, layer(layer_id), batch)[: len(rows)])
            if self.cuda:
                self.replayed.append(self.cuda.take())
        else:
            self.oasis.init_forward_metadata(batch)
            for layer_id, (q, k, v) in enumerate(inputs):
                outs.append(self.oasis.forward_decode(q, k, v, layer(layer_id), batch))
        self.passes.append(outs)
        return replays

    def verify(self, rows: list[int], seq_lens: list[int]) -> None:
        """A TARGET_VERIFY pass of two rows per request (the real token at ``seq_len``, a draft after it)."""
        table = self.oasis.req_to_token_pool.req_to_token
        locs = torch.cat([table[row, n : n + 2] for row, n in zip(rows, seq_lens, strict=True)]).long()
        batch = self.forward_batch(ForwardMode.TARGET_VERIFY, rows, seq_lens, locs, rids=self._note(rows))
        self.oasis.init_forward_metadata(batch)
        outs = []
        for layer_id, (q, k, v) in enumerate(self.inputs(len(rows), per_row=2)):
            outs.append(self.oasis.forward_extend(q, k, v, layer(layer_id), batch))
        self.passes.append(outs)

    def arrive(self, row: int, prompt: int) -> None:
        """A PD decode node's arrival: the prompt's KV written into the host tier by the transfer."""
        generator = torch.Generator().manual_seed(7 + row)
        locs = self.oasis.req_to_token_pool.req_to_token[row, :prompt].long()
        pool = self.oasis.token_to_kv_pool
        for layer_id in range(LAYERS):
            pool.get_key_buffer(layer_id)[locs] = torch.randn(prompt, KV_HEADS, DIM, generator=generator).to(
                self.device
            )
            pool.get_value_buffer(layer_id)[locs] = torch.randn(
                prompt, KV_HEADS, DIM, generator=generator
            ).to(self.device)

    def retract(self, row: int, tokens: int) -> str:
        """SGLang retracts request ``row`` (hook 8) and frees its row; returns its retraction key."""
        key = self.rids.pop(row)
        getattr(self.oasis.req_to_token_pool, RETRACT_LISTENER)(row, key, tokens, False)
        self.finish(row)
        return key

    def finish(self, row: int) -> None:
        """SGLang frees the row: its next request is a new generation."""
        self.rids.pop(row, None)
        self.oasis.req_to_token_pool.req_generation[row] += 1

    def stop(self) -> None:
        self.oasis.selector.pipeline.shutdown()
        self.oasis.gauges.stop()
        note_requests({})


def scenario(server: Server) -> None:
    """Admissions, decode passes with K below and above the context, growth of the host pages a plan
    covers, recall samples (eager under graphs) and a recall target, a PD arrival joining a running
    batch, a retraction and its resume in another row, a finished request's slot taken by the next."""
    server.extend([1, 2], [150, 70], [0, 0])
    lens = {1: 150, 2: 70}

    def decode(rows: list[int], steps: int) -> None:
        for _ in range(steps):
            for row in rows:
                lens[row] += 1
            server.decode(rows, [lens[row] for row in rows])

    decode([1, 2], 12)
    server.arrive(3, 90)  # a PD arrival without a hand-off: its first step is dense, eagerly
    lens[3] = 90
    decode([1, 2, 3], 10)
    key = server.retract(2, lens[2] + 1)  # retracted: its output holds one token more than its KV
    lens[4] = lens.pop(2) + 1
    server.extend([4], [lens[4]], [0], keys={4: key})  # re-prefilled in another row, going on
    decode([1, 3, 4], 8)
    server.finish(1)  # finished: its slot goes to the next request
    server.extend([1], [40], [0])
    lens[1] = 40
    decode([1, 3, 4], 8)


def verify_scenario(server: Server) -> None:
    """No CUDA graphs: the captured step (uncompiled) on verify passes, drafts accepted at random, and a
    request whose blocks grow past a block bucket (64 blocks: 1,024 tokens)."""
    server.extend([1, 2], [1030, 60], [0, 0])
    lens = {1: 1030, 2: 60}
    accepts = torch.rand(14, generator=torch.Generator().manual_seed(5)) < 0.5
    for accepted in accepts.tolist():
        server.verify([1, 2], [lens[1], lens[2]])
        for row in (1, 2):
            lens[row] += 1 + int(accepted)  # the real token, and the draft if accepted


CASES: dict[str, tuple[OasisConfig, bool, Callable[[Server], None]]] = {
    "graphs_k_sparse": (config(recall_sample_every=4, recall_target=0.9), True, scenario),
    "graphs_k_covering": (config(top_k=64, device_kv_tokens=32768), True, scenario),
    "captured_verify": (config(lookahead="ngram", draft_policy="verify", top_k=8), False, verify_scenario),
    # --oasis-selector codes: every block scored by its keys' codes (the codes on the device, their
    # bookkeeping on the host), and a shortlist of m x K by the bound
    "graphs_codes": (config(selector="codes", recall_sample_every=4), True, scenario),
    "captured_verify_codes": (
        config(lookahead="ngram", draft_policy="verify", top_k=8, selector="codes", code_candidates=2),
        False,
        verify_scenario,
    ),
}
DESIGNED = {"download", "plan", "upload"}  # where a replayed pass may cross, and only there


@contextlib.contextmanager
def named_crossings(cuda: FakeCuda) -> Iterator[None]:
    """The places the design names its copies: the last replay's counts and tables read back (``fold``),
    the pass planned on the host (``ready``: SGLang's token locations and page rows read, the tables'
    rows uploaded), the plan copied into the graph's buffers (``load``)."""

    def tagged(method: Callable[..., Any], name: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with cuda.region(name):
                return method(*args, **kwargs)

        return run

    with contextlib.ExitStack() as stack:
        for owner, method, name in ((GraphedStep, "fold", "download"), (CapturedStep, "ready", "plan"), (GraphedStep, "load", "upload")):  # fmt: skip
            stack.enter_context(pytest.MonkeyPatch.context()).setattr(
                owner, method, tagged(getattr(owner, method), name)
            )
        yield


@pytest.mark.parametrize("case", CASES)
def test_the_cuda_path_runs_on_the_device_as_the_eager_step_on_cpu(case: str) -> None:
    """The CUDA path (replays through ``init_cuda_graph_state``, or the captured step) on the fake device
    against the eager step on CPU (``--oasis-decode-step eager``): the same outputs (up to the summation
    order over masked slots), the same tables, epochs and counters."""
    cfg, graphs, play = CASES[case]
    cpu = Server("cpu", dataclasses.replace(cfg, decode_step="eager"), graphs=False)
    play(cpu)
    with FakeCuda() as cuda, named_crossings(cuda):
        gpu = Server("cuda", cfg, graphs, cuda)
        play(gpu)  # raises on any device mismatch, and on any crossing inside a replay or the program
        gpu.oasis.selector.finish_pending()  # the last replay's results into the host's tables
    cpu.oasis.selector.finish_pending()
    assert len(gpu.passes) == len(cpu.passes)
    for number, (ours, theirs) in enumerate(zip(gpu.passes, cpu.passes, strict=True)):
        for layer_id, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            torch.testing.assert_close(
                values(a), b, rtol=1e-5, atol=1e-5, msg=f"pass {number}, layer {layer_id}"
            )
    slots = gpu.oasis.tier.num_request_slots  # the padding slot's rows are the program's alone
    for name, table in gpu.oasis.tier.tables.host.items():
        assert torch.equal(table[:slots], cpu.oasis.tier.tables.host[name][:slots]), name
    assert torch.equal(gpu.oasis.summaries.epoch, cpu.oasis.summaries.epoch)  # pages restarted once each
    ours, theirs = gpu.oasis.stats.snapshot(), cpu.oasis.stats.snapshot()

    def counted(stats: dict[str, int]) -> dict[str, int]:  # not times, nor which step ran the passes
        return {  # nor who coded a block: a captured pass codes the blocks its tokens fill, uncounted
            k: v
            for k, v in stats.items()
            if not k.endswith(("_us", "_ms")) and not k.startswith("captured_") and k != "key_code_pages"
        }

    assert counted(ours) == counted(theirs)
    if cfg.selector == "codes":  # every block either path coded holds the same codes
        assert gpu.oasis.tier.codes is not None and cpu.oasis.tier.codes is not None
        both = (gpu.oasis.tier.codes.coded >= 0) & (cpu.oasis.tier.codes.coded >= 0)
        assert int(both.sum()) > 20 and theirs["key_code_pages"] > 0
        mine, reference = values(gpu.oasis.tier.codes.codes)[both], cpu.oasis.tier.codes.codes[both]
        assert torch.equal(mine, reference)
    covered = {name: ours[name] for name in ("arrived_requests", "resumed_requests", "requests")}
    if play is scenario:  # every kind of pass the scenario names happened (a slot changed hands: 5 in 4)
        assert covered == {"arrived_requests": 1, "resumed_requests": 1, "requests": 5}
        assert gpu.oasis.tier.num_request_slots == ROWS and gpu.oasis.tier.claims == 5
    if case == "graphs_k_sparse":  # samples ran eagerly, the target's growth in replays
        assert ours["recall_samples"] > 0 and ours["recall_target_grows"] > 0 and ours["blocks_deferred"] > 0
        assert ours["captured_decode_passes"] < ours["decode_steps"] - 2  # the admissions' and samples'
    if play is verify_scenario:  # verify passes captured, across block buckets (a bucket every 16 blocks)
        assert isinstance(gpu.oasis.captured, CapturedStep)
        shapes = {blocks for _, blocks, _ in gpu.oasis.captured.compiles.shapes}
        assert {64, 80} <= shapes and shapes <= set(gpu.oasis.captured.block_buckets), shapes
    if graphs:
        assert ours["captured_decode_passes"] >= 10 and len(gpu.replayed) == ours["captured_decode_passes"]
        for events in gpu.replayed:  # outside the replay, only the copies the design names
            assert {e.region for e in events} <= DESIGNED, [
                str(e) for e in events if e.region not in DESIGNED
            ]
            reads = [e for e in events if e.kind != "host_to_device"]
            assert sum(e.region == "download" for e in reads) <= 1, [str(e) for e in reads]
            assert all(e.kind == "host_to_device" for e in events if e.region == "upload")
    else:
        assert ours["captured_decode_passes"] >= 10
    gpu.stop()
    cpu.stop()


# --- the smaller fixes, each with what it broke ---------------------------------------------------


def _decode_some(server: Server, steps: int, contexts: tuple[int, int] = (150, 70)) -> None:
    server.extend([1, 2], list(contexts), [0, 0])
    for step in range(1, steps + 1):
        server.decode([1, 2], [contexts[0] + step, contexts[1] + step])


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("failing_layer", [0, 1])
def test_a_program_failing_at_a_layer_leaves_the_host_bookkeeping_done_once(
    device: str, failing_layer: int
) -> None:
    """The captured step's program fails at one layer of a pass (a compile failure, say): that layer and
    the pass's later ones run eagerly, and the server decodes eagerly from then on. The pass must end as
    an eager pass would: the pages its tokens start bumped once (before, twice when the epoch layer
    failed), the earlier layers' counts folded and (on CUDA) their tables read back (before, neither)."""
    cfg, contexts = config(), (157, 77)  # the fourth pass's tokens start pages 10 and 5
    eager = Server("cpu", dataclasses.replace(cfg, decode_step="eager"), graphs=False)
    _decode_some(eager, 6, contexts)
    calls = {"n": 0}

    def failing(*args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2 * 3 + failing_layer + 1:  # the fourth captured pass, at ``failing_layer``
            assert bool((values(args[2].locs[:2]) % BLOCK == 0).all())  # it starts pages
            raise RuntimeError("a compile failure")
        return decode_layer(*args)

    with FakeCuda() if device == "cuda" else contextlib.nullcontext() as cuda:
        server = Server(device, cfg, graphs=False, cuda=cuda)
        assert isinstance(server.oasis.captured, CapturedStep)
        server.oasis.captured.program = failing
        server.oasis.captured.ahead = None  # counted calls: no compiles ahead
        _decode_some(server, 6, contexts)
        server.oasis.selector.finish_pending()
    eager.oasis.selector.finish_pending()
    for ours, theirs in zip(server.passes, eager.passes, strict=True):
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(values(a), b, rtol=1e-5, atol=1e-5)
    assert torch.equal(server.oasis.summaries.epoch, eager.oasis.summaries.epoch)
    slots = server.oasis.tier.num_request_slots
    for name, table in server.oasis.tier.tables.host.items():
        assert torch.equal(table[:slots], eager.oasis.tier.tables.host[name][:slots]), name
    ours, theirs = server.oasis.stats.snapshot(), eager.oasis.stats.snapshot()
    for name in ("selections", "scored_selections", "selection_changes", "blocks_loaded", "blocks_just_filled",
                 "blocks_from_active", "decode_bytes_host_to_device"):  # fmt: skip
        assert ours[name] == theirs[name], name
    assert ours["captured_decode_passes"] == 3 + (failing_layer > 0)  # the failed pass's first layer counted
    server.stop()
    eager.stop()


def test_a_replays_figures_reach_its_requests_before_their_results_are_processed() -> None:
    """Hook 4 settles a replay of the batch whose results SGLang processes: a request finishing there has
    its last pass's blocks in its own figures (before, they were folded at the next pass, after its
    figures had gone out, and were dropped), credited to the requests that ran it."""
    with FakeCuda() as cuda:
        server = Server("cuda", config(top_k=2), cuda=cuda)
        server.extend([1, 2], [150, 70], [0, 0])
        replayed = [server.decode([1, 2], [150 + step, 70 + step]) for step in range(1, 12)]
        assert (
            replayed[-1] and isinstance(server.oasis.captured, GraphedStep) and server.oasis.captured.unfolded
        )
        seen: dict[str, Any] = {}

        def process(scheduler: Any, batch: Any) -> None:  # SGLang's process_batch_result
            seen["unfolded"] = server.oasis.captured.unfolded  # type: ignore[union-attr]
            seen["figures"] = server.oasis.stats.requests.take(server.rids[1])

        reqs = [NS(kv=NS(req_pool_idx=row), rid=server.rids[row]) for row in (1, 2)]
        scheduler = NS(tp_worker=NS(model_runner=NS(attn_backend=server.oasis)), tp_size=1)
        hooks.abort_failed_transfers(process, scheduler, NS(reqs=reqs))
        server.stop()
    eager = Server("cpu", config(top_k=2, decode_step="eager"), graphs=False)
    eager.extend([1, 2], [150, 70], [0, 0])
    for step in range(1, 12):
        eager.decode([1, 2], [150 + step, 70 + step])
    eager.oasis.selector.finish_pending()
    expected = eager.oasis.stats.requests.take(eager.rids[1])
    assert seen["unfolded"] == 0 and seen["figures"] == expected and expected["decode_blocks_loaded"] > 0
    eager.stop()


def test_hook_14_asked_twice_of_one_batch_begins_it_once() -> None:
    """SGLang's speculative workers ask ``can_run_graph`` of a batch before the model runner asks again."""
    server = Server("cpu", config())
    server.extend([1, 2], [150, 70], [0, 0])
    batch = server.forward_batch(ForwardMode.DECODE, [1, 2], [151, 71], torch.tensor([151, 71]), rids=None)
    runner = NS(attn_backend=server.oasis)
    before = server.oasis.step
    first = hooks.ask_backend_to_replay(lambda r, f: True, runner, batch)
    assert hooks.ask_backend_to_replay(lambda r, f: True, runner, batch) == first
    assert server.oasis.step == before + 1
    server.stop()


def test_a_captured_step_leaves_torch_s_process_wide_settings_alone() -> None:
    """Its compile settings apply to its own calls (before, building one changed torch's recompile limit and
    compile workers for the whole process)."""
    limit, threads = torch._dynamo.config.cache_size_limit, torch._inductor.config.compile_threads
    server = Server("cpu", config(), graphs=False)
    assert isinstance(server.oasis.captured, CapturedStep)
    assert (torch._dynamo.config.cache_size_limit, torch._inductor.config.compile_threads) == (limit, threads)
    server.stop()
