"""sgl-kernel-oasis: the ops of sglang-oasis's hot path.

Each op has a pure-torch reference with the public signature (the CPU path runs these) and, for the
hot path, a Triton kernel with the same signature in ``sgl_kernel_oasis.triton_kernels``, tested against
it. ``sgl_kernel_oasis.ops`` picks one per call: Triton for CUDA tensors, the reference otherwise.
"""

from sgl_kernel_oasis.block_copy import copy_blocks_to_slots
from sgl_kernel_oasis.block_scoring import (
    score_blocks,
    score_blocks_batched,
    score_paged_blocks,
    select_top_blocks,
    window_block_mass,
)
from sgl_kernel_oasis.block_summaries import (
    append_block_summaries,
    build_block_summaries,
    update_page_summaries,
)
from sgl_kernel_oasis.sparse_attention import headwise_decode_attention, sparse_decode_attention

__all__ = [
    "append_block_summaries",
    "build_block_summaries",
    "copy_blocks_to_slots",
    "headwise_decode_attention",
    "score_blocks",
    "score_blocks_batched",
    "score_paged_blocks",
    "select_top_blocks",
    "sparse_decode_attention",
    "update_page_summaries",
    "window_block_mass",
]
