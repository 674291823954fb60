"""Where a sparse decode step's time goes, one layer at a time, against SGLang's torch_native decode.

In process, no server: the oasis backend (``OasisAttnBackend``, its real parts) over a stand-in for
SGLang's KV pool (per-layer K/V tensors with SGLang's ``get_key_buffer`` / ``set_kv_buffer``), one
request of ``--context-tokens`` tokens, batch 1, SmolLM2's attention shape (9 query heads, 3 KV heads,
head_dim 64), float32. Layer 0 is a dense layer (``--oasis-dense-layers 0``: SGLang's torch_native
decode, the baseline); layer 1 the sparse path. Each step decodes one token at both layers; times are
per layer and step, averaged over ``--steps``. Modes: ``k_covering`` (K holds every block: the
"unchanged" selection shortcut) and ``k_sparse`` (``--sparse-top-k``, scoring and top-K every step).

Then one profile (cProfile) of the sparse layer with K covering: the functions of the sparse path by
cumulative time per step, the breakdown behind ``bench_overhead``'s ``ratio_k_covering``.

    python benchmark/bench_decode_layer.py --json decode_layer.json [--context-tokens 1024] [--steps 200]

Prints the table and the profile; JSON: ``modes.<mode>.{dense_ms, sparse_ms, ratio}``, ``profile``
(list of ``{function, ms_per_step}``), ``setting``, ``date``, ``machine``. About half a minute.
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

from sglang_oasis.attention.oasis_backend import OasisAttnBackend
from sglang_oasis.config import OasisConfig

BLOCK, KV_HEADS, Q_HEADS, DIM, LAYERS, POOL = 16, 3, 9, 64, 2, 8192


class StandInPool:
    """Per-layer K/V tensors with the slice of SGLang's MHATokenToKVPool the backend uses."""

    size, page_size, layer_num, head_num, head_dim, dtype = POOL, BLOCK, LAYERS, KV_HEADS, DIM, torch.float32

    def __init__(self) -> None:
        self.k = [torch.randn(POOL + 2 * BLOCK, KV_HEADS, DIM) for _ in range(LAYERS)]
        self.v = [torch.randn(POOL + 2 * BLOCK, KV_HEADS, DIM) for _ in range(LAYERS)]

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    def set_kv_buffer(self, layer: Any, loc: Any, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer.layer_id][loc.loc] = k.view(-1, KV_HEADS, DIM)
        self.v[layer.layer_id][loc.loc] = v.view(-1, KV_HEADS, DIM)


def backend(top_k: int, context: int) -> OasisAttnBackend:
    """A backend whose request (row 1) has just been admitted with ``context`` tokens."""
    req_to_token = torch.zeros(3, POOL // 2, dtype=torch.int32)
    req_to_token[1] = torch.arange(POOL // 2, dtype=torch.int32)
    runner = SimpleNamespace(
        device="cpu",
        req_to_token_pool=SimpleNamespace(
            req_to_token=req_to_token, req_generation=torch.zeros(3, dtype=torch.int64), free_slots=[2]
        ),
        token_to_kv_pool=StandInPool(),
        server_args=SimpleNamespace(port=0, enable_metrics=False, max_running_requests=1),
    )
    config = OasisConfig(
        block_size=BLOCK, top_k=top_k, device_kv_tokens=POOL, dense_layers=(0,), prefill_window=0
    )
    oasis = OasisAttnBackend(runner, config)
    oasis.slots.claim(1, 0)
    oasis.set_batch([1], admission=True)
    oasis.intake.catch_up(oasis.batch, 1, torch.tensor([context]))
    oasis.selector.select(oasis.batch, 1, torch.randn(1, Q_HEADS, DIM), [context])
    oasis.selector.finish_pending()
    first = context - context % BLOCK  # the partial block, as an extend stores it
    pool = oasis.token_to_kv_pool
    oasis.tier.active.store(
        1, oasis.batch.slots, torch.tensor([first]), torch.tensor([context]), pool.k[1][first:context],
        pool.v[1][first:context],
    )  # fmt: skip
    return oasis


def layer(layer_id: int) -> SimpleNamespace:
    return SimpleNamespace(
        layer_id=layer_id, tp_q_head_num=Q_HEADS, tp_k_head_num=KV_HEADS, qk_head_dim=DIM, v_head_dim=DIM,
        scaling=DIM**-0.5, is_cross_attention=False, sliding_window_size=None,
    )  # fmt: skip


def decode(
    top_k: int, context: int, steps: int, profile: cProfile.Profile | None = None
) -> tuple[float, float]:
    """Mean ms per step of the dense layer and of the sparse layer."""
    oasis = backend(top_k, context)
    dense_s = sparse_s = 0.0
    for step in range(steps):
        seq = context + 1 + step
        batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE, req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([seq]),
            out_cache_loc=torch.tensor([seq - 1]), encoder_lens=None, spec_info=None,
        )  # fmt: skip
        oasis.step += 1
        oasis.set_batch([1])
        q, k, v = (
            torch.randn(1, Q_HEADS * DIM),
            torch.randn(1, KV_HEADS * DIM),
            torch.randn(1, KV_HEADS * DIM),
        )
        began = time.perf_counter()
        oasis.forward_decode(q, k, v, layer(0), batch)
        middle = time.perf_counter()
        if profile is not None:
            profile.enable()
        oasis.forward_decode(q, k, v, layer(1), batch)
        if profile is not None:
            profile.disable()
        dense_s += middle - began
        sparse_s += time.perf_counter() - middle
    # Stop the backend's threads: a daemon thread still inside a torch op at exit aborts the process
    # ("terminate called without an active exception", seen once in CI).
    oasis.selector.pipeline.shutdown()
    oasis.gauges.stop()
    return dense_s / steps * 1e3, sparse_s / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--context-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--sparse-top-k", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    context, steps = args.context_tokens, args.steps
    covering = (context + steps) // BLOCK + 1
    modes = {}
    for mode, top_k in (("k_covering", covering), ("k_sparse", args.sparse_top_k)):
        decode(top_k, context, 20)  # warm-up
        dense_ms, sparse_ms = decode(top_k, context, steps)
        modes[mode] = {
            "top_k": top_k,
            "dense_ms": dense_ms,
            "sparse_ms": sparse_ms,
            "ratio": sparse_ms / dense_ms,
        }
    print(f"{'mode':<12} {'top_k':>5} {'dense ms':>9} {'sparse ms':>10} {'ratio':>6}")
    for mode, row in modes.items():
        print(
            f"{mode:<12} {row['top_k']:>5} {row['dense_ms']:>9.3f} {row['sparse_ms']:>10.3f} {row['ratio']:>6.2f}"
        )
    profile = cProfile.Profile()
    decode(covering, context, steps, profile)
    stats = pstats.Stats(profile)
    rows = []
    for (path, line, name), (_, _, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "sglang_oasis" in path or "sgl_kernel_oasis" in path:
            short = path.split("/python/")[-1]
            rows.append({"function": f"{short}:{line}({name})", "ms_per_step": cumulative / steps * 1e3})
    rows.sort(key=lambda row: -row["ms_per_step"])
    print("\nsparse layer, K covering: cumulative ms per step (profiled, so slower than above)")
    for row in rows[:20]:
        print(f"{row['ms_per_step']:8.3f}  {row['function']}")
    if args.json:
        result = {
            "setting": {"context_tokens": context, "steps": steps, "block": BLOCK, "kv_heads": KV_HEADS,
                        "q_heads": Q_HEADS, "head_dim": DIM, "dtype": "float32", "threads": 1},
            "modes": modes, "profile": rows[:40],
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.processor() or platform.machine(),
        }  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
