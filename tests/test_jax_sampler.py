"""jaxengine.sampler against enginecore.sampling_ref (the numpy spec), every method and variant."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cpu_kernels import jax_ops
from enginecore import sampling_ref as ref
from jaxengine import sampler as S

V = 4096
METHODS = ("sort", "bisect", "topk")


# "cpu": sample(..., cpu_kernels=True), the torch sampler's C kernels as custom calls (where they run)
CPU = pytest.param("cpu", marks=pytest.mark.skipif(bool(jax_ops.available()), reason="no CPU kernels here"))
VARIANTS = (*METHODS, CPU)
_sample = jax.jit(S.sample, static_argnames=("mode", "num_logprobs", "method", "cpu_kernels"))


def filter_logits(x, top_k, top_p, min_p, method):
    if method == "cpu":
        return jax.jit(S.filter_logits_cpu)(x, top_k, top_p, min_p)
    return jax.jit(S.filter_logits, static_argnames=("method", "num_candidates"))(x, top_k, top_p, min_p, method)


def run_sample(x, temp, top_k, top_p, min_p, u, processed=None, *, num_logprobs=0, method="topk",
               all_greedy=None, needs_filtering=None, mode=None):
    """S.sample with its run-time flags derived from the rows (or forced), as the runner packs them."""
    sampling = temp >= 1e-5
    if all_greedy is None:
        all_greedy = not sampling.any()
    if needs_filtering is None:
        needs_filtering = bool(np.any(sampling & ((top_k > 0) | (top_p < 1.0) | (min_p > 0.0))))
    if mode is None:
        mode = S.sampler_mode(bool(all_greedy), num_logprobs > 0, processed is not None)
    sampled, (ids, lps, tok_lp, rank) = _sample(
        x, temp, top_k, top_p, min_p, u, np.bool_(all_greedy), np.bool_(needs_filtering), np.bool_(num_logprobs > 0),
        processed, mode=mode, num_logprobs=num_logprobs, method="topk" if method == "cpu" else method,
        cpu_kernels=method == "cpu")
    return {"sampled": np.asarray(sampled), "topk_ids": np.asarray(ids), "topk_logprobs": np.asarray(lps),
            "sampled_logprobs": np.asarray(tok_lp), "sampled_ranks": np.asarray(rank)}


def rows(n=12, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, V)) * 2.5).astype(np.float32)
    x[:, 10:40] = 4.0  # a block of exact ties at the top-k / top-p cut
    x[1, :] = 0.0  # a flat row
    x[2, 5:] = -np.inf  # only 5 live tokens
    x[3, 100] = 30.0  # one dominant token
    return x


def filter_params(n, seed=1):
    rng = np.random.default_rng(seed)
    top_k = rng.choice([0, 1, 5, 20, 35, 300, V - 1], size=n).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5, 0.99, 0.05], size=n).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.3], size=n).astype(np.float32)
    top_k[0], top_p[0], min_p[0] = 400, 0.999, 0.0  # forces the topk method's bisect fallback
    return top_k, top_p, min_p


@pytest.mark.parametrize("method", VARIANTS)
def test_filter_masks_match_reference(method):
    x = rows()
    top_k, top_p, min_p = filter_params(len(x))
    got = np.asarray(filter_logits(jnp.asarray(x), jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(min_p),
                                     method))
    for i in range(len(x)):
        want = ref.filter_logits(x[i], int(top_k[i]), float(top_p[i]), float(min_p[i]))
        np.testing.assert_array_equal(np.isinf(got[i]), np.isinf(want), err_msg=f"row {i} ({method})")
        live = np.isfinite(want)
        np.testing.assert_array_equal(got[i][live], want[live])


def test_top_k_keeps_ties_and_top_p_keeps_ties():
    x = np.zeros((1, V), np.float32)
    x[0, :8] = 3.0  # 8 tied maxima
    for method in METHODS + (() if jax_ops.available() else ("cpu",)):
        out = np.asarray(filter_logits(jnp.asarray(x), jnp.array([2]), jnp.array([1.0]), jnp.array([0.0]), method))
        assert np.isfinite(out[0, :8]).all() and np.isinf(out[0, 8:]).all(), method
        out = np.asarray(filter_logits(jnp.asarray(x), jnp.array([0]), jnp.array([0.01]), jnp.array([0.0]), method))
        assert np.isfinite(out[0, :8]).all() and np.isinf(out[0, 8:]).all(), method


def test_penalties_and_bias_match_reference():
    rng = np.random.default_rng(3)
    n = 6
    x = rows(n)
    bias = np.zeros((n, V), np.float32)
    bias[0, 7] = 5.0
    bias[1, : V // 2] = -np.inf  # allowed_token_ids-style mask
    counts = rng.integers(0, 3, size=(n, V)).astype(np.float32) * (rng.random((n, V)) < 0.01)
    pmask = rng.random((n, V)) < 0.02
    pres = np.array([0.0, 0.5, 1.0, -0.5, 0.0, 2.0], np.float32)
    freq = np.array([0.0, 0.1, 0.0, 0.3, -0.2, 1.0], np.float32)
    rep = np.array([1.0, 1.3, 0.8, 1.0, 2.0, 1.1], np.float32)
    got = np.asarray(S.apply_bias_and_penalties(jnp.asarray(x), bias, counts, pmask, pres, freq, rep))
    for i in range(n):
        want = ref.apply_penalties(x[i] + bias[i], counts[i], pmask[i], pres[i], freq[i], rep[i])
        np.testing.assert_allclose(got[i], want, rtol=0, atol=0)


@pytest.mark.parametrize("method", VARIANTS)
def test_sample_matches_reference_rows(method):
    rng = np.random.default_rng(4)
    x = rows(16, seed=5)
    n = len(x)
    temp = rng.choice([0.0, 0.5, 1.0, 1.7], size=n).astype(np.float32)
    top_k, top_p, min_p = filter_params(n, seed=6)
    u = rng.random(n).astype(np.float32)
    bias = np.zeros((n, V), np.float32)
    bias[:, 3] = 2.0
    counts = (rng.random((n, V)) < 0.005).astype(np.float32)
    pmask = rng.random((n, V)) < 0.01
    pres, freq = np.full(n, 0.2, np.float32), np.full(n, 0.1, np.float32)
    rep = np.full(n, 1.2, np.float32)
    out = run_sample(x, temp, top_k, top_p, min_p, u, (bias, counts, pmask, pres, freq, rep), num_logprobs=3,
                     method=method)
    for i in range(n):
        want = ref.sample_row(x[i], temperature=float(temp[i]), top_k=int(top_k[i]), top_p=float(top_p[i]),
                              min_p=float(min_p[i]), u=float(u[i]), bias=bias[i], output_counts=counts[i],
                              prompt_mask=pmask[i], presence=float(pres[i]), frequency=float(freq[i]),
                              repetition=float(rep[i]))
        assert int(out["sampled"][i]) == want, f"row {i} ({method})"


@pytest.mark.parametrize("method", ["topk", CPU])
def test_greedy_and_unfiltered_batches(method):
    x = rows(8, seed=7)
    n = len(x)
    ones, zeros = np.ones(n, np.float32), np.zeros(n, np.float32)
    out = run_sample(x, zeros, np.zeros(n, np.int32), ones, zeros, ones * 0.5, method=method)
    assert np.asarray(out["sampled"]).tolist() == [int(np.argmax(r)) for r in x]
    u = np.linspace(0.01, 0.99, n).astype(np.float32)
    out = run_sample(x, ones, np.zeros(n, np.int32), ones, zeros, u, method=method)
    assert np.asarray(out["sampled"]).tolist() == [ref.sample_row(x[i], u=float(u[i])) for i in range(n)]


def test_inverse_cdf_pick_given_u():
    rng = np.random.default_rng(8)
    p = rng.random((5, V)).astype(np.float32)
    p[1, ::2] = 0.0  # zeros are never picked
    p[2, :] = 0.0
    p[2, 17] = 1.0
    p /= p.sum(-1, keepdims=True)
    for u in (0.0, 1e-6, 0.25, 0.5, 0.7501, 0.999999):
        got = np.asarray(jax.jit(S.inverse_cdf)(jnp.asarray(p), jnp.full(5, u, jnp.float32)))
        want = [ref.inverse_cdf(p[i], u) for i in range(5)]
        assert got.tolist() == want, u
        assert all(p[i, got[i]] > 0 for i in range(5))


@pytest.mark.parametrize("method", ["topk", CPU])
def test_logprobs_are_raw_topn_with_rank(method):
    x = rows(4, seed=9)
    n = len(x)
    temp = np.array([0.0, 1.0, 0.7, 1.3], np.float32)
    out = run_sample(x, temp, np.zeros(n, np.int32), np.ones(n, np.float32), np.zeros(n, np.float32),
                     np.full(n, 0.3, np.float32), num_logprobs=5, method=method)
    for i in range(n):
        lp = ref.log_softmax(x[i])
        tok = int(out["sampled"][i])
        ids, lps, rank = ref.topk_logprobs(lp, tok, 5)
        assert int(out["sampled_ranks"][i]) == rank
        np.testing.assert_allclose(float(out["sampled_logprobs"][i]), lps[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.asarray(out["topk_logprobs"][i]), lps[1:], rtol=1e-6, atol=1e-6)
        # the top block is a run of exact ties: compare values, and ids as sets of tied tokens
        assert set(np.asarray(out["topk_ids"][i]).tolist()) <= set(np.nonzero(lp >= min(lps[1:]))[0].tolist())


def test_run_time_flags_only_skip_work():
    """The traced flags choose which work runs; forcing a branch a batch does not need changes nothing."""
    x = rows(8, seed=11)
    n = len(x)
    temp = np.array([0.0, 0.9, 0.0, 1.2, 0.7, 0.0, 1.0, 0.5], np.float32)
    top_k, top_p, min_p = np.zeros(n, np.int32), np.ones(n, np.float32), np.zeros(n, np.float32)
    u = np.linspace(0.05, 0.95, n).astype(np.float32)
    base = run_sample(x, temp, top_k, top_p, min_p, u)
    forced = run_sample(x, temp, top_k, top_p, min_p, u, needs_filtering=True, num_logprobs=4)
    assert base["sampled"].tolist() == forced["sampled"].tolist()
    full = run_sample(x, temp, top_k, top_p, min_p, u, mode="full")
    assert base["sampled"].tolist() == full["sampled"].tolist()
    greedy = np.zeros(n, np.float32)
    a = run_sample(x, greedy, top_k, top_p, min_p, u)
    b = run_sample(x, greedy, top_k, top_p, min_p, u, all_greedy=False, needs_filtering=True, mode="full")
    c = run_sample(x, greedy, top_k, top_p, min_p, u, mode="sample")
    assert a["sampled"].tolist() == b["sampled"].tolist() == c["sampled"].tolist() == [int(np.argmax(r)) for r in x]
    assert not base["topk_ids"].size and (forced["topk_ids"] >= 0).all() and forced["topk_ids"].shape == (n, 4)
