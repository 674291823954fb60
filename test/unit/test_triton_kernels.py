"""Each Triton kernel of sgl-kernel-oasis against its torch reference on random inputs with awkward sizes
(lengths that are not multiples of the block size, one and many requests, GQA ratios 1, 3 and 7).

On CUDA the kernels run compiled; on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set by
test/conftest.py before Triton is first imported).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch

import sgl_kernel_oasis as reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 on the GPU only: the interpreter computes in numpy, whose stand-in for bf16 makes tl.dot inexact.
DTYPES = (
    [torch.float32, torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.float16]
)


def _load_kernels() -> ModuleType:
    pytest.importorskip("triton")
    if DEVICE == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1", "test/conftest.py turns the interpreter on for CPU"
    return importlib.import_module("sgl_kernel_oasis.triton_kernels")


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return _load_kernels()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


# --- summary update -------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("lengths", [[1], [37], [16, 3, 50, 9]])
@pytest.mark.parametrize("dtype", DTYPES)
def test_update_page_summaries(kernels, block_size: int, lengths: list[int], dtype: torch.dtype) -> None:
    """A prefill of several requests (shuffled locations, some starting mid-page as after a prefix hit),
    then decode appends one token at a time: the kernel's summaries equal the reference's exactly."""
    gen = _gen(block_size * 1000 + sum(lengths))
    heads, dim = 3, 40
    pages_per_req = max(lengths) // block_size + 4
    num_pages = pages_per_req * len(lengths) + 1
    page_order = torch.randperm(num_pages, generator=gen)
    kmin_ref = torch.randn(num_pages, heads, dim, generator=gen).to(dtype)
    kmax_ref = kmin_ref + 1
    kmin, kmax = kmin_ref.to(DEVICE), kmax_ref.to(DEVICE)

    def location(req: int, position: int) -> int:
        page = int(page_order[req * pages_per_req + position // block_size])
        return page * block_size + position % block_size

    def apply(locations: list[int]) -> None:
        locs = torch.tensor(locations, dtype=torch.int64)
        keys = torch.randn(len(locations), heads, dim, generator=gen)
        reference.update_page_summaries(kmin_ref, kmax_ref, locs, keys, block_size)
        kernels.update_page_summaries(kmin, kmax, locs.to(DEVICE), keys.to(DEVICE), block_size)
        assert torch.equal(kmin.cpu(), kmin_ref) and torch.equal(kmax.cpu(), kmax_ref)

    starts = [i % 2 * 3 for i in range(len(lengths))]  # odd requests start 3 tokens into a page
    prefill = [location(r, starts[r] + p) for r, n in enumerate(lengths) for p in range(n)]
    shuffled = torch.randperm(len(prefill), generator=gen).tolist()
    apply([prefill[i] for i in shuffled])
    for step in range(block_size + 2):
        apply([location(r, starts[r] + n + step) for r, n in enumerate(lengths)])


# --- block scoring --------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("num_blocks", [1, 70])
@pytest.mark.parametrize("dtype", DTYPES)
def test_score_paged_blocks(kernels, batch, group, rows, num_blocks, dtype) -> None:
    gen = _gen(batch * 100 + group * 10 + rows + num_blocks)
    kv_heads, dim, num_pages = 2, 48, 97
    query = torch.randn(batch, rows, kv_heads * group, dim, generator=gen).to(dtype)
    low = torch.randn(num_pages, kv_heads, dim, generator=gen)
    kmin, kmax = low.to(dtype), (low + torch.rand(num_pages, kv_heads, dim, generator=gen)).to(dtype)
    pages = torch.randint(0, num_pages, (batch, num_blocks), generator=gen)
    want = reference.score_paged_blocks(query.float(), kmin.float(), kmax.float(), pages)
    got = kernels.score_paged_blocks(query.to(DEVICE), kmin.to(DEVICE), kmax.to(DEVICE), pages.to(DEVICE))
    assert got.shape == (batch, rows, kv_heads, num_blocks) and got.dtype == torch.float32
    scale = want.abs().max().item() + 1
    torch.testing.assert_close(got.cpu() / scale, want / scale, **_tolerance(dtype))
    # The top-K it leads to: same score mass (ties may pick different blocks).
    k = min(8, num_blocks)
    assert torch.allclose(
        want.gather(-1, got.cpu().topk(k).indices).sum(-1), want.topk(k).values.sum(-1), rtol=1e-2, atol=1e-2
    )


# --- decode attention over the head-wise mapping -------------------------------------------------


def _attention_case(batch, rows, group, block, slots, tail, dtype, seed):
    gen = _gen(seed)
    kv_heads, dim = 2, 40
    ws_rows, pool_tokens = batch * kv_heads * slots + 3, 300
    query = torch.randn(batch, rows, kv_heads * group, dim, generator=gen).to(dtype)
    ws_k = torch.randn(ws_rows, block, dim, generator=gen).to(dtype)
    ws_v = torch.randn(ws_rows, block, dim, generator=gen).to(dtype)
    slot_rows = torch.randperm(ws_rows, generator=gen)[: batch * kv_heads * slots].view(
        batch, kv_heads, slots
    )
    empty = torch.rand(batch, kv_heads, slots, generator=gen) < 0.3
    slot_rows = torch.where(empty, -1, slot_rows)
    tail_k = torch.randn(pool_tokens, kv_heads, dim, generator=gen).to(dtype)
    tail_v = torch.randn(pool_tokens, kv_heads, dim, generator=gen).to(dtype)
    tail_locs = torch.randint(0, pool_tokens, (batch, tail), generator=gen)
    tail_valid = torch.rand(batch, rows, tail, generator=gen) < 0.7
    if tail:
        tail_valid[:, :, 0] = True  # every row sees a token even if all its slots are empty
    else:
        slot_rows[:, :, 0] = torch.arange(batch * kv_heads).view(batch, kv_heads) % ws_rows
    return query, ws_k, ws_v, slot_rows, tail_k, tail_v, tail_locs, tail_valid, dim**-0.5


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("group", [1, 3, 7])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize(("block", "slots", "tail"), [(16, 5, 9), (16, 1, 0), (5, 13, 70)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_headwise_decode_attention(kernels, batch, group, rows, block, slots, tail, dtype) -> None:
    case = _attention_case(
        batch, rows, group, block, slots, tail, dtype, seed=batch + group + rows + block + tail
    )
    want = reference.headwise_decode_attention(
        *[x.float() if x.is_floating_point() else x for x in case[:-1]], case[-1]
    )
    got = kernels.headwise_decode_attention(*[x.to(DEVICE) for x in case[:-1]], case[-1])
    assert got.dtype == dtype and got.shape == case[0].shape
    torch.testing.assert_close(got.cpu().float(), want, **_tolerance(dtype))


def test_headwise_reference_equals_gathered_attention() -> None:
    """The reference itself against ``sparse_decode_attention`` over explicitly gathered tokens."""
    query, ws_k, ws_v, slot_rows, tail_k, tail_v, tail_locs, tail_valid, scale = _attention_case(
        2, 2, 3, 16, 4, 6, torch.float32, seed=7
    )
    out = torch.empty_like(query)
    for b in range(2):
        for h in range(2):
            rows_h = [int(r) for r in slot_rows[b, h] if r >= 0]
            keys = torch.cat([ws_k[r] for r in rows_h] + [tail_k[tail_locs[b], h]])
            values = torch.cat([ws_v[r] for r in rows_h] + [tail_v[tail_locs[b], h]])
            for r in range(2):
                seen = torch.cat([torch.ones(len(rows_h) * 16, dtype=torch.bool), tail_valid[b, r]])
                for g in range(3):
                    q = query[b, r, h * 3 + g]
                    weights = torch.softmax((keys[seen] @ q) * scale, dim=0)
                    out[b, r, h * 3 + g] = weights @ values[seen]
    got = reference.headwise_decode_attention(
        query, ws_k, ws_v, slot_rows, tail_k, tail_v, tail_locs, tail_valid, scale
    )
    torch.testing.assert_close(got, out, rtol=1e-5, atol=1e-5)


# --- block copies ---------------------------------------------------------------------------------


@pytest.mark.parametrize("loads", [1, 37])
@pytest.mark.parametrize("block", [16, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_to_slots(kernels, loads: int, block: int, dtype: torch.dtype) -> None:
    gen = _gen(loads + block)
    heads, dim, num_pages, ws_rows = 3, 24, 50, 60
    k_buffer = torch.randn(num_pages * block, heads, dim, generator=gen).to(dtype)
    v_buffer = torch.randn(num_pages * block, heads, dim, generator=gen).to(dtype)
    ws_k_ref = torch.zeros(ws_rows, block, dim, dtype=dtype)
    ws_v_ref = torch.zeros(ws_rows, block, dim, dtype=dtype)
    dst = torch.randperm(ws_rows, generator=gen)[:loads]
    pages = torch.randint(0, num_pages, (loads,), generator=gen)
    heads_ = torch.randint(0, heads, (loads,), generator=gen)
    reference.copy_blocks_to_slots(ws_k_ref, ws_v_ref, dst, k_buffer, v_buffer, pages, heads_)
    ws_k, ws_v = ws_k_ref.new_zeros(ws_k_ref.shape).to(DEVICE), ws_v_ref.new_zeros(ws_v_ref.shape).to(DEVICE)
    kernels.copy_blocks_to_slots(
        ws_k,
        ws_v,
        dst.to(DEVICE),
        k_buffer.to(DEVICE),
        v_buffer.to(DEVICE),
        pages.to(DEVICE),
        heads_.to(DEVICE),
    )
    assert torch.equal(ws_k.cpu(), ws_k_ref) and torch.equal(ws_v.cpu(), ws_v_ref)
    assert int((ws_k_ref.abs().sum((1, 2)) > 0).sum()) == loads  # the reference copied something


@pytest.mark.skipif(DEVICE != "cuda", reason="pinned host memory is a CUDA feature")
def test_copy_from_pinned_host_memory(kernels) -> None:
    """The GPU layout of the host tier: the pool in pinned host memory, read by the kernel over the bus."""
    gen = _gen(3)
    block, heads, dim = 16, 8, 128
    k_buffer = torch.randn(64 * block, heads, dim, generator=gen).to(torch.bfloat16).pin_memory()
    v_buffer = torch.randn(64 * block, heads, dim, generator=gen).to(torch.bfloat16).pin_memory()
    dst = torch.arange(20)
    pages = torch.randint(0, 64, (20,), generator=gen)
    heads_ = torch.randint(0, heads, (20,), generator=gen)
    ws_k_ref = torch.zeros(20, block, dim, dtype=torch.bfloat16)
    ws_v_ref = torch.zeros_like(ws_k_ref)
    reference.copy_blocks_to_slots(ws_k_ref, ws_v_ref, dst, k_buffer, v_buffer, pages, heads_)
    ws_k, ws_v = ws_k_ref.new_zeros(ws_k_ref.shape).cuda(), ws_v_ref.new_zeros(ws_v_ref.shape).cuda()
    kernels.copy_blocks_to_slots(ws_k, ws_v, dst.cuda(), k_buffer, v_buffer, pages.cuda(), heads_.cuda())
    assert torch.equal(ws_k.cpu(), ws_k_ref) and torch.equal(ws_v.cpu(), ws_v_ref)


def test_ops_dispatch_follows_the_device() -> None:
    from sgl_kernel_oasis import ops

    assert not ops.uses_triton(torch.zeros(1))  # CPU tensors always take the reference
    if DEVICE == "cuda":
        assert ops.uses_triton(torch.zeros(1, device="cuda"))
