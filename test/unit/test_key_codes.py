"""Key codes (``sgl_kernel_oasis.key_codes``, ``memory/key_code_store.py``, ``--oasis-selector codes``):
the op against a reference written another way (float64, one query head at a time) on random inputs with
awkward sizes; the store codes each full page once per epoch; through the oasis backend's eager step a
request's next working set is the top-K of the reference's mass over SGLang's pool, which is not the
summaries' bound's; the options that cannot serve it are refused, naming them."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import test_decode_program as harness
import torch

from sgl_kernel_oasis import key_codes_cpu, score_blocks
from sgl_kernel_oasis.key_codes import (
    candidate_mass,
    candidate_mass_torch,
    coded_block_mass,
    coded_block_mass_reference,
    decode_key_codes,
    encode_key_codes,
)
from sglang_oasis.config import OasisConfig, OasisConfigError
from sglang_oasis.memory.device_layout import TierShape, layout
from sglang_oasis.memory.key_code_store import KeyCodeStore
from sglang_oasis.memory.summary_store import BlockSummaryStore


def boxes(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[pages, B, H, D]`` keys -> their pages' min and max ``[pages, H, D]``."""
    return keys.amin(dim=1), keys.amax(dim=1)


@pytest.mark.parametrize("dim", [4, 12, 20])
def test_codes_give_each_key_back_within_half_a_level(dim: int) -> None:
    generator = torch.Generator().manual_seed(dim)
    keys = torch.randn(7, 5, 3, dim, generator=generator) * 3
    keys[2, :, 1] = 0.5  # a box of zero width: every key is its min
    kmin, kmax = boxes(keys)
    codes = encode_key_codes(keys, kmin, kmax)
    assert codes.dtype == torch.uint8 and codes.shape == (7, 5, 3, dim // 4)
    decoded = decode_key_codes(codes, kmin, kmax)
    width = (kmax - kmin)[:, None]
    assert bool(((decoded - keys).abs() <= width / 6 + 1e-5).all())
    assert torch.equal(decoded[2, :, 1], keys[2, :, 1])
    corners = torch.where(keys > (kmin[:, None] + kmax[:, None]) / 2, kmax[:, None], kmin[:, None])
    torch.testing.assert_close(decode_key_codes(encode_key_codes(corners, kmin, kmax), kmin, kmax), corners)


def coded_pages(
    seed: int, pages: int, block: int, kv_heads: int, group: int, dim: int, batch: int, blocks: int
) -> tuple[torch.Tensor, ...]:
    """Random keys of ``pages`` pages, their boxes and codes, ``batch`` queries and each a random
    ``blocks`` of the pages: ``(keys, kmin, kmax, codes, query, page_ids)``."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(pages, block, kv_heads, dim, generator=generator)
    kmin, kmax = boxes(keys)
    query = torch.randn(batch, kv_heads * group, dim, generator=generator)
    page_ids = torch.stack([torch.randperm(pages, generator=generator)[:blocks] for _ in range(batch)])
    return keys, kmin, kmax, encode_key_codes(keys, kmin, kmax), query, page_ids


def test_coded_mass_equals_the_reference_with_awkward_sizes() -> None:
    kv_heads, group = 2, 3
    keys, kmin, kmax, codes, query, page_ids = coded_pages(0, 13, 5, kv_heads, group, 12, batch=4, blocks=7)
    full = torch.tensor([7, 0, 3, 1])
    got = coded_block_mass(query, kmin, kmax, codes, page_ids, full, 0.37)
    expected = coded_block_mass_reference(query, kmin, kmax, keys, page_ids, full, 0.37)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], torch.zeros(kv_heads, 7)) and bool((got[2, :, 3:] == 0).all())
    torch.testing.assert_close(got.sum(-1)[[0, 2, 3]], torch.full((3, kv_heads), float(group)))
    alone = coded_block_mass(query[2:3], kmin, kmax, codes, page_ids[2:3], full[2:3], 0.37)
    assert torch.equal(alone[0], got[2])  # a request's scores do not depend on its batch
    # boxes in float64: not the CPU kernel's (one call for the batch) but the torch form's, row by row
    by_rows = coded_block_mass(query, kmin.double(), kmax.double(), codes, page_ids, full, 0.37)
    torch.testing.assert_close(by_rows, got, rtol=1e-5, atol=1e-6)


def test_candidate_mass_equals_the_reference_and_scores_only_candidates() -> None:
    """``--oasis-code-candidates``: each KV head's softmax over its own candidate blocks (different per
    head, rows padded with -1) equals the float64 definition, and no other block scores; a row whose
    candidates are all its full blocks scores as without candidates."""
    kv_heads, group = 3, 2
    keys, kmin, kmax, codes, query, page_ids = coded_pages(1, 17, 3, kv_heads, group, 8, batch=3, blocks=9)
    generator = torch.Generator().manual_seed(2)
    full = torch.tensor([9, 6, 4])
    candidates = torch.full((3, kv_heads, 5), -1)
    for head in range(kv_heads):
        candidates[0, head] = torch.randperm(9, generator=generator)[:5]
        candidates[1, head, :2] = torch.randperm(6, generator=generator)[:2]
    candidates[2, :, :4] = torch.arange(4)
    got = coded_block_mass(query, kmin, kmax, codes, page_ids, full, 0.5, candidates)
    expected = coded_block_mass_reference(query, kmin, kmax, keys, page_ids, full, 0.5, candidates)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for row, count in ((0, 5), (1, 2)):
        scored = got[row] > 0
        assert torch.equal(scored.sum(-1), torch.full((kv_heads,), count))
        for head in range(kv_heads):
            wanted = set(candidates[row, head, :count].tolist())
            assert set(scored[head].nonzero().flatten().tolist()) == wanted
    torch.testing.assert_close(got.sum(-1), torch.full((3, kv_heads), float(group)))
    whole = coded_block_mass(query[2:], kmin, kmax, codes, page_ids[2:], full[2:], 0.5)
    torch.testing.assert_close(got[2], whole[0])
    alone = coded_block_mass(query[1:2], kmin, kmax, codes, page_ids[1:2], full[1:2], 0.5, candidates[1:2])
    assert torch.equal(alone[0], got[1])  # in a batch or alone, the same scores


def test_corner_keys_give_the_exact_attention_mass() -> None:
    """Keys at their box's corners (each channel its block's min or max) code exactly: the mass is the
    query's true attention mass per block."""
    generator = torch.Generator().manual_seed(1)
    low, high = (
        torch.randn(6, 1, 2, 8, generator=generator),
        torch.rand(6, 1, 2, 8, generator=generator) + 0.1,
    )
    keys = torch.where(torch.rand(6, 4, 2, 8, generator=generator) < 0.5, low, low + high)
    keys[:, 0], keys[:, 1] = low[:, 0], (low + high)[:, 0]  # every box spans low .. low + high
    query = torch.randn(1, 4, 8, generator=generator)
    mass = coded_block_mass(
        query,
        *boxes(keys),
        encode_key_codes(keys, *boxes(keys)),
        torch.arange(6)[None],
        torch.tensor([6]),
        0.5,
    )
    for head in range(2):
        logits = torch.einsum("gd,td->gt", query[0, 2 * head : 2 * head + 2], keys[:, :, head].reshape(-1, 8))
        exact = (logits * 0.5).softmax(-1).view(2, 6, 4).sum(dim=(0, 2))
        torch.testing.assert_close(mass[0, head], exact, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("dim", "group", "block", "box_dtype"),
    [
        (12, 1, 5, torch.float32),
        (20, 3, 16, torch.bfloat16),
        (64, 7, 3, torch.float32),
        (8, 2, 1, torch.bfloat16),
    ],
    ids=["d12-g1-b5-f32", "d20-g3-b16-bf16", "d64-g7-b3-f32", "d8-g2-b1-bf16"],
)
def test_the_cpu_kernel_equals_the_torch_form_and_the_reference(
    dim: int, group: int, block: int, box_dtype: torch.dtype
) -> None:
    """``candidate_mass`` on CPU (``key_codes_cpu.py``, numba) against ``candidate_mass_torch`` and the
    float64 reference: boxes in float32 and bfloat16 (read as their bits), a box of zero width, validity
    per head and for every head, a row with no valid candidate, codes that are a strided view; and the
    same under ``torch.compile`` (the captured step calls it as an opaque op)."""
    kv_heads, batch, width = 3, 3, 11
    keys, _, _, _, query, page_ids = coded_pages(dim, 23, block, kv_heads, group, dim, batch, width)
    keys = keys.to(box_dtype).float()
    keys[4, :, 1] = keys[4, 0, 1].clone()  # a box of zero width
    kmin, kmax = (bound.to(box_dtype) for bound in boxes(keys))
    codes = encode_key_codes(keys, kmin.float(), kmax.float())
    strided = torch.stack([codes, codes.flip(0)], dim=1)[:, 0]  # a view with strides of its own
    assert not strided.is_contiguous() and torch.equal(strided, codes)
    generator = torch.Generator().manual_seed(dim + 1)
    page = torch.stack([page_ids[:, torch.randperm(width, generator=generator)] for _ in range(kv_heads)], 1)
    per_head = torch.rand(batch, kv_heads, width, generator=generator) < 0.6
    per_head[2] = False  # no valid candidate: every block scores 0
    assert key_codes_cpu.supports(query, kmin)
    for valid in (None, per_head, per_head[:, :1]):
        got = candidate_mass(query, kmin, kmax, strided, page, valid, 0.3)
        torch.testing.assert_close(got, candidate_mass_torch(query, kmin, kmax, codes, page, valid, 0.3))
    torch._dynamo.reset()  # a graph of its own per case, within torch's recompile limit
    compiled = torch.compile(candidate_mass, fullgraph=True, dynamic=True)
    expected_mass = candidate_mass(query, kmin, kmax, strided, page, per_head, 0.3)
    torch.testing.assert_close(compiled(query, kmin, kmax, strided, page, per_head, 0.3), expected_mass)
    full = torch.full((batch,), width)
    expected = coded_block_mass_reference(query, kmin.float(), kmax.float(), keys, page_ids, full, 0.3)
    got = coded_block_mass(query, kmin, kmax, strided, page_ids, full, 0.3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(
        candidate_mass(query, kmin, kmax, codes, page, per_head, 0.3)[2], torch.zeros(3, width)
    )
    stray = page.clone()
    stray[0, 0, 0] = codes.shape[0]  # past the last page: refused, not read (the kernel has no bounds checks)
    with pytest.raises(IndexError, match="outside"):
        candidate_mass(query, kmin, kmax, codes, stray, None, 0.3)
    stray[0, 0, 0] = -1
    with pytest.raises(IndexError, match="outside"):
        candidate_mass(query, kmin, kmax, codes, stray, None, 0.3)
    masked = per_head.clone()
    masked[0, 0, 0] = False  # an invalid candidate's page is never read: any value passes
    stray[0, 0, 0] = 10**6
    torch.testing.assert_close(
        candidate_mass(query, kmin, kmax, codes, stray, masked, 0.3),
        candidate_mass(query, kmin, kmax, codes, page, masked, 0.3),
    )


class Pool:
    """What the store reads of SGLang's pool: its key buffers, ``[tokens, kv_heads, dim]`` per layer."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys, self.reads = keys, 0

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        self.reads += 1
        return self.keys[layer]


def test_the_store_codes_a_page_once_per_epoch() -> None:
    block, pages, heads, dim = 4, 6, 2, 8
    keys = torch.randn(2, pages * block, heads, dim, generator=torch.Generator().manual_seed(2))
    summaries = BlockSummaryStore(2, pages, heads, dim, block, torch.float32, "cpu")
    for layer in range(2):
        summaries.update(layer, torch.arange(pages * block), keys[layer])
    store, pool = KeyCodeStore(summaries, 2, pages, heads, dim, "cpu"), Pool(keys)
    assert store.ensure(1, torch.tensor([[3, 1], [1, 4]]), pool) == 3
    by_page = keys[1].view(pages, block, heads, dim)
    expected = encode_key_codes(by_page[[1, 3, 4]], *boxes(by_page[[1, 3, 4]]))
    assert torch.equal(store.codes[1, [1, 3, 4]], expected) and not bool(store.codes[0].any())
    assert store.ensure(1, torch.tensor([4, 1]), pool) == 0 and pool.reads == 1  # coded at this epoch
    keys[1, 4 * block : 5 * block] += 5  # page 4 recycled: its first token restarts its summary and epoch
    summaries.update(0, torch.arange(4 * block, 5 * block), keys[0, 4 * block : 5 * block])
    summaries.update(1, torch.arange(4 * block, 5 * block), keys[1, 4 * block : 5 * block])
    assert store.ensure(1, torch.tensor([1, 4]), pool) == 1
    assert torch.equal(store.codes[1, 4], encode_key_codes(by_page[4:5], *boxes(by_page[4:5]))[0])


@pytest.mark.parametrize("candidates", [0, 2])
def test_through_the_backend_the_next_working_set_is_the_coded_mass_top_k(candidates: int) -> None:
    """An eager decode step with ``--oasis-selector codes`` (no cap, K = 6 of 18-62 blocks): each request's
    next working set per KV head holds the top-K blocks of its query's mass over its coded keys in
    SGLang's pool, this step's token included; the summaries' bound would have chosen others. With
    ``--oasis-code-candidates 2`` the mass is each head's softmax over its 12 best blocks by the bound
    alone; every full block's page is coded either way (the captured step may score any)."""
    config, _, _ = harness.configs("k_sparse_uncapped")
    config = dataclasses.replace(config, selector="codes", code_candidates=candidates)
    oasis = harness.admitted(config, {}, {})
    assert oasis.tier.codes is not None
    store = oasis.tier.codes.coded[harness.SPARSE_LAYER]
    coded = set((store >= 0).nonzero().flatten().tolist())  # by the admission's selection
    harness.eager_step(oasis, 0)
    oasis.selector.finish_pending()
    q = harness.step_inputs(0)[0]
    pool, req_to_token = oasis.token_to_kv_pool, oasis.req_to_token_pool.req_to_token
    ws, differs = oasis.tier.working_sets, 0
    for row, (req, context) in enumerate(zip(harness.REQS, harness.CONTEXTS, strict=True)):
        full = (context + 1) // harness.BLOCK
        pages = (req_to_token[req, 0 : full * harness.BLOCK : harness.BLOCK].long() // harness.BLOCK)[None]
        by_page = pool.k[harness.SPARSE_LAYER].view(-1, harness.BLOCK, harness.KV_HEADS, q.shape[-1])
        kmin, kmax = boxes(by_page)
        bound = score_blocks(q[row : row + 1], kmin[pages[0]], kmax[pages[0]])[0]
        chosen = bound.topk(2 * 6).indices[None] if candidates else None  # [1, H, 12]
        mass = coded_block_mass_reference(
            q[row : row + 1], kmin, kmax, by_page, pages, torch.tensor([full]), harness.SCALE, chosen
        )[0]
        coded |= set(pages[0].tolist())
        held = ws.slot_block[
            oasis.tier.slot(req), harness.SPARSE_LAYER
        ]  # [H, slots]: logical block ids, -1 empty
        for head in range(harness.KV_HEADS):
            expected = set(mass[head].topk(6).indices.tolist())
            assert set(held[head][held[head] >= 0].tolist()) == expected, (req, head)
            differs += expected != set(bound[head].topk(6).indices.tolist())
    assert differs > 0
    assert set((store >= 0).nonzero().flatten().tolist()) == coded
    harness.stop(oasis)


def test_keys_folded_in_late_are_coded_at_once() -> None:
    """A request whose keys reach the summaries late (a PD arrival, a resumed retracted request: its
    summarised position restarted) has its full blocks coded by the catch-up itself, since the captured
    step codes only the blocks its own tokens fill."""
    config, _, _ = harness.configs("k_sparse_uncapped")
    oasis = harness.admitted(dataclasses.replace(config, selector="codes"), {}, {})
    codes, layer = oasis.tier.codes, harness.SPARSE_LAYER
    assert codes is not None
    req, context = harness.REQS[2], harness.CONTEXTS[2]
    table = oasis.req_to_token_pool.req_to_token
    pages = table[req, 0 : context // harness.BLOCK * harness.BLOCK : harness.BLOCK].long() // harness.BLOCK
    oasis.tier.summaries.recycle(pages)  # its pages hold other KV now: every code stale
    assert not bool((codes.coded[layer, pages] == oasis.tier.summaries.epoch[pages]).any())
    oasis.intake.restart(req)
    oasis.set_batch([req])
    oasis.intake.catch_up(oasis.batch, layer, torch.tensor([context]))
    assert torch.equal(codes.coded[layer, pages], oasis.tier.summaries.epoch[pages])
    harness.stop(oasis)


def test_codes_take_their_bytes_from_the_device_budget() -> None:
    config = OasisConfig(selector="codes", device_kv_tokens=100_000)
    shape = TierShape.of(config, num_layers=30, num_kv_heads=3, head_dim=64, element_bytes=2, host_pages=1000)
    plain = TierShape.of(dataclasses.replace(config, selector="summaries"), 30, 3, 64, 2, 1000)
    assert shape.key_codes and not plain.key_codes
    with_codes, without = layout(10**9, shape), layout(10**9, plain)
    assert with_codes.summary_bytes - without.summary_bytes == 30 * 1000 * 16 * 3 * 16
    assert with_codes.request_slots <= without.request_slots


def test_what_cannot_serve_codes_is_refused() -> None:
    assert not OasisConfig(selector="codes").oracle  # a serving mode, not the evaluation-only oracle
    assert OasisConfig(selector="codes", decode_step="captured").decode_step == "captured"  # served since
    with pytest.raises(OasisConfigError, match=r"--oasis-code-candidates: needs --oasis-selector codes"):
        OasisConfig(selector="summaries", code_candidates=4)
    with pytest.raises(OasisConfigError, match=r"--oasis-code-candidates: must be >= 0"):
        OasisConfig(selector="codes", code_candidates=-1)
    with pytest.raises(ValueError, match="head_dim 6"):
        KeyCodeStore(SimpleNamespace(block_size=4), 1, 2, 1, 6, "cpu")  # type: ignore[arg-type]
