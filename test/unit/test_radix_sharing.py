"""Pages shared through SGLang's radix cache, against our per-page summaries and per-slot working sets.

In sparse mode SGLang's KV pool is the host tier (page = block = 16 tokens), and SGLang's radix cache
hands one set of pages to every request that matches a cached prefix, with its own reference counts
(``lock_ref``) and LRU eviction. ``BlockSummaryStore`` keys summaries by page and ``WorkingSetPool``
keys working sets by request slot and generation; this drives SGLang 0.5.23's real memory machinery
through request lifecycles (hypothesis state machine plus two exact cases) and checks both stay right.
Each machine run starts from a cache that finished requests filled to half the pool or more, so
allocations evict from it.

Real SGLang objects, nothing of the radix cache re-implemented (paths under ``sglang/srt/``):

- ``PagedTokenToKVPoolAllocator`` (mem_cache/allocator/paged.py:136), 24 pages of 16 on CPU. It gets
  ``kvcache=None``: the allocator only hands out indices, the KV tensors are this test's fake per-token
  keys/values (each key encodes its token id and position). ``use_triton_kernels`` is forced off: the
  index tensors are on the CPU, so SGLang's own torch path (``alloc_extend_naive``) runs on any machine.
- ``ReqToTokenPool`` (mem_cache/memory_pool.py:376): 4 request slots, generation bumped per allocation.
- ``RadixCache`` (mem_cache/radix_cache.py:281) from ``CacheInitParams`` (mem_cache/cache_init_params.py:20)
  with the fields ``kv_cache_builder.build_kv_cache`` sets (page size 16, LRU). The scheduler of 0.5.23
  builds ``UnifiedRadixCache`` by default (mem_cache/registry.py ``default_radix_cache_factory`` ->
  ``create_unified_radix_cache``), so the state machine also runs on that one (tree components FULL)
  with the invariants its public API allows.
- ``Req`` (managers/schedule_batch.py:1033) with its real ``ReqKvInfo``.

Scheduler steps, called as SGLang's scheduler calls them:

- admission: ``Req.init_next_round_input(tree_cache)`` (schedule_batch.py:1692 -> common.match_kv_cache
  -> ``match_prefix``), ``tree_cache.lock(req.last_node)`` (managers/schedule_policy.py:1690),
  ``alloc_req_slots`` (mem_cache/allocation.py:327), ``prefix_device_indices`` (base_prefix_cache.py:563,
  as ``_prefix_kv_indices`` reads it), ``alloc_paged_token_slots_extend`` (allocation.py:175, which evicts
  from the tree when the allocator is short), the rows written as ``write_cache_indices``' torch branch
  does and the kv lengths set as ``alloc_for_extend`` does (allocation.py:89-104, 483-485);
- after each prefill chunk of an unfinished request: ``checkpoint_kv_cache`` (common.py:271; called from
  batch_result_processor.py:394 and scheduler.py:3776): the page-aligned prefix goes into the tree, the
  request's duplicate pages are freed and its row repointed to the tree's; later chunks of a chunked
  prompt: ``init_next_round_input()`` without a tree (scheduler.py:4177), prefix read off the row;
- decode: ``alloc_paged_token_slots_decode`` (allocation.py:572) and the row write of
  ``alloc_for_decode_default`` (allocation.py:663);
- finish / abort: ``req.to_finish`` + ``update_finish_state`` (schedule_batch.py:2007), then
  ``release_kv_cache(req, tree_cache, checkpoint=True / False)`` (common.py:400; batch_result_processor.py
  :387, scheduler.py:3819): the insert as the old ``cache_finished_req`` did, unlock, slot freed;
- evict: ``tree_cache.evict(EvictParams(num_tokens=n))`` (radix_cache.py:552).

The one stand-in: ``release_kv_cache`` and ``Req.owned_kv_len`` read two leaves of SGLang's published
server config (``get_spec().speculative_algorithm``, ``get_serving().strip_thinking_cache``), which only a
launched server publishes; ``scheduler_config()`` patches those accessors with the defaults (None, False)
for the duration of a release.

Our side, as ``oasis_backend`` does it: a forward writes the new keys at ``out_cache_loc`` and folds them
into ``BlockSummaryStore.update`` (``_summarise``); at every extend the request slot is claimed with its
generation (``init_forward_metadata``); selections plan into ``WorkingSetPool`` and load blocks from the
host pages ``req_to_token[slot, 0:N*B:B] // B`` (``_select`` / ``_run_job``).
"""

from __future__ import annotations

import contextlib
import random
import sys
from array import array
from collections import Counter
from collections.abc import Iterator, Sequence
from types import SimpleNamespace
from unittest import mock

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sglang.srt.managers import schedule_batch
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req
from sglang.srt.mem_cache import common
from sglang.srt.mem_cache.allocation import (
    alloc_paged_token_slots_decode,
    alloc_paged_token_slots_extend,
    alloc_req_slots,
)
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_oasis.memory.summary_store import BlockSummaryStore
from sglang_oasis.memory.working_set import EMPTY, WorkingSetPool

PAGE = 16  # page size = block size
POOL_PAGES = 24  # pages 1..24 (SGLang keeps page 0 as padding): small, so allocations evict
MAX_REQS = 4
MAX_CONTEXT = 256
LAYERS, HEADS, DIM, SLOTS = 2, 2, 4, 3
CODE = 512  # key = (token * CODE + position) * sign * (layer + 1): exact in float32, decodable
SIGNS = torch.tensor([[1.0, -1.0, 1.0, -1.0], [-1.0, 1.0, 1.0, -1.0]])  # [HEADS, DIM]

BASE = [(i * 37) % 997 + 1 for i in range(64)]
PREFIXES = (
    [],  # nothing shared
    BASE[:40],  # 2 full pages + 8 tokens of a third
    BASE[:40],  # (twice: more sharing)
    [*BASE[:24], 700, 701, 702],  # diverges inside page 1: shares page 0 only
    [*BASE[:32], 800, 801, 802, 803, 804],  # diverges exactly at a page boundary
    BASE[:57],  # 3 full pages + 9
)


def fake_keys(layer: int, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """``[n, HEADS, DIM]``: the key of ``tokens[i]`` at ``positions[i]`` (each dim carries both, signed)."""
    code = torch.tensor(list(tokens), dtype=torch.float32) * CODE + torch.tensor(
        list(positions), dtype=torch.float32
    )
    return code[:, None, None] * SIGNS * (layer + 1)


def fake_values(layer: int, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    return fake_keys(layer, tokens, positions) + 0.5


@contextlib.contextmanager
def scheduler_config() -> Iterator[None]:
    """The two server-config leaves ``release_kv_cache`` reads, at their defaults (see the docstring)."""
    config = SimpleNamespace(speculative_algorithm=None, strip_thinking_cache=False)
    with (
        mock.patch.object(common, "get_spec", lambda: config),
        mock.patch.object(common, "get_serving", lambda: config),
        mock.patch.object(schedule_batch, "get_serving", lambda: config),
    ):
        yield


class Harness:
    """SGLang's allocator, request pool and tree cache, our summary store and working sets, fake KV."""

    def __init__(self, unified: bool = False) -> None:
        self.unified = unified
        self.allocator = PagedTokenToKVPoolAllocator(
            POOL_PAGES * PAGE,
            page_size=PAGE,
            dtype=torch.float32,
            device="cpu",
            kvcache=None,
            need_sort=False,
        )
        self.allocator.use_triton_kernels = False  # CPU index tensors: SGLang's torch path
        self.req_pool = ReqToTokenPool(
            size=MAX_REQS, max_context_len=MAX_CONTEXT, device="cpu", enable_memory_saver=False
        )
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=PAGE,
        )
        if unified:
            params.tree_components = (ComponentType.FULL,)
            self.tree: RadixCache | UnifiedRadixCache = UnifiedRadixCache(params)
        else:
            self.tree = RadixCache(params)
        # As OasisAttnBackend sizes them: pool.size // B + 2 pages, req_to_token rows request slots.
        self.summaries = BlockSummaryStore(LAYERS, POOL_PAGES + 2, HEADS, DIM, PAGE, torch.float32, "cpu")
        self.working_sets = WorkingSetPool(
            MAX_REQS + 1, LAYERS, HEADS, DIM, SLOTS, PAGE, torch.float32, "cpu"
        )
        tokens = (POOL_PAGES + 1) * PAGE
        self.k = torch.full((LAYERS, tokens, HEADS, DIM), float("nan"))  # never-written slots read as NaN
        self.v = torch.full_like(self.k, float("nan"))
        self.live: dict[int, Req] = {}  # request slot -> request
        self.seed: dict[str, int] = {}
        self.matched: dict[str, int] = {}  # rid -> prefix length the radix cache matched at admission
        self.step = 0
        self.count = 0

    # --- scheduler ------------------------------------------------------------------------------

    def admit(self, prompts: Sequence[tuple[list[int], int, int | None]], rnd: random.Random) -> list[Req]:
        """One prefill batch of ``(token ids, sampling seed, chunk size or None)``. Returns the admitted
        requests: none if the pool cannot hold the first chunks even after evicting (the scheduler would
        leave them waiting)."""
        reqs = []
        for ids, seed, _ in prompts:
            self.count += 1
            req = Req(f"r{self.count}", "", array("q", ids), SamplingParams(max_new_tokens=MAX_CONTEXT))
            req.init_next_round_input(self.tree)
            req.lock = self.tree.lock(req.last_node)
            self.seed[req.rid], self.matched[req.rid] = seed, req.prefix_len
            reqs.append(req)
        ends = [self._chunk_end(req, chunk) for req, (_, _, chunk) in zip(reqs, prompts, strict=True)]
        if len(reqs) > self.req_pool.available_size() or not self._fits(reqs, ends):
            for req in reqs:
                self.tree.unlock(req.lock)
                req.lock = None
            return []
        prefixes = [
            self.tree.prefix_device_indices(req) if req.prefix_len else torch.empty(0, dtype=torch.int64)
            for req in reqs
        ]
        for req, slot in zip(reqs, alloc_req_slots(self.req_pool, reqs, self.tree), strict=True):
            self.live[slot] = req
        self._extend(reqs, prefixes, ends, rnd)
        admitted = []
        for req, (_, _, chunk) in zip(reqs, prompts, strict=True):
            while req.kv.holds_kv and req.extend_end < len(req.origin_input_ids):
                req.init_next_round_input()  # the chunked request's next round keeps its prefix
                end = self._chunk_end(req, chunk)
                if not self._fits([req], [end]):
                    self.release(req, finished=False)  # (the scheduler would wait; abort it instead)
                    break
                row = self.req_pool.req_to_token[req.kv.req_pool_idx, : req.prefix_len].to(torch.int64)
                self._extend([req], [row], [end], rnd)
            if req.kv.holds_kv:
                admitted.append(req)
        return admitted

    def _chunk_end(self, req: Req, chunk: int | None) -> int:
        total = len(req.origin_input_ids)
        return total if chunk is None else min(total, req.prefix_len + chunk)

    def _fits(self, reqs: Sequence[Req], ends: Sequence[int]) -> bool:
        pages = sum(-(-end // PAGE) - -(-req.prefix_len // PAGE) for req, end in zip(reqs, ends, strict=True))
        return pages * PAGE <= self.allocator.available_size() + self.tree.evictable_size()

    def _extend(
        self, reqs: Sequence[Req], prefixes: Sequence[torch.Tensor], ends: Sequence[int], rnd: random.Random
    ) -> None:
        """Allocate, write the rows, run the 'forward' (claim, keys, summaries, first selection), then
        the result processing: sample after the last chunk, checkpoint into the tree."""
        starts = [req.prefix_len for req in reqs]
        prefix_lens = torch.tensor(starts, dtype=torch.int64)
        seq_lens = torch.tensor(ends, dtype=torch.int64)
        last_loc = torch.cat(
            [p[-1:].to(torch.int64) if len(p) else torch.full((1,), -1, dtype=torch.int64) for p in prefixes]
        )
        out = alloc_paged_token_slots_extend(
            self.tree,
            prefix_lens,
            prefix_lens,
            seq_lens,
            seq_lens,
            last_loc,
            int((seq_lens - prefix_lens).sum()),
        )
        offset = 0
        for req, prefix, start, end in zip(reqs, prefixes, starts, ends, strict=True):
            slot = req.kv.req_pool_idx
            self.req_pool.write((slot, slice(0, start)), prefix)
            self.req_pool.write((slot, slice(start, end)), out[offset : offset + end - start])
            req.kv.kv_allocated_len = req.kv.kv_committed_len = end
            req.extend_end = end
            # forward: the backend claims the slot for this generation, writes keys, then selects
            generation = int(self.req_pool.req_generation[slot])
            previous = self.working_sets.owner[slot]
            cleared = self.working_sets.claim(slot, generation)
            assert cleared == (previous != generation)
            if cleared:  # a new owner: nothing of the previous one survives
                assert self.working_sets.resident_blocks([slot]) == 0
                assert int(self.working_sets.covered[slot].abs().sum()) == 0
            self._write(req, start, end, out[offset : offset + end - start])
            self.select(req, rnd, admission=True)
            offset += end - start
        for req in reqs:
            if req.extend_end == len(req.origin_input_ids):
                req.output_ids.append(self._sample(req))
            checkpoint_kv_cache(req, self.tree)

    def decode(self, req: Req, steps: int, rnd: random.Random) -> None:
        for _ in range(steps):
            seq = req.kv.kv_committed_len
            if seq + 2 >= MAX_CONTEXT or self.allocator.available_size() + self.tree.evictable_size() < PAGE:
                return  # (the scheduler would retract)
            slot = req.kv.req_pool_idx
            last_loc = self.req_pool.req_to_token[slot, seq - 1 : seq].to(torch.int64)
            next_lens = torch.tensor([seq + 1])
            loc = alloc_paged_token_slots_decode(self.tree, next_lens, next_lens, last_loc)
            self.req_pool.write((torch.tensor([slot]), torch.tensor([seq])), loc.to(torch.int32))
            req.kv.kv_allocated_len += 1
            self._write(req, seq, seq + 1, loc)  # the KV of the last sampled token
            req.kv.kv_committed_len += 1
            req.output_ids.append(self._sample(req))
        self.select(req, rnd, admission=False)

    def release(self, req: Req, finished: bool) -> None:
        slot = req.kv.req_pool_idx
        req.to_finish = FINISH_LENGTH(length=len(req.output_ids)) if finished else FINISH_ABORT()
        req.update_finish_state()
        with scheduler_config():
            release_kv_cache(req, self.tree, checkpoint=finished)
        del self.live[slot]
        assert req.lock is None and not req.kv.holds_kv and slot in self.req_pool.free_slots

    def evict(self, num_tokens: int) -> None:
        evictable, available = self.tree.evictable_size(), self.allocator.available_size()
        evicted = self.tree.evict(EvictParams(num_tokens=num_tokens)).num_tokens_evicted
        assert evicted >= min(num_tokens, evictable) and evicted % PAGE == 0
        assert self.tree.evictable_size() == evictable - evicted
        assert self.allocator.available_size() == available + evicted

    def _sample(self, req: Req) -> int:
        """Deterministic 'sampling': requests with the same prompt and seed generate the same tokens."""
        fill = self._fill(req)
        return (fill[-1] * 31 + len(fill) * 7 + self.seed[req.rid] * 13) % 997 + 1

    @staticmethod
    def _fill(req: Req) -> list[int]:
        return [*req.origin_input_ids, *req.output_ids]

    # --- the backend ----------------------------------------------------------------------------

    def _write(self, req: Req, start: int, end: int, locations: torch.Tensor) -> None:
        """A forward's KV write at ``out_cache_loc`` and ``_summarise``."""
        tokens, positions = self._fill(req)[start:end], range(start, end)
        locations = locations.to(torch.int64)
        for layer in range(LAYERS):
            keys = fake_keys(layer, tokens, positions)
            self.k[layer, locations] = keys
            self.v[layer, locations] = fake_values(layer, tokens, positions)
            self.summaries.update(layer, locations, keys)

    def select(self, req: Req, rnd: random.Random, admission: bool) -> None:
        """``_select`` / ``_run_job`` for one request: every full block if they fit (a stand-in for the
        top-K of the scores otherwise: a random choice), capped and prioritised at decode."""
        slot = req.kv.req_pool_idx
        full = req.kv.kv_committed_len // PAGE
        self.step += 1
        reqs = torch.tensor([slot])
        if full == 0:
            self.working_sets.covered[reqs] = 0
            return
        row = self.req_pool.req_to_token[slot]
        pages = row[0 : full * PAGE : PAGE].to(torch.int64)[None] // PAGE  # [1, N] host page per block
        for layer in range(LAYERS):
            selected = torch.zeros((1, HEADS, full), dtype=torch.bool)
            for head in range(HEADS):
                chosen = range(full) if full <= SLOTS else rnd.sample(range(full), rnd.randint(1, SLOTS))
                selected[0, head, list(chosen)] = True
            fresh_from = None if admission else self.working_sets.covered[reqs, layer].clone()
            cap = None if admission else rnd.choice([None, 0, 1, 2])
            priority = torch.tensor([[[rnd.random() for _ in range(full)] for _ in range(HEADS)]])
            self.working_sets.covered[reqs, layer] = full
            plan = self.working_sets.plan_selections(
                reqs, layer, selected, self.step, cap, fresh_from, priority
            )
            self.working_sets.load(plan, reqs, layer, pages, self.k[layer], self.v[layer])

    # --- invariants -----------------------------------------------------------------------------

    def nodes(self) -> Iterator[tuple[TreeNode, int]]:
        """Every RadixCache node but the root, with the position its key starts at."""
        assert isinstance(self.tree, RadixCache)
        stack = [(child, 0) for child in self.tree.root_node.children.values()]
        while stack:
            node, depth = stack.pop()
            yield node, depth
            stack.extend((child, depth + len(node.key)) for child in node.children.values())

    def row(self, req: Req) -> torch.Tensor:
        return self.req_pool.req_to_token[req.kv.req_pool_idx, : req.kv.kv_allocated_len].to(torch.int64)

    def check(self) -> None:
        tree, allocator = self.tree, self.allocator
        holder: dict[int, str] = {}

        def hold(pages: Sequence[int], who: str) -> None:
            for page in pages:
                assert page not in holder, f"page {page} held by {holder[page]} and by {who}"
                holder[page] = who

        # Pages: free, in the tree, or a live request's own (past its tree-owned prefix); never two.
        free = allocator.get_all_free_pages().tolist()
        hold(free, "the free list")
        assert allocator.available_size() == len(free) * PAGE
        written: dict[int, int] = {}  # page -> offsets written (a prefix of the page)

        def written_pages(locations: torch.Tensor, who: str) -> None:
            for page, count in Counter((locations // PAGE).tolist()).items():
                assert written.setdefault(page, count) == count, f"page {page}: {who} wrote {count} offsets"

        if self.unified:
            tree_locations = tree.all_values_flatten().to(torch.int64)
            tree_size = tree.total_size()[0]
        else:
            parts = []
            for node, depth in self.nodes():
                value = node.value.to(torch.int64)
                assert len(value) == len(node.key) and len(value) % PAGE == 0 and len(value) > 0
                tokens = list(node.key.raw_token_ids())
                positions = range(depth, depth + len(value))
                for layer in range(LAYERS):  # a cached page holds exactly its sequence's tokens
                    assert torch.equal(self.k[layer, value], fake_keys(layer, tokens, positions)), node
                parts.append(value)
            tree_locations = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
            tree_size = tree.total_size()
        pages = tree_locations[::PAGE] // PAGE
        assert torch.equal(tree_locations, (pages[:, None] * PAGE + torch.arange(PAGE)).flatten())
        hold(pages.tolist(), "the radix cache")
        written_pages(tree_locations, "the radix cache")
        assert tree_size == len(tree_locations) == tree.evictable_size() + tree.protected_size()

        own_tokens = 0
        locked: set[int] = set()
        for slot, req in self.live.items():
            kv = req.kv
            assert kv.req_pool_idx == slot and kv.kv_allocated_len == kv.kv_committed_len
            row = self.row(req)
            positions = torch.arange(len(row))
            assert torch.equal(row % PAGE, positions % PAGE)  # paged: offset in page = offset in sequence
            assert torch.equal(
                row - row % PAGE, torch.repeat_interleave(row[::PAGE] - row[::PAGE] % PAGE, PAGE)[: len(row)]
            )
            protected = kv.cache_protected_len
            assert protected % PAGE == 0
            path = tree.path_device_indices(req.lock.node).to(torch.int64)
            assert req.lock.node == req.last_node
            assert torch.equal(path, row[:protected])  # the locked path is the row's tree-owned prefix
            locked.update(path.tolist())
            own_pages = (row[protected::PAGE] // PAGE).tolist()
            hold(own_pages, f"request {req.rid}")
            own_tokens += len(own_pages) * PAGE
            written_pages(row, f"request {req.rid}")
            fill = self._fill(req)[: len(row)]
            for layer in range(LAYERS):  # the row's pages hold exactly this request's tokens
                assert torch.equal(self.k[layer, row], fake_keys(layer, fill, positions.tolist())), req.rid
        assert sorted(holder) == list(range(1, POOL_PAGES + 1)), "a page is lost"
        # No leak: free + cached (evictable + protected) + live requests' own == the pool.
        size = allocator.available_size() + tree.evictable_size() + tree.protected_size() + own_tokens
        assert size == POOL_PAGES * PAGE

        # Reference counts: the protected tokens are exactly those on live requests' locked paths.
        assert tree.protected_size() == len(locked)
        if not self.unified:
            expected: Counter[int] = Counter()
            for req in self.live.values():
                node = req.lock.node
                while node is not tree.root_node:
                    expected[node.id] += 1
                    node = node.parent
            nodes = [node for node, _ in self.nodes()]
            assert tree.root_node.lock_ref == 1
            for node in nodes:
                assert node.lock_ref == expected[node.id], (node.id, node.lock_ref, expected[node.id])
            assert tree.protected_size() == sum(len(n.key) for n in nodes if n.lock_ref > 0)
            assert tree.evictable_leaves == {n for n in nodes if n.lock_ref == 0 and not n.children}
        if not self.live:
            assert tree.protected_size() == 0

        # Summaries: every page in use summarises exactly the keys written to it (a shared page once).
        for layer in range(LAYERS):
            for page, count in written.items():
                keys = self.k[layer, page * PAGE : page * PAGE + count]
                kmin, kmax = self.summaries.lookup(layer, torch.tensor([page]))
                assert torch.equal(kmin[0], keys.amin(0)) and torch.equal(kmax[0], keys.amax(0)), (
                    layer,
                    page,
                )

        # Working sets: each resident block mirrors the page the request's row maps that block to.
        for slot, req in self.live.items():
            assert self.working_sets.owner[slot] == int(self.req_pool.req_generation[slot])
            row = self.row(req)
            blocks = self.working_sets.slot_block[slot]  # [LAYERS, HEADS, SLOTS]
            assert int(blocks.max()) < req.kv.kv_committed_len // PAGE
            for layer, head, s in (blocks != EMPTY).nonzero().tolist():
                locations = row[int(blocks[layer, head, s]) * PAGE :][:PAGE]
                assert torch.equal(self.working_sets.k[slot, layer, head, s], self.k[layer, locations, head])
                assert torch.equal(self.working_sets.v[slot, layer, head, s], self.v[layer, locations, head])

    def drain(self) -> None:
        """Finish every live request; then nothing is locked, and evicting everything empties the tree."""
        for req in list(self.live.values()):
            self.release(req, finished=True)
        self.check()
        if not self.unified:
            assert all(node.lock_ref == 0 for node, _ in self.nodes())
        else:
            self.tree.sanity_check()
        self.evict(POOL_PAGES * PAGE)
        assert self.tree.evictable_size() == self.tree.protected_size() == 0
        assert self.allocator.available_size() == POOL_PAGES * PAGE
        self.check()


# --- the state machine ---------------------------------------------------------------------------

prompts = st.lists(
    st.tuples(
        st.integers(0, len(PREFIXES) - 1),
        st.lists(st.integers(1, 3) | st.integers(1, 999), max_size=40),  # often agree for a while
        st.integers(0, 1),  # sampling seed
        st.sampled_from([None, None, 24, 40]),  # chunked prefill (chunks end mid-page)
    ),
    min_size=1,
    max_size=2,
)


def prompt_ids(prefix: int, suffix: list[int]) -> list[int]:
    ids = PREFIXES[prefix] + suffix
    return [*ids, 5] if len(ids) % PAGE == 0 else ids  # never a multiple of 16 (0 included)


class RadixSharing(RuleBasedStateMachine):
    unified = False

    def __init__(self) -> None:
        super().__init__()
        self.h = Harness(unified=self.unified)

    def _pick(self, index: int) -> Req:
        return self.h.live[sorted(self.h.live)[index % len(self.h.live)]]

    @initialize(fill=st.integers(POOL_PAGES // 2, POOL_PAGES - 2), seed=st.integers(0, 2**32 - 1))
    def warm(self, fill: int, seed: int) -> None:
        """Finished requests fill the cache to ``fill`` pages, so later allocations evict from it."""
        rnd = random.Random(seed)
        for _ in range(3 * POOL_PAGES):
            if self.h.tree.evictable_size() >= fill * PAGE:
                break
            suffix = [rnd.randint(1, 999) for _ in range(rnd.randint(16, 60))]
            for req in self.h.admit([(prompt_ids(rnd.randrange(len(PREFIXES)), suffix), 0, None)], rnd):
                self.h.decode(req, rnd.randint(0, 20), rnd)
                self.h.release(req, finished=True)

    @rule(batch=prompts, rnd=st.randoms(use_true_random=False))
    def admit(self, batch: list[tuple[int, list[int], int, int | None]], rnd: random.Random) -> None:
        self.h.admit([(prompt_ids(p, s), seed, chunk) for p, s, seed, chunk in batch], rnd)

    @precondition(lambda self: self.h.live)
    @rule(index=st.integers(0, 3), steps=st.integers(1, 24), rnd=st.randoms(use_true_random=False))
    def decode(self, index: int, steps: int, rnd: random.Random) -> None:
        self.h.decode(self._pick(index), steps, rnd)

    @precondition(lambda self: self.h.live)
    @rule(index=st.integers(0, 3), rnd=st.randoms(use_true_random=False))
    def select(self, index: int, rnd: random.Random) -> None:
        self.h.select(self._pick(index), rnd, admission=False)

    @precondition(lambda self: self.h.live)
    @rule(index=st.integers(0, 3))
    def finish(self, index: int) -> None:
        self.h.release(self._pick(index), finished=True)

    @precondition(lambda self: self.h.live)
    @rule(index=st.integers(0, 3))
    def abort(self, index: int) -> None:
        self.h.release(self._pick(index), finished=False)

    @rule(num_tokens=st.integers(1, 48))
    def evict(self, num_tokens: int) -> None:
        self.h.evict(num_tokens)

    @invariant()
    def consistent(self) -> None:
        self.h.check()

    def teardown(self) -> None:
        if sys.exc_info()[1] is None:  # (after a failure, leave the state and its report alone)
            self.h.drain()


class UnifiedRadixSharing(RadixSharing):
    unified = True


def machine_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


def test_radix_cache_sharing_keeps_summaries_and_working_sets_right() -> None:
    run_state_machine_as_test(RadixSharing, settings=machine_settings(30))


def test_unified_radix_cache_sharing_keeps_summaries_and_working_sets_right() -> None:
    """The tree cache SGLang 0.5.23's scheduler builds by default, with the public-API invariants."""
    run_state_machine_as_test(UnifiedRadixSharing, settings=machine_settings(10))


# --- exact cases ---------------------------------------------------------------------------------


def page_summary(
    layer: int, tokens: Sequence[int], positions: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    keys = fake_keys(layer, tokens, positions)
    return keys.amin(0), keys.amax(0)


def test_second_request_shares_two_pages_of_a_40_token_prefix_and_recomputes_the_third() -> None:
    h = Harness()
    rnd = random.Random(0)
    shared = BASE[:40]
    a_ids, b_ids = [*shared, 501, 502, 503], [*shared, 601, 602, 603, 604, 605]  # 43 and 45 tokens
    [a] = h.admit([(a_ids, 0, None)], rnd)
    row_a = h.row(a)
    assert h.matched[a.rid] == 0 and h.tree.total_size() == 32  # A's checkpoint cached 2 whole pages
    updates: list[torch.Tensor] = []
    update = h.summaries.update

    def recording_update(layer: int, locations: torch.Tensor, keys: torch.Tensor) -> None:
        updates.append(locations)
        update(layer, locations, keys)

    h.summaries.update = recording_update  # type: ignore[method-assign]
    [b] = h.admit([(b_ids, 1, None)], rnd)
    row_b = h.row(b)
    assert h.matched[b.rid] == 32  # exactly the 2 cached pages, not the partly filled third
    assert torch.equal(row_b[:32], row_a[:32])  # the same pages
    a_pages, b_pages = (row_a[::PAGE] // PAGE).tolist(), (row_b[::PAGE] // PAGE).tolist()
    assert b_pages[2] not in a_pages  # tokens 32..39 (shared) recomputed into a page of B's own
    assert updates and all(set((loc // PAGE).tolist()) == {b_pages[2]} for loc in updates)  # none into A's
    for layer in range(LAYERS):
        for block in (0, 1):  # the shared pages: summarised once, by A
            kmin, kmax = h.summaries.lookup(layer, torch.tensor([a_pages[block]]))
            want = page_summary(
                layer, shared[block * PAGE :][:PAGE], range(block * PAGE, block * PAGE + PAGE)
            )
            assert torch.equal(kmin[0], want[0]) and torch.equal(kmax[0], want[1])
        for page, ids in ((a_pages[2], a_ids), (b_pages[2], b_ids)):  # each third page: its own keys
            kmin, kmax = h.summaries.lookup(layer, torch.tensor([page]))
            want = page_summary(layer, ids[32:], range(32, len(ids)))
            assert torch.equal(kmin[0], want[0]) and torch.equal(kmax[0], want[1])
        # B's working set holds blocks 0 and 1 from the shared pages, in block order.
        keys, _, valid = h.working_sets.gather(torch.tensor([b.kv.req_pool_idx]), layer)
        assert int(valid[0, 0].sum()) == 2 * PAGE
        assert torch.equal(keys[0, :, : 2 * PAGE].transpose(0, 1), fake_keys(layer, shared[:32], range(32)))
    assert h.tree.protected_size() == 32  # locked by both
    assert [node.lock_ref for node, _ in h.nodes()] == [2]
    h.check()
    h.release(a, finished=True)
    assert [node.lock_ref for node, _ in h.nodes()] == [1]
    h.check()
    h.release(b, finished=True)
    assert h.tree.total_size() == 32 and h.tree.protected_size() == 0  # 43 and 45 tokens: 2 whole pages
    assert h.allocator.available_size() == (POOL_PAGES - 2) * PAGE
    h.drain()


def test_same_prompt_twice_in_one_batch_is_deduplicated_and_the_freed_pages_restart_their_summaries() -> None:
    h = Harness()
    rnd = random.Random(1)
    freed: list[int] = []  # pages the radix cache's insert gives back as duplicates
    free_segment = h.allocator.free_segment

    def recording_free_segment(free_index: torch.Tensor, *, start_pos: int) -> None:
        freed.extend((free_index[::PAGE] // PAGE).tolist())
        free_segment(free_index, start_pos=start_pos)

    h.allocator.free_segment = recording_free_segment  # type: ignore[method-assign]
    ids = BASE[:57]  # 3 whole pages + 9 tokens
    a, b = h.admit([(ids, 0, None), (ids, 0, None)], rnd)  # one prefill batch: both miss
    assert h.matched[a.rid] == h.matched[b.rid] == 0
    row_a, row_b = h.row(a), h.row(b)
    # A's checkpoint cached its 3 pages; B's then found them, gave its own 3 copies back and now reads A's.
    assert torch.equal(row_b[:48], row_a[:48]) and row_b[48] // PAGE != row_a[48] // PAGE
    assert len(freed) == 3 and not set(freed) & set((row_a[::PAGE] // PAGE).tolist())
    assert h.tree.total_size() == 48 and h.tree.protected_size() == 48
    h.check()  # B's working set (loaded from its own copies before the checkpoint) still mirrors the rows
    # A third request gets those freed pages and writes them from offset 0: their summaries restart
    # (until then they held B's keys of BASE[:48], now C's keys only).
    [c] = h.admit([([900 + i for i in range(40)], 1, None)], rnd)
    assert set(freed) <= set((h.row(c)[::PAGE] // PAGE).tolist())
    h.check()
    h.release(b, finished=False)
    h.check()
    h.drain()
