"""Where a sparse decode step's time goes, one layer at a time, against SGLang's torch_native decode.

In process, no server: the oasis backend (``OasisAttnBackend``, its real parts) over a stand-in for
SGLang's KV pool (per-layer K/V tensors with SGLang's ``get_key_buffer`` / ``set_kv_buffer``), ``--batch``
requests of ``--context-tokens`` tokens each, SmolLM2's attention shape (9 query heads, 3 KV heads,
head_dim 64), float32, one thread. Layer 0 is a dense layer (``--oasis-dense-layers 0``: SGLang's
torch_native decode, the baseline); layer 1 the sparse path. Each step decodes one token per request at
both layers; times are per layer and step, averaged over ``--steps``. Modes: ``k_covering`` (K holds every
block: the eager step's "unchanged" selection shortcut) and ``k_sparse`` (``--sparse-top-k``, scoring and
top-K every step). Each mode runs twice: the eager step (``sparse_ms``) and the captured one
(``--oasis-decode-step captured``, ``captured_ms``: the compiled ``decode_layer``, compiled during the
warm-up steps with ``--compile-backend``, inductor by default). ``ops`` counts the torch ops one step of
each layer dispatches (the eager sparse step's, the dense one's; the captured step is one compiled call).

Then one profile (cProfile) of the eager sparse layer with K covering (``--profile-mode k_sparse``: with
``--sparse-top-k``): the functions of the sparse path by cumulative time per step, the breakdown behind
``bench_overhead``'s ``ratio_k_covering``. ``--selector codes``: the sparse layer ranks blocks by their key
codes (``--oasis-selector codes``, every full block scored; ``key_code_pages``: the pages the eager step's
selections coded, those its requests filled while decoding). The eager step's selection runs on the prefetch pipeline's thread, beside the timed layer and
outside the profile.

    python benchmark/bench_decode_layer.py --json decode_layer.json [--context-tokens 1024] [--steps 200]
        [--batch 1,8] [--compile-backend inductor] [--selector summaries|codes] [--profile-mode k_covering]

Prints the table and the profile; JSON: ``batches.<batch>.<mode>.{dense_ms, sparse_ms, captured_ms, ratio,
captured_ratio, captured_vs_eager, ops_dense, ops_sparse, key_code_pages}``, ``modes`` (batch 1's), ``profile`` (list of
``{function, ms_per_step}``), ``setting``, ``date``, ``machine``. A few minutes (compiling).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import time
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_oasis.attention.decode_program import decode_layer
from sglang_oasis.attention.oasis_backend import OasisAttnBackend
from sglang_oasis.config import OasisConfig
from sglang_oasis_testing.stand_in_pool import StandInPool

BLOCK, KV_HEADS, Q_HEADS, DIM, LAYERS, POOL = 16, 3, 9, 64, 2, 65536
ROW_TOKENS = 4096  # pool tokens per request row (contexts up to 3,072)
COMPILED: dict[
    str, Any
] = {}  # compile backend -> the compiled decode_layer (its graphs shared by every backend)


class OpCounter(TorchDispatchMode):
    """Counts the torch ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def backend(
    top_k: int, context: int, batch: int, captured: str | None, selector: str = "summaries"
) -> OasisAttnBackend:
    """A backend whose requests (rows 1..batch) have just been admitted with ``context`` tokens each;
    ``captured``: the dynamo backend of its captured step (None: the eager step); ``selector``: its
    ``--oasis-selector``."""
    rows = batch + 1
    assert context + 1024 <= ROW_TOKENS and rows * ROW_TOKENS <= POOL, (context, batch)
    req_to_token = torch.zeros(rows, ROW_TOKENS, dtype=torch.int32)
    for req in range(1, rows):
        req_to_token[req] = torch.arange(req * ROW_TOKENS - ROW_TOKENS // 2, (req + 1) * ROW_TOKENS - ROW_TOKENS // 2,
                                         dtype=torch.int32)  # fmt: skip
    runner = SimpleNamespace(
        device="cpu",
        req_to_token_pool=SimpleNamespace(
            req_to_token=req_to_token, req_generation=torch.zeros(rows, dtype=torch.int64), free_slots=[]
        ),
        token_to_kv_pool=StandInPool(POOL, BLOCK, LAYERS, KV_HEADS, DIM),
        server_args=SimpleNamespace(port=0, enable_metrics=False, max_running_requests=batch),
    )
    config = OasisConfig(
        block_size=BLOCK, top_k=top_k, device_kv_tokens=POOL, dense_layers=(0,), prefill_window=0,
        recall_sample_every=0, decode_step="eager" if captured is None else "captured", selector=selector,
    )  # fmt: skip
    oasis = OasisAttnBackend(runner, config)
    if captured is not None and oasis.captured is not None:
        if captured not in COMPILED:
            COMPILED[captured] = torch.compile(decode_layer, fullgraph=True, dynamic=False, backend=captured)
        oasis.captured.program = COMPILED[captured]
    reqs = list(range(1, rows))
    for req in reqs:
        oasis.slots.claim(req, 0)
    oasis.set_batch(reqs, admission=True)
    contexts = torch.full((batch,), context)
    oasis.intake.catch_up(oasis.batch, 1, contexts)
    oasis.intake.mark(oasis.batch.req_index, 1, contexts)
    oasis.selector.select(oasis.batch, 1, torch.randn(batch, Q_HEADS, DIM), [context] * batch)
    oasis.selector.finish_pending()
    first = context - context % BLOCK  # the partial block, as an extend stores it
    pool = oasis.token_to_kv_pool
    for row, req in enumerate(reqs):
        locs = req_to_token[req, first:context].long()
        oasis.tier.active.store(1, oasis.batch.slots[row : row + 1], torch.tensor([first]), torch.tensor([context]),
                                pool.k[1][locs], pool.v[1][locs])  # fmt: skip
    return oasis


def layer(layer_id: int) -> SimpleNamespace:
    return SimpleNamespace(
        layer_id=layer_id, tp_q_head_num=Q_HEADS, tp_k_head_num=KV_HEADS, qk_head_dim=DIM, v_head_dim=DIM,
        scaling=DIM**-0.5, is_cross_attention=False, sliding_window_size=None,
    )  # fmt: skip


def decode(
    oasis: OasisAttnBackend, context: int, first_step: int, steps: int, profile: cProfile.Profile | None = None,
    count: bool = False,
) -> tuple[float, float, int, int]:  # fmt: skip
    """Mean ms per step of the dense layer and of the sparse layer over ``steps`` steps from
    ``first_step``; with ``count``, the ops one step of each dispatched (else 0)."""
    dense_s = sparse_s = 0.0
    ops = [0, 0]
    reqs = [int(r) for r in oasis.batch.req_index.tolist()]
    bs = len(reqs)
    table = oasis.req_to_token_pool.req_to_token
    for step in range(first_step, first_step + steps):
        seq = torch.full((bs,), context + 1 + step)
        batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE, req_pool_indices=torch.tensor(reqs), seq_lens=seq,
            out_cache_loc=table[torch.tensor(reqs), seq - 1].long(), encoder_lens=None, spec_info=None,
        )  # fmt: skip
        oasis.begin_batch(ForwardMode.DECODE, reqs, seq.tolist(), None)
        q, k, v = (torch.randn(bs, heads * DIM) for heads in (Q_HEADS, KV_HEADS, KV_HEADS))
        for which in (0, 1):
            counter = OpCounter() if count and step == first_step else None
            if which == 1 and profile is not None:
                profile.enable()
            began = time.perf_counter()
            if counter is not None:
                with counter:
                    oasis.forward_decode(q, k, v, layer(which), batch)
                ops[which] = counter.ops
            else:
                oasis.forward_decode(q, k, v, layer(which), batch)
            took = time.perf_counter() - began
            if which == 1 and profile is not None:
                profile.disable()
            if which == 0:
                dense_s += took
            else:
                sparse_s += took
    return dense_s / steps * 1e3, sparse_s / steps * 1e3, ops[0], ops[1]


def stop(oasis: OasisAttnBackend) -> None:
    """Stop the backend's threads: a daemon thread still inside a torch op at exit aborts the process
    ("terminate called without an active exception", seen once in CI)."""
    oasis.selector.pipeline.shutdown()
    oasis.gauges.stop()


def measure(
    top_k: int, context: int, batch: int, steps: int, compile_backend: str, selector: str = "summaries"
) -> dict[str, Any]:
    """One mode at one batch size: the eager step, then the captured one (warm-up steps first: 20, and
    for the captured step every step the timed ones meet, so each shape is compiled before timing)."""
    eager = backend(top_k, context, batch, None, selector)
    decode(eager, context, 0, 20)
    dense_ms, sparse_ms, ops_dense, ops_sparse = decode(eager, context, 20, steps, count=True)
    coded = eager.stats.snapshot().get("key_code_pages", 0)  # pages the eager step's selections coded
    stop(eager)
    warm = backend(top_k, context, batch, compile_backend, selector)
    decode(warm, context, 0, 20 + steps)  # compiles every shape the timed steps meet
    stop(warm)
    captured = backend(top_k, context, batch, compile_backend, selector)
    decode(captured, context, 0, 20)
    captured_dense_ms, captured_ms, _, _ = decode(captured, context, 20, steps)
    assert captured.stats.snapshot()["captured_decode_passes"] == 20 + steps
    stop(captured)
    return {
        "top_k": top_k, "dense_ms": dense_ms, "sparse_ms": sparse_ms, "captured_ms": captured_ms,
        "ratio": sparse_ms / dense_ms, "captured_ratio": captured_ms / captured_dense_ms,
        "captured_vs_eager": captured_ms / sparse_ms, "ops_dense": ops_dense, "ops_sparse": ops_sparse,
        "key_code_pages": coded,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sparse-top-k", type=int, default=16)
    parser.add_argument("--batch", default="1,8", help="batch sizes, comma-separated")
    parser.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend of the captured step"
    )
    parser.add_argument(
        "--selector",
        default="summaries",
        choices=("summaries", "codes"),
        help="the sparse layer's --oasis-selector (codes: every full block scored by its key codes)",
    )
    parser.add_argument(
        "--profile-mode",
        default="k_covering",
        choices=("k_covering", "k_sparse"),
        help="which mode's eager sparse layer to profile (batch 1)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    context, steps = args.context_tokens, args.steps
    covering = (context + 2 * (20 + steps)) // BLOCK + 1
    batches: dict[str, dict[str, Any]] = {}
    print(f"{'batch':>5} {'mode':<12} {'top_k':>5} {'dense ms':>9} {'eager ms':>9} {'capt ms':>8} "
          f"{'eager/dense':>11} {'capt/dense':>10} {'capt/eager':>10} {'ops dense':>9} {'ops eager':>9}")  # fmt: skip
    for batch in (int(b) for b in args.batch.split(",")):
        modes = batches[str(batch)] = {}
        for mode, top_k in (("k_covering", covering), ("k_sparse", args.sparse_top_k)):
            row = modes[mode] = measure(top_k, context, batch, steps, args.compile_backend, args.selector)
            print(f"{batch:>5} {mode:<12} {top_k:>5} {row['dense_ms']:>9.3f} {row['sparse_ms']:>9.3f} "
                  f"{row['captured_ms']:>8.3f} {row['ratio']:>11.2f} {row['captured_ratio']:>10.2f} "
                  f"{row['captured_vs_eager']:>10.2f} {row['ops_dense']:>9} {row['ops_sparse']:>9}", flush=True)  # fmt: skip
    profile = cProfile.Profile()
    profiled_k = covering if args.profile_mode == "k_covering" else args.sparse_top_k
    profiled = backend(profiled_k, context, 1, None, args.selector)
    decode(profiled, context, 0, steps, profile)
    stop(profiled)
    stats = pstats.Stats(profile)
    rows = []
    for (path, line, name), (_, _, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "sglang_oasis" in path or "sgl_kernel_oasis" in path:
            short = path.split("/python/")[-1]
            rows.append({"function": f"{short}:{line}({name})", "ms_per_step": cumulative / steps * 1e3})
    rows.sort(key=lambda row: -row["ms_per_step"])
    print(
        f"\nsparse layer (eager step, {args.selector}), {args.profile_mode}, batch 1: cumulative ms per step "
        "(profiled, so slower than above)"
    )
    for row in rows[:20]:
        print(f"{row['ms_per_step']:8.3f}  {row['function']}")
    if args.json:
        first_batch = next(iter(batches.values()))
        result = {
            "setting": {"context_tokens": context, "steps": steps, "block": BLOCK, "kv_heads": KV_HEADS,
                        "q_heads": Q_HEADS, "head_dim": DIM, "dtype": "float32", "threads": 1,
                        "compile_backend": args.compile_backend, "selector": args.selector,
                        "profile_mode": args.profile_mode},
            "batches": batches, "modes": first_batch, "profile": rows[:40],
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor() or platform.machine(),
        }  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
