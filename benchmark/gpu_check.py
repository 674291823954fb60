"""GPU check of sgl-kernel-oasis: each Triton kernel timed against its byte floor, and a dense vs sparse
decode step of a Qwen3-8B-shaped layer stack (random weights) at long contexts.

Run by ``benchmark/gpu_check.sh`` on a CUDA machine (after the kernel tests). ``--smoke`` runs the same
code at toy sizes, on CPU under Triton's interpreter where there is no GPU (timings then mean nothing).

Byte floor: the fewest bytes a kernel must move (inputs read once, outputs written once) over the
measured device-to-device copy bandwidth (bytes read + written per second); ``floor share`` = floor
time / kernel time (1.0 = as fast as a plain copy of those bytes).

Decode step (per layer: QKV projection, attention, output projection, SwiGLU MLP; bf16):
- dense: attention over the whole context in device memory (torch SDPA; the G query heads of a KV
  head go in as G query rows, the usual GQA decode layout);
- sparse: the new token's summary update, attention over each KV head's K blocks plus the active tail
  (``headwise_decode_attention``), scoring every block summary and top-K (the next step's selection),
  and, in the ``+fetch`` column, the capped fetch: ceil(0.05 K) blocks per KV head and request copied from
  pinned host memory (``copy_blocks_to_slots``), run in line (the pipeline overlaps it; this is the
  serial upper bound).

Prefetch pipeline (``gpu_pipeline.py``): the same stack with the runtime's own ``PrefetchPipeline`` and
``BlockPrefetcher`` (side stream, pinned host pool, capped delta plans), modes none / sync / async.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is first imported

import gpu_timing
import sgl_kernel_oasis as reference
from gpu_pipeline import pipeline_rows
from gpu_step import captured_rows
from gpu_timing import graphed, timed
from sgl_kernel_oasis import triton_kernels as tk


@dataclass
class Shape:
    layers: int = 36
    hidden: int = 4096
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 12288
    block: int = 16
    top_k: int = 128
    fetch_ratio: float = 0.05


SMOKE_SHAPE = Shape(layers=2, hidden=128, q_heads=6, kv_heads=2, head_dim=32, mlp=256, top_k=4)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


DTYPE = torch.bfloat16  # --smoke on CPU: float16 (the interpreter's bf16 tl.dot is not exact)


def copy_bandwidth(device: str, gib: float) -> dict[str, float]:
    """Device-to-device copy (read + write bytes per second) and pinned host -> device."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device=device, dtype=DTYPE)
    dst = torch.empty_like(src)
    d2d_ms = timed(lambda: dst.copy_(src), device, repeat=10)
    result = {"d2d_gb_s": 2 * src.numel() * 2 / d2d_ms / 1e6}
    if device == "cuda":
        host = src[: n // 4].cpu().pin_memory()
        small = dst[: host.numel()]
        h2d_ms = timed(lambda: small.copy_(host, non_blocking=True), device, repeat=10)
        result["h2d_gb_s"] = host.numel() * 2 / h2d_ms / 1e6
    return result


def kernel_rows(shape: Shape, batch: int, context: int, device: str, bw: dict[str, float]) -> list[dict]:
    """Each kernel at a decode-sized shape of one layer: Triton vs the torch reference, against its floor."""
    dt = DTYPE
    h, d, b, g = shape.kv_heads, shape.head_dim, shape.block, shape.q_heads // shape.kv_heads
    pages_per_req = context // b
    num_pages = batch * pages_per_req
    rows: list[dict] = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    torch.manual_seed(0)

    def rand(*size: int, dtype: torch.dtype = dt) -> torch.Tensor:
        return torch.randn(*size, device=device, dtype=dtype)  # made on the device: GiBs of it

    def record(
        name: str, nbytes: int, tri: Callable[[], Any], ref: Callable[[], Any], note: str = "",
        outputs: Callable[[], torch.Tensor] | None = None, time_ref: bool = True, gb_s: float | None = None,
    ) -> None:  # fmt: skip
        """Time both (the reference only if ``time_ref``); first check the kernel against the reference on
        these inputs (their return values, or for in-place ops what ``outputs`` reads after each ran on
        the same starting state). The floor is ``nbytes`` at ``gb_s`` (default: the device copy rate)."""
        if outputs is None:
            err = rel_err(tri(), ref())
        else:
            saved = outputs().clone()
            ref()
            want = outputs().clone()
            outputs().copy_(saved)
            tri()
            err = rel_err(outputs(), want)
        tri_ms = timed(tri, device)
        ref_ms = timed(ref, device) if time_ref else float("nan")
        floor_ms = nbytes / ((gb_s or bw["d2d_gb_s"]) * 1e6)
        rows.append({
            "kernel": name, "bytes": nbytes, "triton_ms": tri_ms, "torch_ms": ref_ms,
            "floor_ms": floor_ms, "floor_share": floor_ms / tri_ms, "speedup_vs_torch": ref_ms / tri_ms,
            "rel_err": err, "note": note,
        })  # fmt: skip

    # Summary update, prefill: every token of every request.
    low = rand(num_pages, h, d)
    summaries = torch.stack([low, low + 1])  # kmin, kmax as one tensor, to check both at once
    kmin, kmax = summaries[0], summaries[1]
    locs = torch.randperm(num_pages * b, generator=gen).to(device)
    keys = rand(num_pages * b, h, d)
    nbytes = keys.numel() * 2 + 2 * kmin.numel() * 2 + locs.numel() * 8
    record("summary update (prefill)", nbytes,
           lambda: tk.update_page_summaries(kmin, kmax, locs, keys, b),
           lambda: reference.update_page_summaries(kmin, kmax, locs, keys, b),
           f"{num_pages * b} tokens", outputs=lambda: summaries)  # fmt: skip
    # Summary update, decode: one token per request.
    dec_locs = (torch.arange(batch) * pages_per_req * b + 5).to(device)
    dec_keys = rand(batch, h, d)
    nbytes = dec_keys.numel() * 2 * 5
    record("summary update (decode)", nbytes,
           lambda: tk.update_page_summaries(kmin, kmax, dec_locs, dec_keys, b),
           lambda: reference.update_page_summaries(kmin, kmax, dec_locs, dec_keys, b),
           f"{batch} tokens (latency-bound)", outputs=lambda: summaries)  # fmt: skip
    # Scoring every block summary, one and two (real + draft) query rows.
    pages = torch.arange(num_pages).view(batch, pages_per_req).to(device)
    for q_rows in (1, 2):
        query = rand(batch, q_rows, shape.q_heads, d)
        nbytes = 2 * batch * pages_per_req * h * d * 2 + batch * q_rows * h * pages_per_req * 4
        record(f"block scoring ({q_rows} row{'s' if q_rows > 1 else ''})", nbytes,
               lambda query=query: tk.score_paged_blocks(query, kmin, kmax, pages),
               lambda query=query: reference.score_paged_blocks(query, kmin, kmax, pages),
               f"{pages_per_req} blocks/request")  # fmt: skip
    # Sparse decode attention over the head-wise mapping (K blocks + a tail of B - 1 tokens).
    slots = shape.top_k
    working_sets = rand(2, batch * h * slots, b, d)
    ws_k, ws_v = working_sets[0], working_sets[1]
    slot_rows = torch.randperm(batch * h * slots, generator=gen).view(batch, h, slots).to(device)
    tail_k, tail_v = rand(batch * b, h, d), rand(batch * b, h, d)
    for q_rows in (1, 2):
        tail = b - 1 + q_rows
        tail_locs = torch.randint(0, batch * b, (batch, tail), generator=gen).to(device)
        tail_valid = torch.ones(batch, q_rows, tail, dtype=torch.bool, device=device)
        query = rand(batch, q_rows, shape.q_heads, d)
        nbytes = 2 * (ws_k.numel() + batch * tail * h * d) * 2 + 2 * query.numel() * 2
        args = (query, ws_k, ws_v, slot_rows, tail_k, tail_v, tail_locs, tail_valid, d**-0.5)
        record(f"sparse attention ({q_rows} row{'s' if q_rows > 1 else ''})", nbytes,
               lambda args=args: tk.headwise_decode_attention(*args),
               lambda args=args: reference.headwise_decode_attention(*args),
               f"K={slots} blocks + {tail} tail, G={g}")  # fmt: skip
    # Block copies for a capped delta: ceil(ratio K) blocks per KV head and request.
    loads = batch * h * math.ceil(shape.fetch_ratio * shape.top_k)
    dst_rows = torch.randperm(ws_k.shape[0], generator=gen)[:loads].to(device)
    src_pages = torch.randint(0, num_pages, (loads,), generator=gen).to(device)
    heads = torch.randint(0, h, (loads,), generator=gen).to(device)
    pool_k, pool_v = rand(num_pages * b, h, d), rand(num_pages * b, h, d)
    nbytes = 2 * 2 * loads * b * d * 2
    record("block copy (device pool)", nbytes,
           lambda: tk.copy_blocks_to_slots(ws_k, ws_v, dst_rows, pool_k, pool_v, src_pages, heads),
           lambda: reference.copy_blocks_to_slots(ws_k, ws_v, dst_rows, pool_k, pool_v, src_pages, heads),
           f"{loads} blocks", outputs=lambda: working_sets)  # fmt: skip
    if device == "cuda":  # the same plan read from pinned host memory; checked against the device copy
        host_k, host_v = pool_k.cpu().pin_memory(), pool_v.cpu().pin_memory()
        record("block copy (pinned host)", nbytes // 2,  # only the reads cross the bus
               lambda: tk.copy_blocks_to_slots(ws_k, ws_v, dst_rows, host_k, host_v, src_pages, heads),
               lambda: reference.copy_blocks_to_slots(ws_k, ws_v, dst_rows, pool_k, pool_v, src_pages, heads),
               f"{loads} blocks, zero-copy over the bus (floor: h2d copy)", outputs=lambda: working_sets,
               time_ref=False, gb_s=bw["h2d_gb_s"])  # fmt: skip
    return rows


class Stack:
    """Random bf16 weights of a Qwen3-8B-shaped decoder (the parts a decode step reads)."""

    def __init__(self, shape: Shape, device: str) -> None:
        self.s = shape
        torch.manual_seed(1)
        qkv = (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim

        def w(*size: int) -> torch.Tensor:
            return torch.randn(*size, device=device, dtype=DTYPE) * size[-1] ** -0.5

        self.layers = [
            (w(qkv, shape.hidden), w(shape.hidden, shape.q_heads * shape.head_dim),
             w(2 * shape.mlp, shape.hidden), w(shape.hidden, shape.mlp))
            for _ in range(shape.layers)
        ]  # fmt: skip

    def step(
        self, x: torch.Tensor, attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    ):
        s = self.s
        batch = x.shape[0]
        for layer, (w_qkv, w_o, w_up, w_down) in enumerate(self.layers):
            qkv = torch.nn.functional.linear(torch.nn.functional.rms_norm(x, (s.hidden,)), w_qkv)
            q, k, v = qkv.split(
                [s.q_heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], -1
            )
            out = attend(layer, q.view(batch, s.q_heads, s.head_dim), k.view(batch, s.kv_heads, s.head_dim),
                         v.view(batch, s.kv_heads, s.head_dim))  # fmt: skip
            x = x + torch.nn.functional.linear(out.reshape(batch, -1), w_o)
            gate, up = torch.nn.functional.linear(torch.nn.functional.rms_norm(x, (s.hidden,)), w_up).chunk(
                2, -1
            )
            x = x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w_down)
        return x


def timed_step(
    stack: Stack, x: torch.Tensor, attend: Callable[..., torch.Tensor], device: str
) -> tuple[float, float, bool]:
    """(eager ms, graph-replay ms, whether the graph was captured) of one decode step."""
    eager_ms = timed(lambda: stack.step(x, attend), device, repeat=10)
    replay, captured = graphed(lambda: stack.step(x, attend), device)
    return eager_ms, timed(replay, device, repeat=10), captured


def dense_step(stack: Stack, x: torch.Tensor, context: int, device: str) -> tuple[float, float, bool]:
    """Attention over the whole context in device memory, ``[batch, kv_heads, context, dim]`` per layer."""
    s, batch = stack.s, x.shape[0]
    g, h, d = s.q_heads // s.kv_heads, s.kv_heads, s.head_dim
    cache_k = [torch.randn(batch, h, context, d, device=device, dtype=DTYPE) for _ in range(s.layers)]
    cache_v = [torch.randn(batch, h, context, d, device=device, dtype=DTYPE) for _ in range(s.layers)]

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache_k[layer][:, :, -1] = k
        cache_v[layer][:, :, -1] = v
        rows = q.view(batch, h, g, d)  # a KV head's G query heads as G query rows
        return torch.nn.functional.scaled_dot_product_attention(rows, cache_k[layer], cache_v[layer])

    return timed_step(stack, x, attend, device)


def sparse_step(
    stack: Stack, x: torch.Tensor, context: int, device: str, fetch: bool
) -> tuple[float, float, bool]:
    """Working sets of K blocks per KV head, summaries of every block, a device buffer for the active
    tail; with ``fetch``, the capped delta copied in from a pinned host pool."""
    s, batch = stack.s, x.shape[0]
    b, h, d, slots = s.block, s.kv_heads, s.head_dim, s.top_k
    gen = torch.Generator(device="cpu").manual_seed(context)
    pages_per_req = context // b
    num_pages = batch * pages_per_req
    ws = [(torch.randn(batch * h * slots, b, d, device=device, dtype=DTYPE),
           torch.randn(batch * h * slots, b, d, device=device, dtype=DTYPE))
          for _ in range(s.layers)]  # fmt: skip
    summaries = []
    for _ in range(s.layers):
        low = torch.randn(num_pages, h, d, device=device, dtype=DTYPE)
        summaries.append((low, low + 1))
    tail_k = [torch.randn(batch * b, h, d, device=device, dtype=DTYPE) for _ in range(s.layers)]
    tail_v = [torch.randn(batch * b, h, d, device=device, dtype=DTYPE) for _ in range(s.layers)]
    slot_rows = torch.arange(batch * h * slots, device=device).view(batch, h, slots)
    tail_len = b // 2
    tail_locs = torch.arange(batch, device=device)[:, None] * b + torch.arange(tail_len, device=device)
    tail_valid = torch.ones(batch, 1, tail_len, dtype=torch.bool, device=device)
    new_locs = tail_locs[:, -1].contiguous()
    summary_locs = torch.arange(batch, device=device) * pages_per_req * b + tail_len - 1
    pages = torch.arange(num_pages, device=device).view(batch, pages_per_req)
    loads = batch * h * math.ceil(s.fetch_ratio * slots)
    host_tokens = min(num_pages * b, 1 << 16)
    host_k = torch.randn(host_tokens, h, d, device=device, dtype=DTYPE).cpu()
    host_v = torch.randn(host_tokens, h, d, device=device, dtype=DTYPE).cpu()
    if device == "cuda":
        host_k, host_v = host_k.pin_memory(), host_v.pin_memory()
    fetch_rows = torch.randperm(batch * h * slots, generator=gen)[:loads].to(device)
    fetch_pages = torch.randint(0, host_tokens // b, (loads,), generator=gen).to(device)
    fetch_heads = torch.randint(0, h, (loads,), generator=gen).to(device)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        tail_k[layer][new_locs] = k
        tail_v[layer][new_locs] = v
        kmin, kmax = summaries[layer]
        ws_k, ws_v = ws[layer]
        tk.update_page_summaries(kmin, kmax, summary_locs, k, b)
        out = tk.headwise_decode_attention(
            q[:, None], ws_k, ws_v, slot_rows, tail_k[layer], tail_v[layer], tail_locs, tail_valid, d**-0.5
        )
        scores = tk.score_paged_blocks(q[:, None], kmin, kmax, pages)[:, 0]
        scores.topk(slots, dim=-1)
        if fetch:
            tk.copy_blocks_to_slots(ws_k, ws_v, fetch_rows, host_k, host_v, fetch_pages, fetch_heads)
        return out[:, 0]

    return timed_step(stack, x, attend, device)


def decode_step_rows(stack: Stack, batch: int, contexts: list[int], device: str) -> list[dict]:
    s = stack.s
    x = torch.randn(batch, s.hidden, device=device, dtype=DTYPE)
    h, d, slots = s.kv_heads, s.head_dim, s.top_k
    results = []
    for context in contexts:
        torch.manual_seed(context)
        dense_eager, dense_ms, dense_graph = dense_step(stack, x, context, device)
        if device == "cuda":
            torch.cuda.empty_cache()
        sparse_eager, sparse_ms, sparse_graph = sparse_step(stack, x, context, device, fetch=False)
        _, fetch_ms, _ = sparse_step(stack, x, context, device, fetch=True)
        if device == "cuda":
            torch.cuda.empty_cache()
        num_pages = batch * context // s.block
        results.append({
            "context": context, "batch": batch, "cuda_graphs": dense_graph and sparse_graph,
            "dense_eager_ms": dense_eager, "sparse_eager_ms": sparse_eager,
            "dense_ms": dense_ms, "sparse_ms": sparse_ms, "sparse_fetch_ms": fetch_ms,
            "speedup": dense_ms / sparse_ms, "speedup_with_fetch": dense_ms / fetch_ms,
            "dense_kv_gib": 2 * s.layers * batch * h * context * d * 2 / 2**30,
            "sparse_device_gib": s.layers * (2 * batch * h * slots * s.block * d + 2 * num_pages * h * d) * 2 / 2**30,
        })  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="toy sizes (CPU: Triton interpreter)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--pipeline-steps", type=int, default=8, help="timed steps per pipeline mode")
    parser.add_argument("--step-batches", type=int, nargs="+", default=[1, 8, 32],
                        help="batches of the captured step (gpu_step.py)")  # fmt: skip
    parser.add_argument("--fake-cuda", action="store_true",
                        help="toy sizes of the captured step only, on a fake CUDA device (CPU): every device "
                        "mismatch, and any sync or copy in a replay, fails it")  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.fake_cuda:
        return fake_cuda_smoke(args.json)
    global DTYPE
    gpu_timing.QUICK = args.smoke
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        DTYPE = torch.float16
    shape = SMOKE_SHAPE if args.smoke else Shape()
    contexts = [128] if args.smoke else args.contexts
    batch = 2 if args.smoke else args.batch
    started = time.time()
    bw = copy_bandwidth(device, 0.01 if args.smoke else 2.0)
    kernels = kernel_rows(shape, batch, max(contexts), device, bw)
    stack = Stack(shape, device)
    steps = decode_step_rows(stack, batch, contexts, device)
    pipeline = pipeline_rows(stack, batch, contexts, device, 2 if args.smoke else args.pipeline_steps)

    def dense_ms(rows: int, context: int) -> float:
        return dense_step(
            stack, torch.randn(rows, shape.hidden, device=device, dtype=DTYPE), context, device
        )[1]

    captured = captured_rows(
        stack, [1, 2] if args.smoke else args.step_batches, contexts, device, dense_ms, shape.top_k,
        shape.fetch_ratio, 2 if args.smoke else 50,
    )  # fmt: skip
    report = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "bandwidth": bw,
        "kernels": kernels,
        "decode_steps": steps,
        "pipeline": pipeline,
        "captured_step": captured,
        "shape": shape.__dict__,
        "seconds": time.time() - started,
    }
    print(f"\n{report['device']}, torch {report['torch']}, triton {report['triton']}; copy bandwidth "
          + ", ".join(f"{k} {v:.0f}" for k, v in bw.items()))  # fmt: skip
    print(
        f"{'kernel':28} {'bytes':>11} {'triton ms':>10} {'torch ms':>10} {'floor ms':>9} {'floor share':>11} {'vs torch':>9} {'rel err':>8}  note"
    )
    for r in kernels:
        print(f"{r['kernel']:28} {r['bytes']:>11} {r['triton_ms']:>10.4f} {r['torch_ms']:>10.4f} {r['floor_ms']:>9.4f} "
              f"{r['floor_share']:>11.2f} {r['speedup_vs_torch']:>9.2f} {r['rel_err']:>8.1e}  {r['note']}")  # fmt: skip
    graphs = all(r["cuda_graphs"] for r in steps)
    print(
        f"\ndecode step, {shape.layers} layers, batch {batch}, K={shape.top_k}, {str(DTYPE)[6:]} random weights, "
        f"{'CUDA graph replays' if graphs else 'eager'} (eager dense/sparse ms: "
        + ", ".join(f"{r['dense_eager_ms']:.1f}/{r['sparse_eager_ms']:.1f}" for r in steps)
        + ")"
    )
    print(
        f"{'context':>8} {'dense ms':>9} {'sparse ms':>10} {'+fetch ms':>10} {'speedup':>8} {'w/ fetch':>9} {'dense KV GiB':>12} {'sparse dev GiB':>14}"
    )
    for r in steps:
        print(f"{r['context']:>8} {r['dense_ms']:>9.2f} {r['sparse_ms']:>10.2f} {r['sparse_fetch_ms']:>10.2f} "
              f"{r['speedup']:>8.2f} {r['speedup_with_fetch']:>9.2f} {r['dense_kv_gib']:>12.2f} {r['sparse_device_gib']:>14.2f}")  # fmt: skip
    print(
        f"\nprefetch pipeline in the step (runtime's PrefetchPipeline + BlockPrefetcher, host pool "
        f"{'pinned' if device == 'cuda' else 'in memory'}, cap {pipeline[0]['cap_per_head']} blocks per KV head, "
        "eager; ms per step)"
    )
    print(
        f"{'context':>8} {'mode':>6} {'step ms':>8} {'wait ms':>8} {'job ms':>8} {'loads':>7} {'deferred':>9} {'copies ok':>9}"
    )
    for r in pipeline:
        print(f"{r['context']:>8} {r['mode']:>6} {r['step_ms']:>8.2f} {r['wait_ms_per_step']:>8.2f} "
              f"{r['job_ms_per_step']:>8.2f} {r['loads_per_step']:>7.0f} {r['deferred_per_step']:>9.0f} "
              f"{r['copies_ok']!s:>9}")  # fmt: skip
    checks = captured["checks"]
    print(
        f"\ncaptured step (the runtime's DeviceTier and GraphedStep in the stack, gpu_step.py, K={shape.top_k}, cap "
        f"{shape.fetch_ratio:g} K, host tier {'page-locked, read in place' if checks['host_tier_device_view'] else 'not read in place'}); "
        f"replay = eager: {checks['replay_equals_eager']} (output rel err {checks['output_rel_err']:.1e}), "
        f"K covering vs SDPA rel err {checks['covering_rel_err']:.1e}"
    )  # fmt: skip
    print(f"{'context':>8} {'batch':>6} {'eager ms':>9} {'replay ms':>10} {'pass ms':>8} {'dense ms':>9} "
          f"{'replay/dense':>12} {'pass/dense':>10} {'host blocks':>11} {'host MB':>8} {'GB/s':>6}")  # fmt: skip
    for r in captured["rows"]:
        print(f"{r['context']:>8} {r['batch']:>6} {r['eager_ms']:>9.2f} {r['replay_ms']:>10.2f} {r['pass_ms']:>8.2f} "
              f"{r['dense_ms']:>9.2f} {r['replay_vs_dense']:>12.2f} {r['pass_vs_dense']:>10.2f} "
              f"{r['host_blocks_per_step']:>11.0f} {r['host_bytes_per_step'] / 1e6:>8.2f} {r['host_gbps']:>6.1f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def fake_cuda_smoke(json_path: str | None) -> None:
    """``--fake-cuda``: the runtime's step (gpu_step.py) at toy sizes on a fake CUDA device: the device
    tier, the page-locked host tier's view and ``GraphedStep`` as on a GPU, the values computed on CPU."""
    from sglang_oasis_testing.fake_cuda import FakeCuda

    shape = SMOKE_SHAPE
    with FakeCuda() as cuda:
        gpu_timing.FAKE = cuda
        stack = Stack(shape, "cuda")

        def dense_ms(rows: int, context: int) -> float:
            return dense_step(
                stack, torch.randn(rows, shape.hidden, device="cuda", dtype=DTYPE), context, "cuda"
            )[1]

        captured = captured_rows(stack, [1, 2], [128], "cuda", dense_ms, shape.top_k, shape.fetch_ratio, 2)
        gpu_timing.FAKE = None
    checks = captured["checks"]
    print(f"fake CUDA: replay = eager {checks['replay_equals_eager']} (rel err {checks['output_rel_err']:.1e}), "
          f"K covering vs SDPA {checks['covering_rel_err']:.1e}, host tier read in place "
          f"{checks['host_tier_device_view']}; rows: {[(r['batch'], r['host_blocks_per_step']) for r in captured['rows']]}")  # fmt: skip
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": "fake cuda", "captured_step": captured}, f, indent=2)


if __name__ == "__main__":
    main()
