"""jaxengine.attention (the XLA ragged paged attention of the CPU/GPU path) against a plain numpy reference.

Ragged batches with decode-only, prefill-only and mixed (prefix-cached context)
rows, a lone decode row (the batch-1 branch), padded tokens and rows, GQA and
sliding windows; the cache after the call holds the new K/V at their slots and
nothing else changed. Also against pallas_kernels' pure-JAX reference (the two
are interchangeable by contract).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from jaxengine.attention import ragged_paged_attention_xla

BS = 8


def make_batch(q_lens, ctx, *, Hq=4, Hkv=2, D=16, num_pages=96, pps=24, Tp=160, Rp=8, seed=0):
    """Every case padded to the same (Tp, Rp) bucket: one compile serves them all."""
    rng = np.random.default_rng(seed)
    R = len(q_lens)
    T = sum(q_lens)
    assert T < Tp and R < Rp
    kv_lens = np.zeros(Rp, np.int32)
    kv_lens[:R] = np.array(q_lens) + np.array(ctx)
    cu = np.zeros(Rp + 1, np.int32)
    cu[1 : R + 1] = np.cumsum(q_lens)
    cu[R + 1 :] = T
    free = rng.permutation(np.arange(1, num_pages))
    table = np.zeros((Rp, pps), np.int32)
    k = 0
    for r in range(R):
        n = -(-int(kv_lens[r]) // BS)
        table[r, :n] = free[k : k + n]
        k += n
    cls = [0 if q == 1 else (1 if c == 0 else 2) for q, c in zip(q_lens, ctx)]
    assert cls == sorted(cls), "rows must be sorted decode, prefill, mixed"
    dist = np.array([cls.count(0), cls.count(0) + cls.count(1), R], np.int32)
    q = rng.standard_normal((Tp, Hq, D)).astype(np.float32)
    k_new = rng.standard_normal((Tp, Hkv, D)).astype(np.float32)
    v_new = rng.standard_normal((Tp, Hkv, D)).astype(np.float32)
    cache = rng.standard_normal((num_pages, BS, 2 * Hkv, D)).astype(np.float32)
    return q, k_new, v_new, cache, kv_lens, table.reshape(-1), cu, dist


def numpy_reference(q, k, v, cache, kv_lens, block_tables, cu, dist, sm_scale, window=None):
    Tp, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    R = len(kv_lens)
    table = block_tables.reshape(R, -1)
    cache = cache.copy()
    out = np.zeros_like(q)
    for r in range(int(dist[2])):
        s, e = int(cu[r]), int(cu[r + 1])
        L = int(kv_lens[r])
        for j, t in enumerate(range(s, e)):
            pos = L - (e - s) + j
            page, slot = table[r, pos // BS], pos % BS
            cache[page, slot, 0::2] = k[t]
            cache[page, slot, 1::2] = v[t]
        rows = np.concatenate([cache[table[r, p // BS], p % BS][None] for p in range(L)])  # [L, 2Hkv, D]
        K, Vv = rows[:, 0::2], rows[:, 1::2]
        for j, t in enumerate(range(s, e)):
            pos = L - (e - s) + j
            for h in range(Hq):
                kh = h // G
                sc = K[: pos + 1, kh] @ q[t, h] * sm_scale
                if window is not None:
                    sc[: max(0, pos - window + 1)] = -np.inf
                p = np.exp(sc - sc.max())
                out[t, h] = (p / p.sum()) @ Vv[: pos + 1, kh]
    return out, cache


CASES = {
    "decode_only": ([1, 1, 1, 1], [5, 40, 17, 90]),
    "lone_decode": ([1], [70]),
    "lone_decode_plus_prefill": ([1, 12], [33, 0]),
    "prefill_only": ([7, 30, 1 + 2 * BS], [0, 0, 0]),
    "mixed": ([1, 1, 9, 4, 25], [3, 60, 0, 11, 19]),
    "long_prefill_chunk": ([150], [0]),
}


attention = jax.jit(ragged_paged_attention_xla, static_argnames=("sm_scale", "sliding_window"))


@pytest.mark.parametrize("window", [None, 13])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_numpy_reference(case, window):
    args = make_batch(*CASES[case], Hq=6, Hkv=2, D=16, seed=sum(map(ord, case)))
    out, cache = attention(*map(jnp.asarray, args), sm_scale=0.25, sliding_window=window)
    want_out, want_cache = numpy_reference(*args, sm_scale=0.25, window=window)
    T = int(args[6][int(args[7][2])])
    np.testing.assert_allclose(np.asarray(out)[:T], want_out[:T], rtol=2e-5, atol=2e-5)
    assert not np.asarray(out)[T:].any(), "padding rows must be 0"
    np.testing.assert_array_equal(np.asarray(cache), want_cache)  # padding wrote nothing


@pytest.mark.parametrize("case", [
    ([1, 1, 1, 1, 1], [700, 30, 600, 5, 519]),  # five decode rows (the 8-row branch), long contexts
    ([1, 1, 1, 1, 1, 1, 40], [3, 9, 1, 14, 2, 511, 0]),  # six decode rows and a prefill
])
def test_decode_branches_rows_and_kv_runs(case):
    """The decode switch: more decode rows than the 4-row branch holds, and contexts of many kv runs."""
    args = make_batch(*case, Hq=4, Hkv=2, D=16, num_pages=400, pps=100, Tp=64, Rp=8, seed=7)
    out, cache = attention(*map(jnp.asarray, args), sm_scale=0.25, sliding_window=None)
    want_out, want_cache = numpy_reference(*args, sm_scale=0.25)
    T = int(args[6][int(args[7][2])])
    np.testing.assert_allclose(np.asarray(out)[:T], want_out[:T], rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(cache), want_cache)


def test_agrees_with_pallas_reference():
    theirs = jax.jit(pallas_kernels.ref_ragged_paged_attention, static_argnames=("sm_scale", "sliding_window"))
    for case in ("mixed", "lone_decode_plus_prefill"):
        args = [jnp.asarray(a) for a in make_batch(*CASES[case], seed=3)]
        o1, c1 = attention(*args, sm_scale=0.25, sliding_window=None)
        o2, c2 = theirs(*args, sm_scale=0.25, sliding_window=None)
        np.testing.assert_allclose(np.asarray(o1), np.asarray(o2), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(c1), np.asarray(c2))


@pytest.mark.parametrize("cpu_decode,dtype", [(False, jnp.float32), (True, jnp.float32), (True, jnp.bfloat16),
                                              (True, jnp.float16)])
@pytest.mark.parametrize("pps,Rp,Tp", [(32, 1, 1), (64, 1, 1), (128, 8, 16)])
def test_cache_is_updated_in_place_inside_a_layer_scan(pps, Rp, Tp, cpu_decode, dtype):
    """Compiled as the model runs it (a scan over layers carrying one donated cache), the write and both
    attention loops must not copy the cache: a copy costs the whole cache per layer per step. XLA:CPU once made
    four such copies per layer when block tables were 64+ columns wide (decode 30 ms -> 7 s per step), and
    wrapped its scatter into a 16-bit float cache in conversions of the whole cache to float32 and back (a
    bfloat16 model's decode step 3.9 s; the CPU path writes with `cpu_kernels.kv_write`)."""
    L, Hq, Hkv, D, bs, pages = 3, 4, 2, 16, 16, 256
    cache = jnp.zeros((L * pages, bs, 2 * Hkv, D), dtype)

    attention = ragged_paged_attention_xla
    if cpu_decode:
        from jaxengine.cpu_wing import attention

    def step(cache, q, k, v, kv_lens, table, cu, dist):
        def body(cache, l):
            out, cache = attention(q, k, v, cache, kv_lens, (table + l * pages).reshape(-1), cu, dist,
                                   sm_scale=D**-0.5)
            return cache, out.sum()

        return jax.lax.scan(body, cache, jnp.arange(L, dtype=jnp.int32))

    args = (cache, jnp.zeros((Tp, Hq, D), dtype), jnp.zeros((Tp, Hkv, D), dtype), jnp.zeros((Tp, Hkv, D), dtype),
            jnp.zeros(Rp, jnp.int32), jnp.zeros((Rp, pps), jnp.int32), jnp.zeros(Rp + 1, jnp.int32),
            jnp.zeros(3, jnp.int32))
    if cpu_decode:
        from cpu_kernels import jax_ops

        if jax_ops.available():
            pytest.skip(jax_ops.available())
    hlo = jax.jit(step, donate_argnums=(0,)).lower(*args).compile().as_text()
    if cpu_decode:
        assert jax_ops.DECODE_ATTENTION in hlo
    big = [line.strip() for line in hlo.splitlines()
           if f"[{L * pages}," in line and any(op in line for op in (" copy(", "copy-start", " convert("))]
    assert not big, "\n".join(big[:4])


@pytest.mark.parametrize("case", ["mixed", "decode_only"])
def test_a_16bit_models_attention_on_the_cpu_kernels(case):
    """A bfloat16 model's attention on the CPU kernels (`cpu_wing.attention`: jax on a CPU runs it so for 16-bit
    models too): its queries read into float32, a bfloat16 cache, the output rounded back to bfloat16 (padding
    rows 0); against the numpy reference on the same rounded values, within bfloat16's rounding of the output."""
    from cpu_kernels import jax_ops
    from jaxengine.cpu_wing import attention

    if jax_ops.available():
        pytest.skip(f"the CPU custom calls do not run here: {jax_ops.available()}")
    bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    q, k, v, cache, kv_lens, table, cu, dist = make_batch(*CASES[case], Hq=6, Hkv=2, D=16, seed=5)
    q, k, v, cache = bf(q), bf(k), bf(v), bf(cache)
    b16 = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    f = jax.jit(attention, static_argnames=("sm_scale", "sliding_window"))
    args = (b16(q), b16(k), b16(v), b16(cache), jnp.asarray(kv_lens), jnp.asarray(table), jnp.asarray(cu),
            jnp.asarray(dist))
    hlo = f.lower(*args, sm_scale=0.25).as_text()
    assert jax_ops.DECODE_ATTENTION in hlo and jax_ops.PREFILL_ATTENTION in hlo  # the kernels' path
    out, new_cache = f(*args, sm_scale=0.25)
    assert out.dtype == jnp.bfloat16
    want_out, want_cache = numpy_reference(q, k, v, cache, kv_lens, table, cu, dist, sm_scale=0.25)
    T = int(cu[int(dist[2])])
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32))[:T], want_out[:T], rtol=1e-2, atol=1e-2)
    assert not np.asarray(out.astype(jnp.float32))[T:].any(), "padding rows must be 0"
    np.testing.assert_array_equal(np.asarray(new_cache.astype(jnp.float32)), want_cache)
