"""Decode and verify attention over each KV head's working set plus the request's active tail.

Per request and KV head the keys a decode step (or a verify row) attends are::

    | working set (read in place, head-wise) | active tail: covered * B .. first | the step's new tokens |

Both parts are the device tier's: the working sets, and the active blocks (``memory/active_blocks.py``),
which hold the tail (the tokens after the blocks the last selection covered) and take each step's new
tokens as the step stores them. A tail the active blocks do not hold (a PD arrival's) is loaded from the
host tier first, counted in ``tail_bytes_host_to_device``; one longer than they can hold (an arrival's
dense first step) is read from the host tier for that step. Dense layers' verify rows attend every
committed token (counted in ``dense_layer_bytes_host_to_device``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from sgl_kernel_oasis import ops, sparse_decode_attention
from sglang_oasis.attention.batch_view import BatchView
from sglang_oasis.memory.active_blocks import concat_ranges
from sglang_oasis.memory.device_tier import DeviceTier
from sglang_oasis.stats import OasisStats

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

# A request's decode attention reads its working-set slots up to its last occupied one, rounded up to this.
SPAN_STEP = 8


def slot_spans(slot_rows: torch.Tensor, step: int = SPAN_STEP) -> torch.Tensor:
    """``[bs]``: how many working-set slots each request's decode attention reads (``slot_rows`` ``[bs,
    kv_heads, slots]``, -1 where empty): up to its last occupied slot on any KV head, rounded up to
    ``step``, at most every slot. A function of the request's own slots, so its attention has the same
    shape alone or in any batch; a K = 16 request on a server that reserves 128 blocks per head does not
    attend ~130 empty slots (masked, but computed)."""
    slots = slot_rows.shape[-1]
    occupied = (slot_rows >= 0).any(dim=1)  # [bs, slots]
    last = torch.where(occupied, torch.arange(1, slots + 1), 0).amax(dim=-1)
    return ((last + step - 1) // step * step).clamp(min=step, max=slots)


class Tail(NamedTuple):
    """What one layer's attention reads besides the working sets, for a batch."""

    k: torch.Tensor  # [tokens, kv_heads, head_dim]: the layer's active blocks (+ host tokens: ``advance``)
    v: torch.Tensor
    locs: torch.Tensor  # [bs, tail + new] rows of ``k``: the committed tail, then the step's new tokens
    valid: torch.Tensor  # [bs, tail] which tail rows are real


class SparseAttention:
    def __init__(
        self,
        tier: DeviceTier,
        req_to_token_pool: ReqToTokenPool,
        kv_pool: MHATokenToKVPool,
        block_size: int,
        stats: OasisStats,
        strict: bool = False,
    ) -> None:
        self.tier = tier
        self.working_sets = tier.working_sets
        self.active = tier.active
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.stats = stats
        self.strict = strict  # tests: decode attention must read device-tier tensors only
        self.num_kv_heads = int(kv_pool.head_num)
        # Bytes of one token's K and V for one KV head in one layer.
        self.token_bytes = 2 * int(kv_pool.head_dim) * self.working_sets.k.element_size()

    def count_host_read(
        self, counter: str, reqs: Sequence[int] | torch.Tensor, tokens: torch.Tensor, keys_only: bool = False
    ) -> None:
        """Count a decode-time read of ``tokens[i]`` tokens' K and V (or keys only) of request row
        ``reqs[i]``, every KV head of one layer, from the host tier, outside the working-set loads: in
        ``counter``, in the totals and in each request's figures (``request_ledger.py``)."""
        per_token = self.num_kv_heads * (self.token_bytes // 2 if keys_only else self.token_bytes)
        nbytes = [int(n) * per_token for n in tokens.tolist()]
        total = sum(nbytes)
        self.stats.add(counter, total)
        self.stats.add("bytes_host_to_device", total)
        self.stats.add("decode_bytes_host_to_device", total)
        rows = reqs.tolist() if isinstance(reqs, torch.Tensor) else reqs
        self.stats.requests.add_bytes([int(r) for r in rows], nbytes)

    def advance(
        self, batch: BatchView, layer_id: int, first: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> Tail:
        """One step at one layer: each request's tail (positions ``covered * B .. first``) held in the
        active blocks, loaded from the host tier where it is not; then the step's new tokens (``k``, ``v``
        ``[bs * n, kv_heads, head_dim]``, positions ``first .. first + n`` of each request) stored after
        it. A tail longer than the active blocks hold beside the new tokens (a PD arrival's dense first
        step) is read from the host tier: those tokens are appended to the returned ``k``/``v``."""
        active, slots = self.active, batch.slots
        bs = len(batch.reqs)
        new = k.shape[0] // bs
        starts, lengths, from_host = self._tails(batch, layer_id, first, new)
        stale = ~from_host & ~active.holds(slots, layer_id, starts, first)
        if bool(stale.any()):
            rows = stale.nonzero().flatten()
            keys, values = self._read_tails(batch, layer_id, rows, starts, first, "a tail the device lacks")
            active.store(layer_id, slots[rows], starts[rows], first[rows], keys, values)
        heads = self.num_kv_heads
        active.store(
            layer_id, slots, first, first + new, k.view(bs * new, heads, -1), v.view(bs * new, heads, -1)
        )
        # Every held tail is padded to the same width, whatever the batch: a request's attention then
        # reduces over the same keys alone or batched, so its output (and greedy tokens) do not depend
        # on what else runs (a batch-wide longest tail would change the reduction's rounding).
        width = int(lengths.max()) if bool(from_host.any()) else active.span - new
        positions = starts[:, None] + torch.arange(width)  # [bs, tail]
        valid = positions < first[:, None]
        locs = active.rows(slots, positions)
        new_locs = active.rows(slots, first[:, None] + torch.arange(new))
        tail_k, tail_v = active.k[layer_id], active.v[layer_id]
        if bool(from_host.any()):
            rows = from_host.nonzero().flatten()
            host_k, host_v = self._read_tails(batch, layer_id, rows, starts, first, "a dense first step")
            at = torch.zeros((len(rows), positions.shape[1]), dtype=torch.int64)
            at[valid[rows]] = tail_k.shape[0] + torch.arange(len(host_k))
            locs[rows] = at
            tail_k = torch.cat([tail_k, host_k.to(tail_k.dtype)])
            tail_v = torch.cat([tail_v, host_v.to(tail_v.dtype)])
        return Tail(tail_k, tail_v, torch.cat([locs, new_locs], dim=1), valid)

    def load_tail(self, req: int, slot: int, layers: list[int], committed: int, new: int) -> None:
        """Load request row ``req``'s tail (positions ``covered * B .. committed`` at each of ``layers``)
        from the host tier into its active blocks, where they hold it beside ``new`` tokens (a resumed
        request's; a longer one is read at its step, as any long tail is); counted."""
        covered = self.working_sets.covered[slot]
        slots, reqs = torch.tensor([slot]), torch.tensor([req])
        for layer in layers:
            start = int(covered[layer]) * self.block_size
            if not 0 < committed - start <= self.active.span - new:
                continue
            starts, ends = torch.tensor([start]), torch.tensor([committed])
            self.active.store(layer, slots, starts, ends, *self._host_tokens(layer, reqs, starts, ends))

    def _read_tails(
        self, batch: BatchView, layer_id: int, rows: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
        what: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """K and V of positions ``[starts, ends)`` of the batch's ``rows``, read from the host tier and
        counted (``tail_bytes_host_to_device``); in strict mode, outside admission, an error naming ``what``."""
        self._check_host_read(what, batch)
        return self._host_tokens(layer_id, batch.req_index[rows], starts[rows], ends[rows])

    def _host_tokens(
        self, layer_id: int, reqs: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``[starts, ends)`` of request rows ``reqs``, read from the host tier and
        counted (``tail_bytes_host_to_device``)."""
        locs = self.pool_locs(reqs, starts, ends)
        self.count_host_read("tail_bytes_host_to_device", reqs, (ends - starts).clamp(min=0))
        return self.kv_pool.get_key_buffer(layer_id)[locs], self.kv_pool.get_value_buffer(layer_id)[locs]

    def pool_locs(self, reqs: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """Host-tier locations of positions ``[starts[i], ends[i])`` of requests ``reqs``, concatenated."""
        rows = torch.repeat_interleave(reqs, (ends - starts).clamp(min=0))
        return self.req_to_token_pool.req_to_token[rows, concat_ranges(starts, ends)].to(torch.int64)

    def _check_host_read(self, what: str, batch: BatchView) -> None:
        if self.strict and not batch.admits:
            raise RuntimeError(f"oasis strict device mode: decode attention read {what} from the host tier")

    def headwise(
        self, batch: BatchView, q_rows: torch.Tensor, layer: RadixAttention, tail: Tail, valid: torch.Tensor
    ) -> torch.Tensor:
        """``[bs, rows, q_heads, dim]`` queries over each KV head's working set (read in place through
        the head-wise mapping) and the tail (row r sees the tokens ``valid[:, r]`` marks): the Triton
        kernel on CUDA, its torch reference on CPU."""
        layer_id = layer.layer_id
        ws_k, ws_v = self.working_sets.block_views()
        if (
            self.strict
            and not batch.admits
            and not all(self.tier.owns(t) for t in (ws_k, ws_v, tail.k, tail.v))
        ):
            raise RuntimeError(
                "oasis strict device mode: decode attention was given a tensor outside the device tier"
            )
        device = ws_k.device  # host-built index tensors: non_blocking, so the stream need not drain first
        slot_rows = self.working_sets.slot_rows(batch.slots, layer_id)
        spans = slot_spans(slot_rows, SPAN_STEP)

        def attend(rows: torch.Tensor | slice, span: int) -> torch.Tensor:
            return ops.headwise_decode_attention(
                q_rows[rows],
                ws_k,
                ws_v,
                slot_rows[rows, :, :span].contiguous().to(device, non_blocking=True),
                tail.k,
                tail.v,
                tail.locs[rows].to(device, non_blocking=True),
                valid[rows].to(device, non_blocking=True),
                layer.scaling,
            )

        parts = spans.unique().tolist()
        if len(parts) == 1:
            return attend(slice(None), parts[0])
        out = torch.empty_like(q_rows)  # one call per span: each request's attention as it is alone
        for span in parts:
            rows = (spans == span).nonzero().flatten()
            out[rows.to(out.device)] = attend(rows, span)
        return out

    def decode(
        self,
        batch: BatchView,
        q: torch.Tensor,
        layer: RadixAttention,
        seq_lens: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        """A decode step's ``[bs, q_heads, dim]`` queries: the token at ``seq_len - 1`` is stored, then
        attended with the working set and the tail."""
        apart = self._long_tails_apart(batch, layer.layer_id, seq_lens - 1, 1)
        if apart is not None:
            out = q.new_empty((*q.shape[:2], v.shape[-1]))
            for rows in (apart, ~apart):
                at = rows.to(q.device)
                out[at] = self.decode(batch.subset(rows), q[at], layer, seq_lens[rows], k[at], v[at])
            return out
        tail = self.advance(batch, layer.layer_id, seq_lens - 1, k, v)
        valid = torch.cat([tail.valid, torch.ones((len(batch.reqs), 1), dtype=torch.bool)], dim=1)
        return self.headwise(batch, q[:, None], layer, tail, valid[:, None, :])[:, 0]

    def verify(
        self, batch: BatchView, q_rows: torch.Tensor, layer: RadixAttention, seq_lens: torch.Tensor,
        k: torch.Tensor, v: torch.Tensor, tree: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Verify rows ``[bs, rows, q_heads, dim]`` of a sparse layer (row r at position ``seq_len + r``;
        ``k``, ``v`` ``[bs * rows, kv_heads, dim]``): the working set, the active tail, then the rows' own
        tokens (the tree mask says which rows see them)."""
        bs, rows = q_rows.shape[:2]
        apart = self._long_tails_apart(batch, layer.layer_id, seq_lens, rows)
        if apart is not None:
            out = q_rows.new_empty((*q_rows.shape[:3], v.shape[-1]))
            k_rows, v_rows = k.view(bs, rows, *k.shape[1:]), v.view(bs, rows, *v.shape[1:])
            for part in (apart, ~apart):
                at = part.to(q_rows.device)
                out[at] = self.verify(
                    batch.subset(part), q_rows[at], layer, seq_lens[part], k_rows[at].flatten(0, 1),
                    v_rows[at].flatten(0, 1), tree[part],
                )  # fmt: skip
            return out
        tail = self.advance(batch, layer.layer_id, seq_lens, k, v)
        valid = torch.cat([tail.valid[:, None, :].expand(-1, rows, -1), tree], dim=2)
        return self.headwise(batch, q_rows, layer, tail, valid)

    def _long_tails_apart(
        self, batch: BatchView, layer_id: int, first: torch.Tensor, new: int
    ) -> torch.Tensor | None:
        """``[bs]`` bool, the first row whose tail is longer than the active blocks hold (a PD arrival's
        dense first step), when the batch has other rows: it attends in a call of its own, so no other
        row is padded to its whole context (nor its result to theirs). None: one call for the batch."""
        long = self._tails(batch, layer_id, first, new)[2]
        if len(long) < 2 or not bool(long.any()):
            return None
        return torch.arange(len(long)) == int(long.nonzero()[0])

    def _tails(
        self, batch: BatchView, layer_id: int, first: torch.Tensor, new: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[bs]`` each: where each request's tail starts (after its covered blocks), its length up to
        ``first``, and whether it is longer than the active blocks hold beside ``new`` tokens."""
        starts = self.working_sets.covered[batch.slots, layer_id] * self.block_size
        lengths = (first - starts).clamp(min=0)
        return starts, lengths, lengths + new > self.active.span

    def dense_verify(
        self, batch: BatchView, q_rows: torch.Tensor, layer: RadixAttention, seq_lens: torch.Tensor,
        draft_locs: torch.Tensor, tree: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Verify rows of a dense layer: every committed token, then the draft rows' (tree mask)."""
        layer_id = layer.layer_id
        positions = torch.arange(max(1, int(seq_lens.max())))[None, :].expand(len(batch.reqs), -1)
        committed = positions < seq_lens[:, None]
        locations = torch.where(
            committed, self.req_to_token_pool.req_to_token[batch.req_index[:, None], positions], 0
        ).long()
        self.count_host_read("dense_layer_bytes_host_to_device", batch.reqs, seq_lens + draft_locs.shape[1])
        locations = torch.cat([locations, draft_locs.cpu()], dim=1)
        keys = self.kv_pool.get_key_buffer(layer_id)[locations].transpose(1, 2)
        values = self.kv_pool.get_value_buffer(layer_id)[locations].transpose(1, 2)
        rows, kv_heads = draft_locs.shape[1], keys.shape[1]
        valid = torch.cat(
            [
                committed[:, None, None, :].expand(-1, kv_heads, rows, -1),
                tree[:, None, :, :].expand(-1, kv_heads, -1, -1),
            ],
            dim=3,
        )
        return sparse_decode_attention(q_rows, keys, values, valid, layer.scaling)


def verify_tree_mask(forward_batch: ForwardBatch, batch: int, rows: int) -> torch.Tensor:
    """``[batch, rows, rows]``: which verify rows each row attends (a chain unless the drafter sent a
    qlen-only tree mask)."""
    spec_info = getattr(forward_batch, "spec_info", None)
    mask = getattr(spec_info, "custom_mask", None)
    if mask is not None and mask.numel() == batch * rows * rows:
        return mask.view(batch, rows, rows).to(torch.bool).cpu()
    if mask is not None:
        raise NotImplementedError(
            f"oasis verify attention reads a qlen-only tree mask; got {mask.numel()} entries for "
            f"{batch} requests x {rows} rows"
        )
    return torch.tril(torch.ones(rows, rows, dtype=torch.bool)).expand(batch, -1, -1)
