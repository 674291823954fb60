"""``--oasis-selector oracle`` (evaluation only): each decode step of a sparse layer attends, per KV head,
the K blocks holding most of the step's own query's exact attention mass. The best any selection of K
blocks per KV head can do, and no serving mode: it reads every key of the context to choose (dense
attention's scores). ``bench_accuracy --oracle-top-ks`` runs it beside the runtime's selection, whose gap
to it is then the selection's (the min/max bound, the lookahead's predicting query, the fetch cap), not
the model's. ``--oasis-selector oracle-pooled``: the same bytes (H x K blocks per request and layer)
shared among the KV heads by mass, the best a head-wise budget (Ada-KV's) could do.

What a step attends, per request and KV head: its sink blocks, its top-K full blocks by the attention
mass the group's query heads give them (softmax over every position, summed over the heads and the
block's tokens), and every position past its full blocks (the partial block, this step's token): the
runtime's working set (K + sinks slots) and active tail, chosen exactly. A request whose full blocks fit
in K + sinks attends all of them: dense. The eager step runs underneath as usual (``OracleAttention``),
so the working sets, summaries, counters and per-request figures stay what they are at that K; only the
attention output is the oracle's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from sglang_oasis.attention.sparse_attention import SparseAttention

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention

    from sglang_oasis.attention.batch_view import BatchView
    from sglang_oasis.options.selection import SelectionOptions


def oracle_positions(
    q: torch.Tensor, keys: torch.Tensor, seq_lens: torch.Tensor, top_k: torch.Tensor, block: int, sinks: int,
    scale: float, pooled: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The positions each KV head attends: ``q`` ``[bs, q_heads, D]``, ``keys`` ``[bs, H, T, D]`` (row b's
    positions below ``seq_lens[b]`` valid), ``top_k`` ``[bs]``. Returns ``[bs, H, T]`` bool. ``pooled``
    (``oracle-pooled``): a row's H x K blocks go to its heads' blocks of most mass, however many per head
    (Ada-KV's head-wise budget, at best; each head keeps its sinks)."""
    return _positions(_logits(q, keys, scale), seq_lens, top_k, block, sinks, pooled)


def oracle_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_lens: torch.Tensor, top_k: torch.Tensor,
    block: int, sinks: int, scale: float, pooled: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Attention of ``q`` ``[bs, q_heads, D]`` over the positions ``oracle_positions`` chooses of ``keys``,
    ``values`` ``[bs, H, T, D]``; ``[bs, q_heads, D]`` in ``q``'s dtype (computed in float32)."""
    logits = _logits(q, keys, scale)  # one product of the query and every key: to choose, then to attend
    attended = _positions(logits, seq_lens, top_k, block, sinks, pooled)  # [bs, H, T]
    probs = logits.masked_fill(~attended[:, :, None, :], float("-inf")).softmax(dim=-1)
    out = torch.einsum("bhgt,bhtd->bhgd", probs, values.float())
    return out.reshape(q.shape[0], q.shape[1], -1).to(q.dtype)


def _logits(q: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """``[bs, H, group, T]`` float32: each query head's scaled scores against its KV head's keys."""
    bs, _, dim = q.shape
    return torch.einsum("bhgd,bhtd->bhgt", q.view(bs, keys.shape[1], -1, dim).float(), keys.float()) * scale


def _positions(
    logits: torch.Tensor, seq_lens: torch.Tensor, top_k: torch.Tensor, block: int, sinks: int, pooled: bool
) -> torch.Tensor:
    """``oracle_positions`` from the step's ``_logits``."""
    bs, heads, _, length = logits.shape
    positions = torch.arange(length)
    valid = positions[None, :] < seq_lens[:, None]  # [bs, T]
    probs = logits.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(dim=-1)
    blocks = length // block
    mass = probs[..., : blocks * block].unflatten(-1, (blocks, block)).sum(dim=(2, 4))  # [bs, H, N]
    index = torch.arange(blocks)
    full = seq_lens // block
    in_range = index[None, :] < full[:, None]  # [bs, N]
    sink = index < sinks
    ranked = mass.masked_fill(~in_range[:, None, :] | sink, float("-inf"))
    if pooled:  # ranks over the row's heads and blocks, against a budget of H x K
        flat = ranked.flatten(1).argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)
        chosen = (flat < (heads * top_k)[:, None]).view(bs, heads, blocks) | sink
    else:
        rank = ranked.argsort(dim=-1, descending=True, stable=True).argsort(dim=-1)  # 0: the most mass
        chosen = (rank < top_k[:, None, None]) | sink
    over = (full > top_k + sinks)[:, None, None]
    selected = torch.where(over, chosen, True) & in_range[:, None, :]  # [bs, H, N]
    tail = (positions[None, :] >= (full * block)[:, None]) & valid  # the partial block, this step's token
    attended = torch.zeros((bs, heads, length), dtype=torch.bool)
    attended[..., : blocks * block] = selected.repeat_interleave(block, dim=-1)
    return attended | tail[:, None, :]


def attention_kind(config: SelectionOptions) -> Callable[..., SparseAttention]:
    """What the oasis backend builds its ``SparseAttention`` with: the class, or with ``--oasis-selector
    oracle`` the oracle's (its sinks the server's)."""
    if not config.oracle:
        return SparseAttention
    return functools.partial(
        OracleAttention, sinks=config.sink_blocks, pooled=config.selector == "oracle-pooled"
    )


class OracleAttention(SparseAttention):
    """``SparseAttention`` whose decode output is the oracle's (see the module); every other path, and
    the eager step's own work beneath a decode, unchanged. Each row's K is its (request, layer)'s
    (``WorkingSetPool.top_k``: a request's ``oasis_top_k`` too)."""

    def __init__(self, *args: object, sinks: int = 0, pooled: bool = False) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.sink_blocks, self.pooled = sinks, pooled

    def decode(
        self, batch: BatchView, q: torch.Tensor, layer: RadixAttention, seq_lens: torch.Tensor,
        k: torch.Tensor, v: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        out = super().decode(batch, q, layer, seq_lens, k, v)  # the runtime's step, for its state and figures
        layer_id = layer.layer_id
        length = int(seq_lens.max())
        positions = torch.arange(length)[None, :]
        rows = self.req_to_token_pool.req_to_token[batch.req_index[:, None], positions.clamp(max=length - 1)]
        locations = torch.where(positions < seq_lens[:, None], rows, 0).long()  # this step's token included
        keys = self.kv_pool.get_key_buffer(layer_id)[locations].transpose(1, 2)  # [bs, H, T, D]
        values = self.kv_pool.get_value_buffer(layer_id)[locations].transpose(1, 2)
        top_k = self.working_sets.top_k[batch.slots, layer_id]
        exact = oracle_attention(
            q.cpu(), keys.cpu(), values.cpu(), seq_lens, top_k.cpu(), self.block_size, self.sink_blocks,
            layer.scaling, self.pooled,
        )  # fmt: skip
        return exact.to(out.device, out.dtype)
