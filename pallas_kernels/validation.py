"""Input checks of ragged paged attention and its VMEM footprint model (shared by the kernel and the tuning table).

`validate_inputs_static` runs at trace time on shapes, dtypes and options;
`validate_inputs_dynamic` checks metadata *values* on the host (tests,
debugging). `estimate_vmem_bytes` is the footprint the kernel's VMEM buffers
take, tile-padded: Mosaic refuses a kernel over its scoped-VMEM limit, so the
per-chip block sizes (`pallas_kernels.tuning`) are chosen against it.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

# The chip-independent defaults; `pallas_kernels.tuning` has the per-chip ones.
DEFAULT_NUM_KV_BLOCKS_PER_CHUNK = 16
DEFAULT_NUM_QUERIES_PER_BLOCK = 32
LANES = 128


def cdiv(a, b):
    return (a + b - 1) // b


def sublanes(dtype) -> int:
    """Rows of one (sublane x 128) VMEM tile for this dtype: 8 for 32-bit, 16 for bf16."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def validate_inputs_static(
    q, k, v, kv_cache, kv_lens, block_tables, cu_q_lens, distribution, *,
    sm_scale=1.0, sliding_window=None, soft_cap=None,
    num_kv_blocks_per_chunk=DEFAULT_NUM_KV_BLOCKS_PER_CHUNK,
    num_queries_per_block=DEFAULT_NUM_QUERIES_PER_BLOCK,
    vmem_limit_bytes=None,
):
    """Checks shapes, dtypes and options; runs at trace time. Raises ValueError."""
    for name, x, nd in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("kv_cache", kv_cache, 4)):
        if x.ndim != nd:
            raise ValueError(f"{name} must have {nd} dims, got shape {x.shape}")
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k.shape {k.shape} != v.shape {v.shape}")
    if k.shape[0] != num_tokens:
        raise ValueError(f"k has {k.shape[0]} tokens but q has {num_tokens}")
    num_kv_heads = k.shape[1]
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not divisible by num_kv_heads={num_kv_heads}")
    if k.shape[2] != head_dim or kv_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim mismatch: q {head_dim}, k/v {k.shape[2]}, kv_cache {kv_cache.shape[3]}")
    if kv_cache.shape[2] != 2 * num_kv_heads:
        raise ValueError(
            f"kv_cache.shape[2]={kv_cache.shape[2]} must be 2 * num_kv_heads = {2 * num_kv_heads} "
            "(K and V interleaved per head)")
    dtypes = {"q": q.dtype, "k": k.dtype, "v": v.dtype, "kv_cache": kv_cache.dtype}
    if len(set(dtypes.values())) != 1:
        raise ValueError(f"q, k, v and kv_cache must share one dtype, got {dtypes}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"dtype must be floating, got {q.dtype}")
    num_reqs = kv_lens.shape[0] if kv_lens.ndim == 1 else -1
    if kv_lens.ndim != 1 or num_reqs < 1:
        raise ValueError(f"kv_lens must be [R] with R >= 1, got shape {kv_lens.shape}")
    if cu_q_lens.shape != (num_reqs + 1,):
        raise ValueError(f"cu_q_lens.shape {cu_q_lens.shape} must be ({num_reqs + 1},) for R={num_reqs}")
    if distribution.shape != (3,):
        raise ValueError(f"distribution.shape {distribution.shape} must be (3,)")
    if block_tables.ndim != 1 or block_tables.shape[0] % num_reqs or block_tables.shape[0] == 0:
        raise ValueError(
            f"block_tables must be flat [R * blocks_per_seq]; length {block_tables.shape} "
            f"is not a positive multiple of R={num_reqs}")
    for name, x in (("kv_lens", kv_lens), ("block_tables", block_tables),
                    ("cu_q_lens", cu_q_lens), ("distribution", distribution)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
    if sliding_window is not None and (int(sliding_window) != sliding_window or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window} must be a positive integer or None")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap={soft_cap} must be > 0 or None")
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale={sm_scale} must be finite")
    if int(num_kv_blocks_per_chunk) != num_kv_blocks_per_chunk or num_kv_blocks_per_chunk < 1:
        raise ValueError(f"num_kv_blocks_per_chunk={num_kv_blocks_per_chunk} must be an integer >= 1")
    if num_queries_per_block < 8 or num_queries_per_block % 8:
        raise ValueError(f"num_queries_per_block={num_queries_per_block} must be a positive multiple of 8")
    if vmem_limit_bytes is not None:
        need = estimate_vmem_bytes(
            num_kv_heads=num_kv_heads, group=num_q_heads // num_kv_heads, head_dim=head_dim,
            block_size=kv_cache.shape[1], dtype=q.dtype,
            num_kv_blocks_per_chunk=num_kv_blocks_per_chunk, num_queries_per_block=num_queries_per_block)
        if need > vmem_limit_bytes:
            raise ValueError(
                f"num_kv_blocks_per_chunk={num_kv_blocks_per_chunk} and num_queries_per_block={num_queries_per_block} "
                f"need ~{need} bytes of VMEM, over vmem_limit_bytes={vmem_limit_bytes}; "
                "lower num_kv_blocks_per_chunk or num_queries_per_block")


def validate_inputs_dynamic(q, k, v, kv_cache, kv_lens, block_tables, cu_q_lens, distribution, **static_kwargs):
    """Host-side checks of the metadata *values* (tests, debugging; not jittable).

    Static checks first, then: distribution ordered within [0, R]; cu_q_lens
    starts at 0, never decreases, stays within T; decode requests have q_len 1;
    every real request has 1 <= q_len <= kv_len <= blocks_per_seq * block_size;
    padded slots have kv_len 0 and q_len 0; every block id is in [0, num_blocks)
    and no block receiving new tokens is the null block 0.
    """
    validate_inputs_static(q, k, v, kv_cache, kv_lens, block_tables, cu_q_lens, distribution, **static_kwargs)
    kv_lens, block_tables, cu_q_lens, distribution = (
        np.asarray(x) for x in (kv_lens, block_tables, cu_q_lens, distribution))
    num_tokens = q.shape[0]
    num_blocks, block_size = kv_cache.shape[:2]
    num_reqs = kv_lens.shape[0]
    blocks_per_seq = block_tables.shape[0] // num_reqs
    d0, d1, d2 = (int(x) for x in distribution)
    if not 0 <= d0 <= d1 <= d2 <= num_reqs:
        raise ValueError(f"distribution {distribution.tolist()} must satisfy 0 <= d0 <= d1 <= d2 <= R={num_reqs}")
    if cu_q_lens[0] != 0:
        raise ValueError(f"cu_q_lens[0]={cu_q_lens[0]} must be 0")
    q_lens = np.diff(cu_q_lens)
    if (q_lens < 0).any():
        raise ValueError(f"cu_q_lens must be non-decreasing, got {cu_q_lens.tolist()}")
    if cu_q_lens[d2] > num_tokens:
        raise ValueError(f"cu_q_lens[mixed_end]={cu_q_lens[d2]} exceeds the token count T={num_tokens}")
    bad = np.nonzero(block_tables[:] < 0)[0].tolist() + np.nonzero(block_tables >= num_blocks)[0].tolist()
    if bad:
        raise ValueError(f"block_tables[{bad[0]}]={block_tables[bad[0]]} out of range [0, {num_blocks})")
    max_len = blocks_per_seq * block_size
    for r in range(num_reqs):
        ql, kl = int(q_lens[r]), int(kv_lens[r])
        if r >= d2:
            if ql or kl:
                raise ValueError(f"padded request slot {r} must have q_len 0 and kv_len 0, got {ql}, {kl}")
            continue
        if r < d0 and ql != 1:
            raise ValueError(f"decode request {r} (< decode_end={d0}) has q_len={ql}, expected 1")
        if not 1 <= ql <= kl <= max_len:
            raise ValueError(
                f"request {r}: need 1 <= q_len ({ql}) <= kv_len ({kl}) <= blocks_per_seq * block_size ({max_len})")
        touched = block_tables[r * blocks_per_seq + np.arange((kl - ql) // block_size, cdiv(kl, block_size))]
        if (touched == 0).any():
            raise ValueError(f"request {r} would write new tokens into the null block 0")


def estimate_vmem_bytes(*, num_kv_heads, group, head_dim, block_size, dtype,
                        num_kv_blocks_per_chunk, num_queries_per_block) -> int:
    """VMEM footprint of one kernel instance, with TPU tile padding."""
    item = jnp.dtype(dtype).itemsize
    d_pad = cdiv(head_dim, LANES) * LANES
    rows = num_queries_per_block * group
    rows_pad = cdiv(rows, 8) * 8
    heads2_pad = cdiv(2 * num_kv_heads, sublanes(dtype)) * sublanes(dtype)
    kv_bufs = 2 * num_kv_blocks_per_chunk * block_size * heads2_pad * d_pad * item
    q_and_o = 2 * 2 * num_kv_heads * rows_pad * d_pad * item   # the pipeline double-buffers both
    acc = num_kv_heads * rows_pad * d_pad * 4
    m_and_l = 2 * num_kv_heads * rows_pad * LANES * 4
    return kv_bufs + q_and_o + acc + m_and_l
