"""Ragged paged attention for TPU (Pallas / Mosaic), with the KV-cache write fused in.

One call serves one ragged batch: decode, prefill and mixed (chunked-prefill)
requests, flattened token by token, against a paged KV cache
``[num_pages, page_size, 2 * Hkv, D]`` (K of kv head ``h`` at ``2h``, V at
``2h + 1``). The reference is :func:`pallas_kernels.reference.ref_ragged_paged_attention`.

How the kernel works
--------------------
* Grid: one step per block of ``num_queries_per_block`` tokens (``bq``). Queries
  are laid out ``[Hkv, T * G, D]`` outside the kernel (``G = Hq // Hkv``) so that
  all ``G`` q heads of one kv head form the rows of a single 2-D matmul.
* Scalar prefetch (SMEM): ``kv_lens``, ``page_indices``, ``cu_q_lens``,
  ``distribution`` and, per q block, the range of requests it touches.
* KV stays in HBM (``memory_space=ANY``). For every (request, kv block) pair of
  the q block, whole pages are DMA'd into one of two VMEM buffers; the next
  pair's copies are started before the current pair is computed (double
  buffering across kv blocks *and* across request boundaries). Only valid slots
  are copied: cached positions ``< kv_len - q_len`` come from the pages, the new
  tokens come straight from the step's new K/V (dynamic-size DMAs), so nothing
  depends on the cache write having landed.
* The cache write is a set of HBM->HBM DMAs (one per request and page touched)
  started at the beginning of the step and waited at its end; the cache is
  aliased in/out. Reads (positions ``< kv_len - q_len``) and writes (positions
  ``>= kv_len - q_len``) never overlap, so q blocks are independent ("parallel").
* Online softmax in float32 with the running max / sum / accumulator in VMEM
  scratch. A request with a single token in the block (decode) is computed on an
  aligned tile of ``lcm(G, sublanes)`` rows instead of the whole block; other
  requests are computed on all ``bq * G`` rows with their rows masked.
* Not done (yet): the first kv block of a q block is not prefetched by the
  previous grid step, so each grid step exposes one DMA latency.

Decode roofline (why the KV stream is what matters)
---------------------------------------------------
Decoding one token reads its request's whole KV once per layer:
``bytes = 2 * kv_len * Hkv * D * bytes_per_elem``. Llama-3-8B (Hkv=8, D=128,
bf16) at kv_len=2048: 8 MiB per token per layer, i.e. 10.2 us on v5e
(819 GB/s HBM) and 5.1 us on v6e (1640 GB/s); q, o and the page table are
noise next to it. Decode attention is therefore a bandwidth kernel: success is
achieved GB/s close to the HBM peak, which needs DMAs large enough to hide
per-DMA and per-iteration overhead and a copy always in flight.

Default block sizes
-------------------
``num_kv_pages_per_block=16``: with page_size 16 a kv block is 256 tokens, 1 MiB
per buffer for Hkv=8, D=128 bf16: ~1.3 us of v5e bandwidth (0.64 us on v6e) per
block, long enough to hide the fixed cost of a pipeline iteration (16 page DMA
issues, one semaphore wait, loop control) behind the transfer; 2 MiB
double-buffered. Smaller blocks waste a larger share of each iteration on that
fixed cost, larger ones only pay off for long contexts and cost VMEM.
``num_queries_per_block=32``: q and o blocks (double-buffered by the pipeline)
plus f32 accumulators come to ~2.5 MiB for G=4. Together ~4.5 MiB, a third of
v5e's 16 MiB scoped-VMEM default (128 MiB physical) and so also safe under v6e's
32 MiB default; page_size 64 (a 1024-token kv block, 8 MiB double-buffered)
still fits v5e's default. Nothing is looked up by TPU generation: pass larger
blocks and ``vmem_limit_bytes`` explicitly to use more of v6e's VMEM.
:func:`estimate_vmem_bytes` gives the footprint (tile-padded).

Status
------
Checked on CPU under TPU interpret mode with the race detector on (against the
reference, which is checked against a naive loop) and through jax's
Pallas->Mosaic lowering for a TPU target. Not yet compiled by Mosaic on a real
TPU nor timed there (``benchmarks/bench_pallas.py`` does that on a TPU host).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.reference import MASK_VALUE

DEFAULT_NUM_KV_PAGES_PER_BLOCK = 16
DEFAULT_NUM_QUERIES_PER_BLOCK = 32
_LANES = 128


def _cdiv(a, b):
    return (a + b - 1) // b


def _sublanes(dtype) -> int:
    """Rows of one (sublane x 128) VMEM tile for this dtype: 8 for 32-bit, 16 for bf16."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


# --------------------------------------------------------------------------- validation


def validate_inputs_static(
    q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, *,
    sm_scale=1.0, sliding_window=None, soft_cap=None,
    num_kv_pages_per_block=DEFAULT_NUM_KV_PAGES_PER_BLOCK,
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
    if page_indices.ndim != 1 or page_indices.shape[0] % num_reqs or page_indices.shape[0] == 0:
        raise ValueError(
            f"page_indices must be flat [R * pages_per_seq]; length {page_indices.shape} "
            f"is not a positive multiple of R={num_reqs}")
    for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices),
                    ("cu_q_lens", cu_q_lens), ("distribution", distribution)):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
    if sliding_window is not None and (int(sliding_window) != sliding_window or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window} must be a positive integer or None")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap={soft_cap} must be > 0 or None")
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale={sm_scale} must be finite")
    if int(num_kv_pages_per_block) != num_kv_pages_per_block or num_kv_pages_per_block < 1:
        raise ValueError(f"num_kv_pages_per_block={num_kv_pages_per_block} must be an integer >= 1")
    if num_queries_per_block < 8 or num_queries_per_block % 8:
        raise ValueError(f"num_queries_per_block={num_queries_per_block} must be a positive multiple of 8")
    if vmem_limit_bytes is not None:
        need = estimate_vmem_bytes(
            num_kv_heads=num_kv_heads, group=num_q_heads // num_kv_heads, head_dim=head_dim,
            page_size=kv_cache.shape[1], dtype=q.dtype,
            num_kv_pages_per_block=num_kv_pages_per_block, num_queries_per_block=num_queries_per_block)
        if need > vmem_limit_bytes:
            raise ValueError(
                f"block sizes need ~{need} bytes of VMEM, over vmem_limit_bytes={vmem_limit_bytes}; "
                "lower num_kv_pages_per_block or num_queries_per_block")


def validate_inputs_dynamic(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, **static_kwargs):
    """Host-side checks of the metadata *values* (tests, debugging; not jittable).

    Static checks first, then: distribution ordered within [0, R]; cu_q_lens
    starts at 0, never decreases, stays within T; decode requests have q_len 1;
    every real request has 1 <= q_len <= kv_len <= pages_per_seq * page_size;
    padded slots have kv_len 0 and q_len 0; every page index is in [0, P) and no
    page receiving new tokens is the null page 0.
    """
    validate_inputs_static(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution, **static_kwargs)
    kv_lens, page_indices, cu_q_lens, distribution = (
        np.asarray(x) for x in (kv_lens, page_indices, cu_q_lens, distribution))
    num_tokens = q.shape[0]
    num_pages, page_size = kv_cache.shape[:2]
    num_reqs = kv_lens.shape[0]
    pages_per_seq = page_indices.shape[0] // num_reqs
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
    bad = np.nonzero(page_indices[:] < 0)[0].tolist() + np.nonzero(page_indices >= num_pages)[0].tolist()
    if bad:
        raise ValueError(f"page_indices[{bad[0]}]={page_indices[bad[0]]} out of range [0, {num_pages})")
    max_len = pages_per_seq * page_size
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
                f"request {r}: need 1 <= q_len ({ql}) <= kv_len ({kl}) <= pages_per_seq * page_size ({max_len})")
        touched = page_indices[r * pages_per_seq + np.arange((kl - ql) // page_size, _cdiv(kl, page_size))]
        if (touched == 0).any():
            raise ValueError(f"request {r} would write new tokens into the null page 0")


def estimate_vmem_bytes(*, num_kv_heads, group, head_dim, page_size, dtype,
                        num_kv_pages_per_block, num_queries_per_block) -> int:
    """VMEM footprint of one kernel instance, with TPU tile padding."""
    item = jnp.dtype(dtype).itemsize
    d_pad = _cdiv(head_dim, _LANES) * _LANES
    rows = num_queries_per_block * group
    rows_pad = _cdiv(rows, 8) * 8
    heads2_pad = _cdiv(2 * num_kv_heads, _sublanes(dtype)) * _sublanes(dtype)
    kv_bufs = 2 * num_kv_pages_per_block * page_size * heads2_pad * d_pad * item
    q_and_o = 2 * 2 * num_kv_heads * rows_pad * d_pad * item   # the pipeline double-buffers both
    acc = num_kv_heads * rows_pad * d_pad * 4
    m_and_l = 2 * num_kv_heads * rows_pad * _LANES * 4
    return kv_bufs + q_and_o + acc + m_and_l


# --------------------------------------------------------------------------- kernel


@dataclasses.dataclass(frozen=True)
class _Static:
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    group: int               # q heads per kv head (G)
    block_q: int             # tokens per q block
    pages_per_block: int
    page_size: int
    pages_per_seq: int
    tile_rows: int           # rows of the single-token (decode) tile; 0 = disabled
    kv_load_mode: str        # see load_kv_head

    @property
    def block_kv(self) -> int:
        return self.pages_per_block * self.page_size


def kv_load_mode(dtype, num_kv_heads: int, interpret) -> str:
    """How the kernel pulls one head's K and V out of the page buffer (see load_kv_head)."""
    if interpret is not False:
        return "index"
    rows = 2 * num_kv_heads
    if jnp.dtype(dtype).itemsize == 4 and rows % _sublanes(dtype) == 0:
        return "strided"
    if jnp.dtype(dtype) == jnp.bfloat16 and rows % _sublanes(dtype) == 0:
        return "packed"
    return "index"


def load_kv_head(kv_buf, slot, h: int, *, mode: str):
    """K and V of kv head ``h`` for every token of buffer ``slot``: two [bkv, D] values.

    The buffer holds whole pages, ``[bkv, 2 * Hkv, D]`` per slot, K at row 2h and
    V at 2h + 1. Modes (all give the same values):

    * "index": plain indexing. The only one jax 0.10's TPU interpreter runs
      (it cannot read through ``Ref.reshape`` / ``Ref.bitcast``).
    * "strided" (32-bit): a sublane-strided load from a 2-D view of the buffer.
    * "packed" (bf16): rows 2h and 2h + 1 share one 32-bit word (K in the low
      half), so one strided load of the uint32 view fetches both and two bit
      operations split them, instead of strided loads of half-words.
    """
    _, bkv, heads2, head_dim = kv_buf.shape
    if mode == "index":
        return kv_buf[slot, :, 2 * h, :], kv_buf[slot, :, 2 * h + 1, :]
    if mode == "strided":
        flat = kv_buf.at[slot].reshape(bkv * heads2, head_dim)
        return (flat[pl.ds(2 * h, bkv, stride=heads2), :],
                flat[pl.ds(2 * h + 1, bkv, stride=heads2), :])
    if mode == "packed":
        heads = heads2 // 2
        words = kv_buf.at[slot].bitcast(jnp.uint32).reshape(bkv * heads, head_dim)
        w = words[pl.ds(h, bkv, stride=heads), :]
        # A bf16 placed in the high half of a 32-bit word is that value as f32.
        k = lax.bitcast_convert_type(w << 16, jnp.float32).astype(kv_buf.dtype)
        v = lax.bitcast_convert_type(w & jnp.uint32(0xFFFF0000), jnp.float32).astype(kv_buf.dtype)
        return k, v
    raise ValueError(f"unknown kv load mode {mode!r}")


def _request(s: _Static, r, blk_start, cu_q_lens_ref, kv_lens_ref):
    """Scalars describing request r as seen from the q block starting at blk_start."""
    q_start = cu_q_lens_ref[r]
    q_end = cu_q_lens_ref[r + 1]
    ctx = kv_lens_ref[r] - (q_end - q_start)               # tokens already in the cache
    t_lo = jnp.maximum(q_start, blk_start)                 # its tokens inside this q block
    t_hi = jnp.minimum(q_end, blk_start + s.block_q)
    first_pos = ctx + t_lo - q_start
    kv_end = ctx + t_hi - q_start                          # keys needed: positions < kv_end
    b_lo = 0
    if s.sliding_window is not None:
        b_lo = jnp.maximum(first_pos - s.sliding_window + 1, 0) // s.block_kv
    b_hi = jnp.maximum(_cdiv(kv_end, s.block_kv), b_lo + 1)
    return dict(q_start=q_start, q_end=q_end, ctx=ctx, t_lo=t_lo, t_hi=t_hi,
                kv_end=kv_end, b_lo=b_lo, b_hi=b_hi)


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,        # [R]
    page_indices_ref,   # [R * pages_per_seq]
    cu_q_lens_ref,      # [R + 1]
    distribution_ref,   # [3]
    blk_reqs_ref,       # [2 * num_q_blocks]: first request, one past last request, per q block
    # inputs
    q_ref,              # [Hkv, bq * G, D]           VMEM block
    new_kv_hbm,         # [T_pad, 2 * Hkv, D]        HBM, K/V interleaved like the cache
    cache_hbm,          # [P, page_size, 2 * Hkv, D] HBM, aliased with cache_out_hbm
    # outputs
    o_ref,              # [Hkv, bq * G, D]           VMEM block
    cache_out_hbm,      # [P, page_size, 2 * Hkv, D] HBM
    # scratch
    kv_buf,             # [2, bkv, 2 * Hkv, D]       VMEM, double buffer
    sems,               # DMA semaphores [3]: fetch slot 0, fetch slot 1, cache write
    m_ref,              # [Hkv, bq * G, 128] f32     running max (lane-replicated)
    l_ref,              # [Hkv, bq * G, 128] f32     running sum
    acc_ref,            # [Hkv, bq * G, D] f32       running numerator
    *,
    s: _Static,
):
    num_kv_heads, rows, head_dim = q_ref.shape
    bkv, ps = s.block_kv, s.page_size
    i = pl.program_id(0)
    num_blocks = pl.num_programs(0)
    blk_start = i * s.block_q
    r_first = blk_reqs_ref[i]
    r_end = blk_reqs_ref[num_blocks + i]
    total = cu_q_lens_ref[distribution_ref[2]]
    req = functools.partial(_request, s, blk_start=blk_start, cu_q_lens_ref=cu_q_lens_ref,
                            kv_lens_ref=kv_lens_ref)

    # ---- fused KV write: start now, wait at the end of the step.
    def write_request(r, carry):
        a = req(r)
        pos_lo = a["ctx"] + a["t_lo"] - a["q_start"]
        pos_hi = a["ctx"] + a["t_hi"] - a["q_start"]
        p_first = pos_lo // ps
        p_end = jnp.where(a["t_hi"] > a["t_lo"], _cdiv(pos_hi, ps), p_first)

        def write_page(p, c):
            lo = jnp.maximum(pos_lo, p * ps)
            n = jnp.minimum(pos_hi, (p + 1) * ps) - lo
            page = page_indices_ref[r * s.pages_per_seq + p]
            pltpu.make_async_copy(
                new_kv_hbm.at[pl.ds(a["q_start"] + lo - a["ctx"], n)],
                cache_out_hbm.at[page, pl.ds(lo - p * ps, n)],
                sems.at[2],
            ).start()
            return c

        return lax.fori_loop(p_first, p_end, write_page, carry)

    lax.fori_loop(r_first, r_end, write_request, 0)
    num_written = jnp.maximum(jnp.minimum(blk_start + s.block_q, total) - blk_start, 0)

    # ---- KV block fetch into one of the two VMEM buffers.
    def fetch(r, b, slot, *, wait: bool):
        a = req(r)
        base = b * bkv
        valid = jnp.clip(a["kv_end"] - base, 0, bkv)       # slots of this block we need
        if wait:
            # One wait for all copies into this slot: the semaphore counts bytes,
            # and the copies filled exactly rows [0, valid) of the buffer.
            @pl.when(valid > 0)
            def _():
                dst = kv_buf.at[slot, pl.ds(0, valid)]
                pltpu.make_async_copy(dst, dst, sems.at[slot]).wait()
            return
        cached = jnp.clip(a["ctx"] - base, 0, valid)        # from pages
        for j in range(s.pages_per_block):                   # static: lets the scalar core pipeline issues
            size = jnp.clip(cached - j * ps, 0, ps)

            @pl.when(size > 0)
            def _():
                page = page_indices_ref[r * s.pages_per_seq + b * s.pages_per_block + j]
                pltpu.make_async_copy(
                    cache_hbm.at[page, pl.ds(0, size)],
                    kv_buf.at[slot, pl.ds(j * ps, size)],
                    sems.at[slot],
                ).start()

        new = valid - cached                                  # this step's tokens, not in the cache yet

        @pl.when(new > 0)
        def _():
            pltpu.make_async_copy(
                new_kv_hbm.at[pl.ds(a["q_start"] + base + cached - a["ctx"], new)],
                kv_buf.at[slot, pl.ds(cached, new)],
                sems.at[slot],
            ).start()

    # ---- one online-softmax update: rows [row0, row0 + nrows) x kv block b of request r.
    def attend(a, b, slot, row0, nrows):
        base = b * bkv
        shape = (nrows, bkv)
        # Row `row` is token blk_start + row // G at position c + row // G. The
        # masks below are that, multiplied through by G: no vector division.
        c = a["ctx"] - a["q_start"] + blk_start
        row = row0 + lax.broadcasted_iota(jnp.int32, shape, 0)
        dk = base - c + lax.broadcasted_iota(jnp.int32, shape, 1)       # key position - c
        mask = ((row >= (a["t_lo"] - blk_start) * s.group) & (row < (a["t_hi"] - blk_start) * s.group)
                & (dk * s.group <= row))                                # causal: kpos <= qpos
        if s.sliding_window is not None:
            mask &= row < (dk + s.sliding_window) * s.group             # qpos - window < kpos
        # Slots past the valid ones hold stale (or, in the interpreter, NaN) data: zero V there.
        v_ok = base + lax.broadcasted_iota(jnp.int32, (bkv, head_dim), 0) < a["kv_end"]
        for h in range(num_kv_heads):
            q = q_ref[h, pl.ds(row0, nrows), :]
            k, v = load_kv_head(kv_buf, slot, h, mode=s.kv_load_mode)
            v = jnp.where(v_ok, v, 0)
            logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32) * s.sm_scale
            if s.soft_cap is not None:
                logits = s.soft_cap * jnp.tanh(logits / s.soft_cap)
            logits = jnp.where(mask, logits, MASK_VALUE)
            m_prev = m_ref[h, pl.ds(row0, nrows), :]                       # [nrows, 128]
            m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(logits - m_next[:, :1]), 0.0)
            alpha = jnp.exp(m_prev - m_next)
            m_ref[h, pl.ds(row0, nrows), :] = m_next
            l_ref[h, pl.ds(row0, nrows), :] = alpha * l_ref[h, pl.ds(row0, nrows), :] + jnp.sum(
                p, axis=1, keepdims=True)
            pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
            acc_ref[h, pl.ds(row0, nrows), :] = alpha[:, :1] * acc_ref[h, pl.ds(row0, nrows), :] + pv

    def compute(r, b, slot):
        a = req(r)
        if not s.tile_rows:
            attend(a, b, slot, 0, rows)
            return
        first_tile = (a["t_lo"] - blk_start) * s.group // s.tile_rows
        last_tile = ((a["t_hi"] - blk_start) * s.group - 1) // s.tile_rows
        one_tile = first_tile == last_tile

        @pl.when(one_tile)
        def _():
            attend(a, b, slot, pl.multiple_of(first_tile * s.tile_rows, s.tile_rows), s.tile_rows)

        @pl.when(jnp.logical_not(one_tile))
        def _():
            attend(a, b, slot, 0, rows)

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def next_item(r, b):
        a = req(r)
        last = b + 1 >= a["b_hi"]
        return jnp.where(last, r + 1, r), jnp.where(last, req(jnp.minimum(r + 1, r_end - 1))["b_lo"], b + 1)

    # Software pipeline over the (request, kv block) items of this q block:
    # iteration k starts the copies of item k, then waits for and computes
    # item k - 1 from the other buffer. One copy of each code path.
    def step(carry):
        r_in, b_in, r_cur, b_cur, k = carry
        slot = k % 2
        issue = r_in < r_end

        @pl.when(issue)
        def _():
            fetch(r_in, b_in, slot, wait=False)

        @pl.when(k > 0)
        def _():
            fetch(r_cur, b_cur, 1 - slot, wait=True)
            compute(r_cur, b_cur, 1 - slot)

        r_nxt, b_nxt = next_item(jnp.minimum(r_in, r_end - 1), b_in)
        return jnp.where(issue, r_nxt, r_in), b_nxt, r_in, b_in, k + 1

    def more(carry):
        r_in, _, r_cur, _, k = carry
        return jnp.where(k == 0, r_in, r_cur) < r_end

    b0 = req(jnp.minimum(r_first, jnp.maximum(r_end - 1, 0)))["b_lo"]
    lax.while_loop(more, step, (r_first, b0, r_first, b0, jnp.int32(0)))

    for h in range(num_kv_heads):
        l = l_ref[h][:, :1]
        out = jnp.where(l > 0, acc_ref[h] / jnp.where(l > 0, l, 1.0), 0.0)
        o_ref[h] = out.astype(o_ref.dtype)

    @pl.when(num_written > 0)
    def _():
        # Same trick as the fetch wait: all writes of this step moved exactly
        # num_written token rows of new_kv, so one wait of that size drains them.
        src = new_kv_hbm.at[pl.ds(blk_start, num_written)]
        pltpu.make_async_copy(src, src, sems.at[2]).wait()


def _block_requests(cu_q_lens, distribution, num_blocks: int, block_q: int):
    """[2 * num_blocks] int32: per q block, first request and one past the last one."""
    total = cu_q_lens[distribution[2]]
    start = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    last = jnp.minimum(start + block_q, total) - 1
    r_first = jnp.searchsorted(cu_q_lens, start, side="right").astype(jnp.int32) - 1
    r_end = jnp.searchsorted(cu_q_lens, last, side="right").astype(jnp.int32)
    empty = start >= total
    r_first = jnp.where(empty, 0, jnp.clip(r_first, 0, distribution[2]))
    r_end = jnp.where(empty, 0, jnp.clip(r_end, 0, distribution[2]))
    return jnp.concatenate([r_first, r_end]).astype(jnp.int32)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "num_kv_pages_per_block",
                     "num_queries_per_block", "vmem_limit_bytes", "interpret"),
    donate_argnames=("kv_cache",),
)
def ragged_paged_attention(
    q,             # [T, Hq, D]
    k,             # [T, Hkv, D]
    v,             # [T, Hkv, D]
    kv_cache,      # [P, page_size, 2 * Hkv, D]  donated, returned updated
    kv_lens,       # [R] int32: tokens in cache after this step; 0 for padded slots
    page_indices,  # [R * pages_per_seq] int32: flattened block tables
    cu_q_lens,     # [R + 1] int32: cumulative new-token counts
    distribution,  # [3] int32: (decode_end, prefill_end, mixed_end)
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_kv_pages_per_block: int = DEFAULT_NUM_KV_PAGES_PER_BLOCK,
    num_queries_per_block: int = DEFAULT_NUM_QUERIES_PER_BLOCK,
    vmem_limit_bytes: int | None = None,
    interpret=False,
):
    """Ragged paged attention with the KV write fused in. Returns ``(out [T, Hq, D], kv_cache)``.

    Token j of request r's q_len new tokens sits at position ``kv_lens[r] - q_len + j``;
    its K/V are written to that slot and it attends to positions ``0..pos``
    (``pos - sliding_window < p`` with a window), q head h using kv head
    ``h // (Hq // Hkv)``. Padding rows (past ``cu_q_lens[mixed_end]``) give 0 and
    write nothing. ``num_kv_pages_per_block`` is capped at pages_per_seq and
    ``num_queries_per_block`` at T rounded up to 8. ``interpret``: False on TPU,
    ``pltpu.InterpretParams(...)`` to run on CPU.
    """
    validate_inputs_static(
        q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        num_kv_pages_per_block=num_kv_pages_per_block, num_queries_per_block=num_queries_per_block,
        vmem_limit_bytes=vmem_limit_bytes)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    page_size = kv_cache.shape[1]
    pages_per_seq = page_indices.shape[0] // kv_lens.shape[0]

    block_q = min(num_queries_per_block, _cdiv(num_tokens, 8) * 8)
    num_blocks = _cdiv(num_tokens, block_q)
    padded = num_blocks * block_q
    pages_per_block = min(num_kv_pages_per_block, pages_per_seq)
    rows = block_q * group
    tile_rows = math.lcm(group, _sublanes(q.dtype))
    if rows % tile_rows or tile_rows >= rows:
        tile_rows = 0
    s = _Static(
        sm_scale=float(sm_scale), sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap), group=group, block_q=block_q,
        pages_per_block=pages_per_block, page_size=page_size, pages_per_seq=pages_per_seq,
        tile_rows=tile_rows,
        kv_load_mode=kv_load_mode(kv_cache.dtype, num_kv_heads, interpret))

    pad = ((0, padded - num_tokens), (0, 0), (0, 0))
    # [T, Hq, D] -> [Hkv, T * G, D]: the G q heads of a kv head become adjacent rows.
    q_rows = jnp.pad(q, pad).reshape(padded, num_kv_heads, group, head_dim)
    q_rows = q_rows.transpose(1, 0, 2, 3).reshape(num_kv_heads, padded * group, head_dim)
    new_kv = jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim)
    new_kv = jnp.pad(new_kv, pad)
    blk_reqs = _block_requests(cu_q_lens, distribution, num_blocks, block_q)

    q_block = pl.BlockSpec((num_kv_heads, rows, head_dim), lambda i, *_: (0, i, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    out_rows, kv_cache = pl.pallas_call(
        functools.partial(_kernel, s=s),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_blocks,),
            in_specs=[q_block, hbm, hbm],
            out_specs=[q_block, hbm],
            scratch_shapes=[
                pltpu.VMEM((2, s.block_kv, 2 * num_kv_heads, head_dim), kv_cache.dtype),
                pltpu.SemaphoreType.DMA((3,)),
                pltpu.VMEM((num_kv_heads, rows, _LANES), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows, _LANES), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
            jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        ],
        # operand 7 = 5 scalar-prefetch arrays + q_rows + new_kv, then the cache
        input_output_aliases={7: 1},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret,
        name="ragged_paged_attention",
    )(kv_lens, page_indices, cu_q_lens, distribution, blk_reqs, q_rows, new_kv, kv_cache)

    out = out_rows.reshape(num_kv_heads, padded, group, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(padded, num_q_heads, head_dim)[:num_tokens], kv_cache
