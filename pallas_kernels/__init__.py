"""Pallas TPU kernels and their pure-JAX references."""

from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import ref_ragged_paged_attention, token_metadata, write_kv_ref
from pallas_kernels.sharded import sharded_ragged_paged_attention
from pallas_kernels.tuning import TUNING, kernel_block_sizes
from pallas_kernels.validation import (
    DEFAULT_NUM_KV_BLOCKS_PER_CHUNK,
    DEFAULT_NUM_QUERIES_PER_BLOCK,
    estimate_vmem_bytes,
    validate_inputs_dynamic,
    validate_inputs_static,
)

__all__ = [
    "DEFAULT_NUM_KV_BLOCKS_PER_CHUNK",
    "DEFAULT_NUM_QUERIES_PER_BLOCK",
    "TUNING",
    "estimate_vmem_bytes",
    "kernel_block_sizes",
    "ragged_paged_attention",
    "ref_ragged_paged_attention",
    "sharded_ragged_paged_attention",
    "token_metadata",
    "validate_inputs_dynamic",
    "validate_inputs_static",
    "write_kv_ref",
]
