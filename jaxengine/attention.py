"""Ragged paged attention in plain XLA, tuned for the CPU serving path (and GPU through XLA).

Same contract and cache layout as :func:`pallas_kernels.ragged_paged_attention`
(so the two are interchangeable): one ragged batch of new tokens, requests
sorted decode-only, prefill-only, mixed; a paged cache
``[num_blocks, block_size, 2 * Hkv, D]`` with K of kv head ``h`` at ``2h`` and
V at ``2h + 1``; the new K/V written into the cache first, then every token
attends causally to its request's cached positions.

Two paths, because one vectorisation cannot serve both shapes well:

* decode rows (``r < decode_end``, one query each) run batched over the
  request axis: every step gathers a run of blocks *per request* (not per
  token) and folds it into an online softmax. The loop stops at the longest
  decode ``kv_len``, so nobody pays for ``max_model_len``; one `lax.switch`
  picks how many rows to process (a power of four that holds every decode
  row: padded request rows cost nothing).
* prefill and mixed rows are cut into work items of ``block_q`` consecutive
  queries of one request; a while loop walks the items and, for each, the kv
  blocks up to the causal limit of its last query. Large, dense matmuls per
  iteration; no quadratic mask over the whole token bucket, and prefix-cached
  context (mixed rows) is read from the cache like everything else.

Both loops have dynamic trip counts, so the compiled program depends only on
the padded token and request counts, never on kv lengths.
Logits, softmax and the weighted sum run in float32. On a CPU with the C kernels
the runner injects `jaxengine.cpu_wing.attention` instead, which comes here for
what those kernels do not cover.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

# Masked logits get this instead of -inf so exp(m_old - m_new) stays finite.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# kv tokens one decode loop iteration reads per row (see _decode_attention)
_DECODE_RUN = 64
_PREFILL_BLOCK_Q = 128
_PREFILL_BLOCK_KV = 512


def _cdiv(a, b):
    return (a + b - 1) // b


def write_kv(
    k,             # [T, Hkv, D]
    v,             # [T, Hkv, D]
    kv_cache,      # [NB, block_size, 2 * Hkv, D]
    req,           # [T] int32 request row of each token
    pos,           # [T] int32 absolute position of each token
    valid,         # [T] bool real (not padding) token
    table,         # [R, blocks_per_seq] int32
):
    """Scatter the new K/V into their slots; padding writes nothing (index out of range, dropped)."""
    T, Hkv, D = k.shape
    NB, block_size = kv_cache.shape[:2]
    block = jnp.where(valid, token_blocks(table, req, pos, block_size), NB)
    new_kv = jnp.stack([k, v], axis=2).reshape(T, 2 * Hkv, D).astype(kv_cache.dtype)
    return kv_cache.at[block, pos % block_size].set(new_kv, mode="drop")


def token_blocks(table, req, pos, block_size: int):
    """table [R, W], req / pos [T] (`token_rows`) -> [T] int32: the cache block each token's K/V go to."""
    return table[req, jnp.clip(pos // block_size, 0, table.shape[1] - 1)]


def token_rows(num_tokens: int, kv_lens, block_tables, cu_q_lens, distribution):
    """A ragged step's tokens: (table [R, W], req [T] each token's request row, pos [T] its position, valid [T]:
    a real token, not the bucket's padding)."""
    R = kv_lens.shape[0]
    table = block_tables.reshape(R, -1)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    req = jnp.clip(jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1, 0, R - 1)
    valid = t < cu_q_lens[distribution[2]]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    pos = jnp.where(valid, kv_lens[req] - q_lens[req] + (t - cu_q_lens[req]), 0)
    return table, req, pos, valid


def _decode_attention(q_rows, kv_cache, table, kv_lens, row_valid, *, sm_scale, sliding_window, soft_cap):
    """One query per request row. q_rows [R, Hq, D] -> [R, Hq, D] (f32).

    A loop over runs of `_DECODE_RUN` kv tokens per row: each iteration gathers the run's
    blocks of every row, scores the G query heads of each kv head against them (einsums over
    [R, Hkv, G, D] x [R, run, Hkv, D]) and folds them into an online softmax. Short runs keep
    the temporaries in cache: on XLA:CPU, 64-token runs beat longer ones and scoring on the
    interleaved K/V axis by a wide margin (benchmarks/README.md, "CPU step notes").
    """
    R, Hq, D = q_rows.shape
    block_size, two_hkv = kv_cache.shape[1], kv_cache.shape[2]
    Hkv = two_hkv // 2
    G = Hq // Hkv
    bps = table.shape[1]
    bp = max(1, min(bps, _DECODE_RUN // block_size))
    blk = bp * block_size
    table = jnp.pad(table, ((0, 0), (0, _cdiv(bps, bp) * bp - bps)))
    lens = jnp.where(row_valid, kv_lens, 0)
    qpos = lens - 1  # [R]
    lo_blk = 0
    if sliding_window is not None:
        big = jnp.iinfo(jnp.int32).max
        lo_blk = jnp.min(jnp.where(row_valid, jnp.maximum(qpos - sliding_window + 1, 0), big))
        lo_blk = jnp.minimum(lo_blk, jnp.max(lens)) // blk
    hi_blk = _cdiv(jnp.max(lens), blk)
    qg = q_rows.reshape(R, Hkv, G, D).astype(jnp.float32) * sm_scale

    def body(carry):
        j, m, l, acc = carry
        blocks = lax.dynamic_slice_in_dim(table, j * bp, bp, axis=1)  # [R, bp]
        kv = kv_cache[blocks].reshape(R, blk, Hkv, 2, D).astype(jnp.float32)
        s = jnp.einsum("rhgd,rshd->rhgs", qg, kv[:, :, :, 0])  # [R, Hkv, G, blk]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kpos = j * blk + jnp.arange(blk, dtype=jnp.int32)
        mask = kpos[None, :] <= qpos[:, None]
        if sliding_window is not None:
            mask &= kpos[None, :] > qpos[:, None] - sliding_window
        mask = mask[:, None, None, :]
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1))  # [R, Hkv, G]
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        acc = alpha[..., None] * acc + jnp.einsum("rhgs,rshd->rhgd", p, kv[:, :, :, 1])
        return j + 1, m_new, alpha * l + p.sum(-1), acc

    init = (
        jnp.asarray(lo_blk, jnp.int32),
        jnp.full((R, Hkv, G), MASK_VALUE, jnp.float32),
        jnp.zeros((R, Hkv, G), jnp.float32),
        jnp.zeros((R, Hkv, G, D), jnp.float32),
    )
    _, _, l, acc = lax.while_loop(lambda c: c[0] < hi_blk, body, init)
    return (acc / jnp.where(l > 0, l, 1.0)[..., None]).reshape(R, Hq, D)


def _decode_switch(q_rows, kv_cache, table, kv_lens, num_decode, **kw):
    """Run the decode path on as few rows as this step needs (one `lax.switch`).

    Decode rows come first in the batch, so rows [0, n) cover them for the smallest n among
    1, 4, 16, ... R that is >= the number of decode rows; the rest of the bucket (padding,
    prefill rows) is neither gathered nor scored. Only the branch taken runs.
    """
    R = q_rows.shape[0]
    sizes = [1]
    while sizes[-1] < R:
        sizes.append(min(4 * sizes[-1], R))

    def branch(n):
        def fn(q_rows, table, kv_lens, num_decode):
            out = _decode_attention(q_rows[:n], kv_cache, table[:n], kv_lens[:n], jnp.arange(n) < num_decode, **kw)
            return jnp.pad(out, ((0, R - n), (0, 0), (0, 0)))
        return fn

    if len(sizes) == 1:
        return branch(R)(q_rows, table, kv_lens, num_decode)
    idx = jnp.minimum(jnp.searchsorted(jnp.asarray(sizes, jnp.int32), num_decode, side="left"), len(sizes) - 1)
    return lax.switch(idx, [branch(n) for n in sizes], q_rows, table, kv_lens, num_decode)


def _prefill_attention(
    q, kv_cache, table, kv_lens, cu_q_lens, distribution, out, *, sm_scale, sliding_window, soft_cap
):
    """Rows in [decode_end, mixed_end), block_q queries of one request per work item. Writes into out."""
    T, Hq, D = q.shape
    block_size, two_hkv = kv_cache.shape[1], kv_cache.shape[2]
    Hkv = two_hkv // 2
    G = Hq // Hkv
    R, bps = table.shape
    bq = min(_PREFILL_BLOCK_Q, _cdiv(T, 8) * 8)
    bp = max(1, min(bps, _PREFILL_BLOCK_KV // block_size))
    blk = bp * block_size
    table = jnp.pad(table, ((0, 0), (0, _cdiv(bps, bp) * bp - bps)))

    rows = jnp.arange(R, dtype=jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    is_pf = (rows >= distribution[0]) & (rows < distribution[2])
    nblk = jnp.where(is_pf, _cdiv(q_lens, bq), 0)
    ends = jnp.cumsum(nblk)
    num_items = ends[-1]

    q_pad = jnp.pad(q, ((0, bq), (0, 0), (0, 0)))
    out = jnp.pad(out, ((0, bq), (0, 0), (0, 0)))

    def item(carry):
        i, out = carry
        r = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)
        j = i - (ends[r] - nblk[r])
        qs = cu_q_lens[r] + j * bq
        nq = jnp.minimum(bq, cu_q_lens[r + 1] - qs)
        pos0 = kv_lens[r] - q_lens[r] + j * bq
        qpos = pos0 + jnp.arange(bq, dtype=jnp.int32)  # [bq]
        qvalid = jnp.arange(bq) < nq
        qb = lax.dynamic_slice_in_dim(q_pad, qs, bq, axis=0)  # [bq, Hq, D]
        # [Hkv, G * bq, D]: plain per-kv-head 2-D matmuls are what XLA:CPU runs fastest
        qh = (qb.reshape(bq, Hkv, G, D).astype(jnp.float32) * sm_scale).transpose(1, 2, 0, 3)
        qh = qh.reshape(Hkv, G * bq, D)
        rpos = jnp.tile(qpos, G)  # [G * bq]
        row_blocks = table[r]
        lo = 0
        if sliding_window is not None:
            lo = jnp.maximum(pos0 - sliding_window + 1, 0) // blk
        hi = _cdiv(pos0 + nq, blk)

        def kv_step(c):
            kb_i, m, l, acc = c
            blocks = lax.dynamic_slice_in_dim(row_blocks, kb_i * bp, bp)
            kv = kv_cache[blocks].reshape(blk, Hkv, 2, D).astype(jnp.float32)
            kb = kv[:, :, 0, :].transpose(1, 0, 2)  # [Hkv, blk, D]
            vb = kv[:, :, 1, :].transpose(1, 0, 2)
            s = jnp.einsum("hmd,hbd->hmb", qh, kb)
            if soft_cap is not None:
                s = soft_cap * jnp.tanh(s / soft_cap)
            kpos = kb_i * blk + jnp.arange(blk, dtype=jnp.int32)
            mask = kpos[None, :] <= rpos[:, None]
            if sliding_window is not None:
                mask &= kpos[None, :] > rpos[:, None] - sliding_window
            s = jnp.where(mask, s, MASK_VALUE)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
            alpha = jnp.exp(m - m_new)
            acc = alpha[..., None] * acc + jnp.einsum("hmb,hbd->hmd", p, vb)
            return kb_i + 1, m_new, alpha * l + p.sum(-1), acc

        shape = (Hkv, G * bq)
        init = (
            jnp.asarray(lo, jnp.int32),
            jnp.full(shape, MASK_VALUE, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (D,), jnp.float32),
        )
        _, _, l, acc = lax.while_loop(lambda c: c[0] < hi, kv_step, init)
        res = acc / jnp.where(l > 0, l, 1.0)[..., None]  # [Hkv, G * bq, D]
        res = res.reshape(Hkv, G, bq, D).transpose(2, 0, 1, 3).reshape(bq, Hq, D).astype(out.dtype)
        old = lax.dynamic_slice_in_dim(out, qs, bq, axis=0)
        new = jnp.where(qvalid[:, None, None], res, old)
        return i + 1, lax.dynamic_update_slice_in_dim(out, new, qs, axis=0)

    _, out = lax.while_loop(lambda c: c[0] < num_items, item, (jnp.int32(0), out))
    return out[:T]


def ragged_paged_attention_xla(
    q,             # [T, Hq, D]
    k,             # [T, Hkv, D]
    v,             # [T, Hkv, D]
    kv_cache,      # [NB, block_size, 2 * Hkv, D]
    kv_lens,       # [R] int32: tokens in cache after this step; 0 for padded rows
    block_tables,  # [R * blocks_per_seq] int32: flattened block tables
    cu_q_lens,     # [R + 1] int32
    distribution,  # [3] int32: (decode_end, prefill_end, mixed_end)
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
):
    """Writes the new K/V, then attends. Returns ``(out [T, Hq, D] in q.dtype, kv_cache)``; padding rows are 0."""
    T, Hq, D = q.shape
    R = kv_lens.shape[0]
    table, req, pos, valid = token_rows(T, kv_lens, block_tables, cu_q_lens, distribution)
    # The cache is written and read in its own 4-D shape only. Reading a reshaped view of it (say one row
    # per slot) lets XLA:CPU push the reshape through the in-place write, duplicating the write, and each
    # duplicate copies the whole cache, every layer of every step (decode became two orders of magnitude
    # slower once block tables had 64 columns). tests/test_jax_attention.py checks the HLO.
    kv_cache = write_kv(k, v, kv_cache, req, pos, valid, table)

    # decode rows: request r's only query is token cu_q_lens[r]
    rows = jnp.arange(R, dtype=jnp.int32)
    row_valid = rows < distribution[0]
    tok = jnp.clip(cu_q_lens[:R], 0, T - 1)
    dec = _decode_switch(
        q[tok], kv_cache, table, kv_lens, distribution[0],
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
    )
    out = jnp.zeros((T, Hq, D), q.dtype)
    out = out.at[jnp.where(row_valid, tok, T)].set(dec.astype(out.dtype), mode="drop")
    out = _prefill_attention(
        q, kv_cache, table, kv_lens, cu_q_lens, distribution, out,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap,
    )
    return out, kv_cache
