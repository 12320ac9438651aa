"""The float32 CPU kernels of `cpu_kernels.torch_ops` against torch's ops and transformers' RoPE.

(The 4-/8-bit GGUF kernels are in test_torch_quant.py; the cache writes and decode attention in
test_torch_attention.py, against the attention reference.)
"""

from __future__ import annotations

import ctypes

import pytest
import torch

import torch.nn.functional as F  # noqa: E402

from cpu_kernels import torch_ops  # noqa: E402


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("M,K", [(1, 64), (3, 576), (5, 70), (40, 8)])
def test_rms_norm(lib, M, K):
    base = randn(M, K + 9) * 3
    x = base[:, 4 : 4 + K]  # rows K + 9 floats apart
    w = randn(K, seed=1)
    got = torch_ops.rms_norm(lib, x, w, 1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, (K,), w, 1e-5), rtol=1e-6, atol=1e-6)
    # with the residual stream: residual += x in place, then the norm of it
    residual = randn(M, K, seed=2)
    want_res = residual + x
    got = torch_ops.rms_norm(lib, x, w, 1e-5, residual)
    assert torch.equal(residual, want_res)
    torch.testing.assert_close(got, F.rms_norm(want_res, (K,), w, 1e-5), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("D", [16, 64, 6])
def test_rope_matches_transformers(lib, D):
    from transformers.models.llama.modeling_llama import rotate_half

    T, H = 5, 3
    pos = torch.tensor([0, 7, 1, 300, 2])
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = pos[:, None].float() * inv[None]  # [T, D/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)  # transformers' form
    qkv = randn(T, H + 2, D)  # rotate the first H heads of each row in place, as a view of a wider tensor
    want = qkv[:, :H] * cos[:, None] + rotate_half(qkv[:, :H]) * sin[:, None]
    tail = qkv[:, H:].clone()
    ours_sin = torch.cat([-ang.sin(), ang.sin()], -1)  # torchengine.model's tables: (cos, cos), (-sin, sin)
    out = torch_ops.rope_(lib, qkv[:, :H], cos[:, None].contiguous(), ours_sin[:, None].contiguous())
    assert out.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qkv[:, :H], want, rtol=1e-5, atol=1e-6)
    assert torch.equal(qkv[:, H:], tail)


@pytest.mark.parametrize("M,I", [(1, 1536), (4, 37)])
def test_silu_mul(lib, M, I):
    gu = randn(M, 2 * I) * 4
    torch.testing.assert_close(torch_ops.silu_mul(lib, gu), F.silu(gu[:, :I]) * gu[:, I:], rtol=2e-6, atol=1e-7)


def test_silu_mul_exp_over_the_whole_range(lib):
    """The kernel's vectorised exp: within a few float32 ulps of float64 from -100 to 100 (clamped ends)."""
    g = torch.linspace(-100, 100, 20001)
    gu = torch.cat([g, torch.ones_like(g)])[None]
    got = torch_ops.silu_mul(lib, gu)[0].double()
    want = g.double() * torch.sigmoid(g.double())
    torch.testing.assert_close(got, want, rtol=4e-7, atol=1e-30)


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 8, 9, 13, 33, 63])
@pytest.mark.parametrize("N,K", [(49, 64), (300, 70), (1000, 576)])
def test_f32_gemm(lib, M, N, K):
    """Every tile (4, 3, 2, 1 rows; 3, 2, 1 weight rows), K with and without a tail of 8, N across threads
    and weight panels, M across row blocks (12 rows at K 576)."""
    x, w = randn(M, K), randn(N, K, seed=1)
    want = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(torch_ops.f32_gemm(lib, x, w), want, rtol=1e-5, atol=1e-6 * K)  # float32 sums


def test_bad_arguments_raise(lib):
    with pytest.raises(ValueError):
        torch_ops.f32_gemm(lib, torch.zeros(3, 8), torch.zeros(4, 9))  # K differs
    with pytest.raises(ValueError):
        torch_ops.f32_gemm(lib, torch.zeros(0, 8), torch.zeros(4, 8))  # no rows
    with pytest.raises(ValueError):
        torch_ops.rope_(lib, torch.zeros(2, 1, 5), torch.zeros(2, 1, 5), torch.zeros(2, 1, 5))  # odd D


def test_rows_do_not_depend_on_their_neighbours(lib):
    """Each row of a call comes out bit-identical to the same row computed alone (any row count, any place
    in the batch): the float32 and the 4-/8-bit matmuls. Outputs must not change with the batch a request
    shares (preemption, chunked prefill, the prefix cache: tests/test_structured_outputs.py)."""
    import numpy as np

    K, N = 96, 70
    x, w = randn(11, K), randn(N, K, seed=1)
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (N, K)).astype(np.uint8)
    scale = rng.random((N, K // 32)).astype(np.float16).astype(np.float32)
    offset = (rng.random((N, K // 32)) - 0.5).astype(np.float16).astype(np.float32)
    q8 = rng.integers(-127, 128, (N, K)).astype(np.int8)
    kernels = {
        "f32": lambda h: torch_ops.f32_gemm(lib, h, w),
        "q4": lambda h, b=torch_ops.pack(q, scale, offset): torch_ops.gemm(lib, h, b),
        "q8": lambda h, b=torch_ops.pack8(q8, scale): torch_ops.gemm(lib, h, b),
    }
    for name, f in kernels.items():
        alone = torch.cat([f(x[i : i + 1]) for i in range(len(x))])
        for M in range(2, len(x) + 1):
            assert torch.equal(f(x[:M]), alone[:M]), (name, M)
    # float32 at a real model's width, rows across the kernel's row blocks (12 rows at K 576)
    x, w = randn(70, 576), randn(200, 576, seed=2)
    alone = torch.cat([torch_ops.f32_gemm(lib, x[i : i + 1], w) for i in range(len(x))])
    for M in (5, 12, 13, 29, 57, 70):
        assert torch.equal(torch_ops.f32_gemm(lib, x[:M], w), alone[:M]), M
        assert torch.equal(torch_ops.f32_gemm(lib, x[70 - M :], w), alone[70 - M :]), M


def test_pack_panels_round_trip():
    w = randn(37, 10)
    panels = torch_ops.pack_panels(w)
    assert panels.shape == (3, 10, 16) and panels.is_contiguous()
    assert torch.equal(panels[2, :, 5:], torch.zeros(10, 11))  # the padding rows
    ids = torch.tensor([0, 36, 15, 16, 3, 36])
    assert torch.equal(torch_ops.panel_rows(panels, ids), w[ids])
    # into a slice of a huge-page buffer (the model packs all its weights into one): the same panels
    from cpu_kernels.memory import HUGE_PAGE

    n = torch_ops.panels_size(w)
    buf = torch_ops.huge_page_buffer(3 * n)
    assert buf.numel() == 3 * n and buf.data_ptr() % HUGE_PAGE == 0
    into = torch_ops.pack_panels(w, buf[n : 2 * n])
    assert torch.equal(into, panels) and into.is_contiguous() and into.data_ptr() == buf[n:].data_ptr()


def test_pack_panels_kernel_gives_the_reference_layout(lib):
    """The C packer (what both backends pack their weights with at load) against the layout written out in torch:
    row v at [v // 16, :, v % 16], zero rows padding the last panel; k past one 64-wide block and rows `ld`
    floats apart."""
    for V, K, ld in ((37, 10, 10), (203, 130, 130), (48, 576, 600), (1, 1, 1)):
        big = randn(V, ld, seed=V)
        w = big[:, :K]
        P = -(-V // 16)
        padded = torch.zeros((P * 16, K))
        padded[:V] = w
        want = padded.view(P, 16, K).transpose(1, 2)
        got = torch.full((P * K * 16,), float("nan"))
        assert lib.pack_panels_f32(w.data_ptr(), V, K, ld, got.data_ptr()) == 0
        assert torch.equal(got.view(P, K, 16), want), (V, K, ld)
        assert torch.equal(torch_ops.pack_panels(w), want)
    assert lib.pack_panels_f32(w.data_ptr(), 4, 5, 4, got.data_ptr()) != 0  # rows closer than K floats


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 6, 7, 13, 18, 19, 23, 32, 70])
@pytest.mark.parametrize("V,K", [(1000, 64), (203, 8), (1021, 576)])
def test_panel_gemm(lib, M, V, K, blocked_from):
    """Logits against float64, every tile (6..1 rows; 1-4 panels), a vocabulary that is not a multiple of 16
    or 8, two threads, both loop orders (the unblocked one below `blocked_from` rows, in row blocks of 6 at K
    576; the k-blocked one from there, in row blocks of 48: 70 rows is two; 32 is a batch-32 decode step: five
    row tiles and a 2-row tail; 7 and 13 rows a tail of 1); greedy is torch.argmax of the same logits."""
    x, w = randn(M, K), randn(V, K, seed=1)
    panels = torch_ops.pack_panels(w)
    logits = torch_ops.panel_gemm(lib, x, panels, V)
    torch.testing.assert_close(logits, (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-6 * K)
    assert torch.equal(torch_ops.panel_gemm(lib, x, panels, V, greedy=True), logits.argmax(-1))
    # each row the same alone as among the others, logits and tokens
    alone = torch.cat([torch_ops.panel_gemm(lib, x[i : i + 1], panels, V) for i in range(M)])
    assert torch.equal(alone, logits)


@pytest.mark.parametrize("M,K,V,threads", [
    (301, 1100, 203, 2),  # 13 panels (the last partial) shared 6 / 7 between the threads; k blocks of 576 + 524
    (263, 1100, 40, 2),  # 3 panels, 1 / 2; row blocks of 48 x 5 + 23 (a 5-row tail)
    (259, 600, 1003, 1),  # one thread; tails of 1-4 rows (259-262) after five row blocks
    (260, 600, 1003, 1),
    (261, 600, 1003, 1),
    (262, 600, 1003, 1),
    (300, 576, 40, 2),  # K = 576: one k block
    (256, 576, 960, 2),  # a prefill's q/k/v linear: 60 panels, 30 / 30
])
def test_panel_gemm_many_rows(lib, M, K, V, threads):
    """From 19 rows (6 on a CPU without AVX-512) panel_gemm shares single panels between the threads and blocks
    k (partial sums through y between blocks of 576): the same bits as a row computed alone (one row never
    blocks), whatever the shares, the k blocks (a short last one), the row blocks and tails, and a vocabulary
    with a partial last panel; the greedy head's argmax over the same split is the logits' argmax."""
    x, w = randn(M, K, seed=5), randn(V, K, seed=6)
    panels = torch_ops.pack_panels(w)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        logits = torch_ops.panel_gemm(lib, x, panels, V)
        greedy = torch_ops.panel_gemm(lib, x, panels, V, greedy=True)
    finally:
        torch.set_num_threads(n)
    torch.testing.assert_close(logits, (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-6 * K)
    alone = torch.cat([torch_ops.panel_gemm(lib, x[i : i + 1], panels, V) for i in range(M)])
    assert torch.equal(alone, logits)
    assert torch.equal(greedy, logits.argmax(-1))


@pytest.mark.parametrize("n,nt,least", [(60, 2, 4), (36, 2, 4), (192, 2, 4), (7, 3, 4), (1000, 5, 1), (3, 4, 1)])
def test_shares_hand_out_every_part_once_the_owner_in_order(lib, n, nt, least):
    """The linears' parts between threads (shares_claim), in random interleavings of the threads' claims (and a
    thread with no share of its own): every part goes out exactly once; a thread takes its own share from its
    start upwards, each claim where the last ended, half of what is left (at least `least` or the rest); parts
    of another's share come from its back; `pe` is the end of the share for an owner's claim (its next claim
    continues there) and the claim's end for a taken one."""
    import numpy as np

    a, b, pe = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    for empty in (0, -3):  # nothing to hand out
        sh = (ctypes.c_uint64 * nt)()
        lib.shares_init(sh, empty, nt)
        assert not lib.shares_claim(sh, nt, 0, 0, ctypes.byref(a), ctypes.byref(b), ctypes.byref(pe))
    rng = np.random.default_rng(n * 7 + nt)
    for _ in range(50):
        sh = (ctypes.c_uint64 * nt)()
        lib.shares_init(sh, n, nt)
        start = [n * t // nt for t in range(nt)]
        end = [n * (t + 1) // nt for t in range(nt)]
        lo, hi = list(start), list(end)  # what the model says is left of each share
        owner_at = list(start)
        got = np.zeros(n, dtype=int)
        active = list(range(-1, nt))  # -1: a thread without a share
        while active:
            t = int(rng.choice(active))
            if not lib.shares_claim(sh, nt, t, least, ctypes.byref(a), ctypes.byref(b), ctypes.byref(pe)):
                assert all(h == l for l, h in zip(lo, hi))  # nothing left anywhere
                active.remove(t)
                continue
            got[a.value:b.value] += 1
            assert a.value < b.value
            if 0 <= t < nt and lo[t] < hi[t]:  # its own share, from the front
                left = hi[t] - lo[t]
                assert (a.value, pe.value) == (owner_at[t], hi[t])
                assert b.value - a.value == min(left, max(least, (left + 1) // 2))
                owner_at[t] = lo[t] = b.value
            else:  # the back of the fullest other share
                v = max(range(nt), key=lambda u: (hi[u] - lo[u], -u))
                left = hi[v] - lo[v]
                assert (b.value, pe.value) == (hi[v], hi[v])
                assert b.value - a.value == min(left, max(least, left // 2))
                hi[v] = a.value
        assert (got == 1).all()


@pytest.mark.parametrize("M,K,V", [(30, 1100, 203), (8, 600, 203), (25, 576, 40)])
def test_panel_gemm_parts_in_any_ranges_give_the_whole_calls_bits(lib, M, K, V, blocked_from):
    """panel_gemm_part over the panels cut into random ranges (as claims cut them: starting anywhere, not at
    multiples of 4), each allowed to prefetch past its end up to a random bound (beyond the last panel too):
    the same bits as one panel_gemm call; k blocks of 576 + 524 (the prefetch into the next range's first
    k block), a partial last panel, at 8 rows the unblocked order (parts of 4 panels) or the blocked one."""
    import numpy as np

    x, w = randn(M, K, seed=7), randn(V, K, seed=8)
    panels = torch_ops.pack_panels(w)
    want = torch_ops.panel_gemm(lib, x, panels, V)
    unit, nt, claim = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    parts = lib.panel_gemm_plan(M, K, V, 2, ctypes.byref(unit), ctypes.byref(nt), ctypes.byref(claim))
    assert unit.value == (1 if M >= blocked_from else 4)  # single panels where the order blocks k
    unit = unit.value
    rng = np.random.default_rng(M)
    for _ in range(20):
        cuts = sorted({0, parts, *rng.integers(1, parts, size=rng.integers(0, parts)).tolist()})
        y = torch.full((M, V), float("nan"))
        for lo, hi in zip(cuts, cuts[1:]):
            lib.panel_gemm_part(x.data_ptr(), M, K, panels.data_ptr(), V, y.data_ptr(), None, unit, lo, hi,
                                int(rng.integers(hi, parts + 3)))
        assert torch.equal(y, want)


@pytest.mark.parametrize("n,nt,least,threads", [(20000, 2, 1, 3), (20000, 4, 1, 2), (5000, 2, 4, 2)])
def test_shares_under_contention_hand_out_every_part_once(lib, n, nt, least, threads):
    """OpenMP threads claiming back to back at once (shares_count; a thread past nt only takes from the
    others), the compare-and-swaps contended: each part handed out exactly once."""
    import numpy as np

    for _ in range(20):
        counts = np.zeros(n, dtype=np.int32)
        assert lib.shares_count(n, nt, least, threads, counts.ctypes.data) == 0
        assert (counts == 1).all(), np.flatnonzero(counts != 1)[:10]


@pytest.mark.parametrize("M", [8, 30])  # the unblocked order (at 8 from 19) and the k-blocked one
def test_greedy_folds_do_not_depend_on_the_order_of_the_panels(lib, M, blocked_from):
    """A set of running maxima folded from the panels in any order (a claim takes them from the back of another
    thread's share) gives the first maximum: among equal values a lane keeps the lowest column."""
    V, K = 1003, 64
    w = randn(V, K, seed=5) * 0.1
    w[[37 + 16 * 7, 37 + 16 * 40, 21]] = w[37].clone()  # a tie in lane 5 of four panels (1, 2, 9 and 42)
    x = w[37].repeat(M, 1)
    x[1] = randn(1, K, seed=6)
    panels = torch_ops.pack_panels(w)
    parts = -(-V // 16)  # one panel a part (unit 1), folded in the orders below
    size = lib.head_best_bytes()
    want = torch_ops.panel_gemm(lib, x, panels, V).argmax(-1)
    assert want[0] == 21
    for order in (range(parts - 1, -1, -1), [*range(parts // 2, parts), *range(parts // 2)]):
        best = torch.zeros(size * M, dtype=torch.uint8)
        lib.head_best_init(best.data_ptr(), M)
        for p in order:
            lib.panel_gemm_part(x.data_ptr(), M, K, panels.data_ptr(), V, None, best.data_ptr(), 1, p, p + 1, p + 1)
        got = [lib.head_best_argmax(best.data_ptr() + size * m, 1, 0) for m in range(M)]
        assert got == want.tolist()


@pytest.mark.parametrize("M", [8, 25, 27, 29])  # 8: the unblocked order from 19, the blocked one from 6 (a 2-row
# tail); 25 / 27 / 29: the k-blocked one, tails of 1 / 3 / 5 rows
def test_panel_gemm_greedy_ties_nan_and_padding(lib, M, blocked_from):
    """torch.argmax's answer in the corner cases: the first of tied maxima (within a lane, across lanes and
    across the two threads' halves of the vocabulary), a NaN logit (the first NaN wins), a row of equal logits
    (index 0), and the padding columns of the last panel never win."""
    V, K = 1003, 64
    w = randn(V, K, seed=3) * 0.1
    w[[7, 900, 455, 456, 1002]] = w[500].clone()  # ties with 500 in other lanes, panels and thread halves
    w[[305, 300]] = w[40].clone() * 2  # a tie whose first index sits in the higher lane (300 = 18 * 16 + 12:
    # lane 4 of its panel's second half; 305 = 19 * 16 + 1: lane 1 of the first half)
    x = randn(M, K, seed=4)
    x[1] = 0  # every logit 0
    panels = torch_ops.pack_panels(w)
    logits = torch_ops.panel_gemm(lib, x, panels, V)
    got = torch_ops.panel_gemm(lib, x, panels, V, greedy=True)
    assert torch.equal(got, logits.argmax(-1))
    assert got[1] == 0
    # rows whose best is a tied group: the first of it (in the main tiles and in the tail)
    xs = torch.stack([w[500], w[40]]).repeat(M // 2 + 1, 1)[:M]
    t = torch_ops.panel_gemm(lib, xs, panels, V, greedy=True)
    assert t.tolist() == [7, 300] * (M // 2) + [7] * (M % 2)
    assert torch.equal(t, torch_ops.panel_gemm(lib, xs, panels, V).argmax(-1))
    # NaN: torch.argmax returns the first NaN
    w2 = w.clone()
    w2[321, 0] = float("nan")
    w2[999, 0] = float("nan")
    p2 = torch_ops.pack_panels(w2)
    assert torch.equal(torch_ops.panel_gemm(lib, x, p2, V, greedy=True), torch_ops.panel_gemm(lib, x, p2, V).argmax(-1))
    # a padded vocabulary whose real logits are all below the padding's 0
    wn = -w.abs() - 1
    xp = torch.ones(3, K)
    pn = torch_ops.pack_panels(wn)
    assert torch.equal(torch_ops.panel_gemm(lib, xp, pn, V, greedy=True), (xp @ wn.t()).argmax(-1))
    with pytest.raises(ValueError):
        torch_ops.panel_gemm(lib, torch.zeros(2, 63), panels, V)  # K differs
    with pytest.raises(ValueError):
        torch_ops.panel_gemm(lib, torch.zeros(2, K), panels, V + 16)  # more vocabulary than panels


def test_exp_edges_nan_and_overflow(lib):
    """NaN stays NaN in the vectorised exp as in the scalar tail (silu(NaN) is NaN in both), and exp near
    its float32 limit is finite (88.4-88.7 gave inf once: 2^128)."""
    I = 19  # 16 in the vector body, 3 in the scalar tail
    g = torch.full((I,), 2.0)
    g[[3, 17]] = float("nan")
    gu = torch.cat([g, torch.ones(I)])[None]
    got = torch_ops.silu_mul(lib, gu)[0]
    assert torch.isnan(got[[3, 17]]).all() and not torch.isnan(got[[0, 16, 18]]).any()
    # silu(-x) = -x / (1 + e^x): e^x for x in (88.38, 88.72] must not be inf (the result: a tiny negative, not -0)
    g = -torch.linspace(88.4, 88.7, 16)
    out = torch_ops.silu_mul(lib, torch.cat([g, torch.ones(16)])[None])[0]
    assert torch.isfinite(out).all() and (out < 0).all()


@pytest.mark.parametrize("kv_len", [5, 16, 13])  # scores in the scalar tail only, the vector body only, both
def test_decode_attention_propagates_a_nan_score(lib, kv_len):
    """A NaN query gives a NaN output row, as torch's attention does, wherever its scores fall."""
    Hq, Hkv, D, bs = 2, 1, 8, 4
    nb = -(-kv_len // bs)
    k_cache, v_cache = randn(nb + 1, bs, Hkv, D), randn(nb + 1, bs, Hkv, D, seed=1)
    q = randn(1, Hq, D, seed=2)
    q[0, 1, 3] = float("nan")
    out = torch.empty(1, Hq, D)
    torch_ops.decode_attention(lib, q, torch.zeros(1, dtype=torch.int64), torch.tensor([kv_len], dtype=torch.int32),
                                 torch.arange(1, nb + 1, dtype=torch.int32)[None], k_cache, v_cache, D**-0.5, None, out)
    assert torch.isnan(out[0, 1]).all() and torch.isfinite(out[0, 0]).all()


@pytest.mark.parametrize("Hq,Hkv,D,bs,window", [(9, 3, 64, 16, None), (8, 2, 32, 8, 17), (4, 4, 24, 4, None),
                                                (12, 2, 128, 16, None)])
def test_prefill_attention_is_decode_attention_for_every_query(lib, Hq, Hkv, D, bs, window):
    """Each prefill query gets decode_attention's bits for a query at its position (so a token's attention is
    the same prefilled, chunk-prefilled, recomputed or decoded), within float32 of a float64 softmax; rows of
    other requests are left alone."""
    q_lens, kv_lens = [70, 33, 1, 130], [70, 50, 12, 130]  # a prefill, a chunk after 17 cached, a single query
    n, P = len(q_lens), max(-(-x // bs) for x in kv_lens)
    k_cache, v_cache = randn(n * P + 1, bs, Hkv, D), randn(n * P + 1, bs, Hkv, D, seed=1)
    tables = (torch.randperm(n * P, generator=torch.Generator().manual_seed(2)) + 1).view(n, P).to(torch.int32)
    T = sum(q_lens) + 2
    q = randn(T, Hq, D, seed=3)
    starts = [0, 70, 103, 104]
    out = torch.full((T, Hq, D), 5.0)
    i32 = lambda a: torch.tensor(a, dtype=torch.int32)  # noqa: E731
    torch_ops.prefill_attention(lib, q, i32(starts), i32(q_lens), i32(kv_lens), tables, k_cache, v_cache,
                                  D**-0.5, window, out)
    assert (out[-2:] == 5.0).all()
    rows, lens, tabs = [], [], []
    for i in range(n):
        for j in range(q_lens[i]):
            rows.append(starts[i] + j)
            lens.append(kv_lens[i] - q_lens[i] + j + 1)
            tabs.append(tables[i])
    dec = torch.full((T, Hq, D), 5.0)
    torch_ops.decode_attention(lib, q, torch.tensor(rows, dtype=torch.int64), i32(lens), torch.stack(tabs).contiguous(),
                                 k_cache, v_cache, D**-0.5, window, dec)
    assert torch.equal(out, dec)
    G = Hq // Hkv
    for t, L, tab in list(zip(rows, lens, tabs))[::7]:
        pos = torch.arange(max(0, L - window) if window else 0, L)
        slots = tab[pos // bs].long() * bs + pos % bs
        K, V = k_cache.view(-1, Hkv, D)[slots].double(), v_cache.view(-1, Hkv, D)[slots].double()
        for h in range(Hq):
            p = torch.softmax(K[:, h // G] @ q[t, h].double() * D**-0.5, 0)
            torch.testing.assert_close(out[t, h].double(), p @ V[:, h // G], rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kv_write_to_a_16bit_cache_rounds_as_torch_does(lib, dtype):
    """kv_write converts float32 rows into a float16 / bfloat16 cache as .to(dtype) does (round to nearest
    even, overflow to inf, subnormals), bit for bit; a NaN stays a NaN."""
    T, Hkv, D = 5, 2, 20  # 40 floats a row: the vector body and a scalar tail
    k, v = randn(T, Hkv, D) * 3, randn(T, Hkv, D, seed=1) * 1e-3
    k[0, 0, :6] = torch.tensor([65519.0, 65521.0, 1e6, -1e-7, 3e38, 1.0 + 2**-8])  # f16 edges; a bf16 tie
    k[1, 1, 17] = v[2, 0, 3] = float("nan")
    v[3, 1, :4] = torch.tensor([1e-40, -2.5e-42, float("inf"), -0.0])  # float32 subnormals, inf, -0
    slots = torch.tensor([3, -1, 0, 9, 4], dtype=torch.int64)
    kc, vc = torch.zeros(3, 4, Hkv, D, dtype=dtype), torch.zeros(3, 4, Hkv, D, dtype=dtype)
    torch_ops.kv_write(lib, k, v, slots, kc, vc)
    for got, src in ((kc, k), (vc, v)):
        want = torch.zeros_like(got).view(-1, Hkv, D)
        keep = slots >= 0
        want.index_copy_(0, slots[keep], src[keep].to(dtype))
        g, w = got.view(-1, Hkv, D), want
        assert torch.equal(g.isnan(), w.isnan())
        ok = ~w.isnan()
        assert torch.equal(g.view(torch.int16)[ok], w.view(torch.int16)[ok])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,D,window", [(9, 3, 64, None), (8, 2, 32, 9), (6, 3, 20, None)])
def test_attention_over_a_16bit_cache_is_float32_attention_over_its_values(lib, dtype, Hq, Hkv, D, window):
    """decode_attention and prefill_attention over a float16 / bfloat16 cache give the bits the float32
    kernels give over the same values (a 16-bit cache is read back exactly), and prefill still equals decode."""
    bs, kv_lens, q_lens = 8, [37, 1, 70, 16], [37, 1, 5, 16]
    n, P = len(kv_lens), max(-(-x // bs) for x in kv_lens)
    k16, v16 = (randn(n * P + 1, bs, Hkv, D, seed=s).to(dtype) for s in (0, 1))
    tables = (torch.randperm(n * P, generator=torch.Generator().manual_seed(2)) + 1).view(n, P).to(torch.int32)
    i32 = lambda a: torch.tensor(a, dtype=torch.int32)  # noqa: E731
    T = sum(q_lens)
    q = randn(T, Hq, D, seed=3)
    starts = [0, 37, 38, 43]
    outs = {}
    for name, (kc, vc) in (("16", (k16, v16)), ("32", (k16.float(), v16.float()))):
        pre = torch.full((T, Hq, D), 5.0)
        torch_ops.prefill_attention(lib, q, i32(starts), i32(q_lens), i32(kv_lens), tables, kc, vc, D**-0.5, window,
                                      pre)
        dec = torch.full((n, Hq, D), 5.0)  # each request's last query, decoded
        last = torch.tensor([s + ql - 1 for s, ql in zip(starts, q_lens)], dtype=torch.int64)
        torch_ops.decode_attention(lib, q[last].contiguous(), torch.arange(n), i32(kv_lens), tables, kc, vc,
                                     D**-0.5, window, dec)
        assert torch.equal(pre[last], dec)
        outs[name] = pre
    assert torch.equal(outs["16"], outs["32"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the per-key loop and the tiles
@pytest.mark.parametrize("Hq,Hkv,D", [(9, 3, 64), (8, 2, 32), (4, 1, 24), (12, 3, 20)])
def test_decode_attention_rows_do_not_depend_on_the_batch(lib, Hq, Hkv, D, dtype):
    """A request's decode attention has the same bits alone (the split order on two threads: its keys' scores,
    then its outputs' dims, split between them), with one other request (the split order or a kv head's heads a
    task) and among many (a request a task): the tasks' tiles of heads and keys never change a head's
    arithmetic."""
    bs, lens = 16, [300, 171, 1, 64, 0, 250, 90]  # long enough to use both threads; a row with no cached token
    n, P = len(lens), max(-(-x // bs) for x in lens)
    kc, vc = randn(n * P + 1, bs, Hkv, D).to(dtype), randn(n * P + 1, bs, Hkv, D, seed=1).to(dtype)
    tables = (torch.randperm(n * P, generator=torch.Generator().manual_seed(2)) + 1).view(n, P).to(torch.int32)
    q = randn(n, Hq, D, seed=3)
    i32 = lambda a: torch.tensor(a, dtype=torch.int32)  # noqa: E731
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def run(rows):
            out = torch.full((n, Hq, D), 5.0)
            idx = torch.tensor(rows)
            torch_ops.decode_attention(lib, q, idx.to(torch.int64), i32([lens[r] for r in rows]),
                                         tables[idx].contiguous(), kc, vc, D**-0.5, None, out)
            return out[idx]

        together = run(list(range(n)))
        for r in range(n):
            assert torch.equal(run([r]), together[r : r + 1]), r
            assert torch.equal(run([r, (r + 1) % n])[:1], together[r : r + 1]), r
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together[4], torch.zeros(Hq, D))
    G = Hq // Hkv
    for r in (0, 2):
        slots = tables[r][torch.arange(lens[r]) // bs].long() * bs + torch.arange(lens[r]) % bs
        K, V = kc.view(-1, Hkv, D)[slots].double(), vc.view(-1, Hkv, D)[slots].double()
        for h in range(Hq):
            p = torch.softmax(K[:, h // G] @ q[r, h].double() * D**-0.5, 0)
            torch.testing.assert_close(together[r, h].double(), p @ V[:, h // G], rtol=1e-5, atol=2e-6)


def test_prefill_attention_refuses_bad_lengths(lib):
    k_cache = randn(3, 4, 1, 8)
    q, out = randn(4, 2, 8), torch.zeros(4, 2, 8)
    i32 = lambda a: torch.tensor(a, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match="prefill_attention"):  # kv_len < q_len
        torch_ops.prefill_attention(lib, q, i32([0]), i32([4]), i32([3]), i32([[1, 2]]), k_cache, k_cache, 0.3,
                                      None, out)


# ---- the samplers' rows (both backends' samplers on a CPU; jax's custom calls: test_jax_cpu_kernels.py) -----


@pytest.mark.parametrize("V", [7, 300, 49152 + 5])  # the tail only, body and tail, a vocabulary
def test_log_softmax_and_softmax_rows(lib, V):
    import numpy as np

    from enginecore import sampling_ref as ref

    base = randn(6, V + 3) * 4
    x = base[:, :V]  # rows V + 3 floats apart
    x[1, : V // 2] = float("-inf")  # masked tokens: probability exactly 0
    x[2, V - 1] = 60.0  # one dominant token in the tail
    x[3] = float("-inf")  # an all -inf row: NaN, as in the reference
    x[4, V // 3] = float("nan")
    lp = torch_ops.log_softmax(lib, x)
    p = torch_ops.log_softmax(lib, x, probs=True)
    for i in (0, 1, 2, 5):
        want = torch.from_numpy(ref.log_softmax(x[i].numpy()).astype(np.float64))
        live = torch.isfinite(want)
        assert torch.equal(torch.isfinite(lp[i]), live)
        torch.testing.assert_close(lp[i][live].double(), want[live], rtol=0, atol=4e-6)
        assert (p[i][~live] == 0).all()
        assert abs(p[i].double().sum().item() - 1.0) < 1e-5
    assert torch.isnan(lp[3]).all() and torch.isnan(lp[4]).all()
    # a row's bits alone are its bits among others, on any number of threads
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch_ops.log_softmax(lib, x[5:6])
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one[0], lp[5])


def test_inverse_cdf_rows_is_the_exact_search(lib):
    import numpy as np

    V = 5000
    p = torch.rand(4, V, generator=torch.Generator().manual_seed(3))
    p[1, ::2] = 0.0  # zeros are never drawn
    p[2] = 0.0
    p[2, 17] = 1.0
    p /= p.sum(-1, keepdim=True)
    for u in (0.0, 1e-6, 0.25, 0.5, 0.7501, 0.999999):
        got = torch_ops.inverse_cdf(lib, p, torch.full((4,), u))
        cum = np.cumsum(p.double().numpy(), axis=-1)
        want = [int(np.searchsorted(cum[i], np.float64(np.float32(u)) * cum[i, -1], side="right")) for i in range(4)]
        assert got.tolist() == want, u
        assert all(p[i, got[i]] > 0 for i in range(4))
    # u so close to 1 that rounding lands past the mass: the last token with a probability, never one without
    p[3, V - 10 :] = 0.0
    assert torch_ops.inverse_cdf(lib, p[3:4], torch.tensor([0.99999994]))[0] <= V - 11


def test_top_p_thresholds_keep_the_reference_tokens(lib):
    import numpy as np

    from enginecore import sampling_ref as ref

    x = randn(6, 3000, seed=4) * 3
    x[1] = 0.0  # flat: the cut falls in a long run of ties, all kept
    x[2, 5:] = float("-inf")
    x[3, :] = x[3].round()  # many ties
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.3, 1.0, 0.999])
    p = torch_ops.log_softmax(lib, x, probs=True)
    t = torch_ops.top_p_thresholds(lib, p, top_p)
    assert t[4] == 0
    for i in range(6):
        want = np.isfinite(ref.filter_logits(x[i].numpy(), 0, float(top_p[i]), 0.0))
        assert np.array_equal((p[i] >= t[i]).numpy(), want), i


@pytest.mark.parametrize("n", [0, 1, 5, 20])
def test_top_n_rows_is_a_stable_sorts_head(lib, n):
    x = (randn(5, 1000, seed=5) * 2).round()  # many ties
    x[1, :] = 1.0  # all tied: the first n ids
    x[2, 500:] = float("-inf")
    vals, ids = torch_ops.top_n(lib, x, n)
    want_vals, want_ids = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(vals, want_vals[:, :n]) and torch.equal(ids, want_ids[:, :n])


def test_huge_page_array_is_aligned_zeroed_writable_memory():
    """The buffer both backends pack their CPU weights into: 2 MiB-aligned (so its whole 2 MiB pages can be
    huge pages; whether the OS gives them is its choice, shown by benchmarks/bench_huge_pages.py), zero-filled,
    writable, kept alive by the array."""
    import gc

    import numpy as np

    from cpu_kernels.memory import HUGE_PAGE, huge_page_array

    a = huge_page_array(3 * HUGE_PAGE // 4 + 5)
    assert a.dtype == np.float32 and a.size == 3 * HUGE_PAGE // 4 + 5 and a.ctypes.data % HUGE_PAGE == 0
    assert not a.any()
    b = a[7:]
    del a
    gc.collect()
    b[:] = 2.0
    assert float(b.sum()) == 2.0 * b.size


def test_populate_in_background_commits_the_pages_and_keeps_what_steps_write(monkeypatch):
    """The CPU KV caches' background commit (`cpu_kernels.memory.populate_in_background`): every page of the range
    becomes resident, and what is written to it before and while it runs stays (MADV_POPULATE_WRITE writes no
    data); `XLASERVE_KV_POPULATE=off` commits nothing. Skipped where the kernel has no MADV_POPULATE_WRITE."""
    import ctypes
    import sys
    import time

    import numpy as np

    from cpu_kernels.memory import HUGE_PAGE, MADV_POPULATE_WRITE, huge_page_array, populate_in_background
    from tests.memory import resident_bytes

    if not sys.platform.startswith("linux"):
        pytest.skip("Linux's madvise")
    probe = huge_page_array(HUGE_PAGE, np.uint8)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(probe.ctypes.data, 4096, MADV_POPULATE_WRITE) != 0:
        pytest.skip("no MADV_POPULATE_WRITE (Linux < 5.14)")
    monkeypatch.setenv("XLASERVE_KV_POPULATE", "off")
    off = huge_page_array(8 * HUGE_PAGE, np.uint8)
    assert populate_in_background(off.ctypes.data, off.nbytes).is_set()
    monkeypatch.delenv("XLASERVE_KV_POPULATE")
    a = huge_page_array(24 * HUGE_PAGE + 4096, np.uint8)
    a[123], a[-1] = 7, 9
    stop = populate_in_background(a.ctypes.data, a.nbytes, chunk=HUGE_PAGE)
    a[10 * HUGE_PAGE + 5] = 5  # while it runs (or after)
    deadline = time.monotonic() + 30
    while resident_bytes(a.ctypes.data, a.nbytes) < a.nbytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resident_bytes(a.ctypes.data, a.nbytes) == a.nbytes
    assert (a[123], a[-1], a[10 * HUGE_PAGE + 5]) == (7, 9, 5) and int(a.astype(np.int64).sum()) == 21
    assert resident_bytes(off.ctypes.data, off.nbytes) < off.nbytes // 2
    stop.set()


def test_release_free_heap_returns_freed_chunks_pages():
    """What both runners call after packing a model's weights (`cpu_kernels.memory.release_free_heap`): the pages of
    chunks freed inside the heap (below a live one, so glibc's free cannot shrink the heap) stop being resident."""
    import mmap
    import sys

    from cpu_kernels.memory import release_free_heap
    from tests.memory import resident_bytes

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's heap")
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, n = 64 << 10, 512  # 32 MiB of chunks under glibc's smallest mmap threshold: from the heap
    chunks = [libc.malloc(size) for _ in range(n)]
    top = libc.malloc(size)
    for c in chunks:
        ctypes.memset(c, 1, size)
    for c in chunks:
        libc.free(c)
    page = mmap.PAGESIZE  # each chunk's own whole pages (the heap's other chunks between them may be live)
    inner = [(-(-c // page) * page, (c + size) // page * page) for c in chunks]
    total = sum(b - a for a, b in inner)

    def resident():
        return sum(resident_bytes(a, b - a) for a, b in inner)

    before = resident()
    if before < 0.9 * total:
        libc.free(top)
        pytest.skip(f"this allocator returned {total - before} of {total} bytes on free")
    release_free_heap()
    after = resident()
    libc.free(top)
    assert after < 0.1 * total, (before, after)


def test_huge_page_bytes_sums_the_mappings_that_hold_the_array(tmp_path):
    """What the engines log of their weights' buffer: the AnonHugePages of the mappings overlapping the
    array (/proc/self/smaps' format), capped at its size; this process's own smaps gives a number in range."""
    import numpy as np

    from cpu_kernels.memory import HUGE_PAGE, huge_page_array, huge_page_bytes

    a = huge_page_array(HUGE_PAGE // 2)  # 4 MiB of float32
    a[:] = 1.0
    lo, hi = a.ctypes.data, a.ctypes.data + a.nbytes
    fake = tmp_path / "smaps"
    fake.write_text(
        f"{lo - 8192:x}-{lo:x} rw-p 00000000 00:00 0\nSize: 8 kB\nAnonHugePages:      2048 kB\n"  # ends below
        f"{lo:x}-{lo + HUGE_PAGE:x} rw-p 00000000 00:00 0 \nSize: 2048 kB\nAnonHugePages:      2048 kB\n"
        "VmFlags: rd wr mr mw me ac hg\n"
        f"{lo + HUGE_PAGE:x}-{hi + 4096:x} rw-p 00000000 00:00 0\nAnonHugePages:      4096 kB\n"
        f"{hi + 4096:x}-{hi + 8192:x} r--p 00000000 08:01 42   /usr/lib/x.so\nAnonHugePages:      2048 kB\n")
    assert huge_page_bytes(a, str(fake)) == a.nbytes  # 2 + 4 MiB overlap it, capped at its 4
    assert huge_page_bytes(a[: HUGE_PAGE // 4], str(fake)) == HUGE_PAGE  # the first mapping only
    assert huge_page_bytes(a, str(tmp_path / "missing")) == 0
    real = huge_page_bytes(a)
    assert 0 <= real <= a.nbytes and real % HUGE_PAGE == 0

