"""cpu_kernels.jax_ops: the jax backend's CPU kernels as XLA custom calls.

Linears: the panels are the torch backend's layout; against a float64 product for every layer of a stacked
weight; a row's bits the same alone as in any batch and the same as the torch backend's `panel_gemm` on the
same data (one kernel for both backends); the argmax variant the product's first maximum (ties, NaN); a bad layer index or output width is an error, not a read past
the weights; inside a scan it reads each layer's weights without the dynamic-slice copy XLA's dot needs. Decode attention: against XLA's decode path (GQA, sliding windows,
fewer decode rows than rows), a row the same alone as among others, and a block id or length that would
read outside the cache refused; the cache writes as astype rounds, in place. RMSNorm: the torch backend's bits, a row's the same in any batch (XLA's is
not). Engine-level: tests/test_jax_model.py (greedy tokens vs transformers,
and vs XLA's dots).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import jax_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", autouse=True)
def available():
    why = jax_ops.available()
    if why:
        pytest.skip(f"the CPU custom call does not run here: {why}")


def data(L, N, K, T, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((T, K), np.float32), rng.standard_normal((L, N, K), np.float32)


def linear(x, w, layer):
    """x . w[layer]^T through the custom call on w [L, N, K] packed into panels."""
    return jax_ops.panel_linear(x, jax_ops.pack_panels(w), layer, w.shape[1])


def test_pack_panels_is_the_torch_backends_layout_and_panel_rows_inverts_it():
    from cpu_kernels import torch_ops as torch_kernels

    _, w = data(1, 50, 37, 1)
    packed = np.asarray(jax_ops.pack_panels(jnp.asarray(w[0])))
    import torch

    assert np.array_equal(packed, torch_kernels.pack_panels(torch.from_numpy(w[0])).numpy())
    ids = jnp.asarray([0, 15, 16, 49, 7], jnp.int32)
    assert np.array_equal(np.asarray(jax_ops.panel_rows(jnp.asarray(packed), ids)), w[0][np.asarray(ids)])


@pytest.mark.parametrize("L,N,K,T", [(3, 50, 37, 1), (2, 200, 96, 5), (1, 1000, 576, 37), (4, 24, 8, 70),
                                     (1, 576, 64, 300)])
def test_linear_matches_float64_every_layer(L, N, K, T):
    x, w = data(L, N, K, T)
    f = jax.jit(linear)
    for l in range(L):
        y = np.asarray(f(x, w, jnp.int32(l)))
        ref = x.astype(np.float64) @ w[l].astype(np.float64).T
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.sqrt(K))


def test_a_row_is_the_same_alone_and_in_any_batch():
    x, w = data(2, 1000, 576, 300, seed=1)  # 300 rows: the k-blocked order, its row blocks of 48
    f = jax.jit(linear)
    full = np.asarray(f(x, w, jnp.int32(1)))
    for lo, hi in [(0, 1), (5, 6), (3, 7), (10, 37), (0, 256)]:
        part = np.asarray(f(x[lo:hi], w, jnp.int32(1)))
        assert np.array_equal(part, full[lo:hi]), (lo, hi)


@pytest.mark.parametrize("T", [9, 300])
def test_bits_equal_the_torch_backends_panel_gemm(T):
    import torch

    from cpu_kernels import torch_ops as torch_kernels

    lib, why = torch_kernels.load()
    if lib is None:
        pytest.skip(why)
    x, w = data(3, 333, 200, T, seed=2)
    y = torch_kernels.panel_gemm(lib, torch.from_numpy(x), torch_kernels.pack_panels(torch.from_numpy(w[2])), 333)
    assert np.array_equal(np.asarray(jax.jit(linear)(x, w, jnp.int32(2))), y.numpy())


@pytest.mark.parametrize("T", [1, 7, 18, 19, 29, 32, 300])
def test_argmax_is_the_first_maximum_of_the_linear_and_the_torch_backends_greedy_token(T, blocked_from):
    """panel_argmax: the first index of each row's maximum of panel_linear's product (ties across the sets of
    running maxima XLA's threads fold into, by slice or by claim from `blocked_from` rows, and within one lane of
    a set; NaN counting as the largest), the torch backend's panel_gemm greedy tokens. Both loop orders: the
    unblocked tiles below `blocked_from` rows, the k-blocked ones from there (29: its 5-row tail; 32: a batch-32
    decode step's 2-row tail; 7 and 19 from 6: a tail of 1)."""
    import torch

    from cpu_kernels import torch_ops as torch_kernels

    x, w = data(2, 5003, 64, T, seed=3)
    w[1, 4100] = w[1, 37]  # the same row twice, far apart: the same product bits, a tie the lower index wins
    w[1, 45] = w[1, 37]  # the same lane of the same panel (37 + 8): a tie inside one running maximum
    w[1, 3237] = w[1, 37]  # the same lane 200 panels on: across slices when XLA has threads enough
    x[0] = 4 * w[1, 37]  # row 0's maximum is that pair
    panels = jax_ops.pack_panels(w)
    argmax = jax.jit(functools.partial(jax_ops.panel_argmax, n=5003))
    for layer in (0, 1):
        logits = np.asarray(jax.jit(linear)(x, w, jnp.int32(layer)))
        got = np.asarray(argmax(x, panels, jnp.int32(layer)))
        assert got.dtype == np.int32 and np.array_equal(got, logits.argmax(-1)), layer
    assert got[0] == 37
    lib, why = torch_kernels.load()
    if lib is not None:
        tp = torch_kernels.pack_panels(torch.from_numpy(w[1]))
        assert np.array_equal(got, torch_kernels.panel_gemm(lib, torch.from_numpy(x), tp, 5003, greedy=True).numpy())
    w[0, 2999, 5] = np.nan  # every row's product there is NaN: the first NaN wins, as in jnp.argmax
    w[0, 4500, 7] = np.nan
    got = np.asarray(argmax(x, jax_ops.pack_panels(w), jnp.int32(0)))
    assert np.array_equal(got, np.full(T, 2999))
    with pytest.raises(Exception, match="disagree"):
        np.asarray(jax.jit(functools.partial(jax_ops.panel_argmax, n=4900))(x, panels, jnp.int32(0)))


def test_a_layer_index_out_of_range_or_a_wrong_width_is_an_error():
    x, w = data(2, 30, 16, 3)
    f = jax.jit(linear)
    for bad in (-1, 2):
        with pytest.raises(Exception, match="layer index out of range"):
            np.asarray(f(x, w, jnp.int32(bad)))
    panels = jax_ops.pack_panels(w)  # 2 panels: 17..32 outputs
    for n in (16, 33):
        with pytest.raises(Exception, match="disagree"):
            np.asarray(jax.jit(functools.partial(jax_ops.panel_linear, n=n))(x, panels, jnp.int32(0)))


@pytest.mark.parametrize("K", [64, 576, 1000])
def test_rms_norm_rows_do_not_depend_on_the_row_count_and_equal_the_torch_backends(K):
    """XLA's own RMSNorm reduces a row in another order from 8 rows up (the pitfall is checked here too);
    the custom call is the torch backend's rms_norm, a row's bits the same in any batch."""
    import torch

    from jaxengine.model import rms_norm as xla_rms_norm
    from cpu_kernels import torch_ops as torch_kernels

    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((300, K), np.float32) * 3, rng.standard_normal(K, np.float32)
    f = jax.jit(functools.partial(jax_ops.rms_norm, eps=1e-5))
    full = np.asarray(f(x, w))
    ref = x.astype(np.float64) / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(full, ref, rtol=2e-6, atol=2e-6)
    for lo, hi in [(0, 1), (5, 7), (3, 10), (10, 47), (0, 256)]:
        assert np.array_equal(np.asarray(f(x[lo:hi], w)), full[lo:hi]), (lo, hi)
    g = jax.jit(functools.partial(xla_rms_norm, eps=1e-5))
    xla_full = np.asarray(g(x, w))
    assert any(not np.array_equal(np.asarray(g(x[i : i + 1], w)), xla_full[i : i + 1]) for i in range(8))
    lib, why = torch_kernels.load()
    if lib is None:
        pytest.skip(why)
    y = torch_kernels.rms_norm(lib, torch.from_numpy(x), torch.from_numpy(w), 1e-5)
    assert np.array_equal(full, y.numpy())
    h = jax.jit(functools.partial(jax_ops.rms_norm, eps=1e-5))(x.reshape(30, 10, K), w)  # [..., K] rows
    assert np.array_equal(np.asarray(h).reshape(300, K), full)


def test_silu_mul_and_rope_bits_equal_the_torch_backends():
    """The MLP activation and RoPE as the torch backend computes them (XLA's logistic and its fused
    multiply-adds give other bits): with the linears, norms and attention, the two backends' logits match."""
    import torch

    from jaxengine.model import apply_rope
    from cpu_kernels import torch_ops as torch_kernels

    lib, why = torch_kernels.load()
    if lib is None:
        pytest.skip(why)
    rng = np.random.default_rng(5)
    gu = rng.standard_normal((37, 2 * 100), np.float32) * 4  # I = 100: the vector body and a scalar tail
    y = np.asarray(jax.jit(jax_ops.silu_mul)(gu))
    g, u = gu[:, :100].astype(np.float64), gu[:, 100:].astype(np.float64)
    np.testing.assert_allclose(y, g / (1 + np.exp(-g)) * u, rtol=1e-5, atol=1e-6)
    assert np.array_equal(y, torch_kernels.silu_mul(lib, torch.from_numpy(gu)).numpy())
    assert np.array_equal(np.asarray(jax.jit(jax_ops.silu_mul)(gu[3:4])), y[3:4])

    T, H, D = 9, 5, 64
    x = rng.standard_normal((T, H, D), np.float32)
    ang = rng.uniform(0, 100, (T, D // 2)).astype(np.float32)
    cos, sin = np.cos(ang), np.sin(ang)
    c2, s2 = (np.asarray(t) for t in jax_ops.rope_tables(jnp.asarray(cos), jnp.asarray(sin)))
    r = np.asarray(jax.jit(jax_ops.rope)(x, c2, s2))
    np.testing.assert_allclose(r, np.asarray(apply_rope(x, cos, sin)), rtol=1e-5, atol=1e-5)
    xt = torch.from_numpy(x.copy())
    torch_kernels.rope_(lib, xt, torch.from_numpy(np.concatenate([cos, cos], -1)[:, None].copy()),
                        torch.from_numpy(np.concatenate([-sin, sin], -1)[:, None].copy()))
    assert np.array_equal(r, xt.numpy())
    with pytest.raises(Exception, match="expected"):
        np.asarray(jax.jit(jax_ops.rope)(x, cos, sin))  # the half tables, not the kernel's


def test_rms_norm_refuses_a_weight_of_another_width():
    with pytest.raises(Exception, match="expected"):
        np.asarray(jax.jit(functools.partial(jax_ops.rms_norm, eps=1e-5))(np.ones((3, 8), np.float32),
                                                                              np.ones(7, np.float32)))


def test_in_a_scan_the_weights_are_not_sliced():
    x, w = data(4, 64, 64, 8, seed=3)
    panels = jax_ops.pack_panels(w)

    def with_call(x, panels):
        return jax.lax.scan(lambda h, l: (jnp.tanh(jax_ops.panel_linear(h, panels, l, 64)), None), x,
                            jnp.arange(4, dtype=jnp.int32))[0]

    def with_dot(x, w):
        return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl.T), None), x, w)[0]

    np.testing.assert_allclose(np.asarray(jax.jit(with_call)(x, panels)), np.asarray(jax.jit(with_dot)(x, w)),
                               rtol=1e-4, atol=1e-4)

    def weight_slices(fn, w):
        hlo = jax.jit(fn).lower(x, w).compile().as_text()
        return [ln for ln in hlo.splitlines()
                if "dynamic-slice(" in ln and ln.split("=", 1)[1].lstrip().startswith("f32")]

    assert jax_ops.PANEL_LINEAR in jax.jit(with_call).lower(x, panels).compile().as_text()
    assert weight_slices(with_call, panels) == []
    assert weight_slices(with_dot, w)  # the check can fail: XLA's dot is handed a slice of the weights


def paged(R, Hq, Hkv, D, bs, lens, seed=0):
    """q [R, Hq, D], a cache [NB, bs, 2 Hkv, D] and block tables [R, W] with shuffled block ids."""
    rng = np.random.default_rng(seed)
    W = max(-(-n // bs) for n in lens) + 1
    NB = R * W + 3
    cache = rng.standard_normal((NB, bs, 2 * Hkv, D), np.float32)
    table = rng.permutation(NB)[: R * W].reshape(R, W).astype(np.int32)
    q = rng.standard_normal((R, Hq, D), np.float32)
    return q, cache, table, np.asarray(lens, np.int32)


@pytest.mark.parametrize("Hq,Hkv,window", [(4, 2, None), (6, 1, None), (4, 4, 5), (8, 2, 17)])
def test_decode_attention_matches_xlas_decode_path(Hq, Hkv, window):
    from jaxengine.attention import _decode_attention

    D, bs, lens = 16, 4, [1, 9, 23, 40, 4, 16]
    q, cache, table, kv_lens = paged(len(lens), Hq, Hkv, D, bs, lens)
    scale = D ** -0.5
    for n in (len(lens), 3, 1, 0):
        got = np.asarray(jax.jit(functools.partial(jax_ops.decode_attention, sm_scale=scale,
                                                   sliding_window=window))(q, cache, table, kv_lens, n))
        want = np.asarray(_decode_attention(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(table), kv_lens,
                                            jnp.arange(len(lens)) < n, sm_scale=scale, sliding_window=window,
                                            soft_cap=None))
        np.testing.assert_allclose(got[:n], want[:n], rtol=2e-5, atol=2e-5)
        assert not got[n:].any()  # rows past the decode rows are zero


def test_decode_attention_rows_do_not_depend_on_their_neighbours():
    lens = [30, 7, 64, 12]
    q, cache, table, kv_lens = paged(4, 8, 2, 32, 8, lens, seed=4)
    f = jax.jit(functools.partial(jax_ops.decode_attention, sm_scale=0.2))
    full = np.asarray(f(q, cache, table, kv_lens, 4))
    one = np.asarray(f(q[2:3], cache, table[2:3], kv_lens[2:3], 1))
    assert np.array_equal(one[0], full[2])


def test_decode_attention_on_several_threads_gives_a_rows_bits_of_one_thread():
    """Long contexts: enough work for XLA's threads, and the split order for one row (too few rows for a task a
    kv head: its keys' scores split between the threads, then its outputs' dims) but a task per kv head for four;
    either way a row's bits are the same, and match XLA's path."""
    from jaxengine.attention import _decode_attention

    lens = [500, 377, 512, 260]
    q, cache, table, kv_lens = paged(4, 8, 2, 64, 16, lens, seed=5)
    f = jax.jit(functools.partial(jax_ops.decode_attention, sm_scale=0.125))
    full = np.asarray(f(q, cache, table, kv_lens, 4))
    for r in range(4):
        one = np.asarray(f(q[r:r + 1], cache, table[r:r + 1], kv_lens[r:r + 1], 1))
        assert np.array_equal(one[0], full[r]), r
    want = np.asarray(_decode_attention(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(table), kv_lens,
                                        jnp.ones(4, bool), sm_scale=0.125, sliding_window=None, soft_cap=None))
    np.testing.assert_allclose(full, want, rtol=2e-5, atol=2e-5)


def test_decode_attention_refuses_a_block_outside_the_cache_or_a_length_past_its_table():
    q, cache, table, kv_lens = paged(2, 4, 2, 8, 4, [5, 6])
    f = jax.jit(functools.partial(jax_ops.decode_attention, sm_scale=1.0))
    bad = table.copy()
    bad[1, 0] = cache.shape[0]
    with pytest.raises(Exception, match="block id out of range"):
        np.asarray(f(q, cache, bad, kv_lens, 2))
    with pytest.raises(Exception, match="kv_len past the block table"):
        np.asarray(f(q, cache, table, np.asarray([5, table.shape[1] * 4 + 1], np.int32), 2))
    np.asarray(f(q, cache, bad, kv_lens, 1))  # row 1 is not a decode row: its table is not read


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_kv_write_writes_each_tokens_k_and_v_rounded_as_astype_and_nothing_else(dtype):
    """The cache after kv_write is the cache with each real token's K and V rows (kv head h's at 2h and 2h + 1
    of its slot) replaced by them rounded as XLA's astype rounds (specials too), padding (slot -1) writing
    nothing, updated in place; a slot outside the cache is an error."""
    rng = np.random.default_rng(3)
    NB, bs, Hkv, D, T = 5, 4, 3, 8, 7
    cache = jnp.array(rng.standard_normal((NB, bs, 2 * Hkv, D), np.float32), dtype)  # (its own buffer: donated)
    k, v = rng.standard_normal((2, T, Hkv, D), np.float32) * 1e3
    k[0, 0, :4] = [np.inf, -np.inf, 1e-41, -0.0]  # (a subnormal, -0)
    v[1, 2, :3] = [65519.0, 1e-8, 3.0e38]  # (float16's overflow and underflow, bfloat16's rounding up)
    slots = np.asarray([3, -1, 19, 0, -1, 11, 7], np.int32)
    f = jax.jit(jax_ops.kv_write, donate_argnums=(2,))
    want = np.array(cache.astype(jnp.float32)).reshape(NB * bs, 2 * Hkv, D)
    for t in np.flatnonzero(slots >= 0):
        want[slots[t], 0::2] = np.asarray(jnp.asarray(k[t]).astype(dtype).astype(jnp.float32))
        want[slots[t], 1::2] = np.asarray(jnp.asarray(v[t]).astype(dtype).astype(jnp.float32))
    where = cache.unsafe_buffer_pointer()
    got = f(jnp.asarray(k), jnp.asarray(v), cache, jnp.asarray(slots))
    assert got.dtype == dtype and got.unsafe_buffer_pointer() == where  # (donated: written where it lies)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)).reshape(NB * bs, 2 * Hkv, D), want)
    with pytest.raises(Exception, match="slot outside the cache"):
        np.asarray(f(jnp.asarray(k), jnp.asarray(v), jnp.zeros((NB, bs, 2 * Hkv, D), dtype),
                     jnp.asarray(np.where(slots == 7, NB * bs, slots))))


def ragged(q_lens, kv_lens, Hq, Hkv, D, bs, decodes=0, seed=0):
    """A ragged step: `decodes` requests of one query first, then the rest; q [T, Hq, D] and a paged cache."""
    rng = np.random.default_rng(seed)
    R = len(q_lens)
    W = max(-(-n // bs) for n in kv_lens) + 1
    NB = R * W + 3
    cache = rng.standard_normal((NB, bs, 2 * Hkv, D), np.float32)
    table = rng.permutation(NB)[: R * W].reshape(R, W).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(cu[-1]) + 3, Hq, D), np.float32)  # 3 padding rows
    dist = np.asarray([decodes, R, R], np.int32)
    return q, cache, table, np.asarray(kv_lens, np.int32), cu, dist


@pytest.mark.parametrize("Hq,Hkv,D,bs,window", [(9, 3, 64, 16, None), (4, 2, 16, 4, None), (8, 2, 32, 8, 17),
                                                (4, 4, 24, 4, None)])
def test_prefill_attention_is_decode_attention_for_every_query(Hq, Hkv, D, bs, window):
    """Every prefill or mixed query gets decode attention's bits for a query at its position (a token's
    attention is the same prefilled, chunk-prefilled, recomputed or decoded); within float32 of XLA's
    prefill path; decode rows and padding rows are left as given."""
    from jaxengine.attention import _prefill_attention

    q_lens, kv_lens = [1, 70, 33, 5], [9, 70, 50, 5]  # a decode, a prefill, a mixed (17 cached), a short one
    q, cache, table, lens, cu, dist = ragged(q_lens, kv_lens, Hq, Hkv, D, bs, decodes=1, seed=6)
    scale = D ** -0.5
    base = np.full(q.shape, 7.0, np.float32)
    f = jax.jit(functools.partial(jax_ops.prefill_attention, sm_scale=scale, sliding_window=window))
    got = np.asarray(f(q, cache, table, lens, cu, dist, base))
    assert (got[cu[0]:cu[1]] == 7.0).all() and (got[cu[-1]:] == 7.0).all()  # decode row, padding kept
    # each query alone through the decode kernel, at its position (kv_len = position + 1)
    rows, tables, dlens = [], [], []
    for r in range(1, len(q_lens)):
        for j in range(q_lens[r]):
            rows.append(cu[r] + j)
            tables.append(table[r])
            dlens.append(kv_lens[r] - q_lens[r] + j + 1)
    dec = np.asarray(jax.jit(functools.partial(jax_ops.decode_attention, sm_scale=scale, sliding_window=window))(
        q[rows], cache, np.stack(tables), np.asarray(dlens, np.int32), len(rows)))
    assert np.array_equal(got[rows], dec)
    want = np.asarray(_prefill_attention(jnp.asarray(q), jnp.asarray(cache), jnp.asarray(table), jnp.asarray(lens),
                                         jnp.asarray(cu), jnp.asarray(dist), jnp.zeros(q.shape, jnp.float32),
                                         sm_scale=scale, sliding_window=window, soft_cap=None))
    np.testing.assert_allclose(got[rows], want[rows], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16"])
def test_attention_bits_equal_the_torch_backends(kv_dtype):
    """The prefill and decode custom calls give the torch backend's kernels' bits, over a float32 cache or a
    16-bit one (`--kv-cache-dtype`), whose values they read back exactly."""
    import torch

    from cpu_kernels import torch_ops as torch_kernels

    lib, why = torch_kernels.load()
    if lib is None:
        pytest.skip(why)
    q_lens, kv_lens = [40, 300], [40, 333]
    Hq, Hkv, D, bs = 6, 2, 64, 16
    q, cache, table, lens, cu, dist = ragged(q_lens, kv_lens, Hq, Hkv, D, bs, seed=7)
    cache = jnp.asarray(cache).astype(kv_dtype)
    got = np.asarray(jax.jit(functools.partial(jax_ops.prefill_attention, sm_scale=0.125))(
        q, cache, table, lens, cu, dist, np.zeros(q.shape, np.float32)))
    tc = torch.from_numpy(np.asarray(cache.astype(jnp.float32))).to(getattr(torch, kv_dtype))
    kc, vc = tc[:, :, 0::2].contiguous(), tc[:, :, 1::2].contiguous()  # the torch backend's separate caches
    out = torch.zeros(q.shape)
    i32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, np.int32))  # noqa: E731
    torch_kernels.prefill_attention(lib, torch.from_numpy(q), i32(cu[:-1]), i32(q_lens), i32(lens),
                                    i32(table), kc, vc, 0.125, None, out)
    assert np.array_equal(got, out.numpy())
    # each request's last query, decoded
    last = np.asarray(cu[1:3]) - 1
    dec = np.asarray(jax.jit(functools.partial(jax_ops.decode_attention, sm_scale=0.125))(
        q[last], cache, table, lens, np.int32(2)))
    dout = torch.zeros((2, Hq, D))
    torch_kernels.decode_attention(lib, torch.from_numpy(q[last]), torch.arange(2), i32(lens), i32(table), kc, vc,
                                   0.125, None, dout)
    assert np.array_equal(dec, dout.numpy()) and np.array_equal(dec, got[last])


def test_prefill_attention_refuses_a_block_outside_the_cache_or_rows_outside_the_tokens():
    q, cache, table, lens, cu, dist = ragged([20, 9], [20, 30], 4, 2, 16, 4, seed=8)
    f = jax.jit(functools.partial(jax_ops.prefill_attention, sm_scale=0.25))
    base = np.zeros(q.shape, np.float32)
    bad = table.copy()
    bad[1, 5] = cache.shape[0]
    with pytest.raises(Exception, match="block id out of range"):
        np.asarray(f(q, cache, bad, lens, cu, dist, base))
    with pytest.raises(Exception, match="kv_len shorter than q_len or past the table"):
        np.asarray(f(q, cache, table, np.asarray([20, 8], np.int32), cu, dist, base))
    with pytest.raises(Exception, match="cu_q_lens outside the tokens"):
        np.asarray(f(q, cache, table, lens, np.asarray([0, 20, 99], np.int32), dist, base))


def layers_step(L, q_lens, kv_lens, seed, decodes=1):
    """A ragged step (`decodes` decode rows first) for `cpu_kernels.layers` on L random layers (H 32, 4 q heads,
    2 kv heads of 8, I 40, blocks of 4): (L, T, the jitted call, one layer's cache, the L layers' cache, table,
    kv_lens, cu_q_lens, distribution, the arguments before the cache)."""
    H, Hq, Hkv, D, I = 32, 4, 2, 8, 40
    _, cache1, table, lens, cu, dist = ragged(q_lens, kv_lens, Hq, Hkv, D, 4, decodes=decodes, seed=seed)
    rng = np.random.default_rng(seed + 1)
    T = int(cu[-1]) + 3
    cache = np.concatenate([cache1] * L)  # [L * NB, bs, 2 Hkv, D]: layer l's block b at row l * NB + b
    w = lambda *shape: jax_ops.pack_panels(jnp.asarray(rng.standard_normal(shape, np.float32) * 0.2))  # noqa: E731
    qkv, o, gate_up, down = w(L, (Hq + 2 * Hkv) * D, H), w(L, H, Hq * D), w(L, 2 * I, H), w(L, H, I)
    ang = rng.uniform(0, 3, (T, D // 2)).astype(np.float32)
    cos, sin = jax_ops.rope_tables(jnp.cos(ang), jnp.sin(ang))
    x = rng.standard_normal((T, H), np.float32)
    none = np.zeros((0,), np.float32)
    norms = rng.uniform(0.5, 1.5, (L, H)).astype(np.float32)
    f = jax.jit(functools.partial(jax_ops.layers, num_heads=Hq, eps=1e-6, sm_scale=D ** -0.5))
    return L, T, f, cache1, cache, table, lens, cu, dist, (x, norms, norms, qkv, o, gate_up, down, none, none,
                                                           none, cos, sin)


def test_layers_refuses_a_block_outside_the_cache_or_rows_outside_the_tokens():
    """The one-call layers (`cpu_kernels.layers`) check every request row of a step before it writes a cache
    row: a block id outside the cache, a kv_len past the table or shorter than the row's tokens, tokens
    outside x, a decode row of more than one token are errors, and a well-formed step runs."""
    L, T, f, cache1, cache, table, lens, cu, dist, args = layers_step(2, [1, 9, 6], [5, 20, 6], seed=11)

    def run(table=table, lens=lens, cu=cu):
        return f(*args, jnp.asarray(cache), table, lens, cu, dist)

    out, new_cache = run()
    assert np.isfinite(np.asarray(out)).all() and not np.array_equal(np.asarray(new_cache), cache)
    bad = table.copy()
    bad[1, 4] = cache1.shape[0]  # row 1's 5th block (20 tokens of 4): one past the layer's blocks
    with pytest.raises(Exception, match="block id out of range"):
        run(table=bad)
    with pytest.raises(Exception, match="kv_len shorter than q_len or past the table"):
        run(lens=np.asarray([5, 8, 6], np.int32))  # 9 new tokens, 8 in the cache
    with pytest.raises(Exception, match="kv_len shorter than q_len or past the table"):
        run(lens=np.asarray([5, table.shape[1] * 4 + 1, 6], np.int32))
    with pytest.raises(Exception, match="cu_q_lens outside the tokens"):
        run(cu=np.asarray([0, 1, 10, T + 1], np.int32))
    with pytest.raises(Exception, match="a decode row's not one token"):
        run(cu=np.asarray([0, 2, 10, 16], np.int32))


def test_layers_run_the_last_layers_mlp_on_the_kept_rows_alone_with_the_same_bits():
    """`cpu_kernels.layers` with keep (the rows the step samples from) and all_rows [0]: the last layer's o linear
    and MLP run on the kept rows only, gathered; those rows' hidden states are the bits of the call that computes
    every row, every row's K and V are still written (the caches equal), and the other rows differ (not
    computed). all_rows [1] (prompt logprobs) computes every row; a kept row outside the tokens is an error. A
    decode row, two prefill rows and padding, three layers: 40 rows (the linears' k-blocked order), 3 kept (the
    other order)."""
    L, T, f, _, cache, table, lens, cu, dist, args = layers_step(3, [1, 30, 6], [5, 41, 6], seed=21)

    def run(keep, all_rows):
        out, c = f(*args, jnp.asarray(cache), table, lens, cu, dist, np.asarray(keep, np.int32),
                   np.asarray([all_rows], np.int32))
        return np.asarray(out), np.asarray(c)

    want, want_cache = run([0, 0, 0], 1)
    last = (cu[1:] - 1).astype(np.int32)  # each request's last token: what a step samples from
    got, got_cache = run(last, 0)
    assert np.array_equal(got[last], want[last])
    assert np.array_equal(got_cache, want_cache)
    others = np.setdiff1d(np.arange(T), last)
    assert not np.array_equal(got[others], want[others])  # the other rows were not computed ...
    assert np.array_equal(run(last, 1)[0], want)  # ... unless every row is wanted
    rows = np.asarray([17, 3, 30], np.int32)  # any distinct rows, in any order
    assert np.array_equal(run(rows, 0)[0][rows], want[rows])
    with pytest.raises(Exception, match="a kept row outside the tokens"):
        run([0, T, 1], 0)
    # one layer: the first is the last, gathered from the embeddings' stream
    _, _, f1, _, cache, table, lens, cu, dist, args = layers_step(1, [1, 30, 6], [5, 41, 6], seed=23)
    one = lambda keep, a: np.asarray(f1(*args, jnp.asarray(cache), table, lens, cu, dist,  # noqa: E731
                                        np.asarray(keep, np.int32), np.asarray([a], np.int32))[0])
    last = (cu[1:] - 1).astype(np.int32)
    assert np.array_equal(one(last, 0)[last], one(last, 1)[last])


def test_layers_give_a_long_decode_row_the_same_bits_alone_or_beside_another():
    """A decode row alone in a step with enough attention work for XLA's threads runs decode attention's split
    order (jax_ops.c: its keys' scores split between the threads, then its outputs' dims); beside a second
    decode row, a task a kv head. Here the second row is a decode row (dist [2, ...]) or a one-token prefill row
    (dist [1, ...]: prefill attention, which gives a query decode attention's bits): every row's hidden state and
    the caches are the same bits either way, through two layers (each leaves the split order's counts at zero
    for the next)."""
    L, T, f, _, cache, table, lens, cu, dist, args = layers_step(2, [1, 1, 5], [1500, 1300, 5], seed=31, decodes=2)
    assert dist[0] == 2
    two_out, two_cache = f(*args, jnp.asarray(cache), table, lens, cu, dist)
    one_out, one_cache = f(*args, jnp.asarray(cache), table, lens, cu, np.asarray([1, *dist[1:]], np.int32))
    assert np.array_equal(np.asarray(one_out), np.asarray(two_out))
    assert np.array_equal(np.asarray(one_cache), np.asarray(two_cache))


def test_the_samplers_draw_the_same_tokens_with_the_same_logprob_bits_as_the_torch_backend():
    """Same logits and requests through jax's `sample(cpu_kernels=True)` and the torch sampler: the same seeded
    tokens (temperature, min-p, top-k, top-p) and logprobs equal to the bit; a row alone gives its bits in the
    batch (XLA's log_softmax and the torch sampler's sums differed by an ulp and changed with the row count)."""
    import torch

    from enginecore.sampling_batch import SamplingBatch
    from enginecore.sampling_ref import seeded_uniform
    from jaxengine import sampler as jax_sampler
    from torchengine import sampler as torch_sampler

    rng = np.random.default_rng(3)
    R, V, N = 40, 49152 + 5, 5
    x = (rng.standard_normal((R, V)) * 3).astype(np.float32)
    x[5, 1000:] = -np.inf  # a row with few live tokens
    temp = rng.choice([0.0, 0.6, 1.0, 1.5], R).astype(np.float32)
    top_k = rng.choice([0, 0, 20, 300, 5000], R).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5, 0.99], R).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.05], R).astype(np.float32)
    u = seeded_uniform(np.arange(R) + 11, 0, rng.integers(0, 1000, R))
    sb = SamplingBatch(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, uniform=u, all_greedy=False,
                       needs_filtering=True, num_logprobs=N)
    t = torch_sampler.sample(torch.from_numpy(x), torch_sampler.SamplingTensors.from_batch(sb, torch.device("cpu")))
    run = jax.jit(functools.partial(jax_sampler.sample, mode="full", num_logprobs=N, method="topk", cpu_kernels=True))

    def jax_rows(rows):
        sampled, (ids, lps, tok_lp, rank) = run(
            jnp.asarray(x[rows]), temp[rows], top_k[rows], top_p[rows], min_p[rows], u[rows], np.bool_(False),
            np.bool_(True), np.bool_(True))
        return [np.asarray(a) for a in (sampled, ids, lps, tok_lp, rank)]

    sampled, ids, lps, tok_lp, rank = jax_rows(slice(None))
    assert sampled.tolist() == t.sampled.tolist()
    assert len(set(sampled[temp > 0].tolist())) > R // 4  # draws, not all the argmax
    bits = lambda a: np.asarray(a, np.float32).view(np.int32)  # noqa: E731
    np.testing.assert_array_equal(bits(tok_lp), bits(t.sampled_logprobs.numpy()))
    np.testing.assert_array_equal(bits(lps), bits(t.topk_logprobs.numpy()))
    np.testing.assert_array_equal(ids, t.topk_ids.numpy())
    np.testing.assert_array_equal(rank, t.sampled_ranks.numpy())
    for i in (0, 5, 17):
        alone = jax_rows(slice(i, i + 1))
        assert alone[0][0] == sampled[i] and bits(alone[3])[0] == bits(tok_lp)[i]
        np.testing.assert_array_equal(bits(alone[2][0]), bits(lps[i]))


def test_pack_onto_huge_pages_packs_each_group_into_one_aligned_buffer():
    """`pack_cpu_panels` packs the weights on the host into one huge-page buffer: each group `pack_panels` of its
    weights' rows concatenated (read through a reshape, as `model.as_out_in` gives them; a partial last panel
    zero-padded), each result jax's view of its slice (no copy: back to back from a 2 MiB boundary), the
    sources freed; traced, the shapes `pack_panels` gives."""
    from cpu_kernels.memory import HUGE_PAGE

    rng = np.random.default_rng(5)
    a1, a2 = (jnp.asarray(rng.standard_normal(s, np.float32)) for s in ((2, 32, 7), (2, 16, 7)))
    o = jnp.asarray(rng.standard_normal((2, 7, 3, 5), np.float32))  # [L, N, Hq, D]: read as [L, 7, 15]
    b = jnp.asarray(rng.standard_normal((20, 9), np.float32))  # 20 rows: a partial second panel
    want = {"a": np.asarray(jax_ops.pack_panels(jnp.concatenate([a1, a2], axis=1))),
            "o": np.asarray(jax_ops.pack_panels(o.reshape(2, 7, 15))),
            "b": np.asarray(jax_ops.pack_panels(b[None]))}
    groups = {"a": [(a1, a1.shape), (a2, a2.shape)], "o": [(o, (2, 7, 15))], "b": [(b, (1, 20, 9))]}
    out = jax_ops.pack_onto_huge_pages(groups)
    assert want["b"].shape == (1, 2, 9, 16) and not want["b"][0, 1, :, 4:].any()
    for k in want:
        assert np.array_equal(np.asarray(out[k]), want[k]), k
        assert out[k].sharding == jax.devices("cpu")[0] or out[k].sharding.device_set == {jax.devices("cpu")[0]}
    assert all(w.is_deleted() for w in (a1, a2, o, b))
    p = out["a"].unsafe_buffer_pointer()
    assert p % HUGE_PAGE == 0 and out["o"].unsafe_buffer_pointer() == p + want["a"].nbytes
    assert out["b"].unsafe_buffer_pointer() == p + want["a"].nbytes + want["o"].nbytes
    # traced (abstract_inputs' eval_shape of pack_cpu_panels)
    shapes = jax.eval_shape(lambda x: jax_ops.pack_onto_huge_pages({"x": [(x * 2, (1, 24, 3))]}),
                            jnp.zeros((24, 3)))
    assert shapes["x"].shape == (1, 2, 3, 16)


def test_zero_pages_zeroes_dirty_memory_and_leaves_its_neighbours():
    """`cpu_kernels.cc`'s zero_pages (behind `zeros`): n bytes anywhere in written memory read as zero after it,
    the pages wholly inside handed back to the OS (only where there is one, in private anonymous memory), the
    bytes around untouched."""
    import ctypes
    import mmap

    lib = jax_ops._library()[0]
    lib.zero_pages.argtypes, lib.zero_pages.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
    page = mmap.PAGESIZE
    buf = np.empty(64 * page + 3000, np.uint8)  # malloc's memory, as XLA's buffers are
    for off, n in ((0, buf.size), (123, 5 * page + 77), (page - 5, 3 * page), (17, 100), (9, 0)):
        buf[:] = 7
        a = buf.ctypes.data + off
        whole_page_inside = (a + n) // page * page > -(-a // page) * page
        assert lib.zero_pages(a, n) == int(whole_page_inside), (off, n)
        assert not buf[off : off + n].any(), (off, n)
        assert (buf[:off] == 7).all() and (buf[off + n :] == 7).all(), (off, n)
    # a shared mapping's pages would read their contents again after the advice: written instead
    shared = mmap.mmap(-1, 8 * page)
    view = np.frombuffer(shared, np.uint8)
    view[:] = 7
    assert lib.zero_pages(view.ctypes.data + 1, view.size - 1) == 0
    assert view[0] == 7 and not view[1:].any()
    del view
    shared.close()


def _in_a_fresh_heap(code: str) -> list[int]:
    """Run `code` in a fresh process whose glibc serves buffers of up to 256 MB from its heap (freed ones are handed
    back with their old contents, not as fresh zero-filled mappings), one heap for all threads (else a buffer freed
    by one of XLA's threads and the next allocated by another come from two arenas: on a busy 2-core machine, 1
    reuse in 200 tries); -> the integers it prints."""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 28),
                            "MALLOC_TRIM_THRESHOLD_": str(1 << 30), "MALLOC_ARENA_MAX": "1"})
    assert p.returncode == 0, p.stdout + p.stderr
    return [int(v) for v in p.stdout.split()]


_ZEROS_OVER_REUSED = """
import jax, jax.numpy as jnp, numpy as np
from cpu_kernels import jax_ops
jax_ops.lib()
sevens = jax.jit(lambda: jnp.full((1024, 1000), 7.0)).lower().compile()
zeros = jax.jit(lambda: jax_ops.zeros((1024, 1000), jnp.float32)).lower().compile()
tries = reused = 0
while tries < 200 and reused < 3:
    a = sevens()
    p = a.block_until_ready().unsafe_buffer_pointer()
    a.delete()
    z = zeros()
    tries, reused = tries + 1, reused + (z.block_until_ready().unsafe_buffer_pointer() == p)
    assert not np.asarray(z).any()
    z.delete()
print(tries, reused)
"""


def test_zeros_commits_no_memory_until_written():
    """`zeros` (the jax CPU KV cache): zeros of any dtype, also over memory that held other values, and a 64 MiB
    one holds (almost) none of its pages in memory until written, where every page of jnp.zeros' is (mincore:
    the buffers' own pages, whatever memory the allocator reused for them)."""
    from tests.memory import resident_bytes

    for shape, dtype in (((3,), jnp.float32), ((1000, 5), jnp.bfloat16), ((7, 4096, 3), jnp.float16)):
        z = jax.jit(lambda: jax_ops.zeros(shape, dtype))()
        assert z.shape == shape and z.dtype == dtype and not np.asarray(z.astype(jnp.float32)).any()
    # over memory that held other values: a freed 4 MB buffer handed back by the allocator. In this process that
    # depends on the whole session's heap history (once, in CI, none of 20 tries was reused), so a fresh
    # process does it, with glibc told to serve such buffers from its heap (MALLOC_MMAP_THRESHOLD_) rather than
    # as fresh mappings, whose pages the kernel would zero whatever `zeros` did
    tries, reused = _in_a_fresh_heap(_ZEROS_OVER_REUSED)
    assert reused >= 3, f"a freed buffer was reused {reused} times in {tries}: zeros not tried over written memory"
    shape, nbytes = (16, 1 << 20), 64 << 20
    z = jax.jit(lambda: jax_ops.zeros(shape, jnp.float32))()
    zx = jax.jit(lambda: jnp.zeros(shape, jnp.float32))()
    ours, xlas = (resident_bytes(a.block_until_ready().unsafe_buffer_pointer(), nbytes) for a in (z, zx))
    assert ours < nbytes // 8 and xlas > nbytes // 2, (ours, xlas)
    assert not np.asarray(z).any() and not np.asarray(zx).any()


def qx_weights(kind: str, L: int, N: int, K: int, seed: int):
    """L stacked [N, K] float32 weights as a loader serves them from a GGUF file's `kind` blocks (or bfloat16
    values) and the same as `cpu_kernels.layout` panels [L, NP, K / 32, group bytes]."""
    from cpu_kernels import layout as qx
    from enginecore.model_loader import Int4Groups, Int8Groups

    rng = np.random.default_rng(seed)
    f16 = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float16).astype(np.float32)  # noqa: E731
    ws, packed = [], []
    for _ in range(L):
        if kind in ("BF16", "F16"):
            w = np.asarray(jnp.asarray(rng.standard_normal((N, K), np.float32)).astype(
                jnp.bfloat16 if kind == "BF16" else jnp.float16), np.float32)
            p = np.asarray(jax_ops.pack_panels(jnp.asarray(w)))
            assert qx.half_kind(p) == qx.QX_KINDS[kind]
            ws.append(w), packed.append(qx.half_panels(jax_ops.lib(), "w", p, qx.QX_KINDS[kind]))
        elif kind == "Q8_0":
            g = Int8Groups(rng.integers(-128, 128, (N, K)).astype(np.int8), f16(N, K // 32))
            ws.append(g.dequantize()), packed.append(qx.pack_q8x(g.q, g.scale))
        else:
            d = f16(N, K // 32)
            m = -8 * d if kind in ("Q4_0", "I8") else f16(N, K // 32)
            if kind == "Q4_K":  # float32 scales and offsets (a Q4_K's d * sc, -(dmin * mn): 17 significant bits)
                d, m = d * rng.integers(1, 64, d.shape), m * rng.integers(1, 64, m.shape)
            g = Int4Groups(rng.integers(0, 16, (N, K)).astype(np.uint8), d.astype(np.float32), m.astype(np.float32))
            ws.append(g.dequantize())
            if kind == "I8":  # the wide form (a Q4_0 weight as it: int8 q - 8, float32 scales per 16)
                packed.append(qx.pack_i8x(qx.to_wide(g)))
                continue
            assert qx.q4_kind(g) == qx.QX_KINDS[kind]
            packed.append(qx.pack_q4x(g.q, g.scale, None if kind == "Q4_0" else g.offset, qx.QX_KINDS[kind]))
    return np.stack(ws), np.stack(packed), qx.QX_KINDS[kind]


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0", "BF16", "Q4_K", "I8", "F16"])
def test_qx_linear_and_argmax_give_panel_linears_bits(kind):
    """The weights as stored (`qx_linear`, `qx_argmax`: a GGUF file's blocks, a bfloat16 checkpoint's halves)
    give `panel_linear`'s and `panel_argmax`'s bits over the float32 weights, every layer, 1-13 rows (the
    kernel's tiles and tails), a partial last panel; panels of another kind or shape are an error."""
    L, N, K = 2, 70, 96
    w, packed, k = qx_weights(kind, L, N, K, seed=5)
    panels = jax_ops.pack_panels(jnp.asarray(w))
    lin = jax.jit(jax_ops.qx_linear, static_argnames=("n", "kind"))
    arg = jax.jit(jax_ops.qx_argmax, static_argnames=("n", "kind"))
    rng = np.random.default_rng(7)
    for T in (1, 2, 3, 5, 7, 12, 13):
        x = rng.standard_normal((T, K), np.float32)
        for l in range(L):
            assert np.array_equal(np.asarray(lin(x, packed, jnp.int32(l), n=N, kind=k)),
                                  np.asarray(jax_ops.panel_linear(x, panels, jnp.int32(l), N)))
            assert np.array_equal(np.asarray(arg(x, packed, jnp.int32(l), n=N, kind=k)),
                                  np.asarray(jax_ops.panel_argmax(x, panels, jnp.int32(l), N)))
    other = 3 if kind not in ("BF16", "F16") else 1  # the same bytes read as another kind: refused, not overread
    with pytest.raises(Exception, match="qx panels"):
        jax_ops.qx_linear(x, packed, jnp.int32(0), N, other)
    with pytest.raises(Exception, match="layer index out of range"):
        jax_ops.qx_linear(x, packed, jnp.int32(L), N, k)


@pytest.mark.parametrize("kind", ["F32", "Q4_1"])
def test_head_calls_multiply_only_the_live_rows(kind):
    """`live` (a sample program's rows up to its last sampling one): the four head calls give a whole call's
    outputs for the first `live` rows and zeros (tokens 0) for the rest, `live` traced and clamped to [0, T]
    (40 rows: live counts on both sides of panel_gemm's compute-bound split at 19); one that is not a scalar is
    refused."""
    L, N, K = 1, 70, 96
    w, packed, k = qx_weights("Q4_1", L, N, K, seed=9)
    panels = jax_ops.pack_panels(jnp.asarray(w))
    if kind == "F32":
        lin = jax.jit(lambda x, live: jax_ops.panel_linear(x, panels, jnp.int32(0), N, live))
        arg = jax.jit(lambda x, live: jax_ops.panel_argmax(x, panels, jnp.int32(0), N, live))
    else:
        lin = jax.jit(lambda x, live: jax_ops.qx_linear(x, packed, jnp.int32(0), N, k, live))
        arg = jax.jit(lambda x, live: jax_ops.qx_argmax(x, packed, jnp.int32(0), N, k, live))
    rng = np.random.default_rng(3)
    for T in (1, 8, 40):
        x = rng.standard_normal((T, K), np.float32)
        y, tokens = np.asarray(lin(x, T)), np.asarray(arg(x, T))
        assert np.array_equal(tokens, y.argmax(-1)) and len(set(tokens.tolist())) > min(T, 3) - 1
        for live in sorted({0, 1, T // 2, 19, T - 1, T, T + 5, -3}):
            n = min(max(live, 0), T)
            got_y, got_t = np.asarray(lin(x, jnp.int32(live))), np.asarray(arg(x, jnp.int32(live)))
            assert np.array_equal(got_y[:n], y[:n]) and not got_y[n:].any(), (T, live)
            assert np.array_equal(got_t[:n], tokens[:n]) and not got_t[n:].any(), (T, live)
    call = jax.ffi.ffi_call(jax_ops.PANEL_ARGMAX, jax.ShapeDtypeStruct((T,), jnp.int32))
    with pytest.raises(Exception, match="live: one int32"):  # the custom call itself (the wrapper reshapes)
        call(x, panels, jnp.int32(0), jnp.zeros((2,), jnp.int32), n=np.int32(N))


_LIVE_OVER_REUSED = """
import jax, jax.numpy as jnp, numpy as np
from cpu_kernels import jax_ops
jax_ops.lib()
T, N, K = 64, 4096, 64
rng = np.random.default_rng(0)
panels = jax_ops.pack_panels(jnp.asarray(rng.standard_normal((1, N, K)).astype(np.float32)))
x = jnp.asarray(rng.standard_normal((T, K)).astype(np.float32))
lin = jax.jit(lambda x, live: jax_ops.panel_linear(x, panels, jnp.int32(0), N, live))
arg = jax.jit(lambda x, live: jax_ops.panel_argmax(x, panels, jnp.int32(0), N, live))
tries = reused = 0
while tries < 200 and reused < 6:
    for f in (lin, arg):
        a = f(x, jnp.int32(T))  # every row written (no token 0 among a full call's)
        p = a.block_until_ready().unsafe_buffer_pointer()
        assert np.asarray(a).all()
        a.delete()
        z = f(x, jnp.int32(5))
        tries, reused = tries + 1, reused + (z.block_until_ready().unsafe_buffer_pointer() == p)
        assert not np.asarray(z)[5:].any()
        z.delete()
print(tries, reused)
"""


def test_head_calls_zero_the_rows_past_live_over_written_memory():
    """The rows past `live` are written as zeros, not left as the buffer held them: each call's output over the
    freed output of a call that wrote every row (a fresh heap, as for `zeros` above; both linear and argmax)."""
    tries, reused = _in_a_fresh_heap(_LIVE_OVER_REUSED)
    assert reused >= 6, f"a freed output was reused {reused} times in {tries}: not tried over written memory"


def test_layers_take_a_kind_for_each_linear():
    """`cpu_kernels.layers` with each linear's qx panels of its own kind (qkv bfloat16 halves, o a GGUF 8-bit
    form as Q8_0's, gate_up the same weights' wide panels (QX_I8), down none): the bits of the float32 panels
    alone; the kinds swapped between two linears is an error, not a misread."""
    from cpu_kernels import layout as qx
    from enginecore.model_loader import Int8Groups

    L, T, f, _, cache, table, lens, cu, dist, args = layers_step(2, [1, 3], [5, 7], seed=41)
    rng = np.random.default_rng(2)

    def q8(shape):  # L layers of an 8-bit form's weights [N, K]: (float32 panels, groups)
        gs = [Int8Groups(rng.integers(-128, 128, shape).astype(np.int8),
                         (rng.standard_normal((shape[0], shape[1] // 32)) * 0.002).astype(np.float16).astype(np.float32))
              for _ in range(L)]
        return jax_ops.pack_panels(jnp.asarray(np.stack([g.dequantize() for g in gs]))), gs

    qkv = jnp.asarray(args[3]).astype(jnp.bfloat16).astype(jnp.float32)
    (o, og), (gu, gg) = q8((32, 32)), q8((80, 32))
    args = (*args[:3], qkv, o, gu, *args[6:])
    panels = (qx.half_panels(jax_ops.lib(), "qkv", np.asarray(qkv), qx.QX_KINDS["BF16"]), np.stack([qx.pack_q8x(g.q, g.scale) for g in og]),
              np.stack([qx.pack_i8x(qx.to_wide(g)) for g in gg]), None)
    kinds = (qx.QX_KINDS["BF16"], qx.QX_KINDS["Q8_0"], qx.QX_KINDS["I8"], -1)
    want = f(*args, jnp.asarray(cache), table, lens, cu, dist)
    real = int(cu[-1])
    g = functools.partial(jax_ops.layers, num_heads=4, eps=1e-6, sm_scale=8 ** -0.5, qx_rows=real)
    got = jax.jit(functools.partial(g, qx_kinds=kinds))(*args, jnp.asarray(cache), table, lens, cu, dist, None, None,
                                                        panels)
    assert np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert np.array_equal(np.asarray(got[1]), np.asarray(want[1]))
    # the wide panels are what it read: zeroed, the output changes
    zeroed = jax.jit(functools.partial(g, qx_kinds=kinds))(*args, jnp.asarray(cache), table, lens, cu, dist, None,
                                                           None, (None, None, 0 * panels[2], None))
    assert not np.array_equal(np.asarray(zeroed[0]), np.asarray(want[0]))
    swapped = (kinds[0], kinds[2], kinds[1], -1)
    with pytest.raises(Exception, match="qx panels of another shape or kind"):
        jax.jit(functools.partial(g, qx_kinds=swapped))(*args, jnp.asarray(cache), table, lens, cu, dist, None, None,
                                                        panels)


def test_layers_with_qx_panels_give_the_bits_without_them():
    """`cpu_kernels.layers` given bfloat16-exact weights' qx panels (one linear without: its K is not a multiple
    of 32) computes a step of up to qx_rows real tokens from them (the bucket's padding rows not counted, nor
    computed: zeros): the hidden states and the cache the same bits as from the float32 panels alone; qx panels
    of another layer count are an error."""
    from cpu_kernels import layout as qx

    L, T, f, _, cache, table, lens, cu, dist, args = layers_step(2, [1, 4, 2], [5, 9, 6], seed=31)
    bf = lambda p: jnp.asarray(p).astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    args = (*args[:3], *(bf(p) for p in args[3:7]), *args[7:])
    bf16 = qx.QX_KINDS["BF16"]
    halves = [qx.half_panels(jax_ops.lib(), "w", np.asarray(p), bf16) if qx.half_kind(np.asarray(p)) == bf16
              else None for p in args[3:7]]
    assert halves[3] is None and all(h is not None for h in halves[:3])  # down: K = I = 40
    want = f(*args, jnp.asarray(cache), table, lens, cu, dist)
    real = int(cu[-1])
    assert real < T and not np.asarray(want[0])[real:].any()  # padding rows: zeros, not computed
    g = jax.jit(functools.partial(jax_ops.layers, num_heads=4, eps=1e-6, sm_scale=8 ** -0.5,
                                  qx_kinds=(qx.QX_KINDS["BF16"],) * 4, qx_rows=real))
    got = g(*args, jnp.asarray(cache), table, lens, cu, dist, None, None, tuple(halves))
    assert np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert np.array_equal(np.asarray(got[1]), np.asarray(want[1]))
    zeroed = g(*args, jnp.asarray(cache), table, lens, cu, dist, None, None, (0 * halves[0], None, None, None))
    assert not np.array_equal(np.asarray(zeroed[0]), np.asarray(want[0]))  # (the qx panels are what it read)
    with pytest.raises(Exception, match="qx panels of another shape or kind"):
        g(*args, jnp.asarray(cache), table, lens, cu, dist, None, None, (halves[0][:1], None, None, None))


def test_layers_take_linears_without_float32_panels():
    """`cpu_kernels.layers` with a linear's float32 panels empty (QX_BDOT's engine keeps none,
    `cpu_wing.pack_cpu_panels(bdot=True)`): its shape from its qx panels, the bits of the float32 panels; a step
    its qx panels do not take (more tokens than qx_rows), or no qx panels at all, is an error, not a read of
    nothing."""
    from cpu_kernels import layout as qx

    L, T, f, _, cache, table, lens, cu, dist, args = layers_step(2, [1, 4, 2], [5, 9, 6], seed=33)
    bf = lambda p: jnp.asarray(p).astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    args = (*args[:3], *(bf(p) for p in args[3:7]), *args[7:])
    bf16 = qx.QX_KINDS["BF16"]
    halves = [qx.half_panels(jax_ops.lib(), "w", np.asarray(p), bf16) for p in args[3:6]] + [None]
    want = f(*args, jnp.asarray(cache), table, lens, cu, dist)
    empty = np.zeros((0,), np.float32)
    lean = (*args[:3], empty, empty, empty, *args[6:])  # qkv, o, gate_up: qx panels only
    layers = functools.partial(jax_ops.layers, num_heads=4, eps=1e-6, sm_scale=8 ** -0.5, qx_kinds=(bf16,) * 4)
    got = jax.jit(functools.partial(layers, qx_rows=T))(*lean, jnp.asarray(cache), table, lens, cu, dist, None, None,
                                                          tuple(halves))
    assert np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
    assert np.array_equal(np.asarray(got[1]), np.asarray(want[1]))
    with pytest.raises(Exception, match="without float32 panels"):
        jax.jit(functools.partial(layers, qx_rows=T - 1))(*lean, jnp.asarray(cache), table, lens, cu, dist, None,
                                                            None, tuple(halves))
    with pytest.raises(Exception, match="shapes disagree"):
        jax.jit(functools.partial(layers, qx_rows=T))(*lean, jnp.asarray(cache), table, lens, cu, dist, None, None,
                                                        (None, *halves[1:]))
