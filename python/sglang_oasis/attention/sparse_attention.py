"""Decode and verify attention over each KV head's working set plus the request's active tail.

Per request and KV head the keys a decode step (or a verify row) attends are::

    | working set (read in place, head-wise) | active tail: covered * B .. seq_len | verify rows (tree) |

The working set is the device tier's; the tail (the tokens after the blocks the last selection covered)
and the verify rows are read from the host tier (SGLang's pool) at every step, and counted
(``tail_bytes_host_to_device``). Dense layers' verify rows attend every committed token (counted in
``dense_layer_bytes_host_to_device``).
"""

from __future__ import annotations

from typing import Any

import torch

from sgl_kernel_oasis import ops, sparse_decode_attention
from sglang_oasis.attention.batch_view import BatchView
from sglang_oasis.memory.working_set import WorkingSetPool
from sglang_oasis.stats import OasisStats


class SparseAttention:
    def __init__(
        self,
        working_sets: WorkingSetPool,
        req_to_token_pool: Any,
        kv_pool: Any,
        block_size: int,
        stats: OasisStats,
    ) -> None:
        self.working_sets = working_sets
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.stats = stats
        self.num_kv_heads = int(kv_pool.head_num)
        # Bytes of one token's K and V for one KV head in one layer.
        self.token_bytes = 2 * int(kv_pool.head_dim) * working_sets.k.element_size()

    def count_host_read(self, counter: str, tokens: int, keys_only: bool = False) -> None:
        """Count a decode-time read of ``tokens`` tokens' K and V (or keys only) of every KV head of one
        layer from the host tier, outside the working-set loads: in ``counter`` and in the totals."""
        nbytes = tokens * self.num_kv_heads * (self.token_bytes // 2 if keys_only else self.token_bytes)
        self.stats.add(counter, nbytes)
        self.stats.add("bytes_host_to_device", nbytes)
        self.stats.add("decode_bytes_host_to_device", nbytes)

    def tail(self, batch: BatchView, layer_id: int, seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pool locations ``[bs, tail]`` of each request's active tail (the tokens after the blocks its
        last selection covered) and which of them are real (``[bs, tail]`` bool)."""
        ends = torch.tensor(seq_lens, dtype=torch.int64)
        starts = self.working_sets.covered[batch.slots, layer_id] * self.block_size
        positions = starts[:, None] + torch.arange(int((ends - starts).max()))  # [bs, tail]
        tail_valid = positions < ends[:, None]
        req_to_token = self.req_to_token_pool.req_to_token
        positions = positions.clamp(max=req_to_token.shape[1] - 1)
        locations = torch.where(
            tail_valid, req_to_token[batch.req_index[:, None], positions].to(torch.int64), 0
        )
        self.count_host_read("tail_bytes_host_to_device", int(tail_valid.sum()))
        return locations, tail_valid

    def headwise(
        self,
        batch: BatchView,
        q_rows: torch.Tensor,
        layer: Any,
        tail_locs: torch.Tensor,
        tail_valid: torch.Tensor,
    ) -> torch.Tensor:
        """``[bs, rows, q_heads, dim]`` queries over each KV head's working set (read in place through
        the head-wise mapping) and the tail tokens ``tail_locs`` (row r sees those in ``tail_valid[:, r]``):
        the Triton kernel on CUDA, its torch reference on CPU."""
        layer_id = layer.layer_id
        ws_k, ws_v = self.working_sets.block_views()
        device = ws_k.device  # host-built index tensors: non_blocking, so the stream need not drain first
        return ops.headwise_decode_attention(
            q_rows,
            ws_k,
            ws_v,
            self.working_sets.slot_rows(batch.slots, layer_id).to(device, non_blocking=True),
            self.kv_pool.get_key_buffer(layer_id),
            self.kv_pool.get_value_buffer(layer_id),
            tail_locs.to(device, non_blocking=True),
            tail_valid.to(device, non_blocking=True),
            layer.scaling,
        )

    def verify(
        self, batch: BatchView, q_rows: torch.Tensor, layer: Any, seq_lens: torch.Tensor, draft_locs: torch.Tensor,
        tree: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Verify rows ``[bs, rows, q_heads, dim]`` of a sparse layer: the working set, the active tail,
        then the draft rows' own tokens (the tree mask says which rows see them)."""
        rows = draft_locs.shape[1]
        tail_locs, tail_valid = self.tail(batch, layer.layer_id, seq_lens.tolist())
        self.count_host_read("tail_bytes_host_to_device", draft_locs.numel())
        locs = torch.cat([tail_locs, draft_locs.cpu()], dim=1)
        valid = torch.cat([tail_valid[:, None, :].expand(-1, rows, -1), tree], dim=2)
        return self.headwise(batch, q_rows, layer, locs, valid)

    def dense_verify(
        self, batch: BatchView, q_rows: torch.Tensor, layer: Any, seq_lens: torch.Tensor, draft_locs: torch.Tensor,
        tree: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Verify rows of a dense layer: every committed token, then the draft rows' (tree mask)."""
        layer_id = layer.layer_id
        positions = torch.arange(max(1, int(seq_lens.max())))[None, :].expand(len(batch.reqs), -1)
        committed = positions < seq_lens[:, None]
        locations = torch.where(
            committed, self.req_to_token_pool.req_to_token[batch.req_index[:, None], positions], 0
        ).long()
        self.count_host_read("dense_layer_bytes_host_to_device", int(seq_lens.sum()) + draft_locs.numel())
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

    @staticmethod
    def tree_mask(forward_batch: Any, batch: int, rows: int) -> torch.Tensor:
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
