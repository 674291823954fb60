"""Triton kernels of the hot path, one module per op, each with the signature of its torch reference in
``sgl_kernel_oasis`` (tests compare them on random inputs; on CPU under ``TRITON_INTERPRET=1``).

Importing this package needs Triton; ``sgl_kernel_oasis.ops`` imports it only for CUDA tensors.
"""

from sgl_kernel_oasis.triton_kernels.block_copy import copy_blocks_to_slots
from sgl_kernel_oasis.triton_kernels.block_scoring import score_paged_blocks
from sgl_kernel_oasis.triton_kernels.block_summaries import update_page_summaries
from sgl_kernel_oasis.triton_kernels.sparse_attention import headwise_decode_attention

__all__ = [
    "copy_blocks_to_slots",
    "headwise_decode_attention",
    "score_paged_blocks",
    "update_page_summaries",
]
