"""Pure-JAX reference for ragged paged attention (and the JAX backend's CPU/GPU path).

Same contract as :func:`pallas_kernels.ragged_paged_attention`: one ragged
batch of new tokens, a paged KV cache ``[num_blocks, block_size, 2 * Hkv, D]``
with K of kv head ``h`` at index ``2h`` and V at ``2h + 1``, block tables
flattened into ``block_tables``.

It is jittable with static shapes and vectorised over tokens: every token
gathers, chunk by chunk, the blocks of its own request and runs an online
softmax over them. The loop stops at the longest ``kv_len`` of the batch, so a
batch of short requests does not pay for ``blocks_per_seq * block_size``; a
chunk is at most ``_CHUNK_TOKENS`` positions and one chunk's gather at most
``_GATHER_BUDGET`` elements, whatever the token bucket.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

# Masked logits get this instead of -inf so that exp(m_old - m_new) of a row
# with nothing visible yet stays finite (exp(0) = 1, not nan).
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Per kv-chunk step: at most this many gathered K/V elements (bounds memory),
# and at most this many key positions (the loop runs to the longest kv_len a
# chunk at a time, so small chunks let a batch of short requests stop early).
_GATHER_BUDGET = 1 << 24
_CHUNK_TOKENS = 256


def token_metadata(cu_q_lens, kv_lens, distribution, num_tokens: int):
    """Per-token request id, validity and absolute position.

    Returns ``(req_ids [T] int32, valid [T] bool, positions [T] int32)``.
    Tokens at or beyond ``cu_q_lens[mixed_end]`` are padding: ``valid`` is
    False, their request id is clamped into range and their position is 0.
    """
    num_reqs = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    # Request r owns tokens [cu_q_lens[r], cu_q_lens[r+1]); side="right" skips
    # empty requests (repeated cumulative values).
    req = jnp.searchsorted(cu_q_lens, t, side="right").astype(jnp.int32) - 1
    req = jnp.clip(req, 0, num_reqs - 1)
    valid = t < cu_q_lens[distribution[2]]
    q_start = cu_q_lens[req]
    q_len = cu_q_lens[req + 1] - q_start
    pos = kv_lens[req] - q_len + (t - q_start)
    return req, valid, jnp.where(valid, pos, 0)


def write_kv_ref(
    k,             # [T, Hkv, D]
    v,             # [T, Hkv, D]
    kv_cache,      # [NB, block_size, 2 * Hkv, D]
    kv_lens,       # [R] int32
    block_tables,  # [R * blocks_per_seq] int32
    cu_q_lens,     # [R + 1] int32
    distribution,  # [3] int32
):
    """Scatters the new K/V of every real token into its block slot.

    Padding tokens write nothing (their scatter index is out of range and
    dropped). Returns the updated cache.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    num_blocks, block_size = kv_cache.shape[:2]
    blocks_per_seq = block_tables.shape[0] // kv_lens.shape[0]
    req, valid, pos = token_metadata(cu_q_lens, kv_lens, distribution, num_tokens)
    block = block_tables[req * blocks_per_seq + pos // block_size]
    block = jnp.where(valid, block, num_blocks)  # out of range -> dropped
    slot = pos % block_size
    new_kv = jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim)
    return kv_cache.at[block, slot].set(new_kv.astype(kv_cache.dtype), mode="drop")


def _chunk_blocks(num_tokens: int, block_size: int, blocks_per_seq: int, row_elems: int) -> int:
    blocks = min(_CHUNK_TOKENS // block_size, _GATHER_BUDGET // max(num_tokens * block_size * row_elems, 1))
    return max(1, min(blocks_per_seq, blocks))


def ref_ragged_paged_attention(
    q,             # [T, Hq, D]
    k,             # [T, Hkv, D]
    v,             # [T, Hkv, D]
    kv_cache,      # [NB, block_size, 2 * Hkv, D]
    kv_lens,       # [R] int32: tokens in cache after this step
    block_tables,  # [R * blocks_per_seq] int32
    cu_q_lens,     # [R + 1] int32
    distribution,  # [3] int32: (decode_end, prefill_end, mixed_end)
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
):
    """Writes the new K/V into the cache, then attends causally over it.

    Returns ``(out [T, Hq, D] in q.dtype, kv_cache)``. Padding rows are 0.
    Logits, softmax and the weighted sum run in float32.

    Cost: every token gathers its own request's blocks, so the work is about
    ``T * max(kv_lens) * 2 * Hkv * D`` gathered elements: right for decode,
    wasteful for long prefills (a request's K/V is gathered once per new token).
    Scoring every token against every request's keys instead (no duplication,
    R times the logits) measured slower on CPU for all shapes tried.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    block_size = kv_cache.shape[1]
    num_reqs = kv_lens.shape[0]
    blocks_per_seq = block_tables.shape[0] // num_reqs

    kv_cache = write_kv_ref(k, v, kv_cache, kv_lens, block_tables, cu_q_lens, distribution)
    req, valid, pos = token_metadata(cu_q_lens, kv_lens, distribution, num_tokens)

    chunk_blocks = _chunk_blocks(num_tokens, block_size, blocks_per_seq, 2 * num_kv_heads * head_dim)
    chunk = chunk_blocks * block_size
    num_chunks_max = math.ceil(blocks_per_seq / chunk_blocks)
    table = block_tables.reshape(num_reqs, blocks_per_seq)
    table = jnp.pad(table, ((0, 0), (0, num_chunks_max * chunk_blocks - blocks_per_seq)))
    real = jnp.arange(num_reqs) < distribution[2]
    num_chunks = (jnp.max(jnp.where(real, kv_lens, 0)) + chunk - 1) // chunk   # dynamic: skip unused chunks

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    hi = lax.Precision.HIGHEST

    def body(carry):
        j, m, l, acc = carry
        blocks = lax.dynamic_slice_in_dim(table, j * chunk_blocks, chunk_blocks, axis=1)[req]  # [T, cb]
        kv = kv_cache[blocks].reshape(num_tokens, chunk, num_kv_heads, 2, head_dim)
        kb, vb = kv[..., 0, :], kv[..., 1, :].astype(jnp.float32)                     # [T, chunk, Hkv, D]
        s = jnp.einsum("thgd,tbhd->thgb", qg, kb, preferred_element_type=jnp.float32, precision=hi)
        s = s * sm_scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        kpos = j * chunk + jnp.arange(chunk, dtype=jnp.int32)
        mask = (kpos[None, :] <= pos[:, None]) & valid[:, None]
        if sliding_window is not None:
            mask &= kpos[None, :] > pos[:, None] - sliding_window
        mask = mask[:, None, None, :]                                                  # [T, 1, 1, chunk]
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + p.sum(-1)
        pv = jnp.einsum("thgb,tbhd->thgd", p, vb, precision=hi)
        return j + 1, m_new, l, alpha[..., None] * acc + pv

    shape = (num_tokens, num_kv_heads, group)
    init = (
        jnp.int32(0),
        jnp.full(shape, MASK_VALUE, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape + (head_dim,), jnp.float32),
    )
    _, _, l, acc = lax.while_loop(lambda c: c[0] < num_chunks, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype), kv_cache
