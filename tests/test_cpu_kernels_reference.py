"""Every C kernel of `cpu_kernels` (through `cpu_kernels.torch_ops`' ctypes bindings) against its numpy
reference in `cpu_kernels.reference`, on random inputs of odd sizes, strided rows, padding and tails: bits where
the kernel promises them (panel_gemm's FMA chains, the greedy argmax, the KV cache's rounding, the qx panels'
rebuilt weights, the samplers' picks), float64 with the kernel's float32 rounding allowed elsewhere.

(test_torch_cpu_kernels.py checks the same kernels against torch's ops and their thread / batch invariance.)
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cpu_kernels import layout, torch_ops  # noqa: E402
from cpu_kernels import reference as ref  # noqa: E402
from enginecore.model_loader import Int4Groups, Int8Groups, Iq4Groups, WideGroups  # noqa: E402

QX = layout.QX_KINDS


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def f32(a) -> np.ndarray:
    return np.asarray(a, np.float32)


def strided(x: np.ndarray, pad: int) -> torch.Tensor:
    """x [M, K] as a view whose rows are K + pad floats apart (a slice of a fused projection's output)."""
    M, K = x.shape
    base = torch.full((M, K + pad), float("nan"))
    base[:, pad // 2 : pad // 2 + K] = torch.from_numpy(x)
    return base[:, pad // 2 : pad // 2 + K]


# ---- the glue (glue.c) --------------------------------------------------------------------------------------


@pytest.mark.parametrize("M,K", [(1, 64), (3, 576), (5, 70), (40, 9)])
def test_rms_norm(lib, M, K):
    r = rng(M * K)
    x, w = f32(r.standard_normal((M, K)) * 3), f32(r.standard_normal(K))
    got = torch_ops.rms_norm(lib, strided(x, 7), torch.from_numpy(w), 1e-5).numpy()
    want, _ = ref.rms_norm(x, w, 1e-5)
    np.testing.assert_allclose(got, want, rtol=3e-6, atol=1e-6)
    res = f32(r.standard_normal((M, K)))
    res_t = torch.from_numpy(res.copy())
    got = torch_ops.rms_norm(lib, strided(x, 7), torch.from_numpy(w), 1e-5, res_t).numpy()
    want, want_res = ref.rms_norm(x, w, 1e-5, res)
    assert np.array_equal(res_t.numpy(), want_res)  # the residual stream's add: float32's bits
    np.testing.assert_allclose(got, want, rtol=3e-6, atol=1e-6)


@pytest.mark.parametrize("T,H,D", [(5, 3, 16), (2, 4, 64), (7, 1, 6), (1, 2, 130)])
def test_rope(lib, T, H, D):
    r = rng(T * H * D)
    pos = r.integers(0, 4000, T)
    inv = 1.0 / (10000.0 ** (np.arange(0, D, 2) / D))
    cos, sin = ref.rope_tables(pos[:, None] * inv[None])
    qkv = f32(r.standard_normal((T, H + 2, D)))
    t = torch.from_numpy(qkv.copy())  # the first H heads of each row rotated in place, a view of a wider tensor
    tables = [torch.from_numpy(a)[:, None].contiguous() for a in (cos, sin)]  # [T, 1, D], the model's form
    torch_ops.rope_(lib, t[:, :H], *tables)
    np.testing.assert_allclose(t[:, :H].numpy(), ref.rope(qkv[:, :H], cos, sin), rtol=1e-5, atol=1e-6)
    assert np.array_equal(t[:, H:].numpy(), qkv[:, H:])


@pytest.mark.parametrize("M,I", [(1, 1536), (4, 37), (3, 8), (2, 7)])
def test_silu_mul(lib, M, I):
    gu = f32(rng(M + I).standard_normal((M, 2 * I)) * 6)
    got = torch_ops.silu_mul(lib, torch.from_numpy(gu)).numpy()
    np.testing.assert_allclose(got, ref.silu_mul(gu), rtol=4e-6, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Hkv,D", [(2, 20), (1, 8), (3, 64)])
def test_kv_write(lib, dtype, Hkv, D):
    """Slots anywhere in the cache, padding (-1) skipped, the 16-bit caches rounded to nearest even: the same
    bits as the reference's writes (a NaN stays a NaN)."""
    r = rng(Hkv * D)
    T, nb, bs = 6, 3, 4
    k, v = f32(r.standard_normal((T, Hkv, D)) * 3), f32(r.standard_normal((T, Hkv, D)) * 1e-3)
    k[0, 0, :5] = [65519.0, 65521.0, 1e6, 3e38, 1.0 + 2**-8]  # float16 edges, a bfloat16 tie
    v[1, 0, :3] = [1e-40, -0.0, np.inf]
    k[2, -1, -1] = np.nan
    slots = np.array([3, -1, 0, 11, 4, -1], np.int64)
    kc = torch.zeros(nb, bs, Hkv, D, dtype=dtype)
    vc = torch.zeros(nb, bs, Hkv, D, dtype=dtype)
    torch_ops.kv_write(lib, torch.from_numpy(k), torch.from_numpy(v), torch.from_numpy(slots), kc, vc)
    npdt = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}[dtype]
    want_k, want_v = np.zeros((nb, bs, Hkv, D), npdt), np.zeros((nb, bs, Hkv, D), npdt)
    ref.kv_write(k, v, slots, want_k, want_v)
    for got, want in ((kc, want_k), (vc, want_v)):
        gv, wv = ref.cache_values(bits(got, npdt)), ref.cache_values(want)
        assert np.array_equal(np.isnan(gv), np.isnan(wv))
        ok = ~np.isnan(wv)
        assert np.array_equal(bits(got, npdt).view(np.uint8).reshape(*ok.shape, -1)[ok],
                              want.view(np.uint8).reshape(*ok.shape, -1)[ok])


def bits(cache: torch.Tensor, npdt) -> np.ndarray:
    """A torch cache as the reference holds it (bfloat16 as uint16 bits)."""
    if cache.dtype == torch.bfloat16:
        return cache.view(torch.int16).numpy().view(np.uint16)
    return cache.numpy().astype(npdt)


# ---- float32 linears and the greedy head (panels.c) -----------------------------------------------------


@pytest.mark.parametrize("M,N,K", [(1, 49, 64), (5, 300, 70), (13, 100, 576), (4, 3, 7)])
def test_f32_gemm(lib, M, N, K):
    r = rng(M * N + K)
    x, w = f32(r.standard_normal((M, K))), f32(r.standard_normal((N, K)))
    got = torch_ops.f32_gemm(lib, torch.from_numpy(x), torch.from_numpy(w)).numpy()
    np.testing.assert_allclose(got, ref.f32_linear(x, w), rtol=1e-5, atol=1e-6 * K)  # 8-lane float32 chains


@pytest.mark.parametrize("V,K", [(37, 10), (203, 130), (1, 1), (48, 64)])
def test_pack_panels(lib, V, K):
    w = f32(rng(V + K).standard_normal((V, K)))
    got = torch_ops.pack_panels(torch.from_numpy(w)).numpy()  # the C packer where the library runs
    assert np.array_equal(got, ref.pack_panels(w))
    assert np.array_equal(ref.panel_weights(got, V), w)


@pytest.mark.parametrize("M", [1, 3, 7, 19, 25])
@pytest.mark.parametrize("V,K", [(203, 64), (50, 130)])
def test_panel_gemm_is_one_fma_chain_an_output(lib, M, V, K, blocked_from):
    """panel_gemm's logits bit for bit (both loop orders, a vocabulary with a partial last panel, row tails), and
    its greedy head the reference argmax of them."""
    r = rng(M * V + K)
    x, w = f32(r.standard_normal((M, K))), f32(r.standard_normal((V, K)))
    panels = torch_ops.pack_panels(torch.from_numpy(w))
    got = torch_ops.panel_gemm(lib, torch.from_numpy(x), panels, V).numpy()
    want = ref.panel_gemm(x, panels.numpy(), V)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    greedy = torch_ops.panel_gemm(lib, torch.from_numpy(x), panels, V, greedy=True).numpy()
    assert np.array_equal(greedy, ref.greedy_argmax(want))


def test_greedy_head_ties_and_nan(lib):
    """The first index of the maximum among tied logits (across lanes and panels), the first NaN where there is
    one, and never a padding column of the last panel."""
    V, K = 203, 32
    r = rng(3)
    w = f32(r.standard_normal((V, K)))
    w /= np.linalg.norm(w, axis=-1, keepdims=True)  # unit rows: a row's own logit is the largest
    w[[7, 150, 90, 202]] = w[100]  # ties with 100 in other lanes and panels
    w[[45, 40]] = w[3]  # 40 (lane 8 of its panel) before 45 (lane 13)
    wn = w.copy()
    wn[121, 0] = wn[160, 0] = np.nan
    x = np.stack([w[100], w[3], np.zeros(K, np.float32), np.ones(K, np.float32)])
    for weights in (w, wn, -np.abs(w) - 1):  # the last: every real logit of the row of ones below padding's 0
        panels = torch_ops.pack_panels(torch.from_numpy(weights))
        got = torch_ops.panel_gemm(lib, torch.from_numpy(x), panels, V, greedy=True).numpy()
        assert np.array_equal(got, ref.greedy_argmax(ref.panel_gemm(x, panels.numpy(), V)))
    assert ref.greedy_argmax(ref.panel_gemm(x, ref.pack_panels(w), V))[:3].tolist() == [7, 3, 0]
    assert ref.greedy_argmax(ref.panel_gemm(x, ref.pack_panels(wn), V)).tolist() == [121] * 4


def test_fma32_rounds_once():
    """The reference's FMA: a * b + c with one rounding where float32's multiply then add rounds twice."""
    a = f32([1 + 2**-12, 3.0, 1e-30])
    b = f32([1 + 2**-12, 1 / 3, 1e-30])
    c = f32([-(1 + 2**-11), -1.0, 1.0])
    assert ref.fma32(a, b, c)[0] == np.float32(2.0**-24)  # a * b = 1 + 2^-11 + 2^-24 needs 25 bits
    assert (a * b + c)[0] == 0
    want = [np.float32(float(a[i]) * float(b[i]) + float(c[i])) for i in range(3)]  # single products, exact here
    assert ref.fma32(a, b, c)[1:].tolist() == want[1:]
    # 1 + 2^-24 + 2^-60 rounds in float64 to the float32 midpoint 1 + 2^-24, whose float32 rounding (to even) is 1;
    # rounded once it is 1 + 2^-23 ((1 + u)(1 - u + u^2) = 1 + u^3, u = 2^-12)
    a, b, c = f32([1 + 2**-12]), f32([(1 - 2**-12 + 2**-24) * 2**-24]), f32([1.0])
    assert np.float32(float(a[0]) * float(b[0]) + 1.0) == 1
    assert ref.fma32(a, b, c)[0] == np.float32(1 + 2**-23)


# ---- GGUF blocks with quantized activations (gguf_linear.c) ---------------------------------------------


@pytest.mark.parametrize("M", [1, 4, 9, 32])
@pytest.mark.parametrize("N,K", [(96, 128), (70, 64), (17, 544)])
def test_q4_and_q8_linears(lib, M, N, K):
    r = rng(M * N + K)
    G = K // 32
    q = r.integers(0, 16, (N, K)).astype(np.uint8)
    scale = f32(r.uniform(0.002, 0.05, (N, G)).astype(np.float16))
    offset = f32(r.uniform(-0.4, 0.1, (N, G)).astype(np.float16))
    x = f32(r.standard_normal((M, K)))
    x[0, :32] = 0  # a block of zeros: dx 0
    got = torch_ops.gemm(lib, torch.from_numpy(x), torch_ops.pack(q, scale, offset)).numpy()
    want = ref.q4_linear(x, q, scale, offset)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    q8 = r.integers(-128, 128, (N, K)).astype(np.int8)
    got = torch_ops.gemm(lib, torch.from_numpy(x), torch_ops.pack8(q8, scale)).numpy()
    want = ref.q8_linear(x, q8, scale)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


# ---- the weights as stored (qx.c) -------------------------------------------------------------------------


def qx_case(kind: int, N: int, K: int, seed: int):
    """(the loader's float32 weight [N, K], its qx panels of `kind`) from random groups of that form."""
    r = rng(seed)
    G = K // 32
    s16 = lambda lo, hi, shape: f32(r.uniform(lo, hi, shape).astype(np.float16))  # noqa: E731
    if kind in (QX["Q4_0"], QX["Q4_1"], QX["Q4_K"]):
        q = r.integers(0, 16, (N, K)).astype(np.uint8)
        if kind == QX["Q4_K"]:  # float32 scales of 17 bits, as d * sc of a Q4_K file
            scale = f32(s16(0.001, 0.01, (N, G)) * r.integers(1, 64, (N, G)))
            offset = -f32(s16(0.001, 0.01, (N, G)) * r.integers(0, 64, (N, G)))
        else:
            scale = s16(-0.05, 0.05, (N, G))
            offset = -8 * scale if kind == QX["Q4_0"] else s16(-0.4, 0.1, (N, G))
        g = Int4Groups(q, scale, offset)
        return g.dequantize(), layout.pack_q4x(q, scale, None if kind == QX["Q4_0"] else offset, kind)
    if kind == QX["Q8_0"]:
        g = Int8Groups(r.integers(-128, 128, (N, K)).astype(np.int8), s16(0.001, 0.01, (N, G)))
        return g.dequantize(), layout.pack_q8x(g.q, g.scale)
    if kind == QX["IQ4"]:
        scale = f32(s16(0.001, 0.01, (N, G)) * r.integers(-32, 32, (N, G)))  # IQ4_XS's d * (sc - 32)
        g = Iq4Groups(r.integers(0, 16, (N, K)).astype(np.uint8), scale)
        return g.dequantize(), layout.pack_q4x(g.q, g.scale, None, kind)
    if kind == QX["I8"]:  # Q6_K's form: (d * sc) * q, q in -32..31, groups of 16, offset -0.0
        scale = f32(s16(0.001, 0.01, (N, 2 * G)) * r.integers(-128, 128, (N, 2 * G)))
        g = WideGroups(r.integers(-32, 32, (N, K)).astype(np.int8), scale, np.full_like(scale, -0.0))
        g2 = WideGroups(g.q, scale, f32(s16(-0.1, 0.1, (N, 2 * G))))  # and Q5_K's: with an offset
        return (g.dequantize(), layout.pack_i8x(g)), (g2.dequantize(), layout.pack_i8x(g2))
    half = np.float16 if kind == QX["F16"] else None
    w = f32(r.standard_normal((N, K)))
    w = f32(w.astype(half)) if half else ref.bf16_values(ref.bf16_bits(w))
    return w, None  # the 16-bit panels are cut from the float32 ones (layout.half_panels)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "IQ4", "I8", "BF16", "F16"])
@pytest.mark.parametrize("N,K", [(40, 64), (16, 96)])
def test_qx_rebuild_and_gemm(lib, kind, N, K):
    """Each kind's panels rebuild the loader's float32 weight bit for bit, in the reference and in the kernel
    (`qx_mismatches` against the float32 panels: 0), and qx_gemm gives panel_gemm's bits over them, logits and
    greedy tokens, at several row counts."""
    k = QX[kind]
    cases = qx_case(k, N, K, seed=k * 100 + N)
    for w, packed in cases if kind == "I8" else [cases]:
        panels = ref.pack_panels(w)
        if packed is None:
            assert layout.half_kind(panels) == k
            packed = layout.half_panels(lib, kind, panels, k)
            assert packed is not None
        rebuilt = ref.qx_weights(packed, k, N)
        assert np.array_equal(rebuilt.view(np.uint32), w.view(np.uint32)), kind  # the sign of a zero too
        assert lib.qx_mismatches(packed.ctypes.data, k, K, N, panels.ctypes.data) == 0
        t = torch.from_numpy(packed)
        for M in (1, 3, 8):
            x = f32(rng(M).standard_normal((M, K)))
            got = torch_ops.qx_gemm(lib, torch.from_numpy(x), t, N, k).numpy()
            want = ref.qx_gemm(x, packed, k, N)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (kind, M)
            assert np.array_equal(torch_ops.qx_gemm(lib, torch.from_numpy(x), t, N, k, greedy=True).numpy(),
                                  ref.greedy_argmax(want))


def test_qx_mismatches_counts_a_wrong_weight(lib):
    """The kernels' check that the loaders trust: one weight off by an ulp in the float32 panels is one
    mismatch."""
    w, packed = qx_case(QX["Q4_1"], 40, 64, seed=1)
    panels = ref.pack_panels(w)
    panels[1, 5, 3] = np.nextafter(panels[1, 5, 3], np.float32(np.inf))
    assert lib.qx_mismatches(packed.ctypes.data, QX["Q4_1"], 64, 40, panels.ctypes.data) == 1


# ---- paged attention (attention.c) ------------------------------------------------------------------------


def attention_case(Hq, Hkv, D, bs, kv_lens, dtype, seed):
    """Caches of random blocks (block 0 the null block), one table a request in shuffled blocks."""
    n, P = len(kv_lens), max(1, max(-(-x // bs) for x in kv_lens))
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(n * P + 1, bs, Hkv, D, generator=g).to(dtype)
    vc = torch.randn(n * P + 1, bs, Hkv, D, generator=g).to(dtype)
    tables = (torch.randperm(n * P, generator=g) + 1).view(n, P).to(torch.int32)
    npdt = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}[dtype]
    return kc, vc, tables, bits(kc, npdt), bits(vc, npdt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,D,window", [(4, 2, 32, None), (9, 3, 20, 7), (2, 1, 64, None), (6, 6, 8, 3)])
def test_decode_attention(lib, dtype, Hq, Hkv, D, window):
    bs, kv_lens = 4, [1, 13, 0, 37, 8]  # one token; tails of a block; nothing cached; several blocks
    kc, vc, tables, kn, vn = attention_case(Hq, Hkv, D, bs, kv_lens, dtype, seed=Hq * D)
    T = len(kv_lens) + 2  # rows the step does not decode keep their values
    q = f32(rng(D).standard_normal((T, Hq, D)))
    tokens = np.array([5, 0, 2, 6, 3], np.int64)
    out = torch.full((T, Hq, D), 5.0)
    torch_ops.decode_attention(lib, torch.from_numpy(q), torch.from_numpy(tokens),
                               torch.tensor(kv_lens, dtype=torch.int32), tables, kc, vc, D**-0.5, window, out)
    want = ref.decode_attention(q, tokens, np.array(kv_lens), tables.numpy(), kn, vn, D**-0.5, window)
    np.testing.assert_allclose(out.numpy()[tokens], want[tokens], rtol=1e-5, atol=2e-6)
    assert (out.numpy()[[1, 4]] == 5.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,D,window", [(4, 2, 32, None), (9, 3, 20, 9), (2, 1, 64, 5)])
def test_prefill_attention(lib, dtype, Hq, Hkv, D, window):
    """Prompt chunks (a whole prompt, a chunk after cached tokens, one token, a chunk longer than a query tile)
    attend causally over their tables; rows between the requests (padding) keep their values."""
    bs, kv_lens, q_lens = 8, [37, 1, 70, 16], [37, 1, 5, 16]
    kc, vc, tables, kn, vn = attention_case(Hq, Hkv, D, bs, kv_lens, dtype, seed=Hq + D)
    starts = np.array([0, 38, 40, 46], np.int32)  # a padding row at 37 and at 39
    T = int(starts[-1]) + q_lens[-1]
    q = f32(rng(Hq).standard_normal((T, Hq, D)))
    out = torch.full((T, Hq, D), 5.0)
    i32 = lambda a: torch.tensor(a, dtype=torch.int32)  # noqa: E731
    torch_ops.prefill_attention(lib, torch.from_numpy(q), torch.from_numpy(starts), i32(q_lens), i32(kv_lens),
                                tables, kc, vc, D**-0.5, window, out)
    want = ref.paged_attention(q, starts, np.array(q_lens), np.array(kv_lens), tables.numpy(), kn, vn, D**-0.5,
                               window)
    rows = np.concatenate([np.arange(s, s + ql) for s, ql in zip(starts, q_lens)])
    np.testing.assert_allclose(out.numpy()[rows], want[rows], rtol=1e-5, atol=2e-6)
    assert (out.numpy()[[37, 39]] == 5.0).all()


# ---- the samplers' rows (sampler.c) ---------------------------------------------------------------------


@pytest.mark.parametrize("V", [7, 300, 4101])
def test_log_softmax_rows(lib, V):
    r = rng(V)
    x = f32(r.standard_normal((5, V)) * 4)
    x[1, : V // 2] = -np.inf  # masked tokens: probability exactly 0
    x[2, V - 1] = 60.0
    x[3] = -np.inf  # NaN rows, as the reference's
    x[4, V // 3] = np.nan
    t = strided(x, 3)
    for probs in (False, True):
        got = torch_ops.log_softmax(lib, t, probs=probs).numpy()
        want = ref.log_softmax_rows(x, probs=probs)
        assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(np.isinf(got), np.isinf(want))
        live = np.isfinite(want)
        np.testing.assert_allclose(got[live], want[live], rtol=4e-6 if probs else 0, atol=0 if probs else 4e-6)


@pytest.mark.parametrize("n", [0, 1, 5, 20])
def test_top_n_rows(lib, n):
    x = f32(np.round(rng(n).standard_normal((4, 999)) * 2))  # many ties
    x[1] = 1.0
    x[2, 500:] = -np.inf
    vals, ids = torch_ops.top_n(lib, strided(x, 5), n)
    want_vals, want_ids = ref.top_n_rows(x, n)
    assert np.array_equal(ids.numpy(), want_ids) and np.array_equal(vals.numpy(), want_vals)


def test_inverse_cdf_rows(lib):
    V = 5003
    r = rng(11)
    p = f32(r.random((4, V)))
    p[1, ::2] = 0  # zeros are never drawn
    p[2] = 0
    p[2, 17] = 1
    p[3, V - 10 :] = 0  # a draw past the rounded mass: the last token with a probability
    p /= p.sum(-1, keepdims=True)
    for u in (0.0, 1e-6, 0.25, 0.5, 0.7501, 0.99999994, *r.random(4)):
        uu = np.full(4, u, np.float32)
        got = torch_ops.inverse_cdf(lib, strided(p, 3), torch.from_numpy(uu)).numpy()
        assert np.array_equal(got, ref.inverse_cdf_rows(p, uu)), u


def test_top_p_thresholds(lib):
    r = rng(12)
    x = f32(r.standard_normal((6, 3001)) * 3)
    x[1] = 0  # flat: the cut in a long run of ties
    x[2, 5:] = -np.inf
    x[3] = np.round(x[3])
    p = ref.log_softmax_rows(x, probs=True)
    top_p = f32([0.9, 0.5, 0.95, 0.3, 1.0, 0.999])
    # and a top_p between a row's float32 and float64 running sums at a cut k: float64's (the kernel's) cuts at
    # k, float32's would cut later, at a smaller probability
    ps = np.sort(p[0])[::-1]
    c32, c64 = np.cumsum(ps), np.cumsum(ps.astype(np.float64))
    k = next(k for k in range(1, len(ps) - 1) if ps[k] > ps[k + 1] and c64[k - 1] < np.nextafter(c32[k], f32(1))
             <= c64[k])
    p, top_p = np.concatenate([p, p[:1]]), np.append(top_p, np.nextafter(c32[k], f32(1)))
    want = ref.top_p_thresholds(p, top_p)
    assert want[-1] == ps[k]
    got = torch_ops.top_p_thresholds(lib, strided(p, 2), torch.from_numpy(top_p)).numpy()
    assert np.array_equal(got, want)
    assert got[4] == 0
