"""Pallas TPU kernels and their pure-JAX references."""

from pallas_kernels.ragged_paged_attention import (
    DEFAULT_NUM_KV_PAGES_PER_BLOCK,
    DEFAULT_NUM_QUERIES_PER_BLOCK,
    estimate_vmem_bytes,
    ragged_paged_attention,
    validate_inputs_dynamic,
    validate_inputs_static,
)
from pallas_kernels.reference import ref_ragged_paged_attention, token_metadata, write_kv_ref
from pallas_kernels.sharded import sharded_ragged_paged_attention

__all__ = [
    "DEFAULT_NUM_KV_PAGES_PER_BLOCK",
    "DEFAULT_NUM_QUERIES_PER_BLOCK",
    "estimate_vmem_bytes",
    "ragged_paged_attention",
    "ref_ragged_paged_attention",
    "sharded_ragged_paged_attention",
    "token_metadata",
    "validate_inputs_dynamic",
    "validate_inputs_static",
    "write_kv_ref",
]
