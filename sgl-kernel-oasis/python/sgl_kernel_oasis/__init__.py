"""sgl-kernel-oasis: the ops of sglang-oasis's hot path.

Each op has a pure-torch reference with the public signature (the CPU path runs these); Triton kernels
with the same signatures are added beside them and tested against them.
"""

from sgl_kernel_oasis.block_scoring import score_blocks, score_blocks_batched, select_top_blocks
from sgl_kernel_oasis.block_summaries import append_block_summaries, build_block_summaries
from sgl_kernel_oasis.sparse_attention import sparse_decode_attention

__all__ = [
    "append_block_summaries",
    "build_block_summaries",
    "score_blocks",
    "score_blocks_batched",
    "select_top_blocks",
    "sparse_decode_attention",
]
