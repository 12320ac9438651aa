"""Ragged paged attention for TPU (Pallas / Mosaic), with the KV-cache write fused in.

One call serves one ragged batch: decode, prefill and mixed (chunked-prefill)
requests, flattened token by token, against a paged KV cache
``[num_blocks, block_size, 2 * Hkv, D]`` (K of kv head ``h`` at ``2h``, V at
``2h + 1``) addressed through flattened ``block_tables``. The reference is
:func:`pallas_kernels.reference.ref_ragged_paged_attention`.

How the kernel works
--------------------
* Grid: one step per q block of ``num_queries_per_block`` tokens (``bq``).
  Queries are laid out ``[Hkv, T * G, D]`` outside the kernel (``G = Hq // Hkv``)
  so that all ``G`` q heads of one kv head form the rows of a single 2-D matmul.
* Scalar prefetch (SMEM): ``kv_lens``, ``cu_q_lens``, ``distribution``, per q
  block the range of requests it touches, and per new token its cache slot
  (gathered from the block tables outside the kernel). The block tables stay in
  HBM: a long-context table outgrows SMEM's 1 MiB (Llama-3.1's 131072 tokens in
  16-token blocks are 32 KiB per request). When a kv chunk is issued, its block
  ids are copied into SMEM and waited for at once; that wait overlaps the
  previous chunk's transfer, which is in flight by then.
* KV stays in HBM (``memory_space=ANY``). A request's keys are walked in kv
  chunks of ``num_kv_blocks_per_chunk`` cache blocks. For every (request, kv
  chunk) pair of the q block, whole cache blocks are DMA'd into one of two VMEM
  buffers; the next pair's copies are started before the current pair is
  computed (double buffering across kv chunks *and* across request
  boundaries). Only valid slots are copied: cached positions
  ``< kv_len - q_len`` come from the cache blocks, the new tokens come straight
  from the step's new K/V (dynamic-size DMAs), so nothing depends on the cache
  write having landed.
* The cache write is a set of HBM->HBM DMAs (one per request and cache block
  touched) started at the beginning of the step and waited at its end; the
  cache is aliased in/out. Reads (positions ``< kv_len - q_len``) and writes
  (positions ``>= kv_len - q_len``) never overlap, so q blocks are independent
  ("parallel").
* Online softmax in float32 with the running max / sum / accumulator in VMEM
  scratch. A request with a single token in the q block (decode) is computed on
  an aligned tile of ``lcm(G, sublanes)`` rows instead of the whole q block;
  other requests are computed on all ``bq * G`` rows with their rows masked.
* Not done (yet): the first kv chunk of a q block is not prefetched by the
  previous grid step, so each grid step exposes one DMA latency.

Decode roofline (why the KV stream is what matters)
---------------------------------------------------
Decoding one token reads its request's whole KV once per layer:
``bytes = 2 * kv_len * Hkv * D * bytes_per_elem``. Llama-3-8B (Hkv=8, D=128,
bf16) at kv_len=2048: 8 MiB per token per layer, i.e. 10.2 us on v5e
(819 GB/s HBM) and 5.1 us on v6e (1640 GB/s); q, o and the block table are
noise next to it. Decode attention is therefore a bandwidth kernel: success is
achieved GB/s close to the HBM peak, which needs DMAs large enough to hide
per-DMA and per-iteration overhead and a copy always in flight.

Chunk and q-block sizes
-----------------------
``num_kv_blocks_per_chunk=16`` (the chip-independent default): with block_size
16 a kv chunk is 256 tokens, 1 MiB per buffer for Hkv=8, D=128 bf16: ~1.3 us of
v5e bandwidth (0.64 us on v6e), long enough to hide the fixed cost of a
pipeline iteration (16 block DMA issues, one semaphore wait, loop control)
behind the transfer; 2 MiB double-buffered. Smaller chunks waste a larger share
of each iteration on that fixed cost, larger ones only pay off for long
contexts and cost VMEM. ``num_queries_per_block=32``: q and o blocks
(double-buffered by the pipeline) plus f32 accumulators come to ~2.5 MiB for
G=4. Together ~4.5 MiB, a third of v5e's 16 MiB scoped-VMEM default.
:func:`estimate_vmem_bytes` gives the footprint (tile-padded);
``pallas_kernels.tuning`` holds the per-chip sizes (one table) that the JAX
engine passes.

Status
------
Checked on CPU under TPU interpret mode with the race detector on (against the
reference, which is checked against a naive loop), and compiled by Mosaic for
TPU v5e and v6e targets on a CPU host (libtpu's compile-only client:
``tests/test_tpu_aot.py``). Not yet run nor timed on a TPU
(``benchmarks/bench_pallas.py`` does that on a TPU host).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.reference import MASK_VALUE, token_metadata
from pallas_kernels.validation import (
    DEFAULT_NUM_KV_BLOCKS_PER_CHUNK,
    DEFAULT_NUM_QUERIES_PER_BLOCK,
    LANES,
    cdiv,
    sublanes,
    validate_inputs_static,
)


# --------------------------------------------------------------------------- kernel


@dataclasses.dataclass(frozen=True)
class _Static:
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    group: int               # q heads per kv head (G)
    block_q: int             # tokens per q block
    blocks_per_chunk: int    # cache blocks per kv chunk
    block_size: int          # tokens per cache block
    blocks_per_seq: int      # block-table columns per request
    table_window: int        # block ids copied into SMEM per kv chunk: 128-aligned, covers a chunk's ids
    tile_rows: int           # rows of the single-token (decode) tile; 0 = disabled
    kv_load_mode: str        # see load_kv_head

    @property
    def chunk_kv(self) -> int:
        """Tokens per kv chunk."""
        return self.blocks_per_chunk * self.block_size


def kv_load_mode(dtype, num_kv_heads: int, interpret) -> str:
    """How the kernel pulls one head's K and V out of the chunk buffer (see load_kv_head)."""
    if interpret is not False:
        return "index"
    rows = 2 * num_kv_heads
    if jnp.dtype(dtype).itemsize == 4 and rows % sublanes(dtype) == 0:
        return "strided"
    if jnp.dtype(dtype) == jnp.bfloat16 and rows % sublanes(dtype) == 0:
        return "packed"
    return "index"


def load_kv_head(kv_buf, slot, h: int, *, mode: str):
    """K and V of kv head ``h`` for every token of buffer ``slot``: two [ckv, D] values.

    The buffer holds whole cache blocks, ``[ckv, 2 * Hkv, D]`` per slot, K at row 2h and
    V at 2h + 1. Modes (all give the same values):

    * "index": plain indexing. The only one jax 0.10's TPU interpreter runs
      (it cannot read through ``Ref.reshape`` / ``Ref.bitcast``).
    * "strided" (32-bit): a sublane-strided load from a 2-D view of the buffer.
    * "packed" (bf16): rows 2h and 2h + 1 share one 32-bit word (K in the low
      half), so one strided load of the uint32 view fetches both and two bit
      operations split them, instead of strided loads of half-words.
    """
    _, ckv, heads2, head_dim = kv_buf.shape
    if mode == "index":
        return kv_buf[slot, :, 2 * h, :], kv_buf[slot, :, 2 * h + 1, :]
    if mode == "strided":
        flat = kv_buf.at[slot].reshape(ckv * heads2, head_dim)
        return (flat[pl.ds(2 * h, ckv, stride=heads2), :],
                flat[pl.ds(2 * h + 1, ckv, stride=heads2), :])
    if mode == "packed":
        heads = heads2 // 2
        words = kv_buf.at[slot].bitcast(jnp.uint32).reshape(ckv * heads, head_dim)
        w = words[pl.ds(h, ckv, stride=heads), :]
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
    chunk_lo = 0
    if s.sliding_window is not None:
        chunk_lo = jnp.maximum(first_pos - s.sliding_window + 1, 0) // s.chunk_kv
    chunk_hi = jnp.maximum(cdiv(kv_end, s.chunk_kv), chunk_lo + 1)
    return dict(q_start=q_start, q_end=q_end, ctx=ctx, t_lo=t_lo, t_hi=t_hi,
                kv_end=kv_end, chunk_lo=chunk_lo, chunk_hi=chunk_hi)


def _kernel(
    # scalar prefetch (SMEM)
    kv_lens_ref,        # [R]
    cu_q_lens_ref,      # [R + 1]
    distribution_ref,   # [3]
    blk_reqs_ref,       # [2 * num_q_blocks]: first request, one past last request, per q block
    slots_ref,          # [T_pad]: cache slot (block id * block_size + offset) of each new token
    # inputs
    q_ref,              # [Hkv, bq * G, D]              VMEM block
    new_kv_hbm,         # [T_pad, 2 * Hkv, D]           HBM, K/V interleaved like the cache
    block_tables_hbm,   # [R * blocks_per_seq]          HBM (a long-context table outgrows SMEM)
    cache_hbm,          # [NB, block_size, 2 * Hkv, D]  HBM, aliased with cache_out_hbm
    # outputs
    o_ref,              # [Hkv, bq * G, D]              VMEM block
    cache_out_hbm,      # [NB, block_size, 2 * Hkv, D]  HBM
    # scratch
    kv_buf,             # [2, ckv, 2 * Hkv, D]          VMEM, double buffer
    table_buf,          # [table_window] i32            SMEM, block ids around the chunk being issued
    sems,               # DMA semaphores [4]: fetch slot 0, fetch slot 1, cache write, block-table read
    m_ref,              # [Hkv, bq * G, 128] f32        running max (lane-replicated)
    l_ref,              # [Hkv, bq * G, 128] f32        running sum
    acc_ref,            # [Hkv, bq * G, D] f32          running numerator
    *,
    s: _Static,
):
    num_kv_heads, rows, head_dim = q_ref.shape
    ckv, bs = s.chunk_kv, s.block_size
    i = pl.program_id(0)
    num_q_blocks = pl.num_programs(0)
    blk_start = i * s.block_q
    r_first = blk_reqs_ref[i]
    r_end = blk_reqs_ref[num_q_blocks + i]
    total = cu_q_lens_ref[distribution_ref[2]]
    req = functools.partial(_request, s, blk_start=blk_start, cu_q_lens_ref=cu_q_lens_ref,
                            kv_lens_ref=kv_lens_ref)

    # ---- fused KV write: start now, wait at the end of the step.
    def write_request(r, carry):
        a = req(r)
        pos_lo = a["ctx"] + a["t_lo"] - a["q_start"]
        pos_hi = a["ctx"] + a["t_hi"] - a["q_start"]
        first_block = pos_lo // bs
        end_block = jnp.where(a["t_hi"] > a["t_lo"], cdiv(pos_hi, bs), first_block)

        def write_block(j, c):
            lo = jnp.maximum(pos_lo, j * bs)
            n = jnp.minimum(pos_hi, (j + 1) * bs) - lo
            t = a["q_start"] + lo - a["ctx"]                   # the first new token going to block j
            pltpu.make_async_copy(
                new_kv_hbm.at[pl.ds(t, n)],
                cache_out_hbm.at[slots_ref[t] // bs, pl.ds(lo - j * bs, n)],
                sems.at[2],
            ).start()
            return c

        return lax.fori_loop(first_block, end_block, write_block, carry)

    lax.fori_loop(r_first, r_end, write_request, 0)
    num_written = jnp.maximum(jnp.minimum(blk_start + s.block_q, total) - blk_start, 0)

    # ---- kv chunk fetch into one of the two VMEM buffers.
    def fetch(r, ch, slot, *, wait: bool):
        a = req(r)
        base = ch * ckv
        valid = jnp.clip(a["kv_end"] - base, 0, ckv)       # slots of this chunk we need
        if wait:
            # One wait for all copies into this slot: the semaphore counts bytes,
            # and the copies filled exactly rows [0, valid) of the buffer.
            @pl.when(valid > 0)
            def _():
                dst = kv_buf.at[slot, pl.ds(0, valid)]
                pltpu.make_async_copy(dst, dst, sems.at[slot]).wait()
            return
        cached = jnp.clip(a["ctx"] - base, 0, valid)        # from cache blocks
        num_blocks = cdiv(cached, bs)

        # This chunk's block ids, HBM -> SMEM, in a 128-aligned window (Mosaic slices SMEM and
        # HBM int32 arrays in whole 128-element tiles). Waited at once: the copies below read
        # them; the wait overlaps the previous chunk's transfer, in flight by now.
        first = r * s.blocks_per_seq + ch * s.blocks_per_chunk
        window = jnp.minimum(first // LANES * LANES, block_tables_hbm.shape[0] - s.table_window)
        window = pl.multiple_of(window, LANES)

        @pl.when(num_blocks > 0)
        def _():
            ids = pltpu.make_async_copy(block_tables_hbm.at[pl.ds(window, s.table_window)], table_buf, sems.at[3])
            ids.start()
            ids.wait()

        for j in range(s.blocks_per_chunk):                   # static: lets the scalar core pipeline issues
            size = jnp.clip(cached - j * bs, 0, bs)

            @pl.when(size > 0)
            def _():
                block_id = table_buf[first - window + j]
                pltpu.make_async_copy(
                    cache_hbm.at[block_id, pl.ds(0, size)],
                    kv_buf.at[slot, pl.ds(j * bs, size)],
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

    # ---- one online-softmax update: rows [row0, row0 + nrows) x kv chunk ch of request r.
    def attend(a, ch, slot, row0, nrows):
        base = ch * ckv
        shape = (nrows, ckv)
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
        v_ok = base + lax.broadcasted_iota(jnp.int32, (ckv, head_dim), 0) < a["kv_end"]
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

    def compute(r, ch, slot):
        a = req(r)
        if not s.tile_rows:
            attend(a, ch, slot, 0, rows)
            return
        first_tile = (a["t_lo"] - blk_start) * s.group // s.tile_rows
        last_tile = ((a["t_hi"] - blk_start) * s.group - 1) // s.tile_rows
        one_tile = first_tile == last_tile

        @pl.when(one_tile)
        def _():
            attend(a, ch, slot, pl.multiple_of(first_tile * s.tile_rows, s.tile_rows), s.tile_rows)

        @pl.when(jnp.logical_not(one_tile))
        def _():
            attend(a, ch, slot, 0, rows)

    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def next_item(r, ch):
        a = req(r)
        last = ch + 1 >= a["chunk_hi"]
        return jnp.where(last, r + 1, r), jnp.where(last, req(jnp.minimum(r + 1, r_end - 1))["chunk_lo"], ch + 1)

    # Software pipeline over the (request, kv chunk) items of this q block:
    # iteration k starts the copies of item k, then waits for and computes
    # item k - 1 from the other buffer. One copy of each code path.
    def step(carry):
        r_in, ch_in, r_cur, ch_cur, k = carry
        slot = k % 2
        issue = r_in < r_end

        @pl.when(issue)
        def _():
            fetch(r_in, ch_in, slot, wait=False)

        @pl.when(k > 0)
        def _():
            fetch(r_cur, ch_cur, 1 - slot, wait=True)
            compute(r_cur, ch_cur, 1 - slot)

        r_nxt, ch_nxt = next_item(jnp.minimum(r_in, r_end - 1), ch_in)
        return jnp.where(issue, r_nxt, r_in), ch_nxt, r_in, ch_in, k + 1

    def more(carry):
        r_in, _, r_cur, _, k = carry
        return jnp.where(k == 0, r_in, r_cur) < r_end

    ch0 = req(jnp.minimum(r_first, jnp.maximum(r_end - 1, 0)))["chunk_lo"]
    lax.while_loop(more, step, (r_first, ch0, r_first, ch0, jnp.int32(0)))

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


def _slot_mapping(block_tables, kv_lens, cu_q_lens, distribution, num_tokens: int, block_size: int):
    """[T] int32: the cache slot (block id * block_size + offset) each new token is written to; 0 for padding.

    The fused write needs one block id per new token's block; reading them here (T gathers in XLA)
    keeps the whole block table out of SMEM, whose 1 MiB a long-context table outgrows (256
    requests x 131072 tokens / 16 per block = 8 MiB).
    """
    blocks_per_seq = block_tables.shape[0] // kv_lens.shape[0]
    req, valid, pos = token_metadata(cu_q_lens, kv_lens, distribution, num_tokens)
    block = block_tables[req * blocks_per_seq + pos // block_size]
    return jnp.where(valid, block * block_size + pos % block_size, 0).astype(jnp.int32)


def _block_requests(cu_q_lens, distribution, num_q_blocks: int, block_q: int):
    """[2 * num_q_blocks] int32: per q block, first request and one past the last one."""
    total = cu_q_lens[distribution[2]]
    start = jnp.arange(num_q_blocks, dtype=jnp.int32) * block_q
    last = jnp.minimum(start + block_q, total) - 1
    r_first = jnp.searchsorted(cu_q_lens, start, side="right").astype(jnp.int32) - 1
    r_end = jnp.searchsorted(cu_q_lens, last, side="right").astype(jnp.int32)
    empty = start >= total
    r_first = jnp.where(empty, 0, jnp.clip(r_first, 0, distribution[2]))
    r_end = jnp.where(empty, 0, jnp.clip(r_end, 0, distribution[2]))
    return jnp.concatenate([r_first, r_end]).astype(jnp.int32)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "soft_cap", "num_kv_blocks_per_chunk",
                     "num_queries_per_block", "vmem_limit_bytes", "interpret"),
    donate_argnames=("kv_cache",),
)
def ragged_paged_attention(
    q,             # [T, Hq, D]
    k,             # [T, Hkv, D]
    v,             # [T, Hkv, D]
    kv_cache,      # [NB, block_size, 2 * Hkv, D]  donated, returned updated
    kv_lens,       # [R] int32: tokens in cache after this step; 0 for padded slots
    block_tables,  # [R * blocks_per_seq] int32: flattened block tables
    cu_q_lens,     # [R + 1] int32: cumulative new-token counts
    distribution,  # [3] int32: (decode_end, prefill_end, mixed_end)
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_kv_blocks_per_chunk: int = DEFAULT_NUM_KV_BLOCKS_PER_CHUNK,
    num_queries_per_block: int = DEFAULT_NUM_QUERIES_PER_BLOCK,
    vmem_limit_bytes: int | None = None,
    interpret=False,
):
    """Ragged paged attention with the KV write fused in. Returns ``(out [T, Hq, D], kv_cache)``.

    Token j of request r's q_len new tokens sits at position ``kv_lens[r] - q_len + j``;
    its K/V are written to that slot and it attends to positions ``0..pos``
    (``pos - sliding_window < p`` with a window), q head h using kv head
    ``h // (Hq // Hkv)``. Padding rows (past ``cu_q_lens[mixed_end]``) give 0 and
    write nothing. ``num_kv_blocks_per_chunk`` is capped at blocks_per_seq and
    ``num_queries_per_block`` at T rounded up to 8. ``interpret``: False on TPU,
    ``pltpu.InterpretParams(...)`` to run on CPU.
    """
    validate_inputs_static(
        q, k, v, kv_cache, kv_lens, block_tables, cu_q_lens, distribution,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
        num_kv_blocks_per_chunk=num_kv_blocks_per_chunk, num_queries_per_block=num_queries_per_block,
        vmem_limit_bytes=vmem_limit_bytes)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    block_size = kv_cache.shape[1]
    blocks_per_seq = block_tables.shape[0] // kv_lens.shape[0]

    block_q = min(num_queries_per_block, cdiv(num_tokens, 8) * 8)
    num_q_blocks = cdiv(num_tokens, block_q)
    padded = num_q_blocks * block_q
    blocks_per_chunk = min(num_kv_blocks_per_chunk, blocks_per_seq)
    rows = block_q * group
    tile_rows = math.lcm(group, sublanes(q.dtype))
    if rows % tile_rows or tile_rows >= rows:
        tile_rows = 0
    s = _Static(
        sm_scale=float(sm_scale), sliding_window=sliding_window,
        soft_cap=None if soft_cap is None else float(soft_cap), group=group, block_q=block_q,
        blocks_per_chunk=blocks_per_chunk, block_size=block_size, blocks_per_seq=blocks_per_seq,
        table_window=cdiv(blocks_per_chunk, LANES) * LANES + LANES, tile_rows=tile_rows,
        kv_load_mode=kv_load_mode(kv_cache.dtype, num_kv_heads, interpret))

    pad = ((0, padded - num_tokens), (0, 0), (0, 0))
    # [T, Hq, D] -> [Hkv, T * G, D]: the G q heads of a kv head become adjacent rows.
    q_rows = jnp.pad(q, pad).reshape(padded, num_kv_heads, group, head_dim)
    q_rows = q_rows.transpose(1, 0, 2, 3).reshape(num_kv_heads, padded * group, head_dim)
    new_kv = jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim)
    new_kv = jnp.pad(new_kv, pad)
    blk_reqs = _block_requests(cu_q_lens, distribution, num_q_blocks, block_q)
    slots = jnp.pad(_slot_mapping(block_tables, kv_lens, cu_q_lens, distribution, num_tokens, block_size),
                    (0, padded - num_tokens))
    # whole 128-element tiles, at least one window: the kernel copies ids in aligned windows
    table_len = max(cdiv(block_tables.shape[0], LANES) * LANES, s.table_window)
    block_tables = jnp.pad(block_tables, (0, table_len - block_tables.shape[0]))

    q_block = pl.BlockSpec((num_kv_heads, rows, head_dim), lambda i, *_: (0, i, 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    out_rows, kv_cache = pl.pallas_call(
        functools.partial(_kernel, s=s),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(num_q_blocks,),
            in_specs=[q_block, hbm, hbm, hbm],
            out_specs=[q_block, hbm],
            scratch_shapes=[
                pltpu.VMEM((2, s.chunk_kv, 2 * num_kv_heads, head_dim), kv_cache.dtype),
                pltpu.SMEM((s.table_window,), jnp.int32),
                pltpu.SemaphoreType.DMA((4,)),
                pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
            jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        ],
        # operand 8 = 5 scalar-prefetch arrays + q_rows + new_kv + block_tables, then the cache
        input_output_aliases={8: 1},
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel",), vmem_limit_bytes=vmem_limit_bytes),
        interpret=interpret,
        name="ragged_paged_attention",
    )(kv_lens, cu_q_lens, distribution, blk_reqs, slots, q_rows, new_kv, block_tables, kv_cache)

    out = out_rows.reshape(num_kv_heads, padded, group, head_dim).transpose(1, 0, 2, 3)
    return out.reshape(padded, num_q_heads, head_dim)[:num_tokens], kv_cache
