"""The jitted sampler: `enginecore.sampling_ref` (the spec, in numpy) on device, batched over rows.

Order per row (see sampling_ref): grammar bitmask -> additive bias -> penalties -> greedy argmax, or
temperature -> min-p -> top-k (ties kept) -> top-p (ties kept) -> inverse CDF
with the host's seeded uniform. Logprobs are those of the raw logits.

Compiled variants per request bucket (`SAMPLER_MODES`): greedy, sample, full,
masked (full plus a structured-output token bitmask) and processed (full plus
penalties / token masks, and the bitmask); inside them, which work a batch needs (filtering, logprobs, all
greedy) is decided at run time by `lax.cond` on traced flags.

Top-k and top-p thresholds, three ways, all exact (the k-th largest logit;
sampling_ref's top-p cut value, up to float summation order):
"sort" (full sorts), "bisect" (no sort: a bit-by-bit search over the float32
bit patterns of the threshold, 32 counting passes over the row), and "topk"
(lax.top_k of 256 candidates settles every row whose cut falls among them,
bisect as the fallback under a lax.cond). XLA:CPU sorts are slow (an order of
magnitude behind "topk": benchmarks/bench_jax_sampler.py, timings in
benchmarks/README.md), so "topk" is the default (compilation_config
{"sampler_method": ...} overrides it); it needs no sort on TPU/GPU either.

`cpu_kernels=True` (the runner passes it where the model runs on the CPU kernels,
`params.panels`): log_softmax / softmax, the top-p cut and the draw are the torch
backend's C kernels as custom calls (`cpu_kernels.jax_ops`), each row in a fixed
order, so a CPU's two backends give the same logprobs and the same seeded tokens,
bit for bit, and a row's result does not depend on the rows beside it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from enginecore.sampling_ref import GREEDY_EPS



def _div_rows(x, d):
    """x [R, V] / d [R] as a true IEEE division, like numpy.

    XLA rewrites a division by a broadcast into a multiplication by the
    reciprocal (1 ulp off); the barrier hides the broadcast from that rewrite.
    """
    return x / lax.optimization_barrier(jnp.broadcast_to(d[:, None], x.shape))


def _softmax(x):
    """sampling_ref's softmax: exp(log_softmax(x)), with the max of an all -inf row taken as 0."""
    m = jnp.max(x, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    return jnp.exp(x - m - jnp.log(jnp.sum(jnp.exp(x - m), axis=-1, keepdims=True)))


def apply_token_bitmask(x, bitmask):
    """x [R, V] f32, bitmask [R, ceil(V / 32)] i32 (bit t % 32 of word t // 32: token t allowed) ->
    disallowed tokens at -inf. Shift-and-mask per word, then one `where` (sampling_ref.apply_token_bitmask)."""
    R, V = x.shape
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)[None, None, :]) & 1  # [R, W, 32]
    allowed = bits.reshape(R, -1)[:, :V] != 0
    return jnp.where(allowed, x, -jnp.inf)


def apply_bias_and_penalties(x, bias, output_counts, prompt_mask, presence, frequency, repetition):
    """x [R, V] f32 raw logits -> processed logits (steps 1-2 of sampling_ref)."""
    if bias is not None:
        x = x + bias
    if output_counts is not None:
        seen = prompt_mask | (output_counts > 0)
        x = jnp.where(seen, jnp.where(x > 0, _div_rows(x, repetition), x * repetition[:, None]), x)
        x = x - frequency[:, None] * output_counts
        x = x - presence[:, None] * (output_counts > 0).astype(jnp.float32)
    return x


def _ordered_u32(x):
    """float32 -> uint32 with the same order (-inf smallest)."""
    b = lax.bitcast_convert_type(x, jnp.uint32)
    neg = (b >> 31) == 1
    return jnp.where(neg, ~b, b | jnp.uint32(0x80000000))


def kth_largest_bisect(x, k):
    """x [R, V] f32, k [R] i32 >= 1 -> the k-th largest value per row, as an ordered-uint32 threshold."""
    keys = _ordered_u32(x)

    def body(i, t):
        cand = t | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
        ok = jnp.sum(keys >= cand[:, None], axis=-1, dtype=jnp.int32) >= k
        return jnp.where(ok, cand, t)

    return lax.fori_loop(0, 32, body, jnp.zeros(x.shape[:1], jnp.uint32)), keys


def top_p_threshold_bisect(p, top_p):
    """p [R, V] probabilities, top_p [R] -> int32 bit-pattern threshold: keep bits(p) >= it."""
    bits = lax.bitcast_convert_type(p, jnp.int32)  # p >= 0: bit patterns are ordered

    def body(i, t):
        cand = t | (jnp.int32(1) << (30 - i))
        mass = jnp.sum(jnp.where(bits >= cand[:, None], p, 0.0), axis=-1)
        return jnp.where(mass >= top_p, cand, t)

    return lax.fori_loop(0, 31, body, jnp.zeros(p.shape[:1], jnp.int32)), bits


def _top_p_drop_bisect(p, top_p):
    t, bits = top_p_threshold_bisect(p, top_p)
    return bits < t[:, None]


def _top_k_drop(x, k, use_k, num_candidates: int):
    """The "topk" method's top-k cut: (x with tokens below each row's k-th largest value at -inf, the row's
    `num_candidates` largest values [R, C] descending, the k-th largest [R, 1]). The candidates settle every
    row whose k falls among them; if any row needs more, a lax.cond runs the bisect search."""
    vals, _ = lax.top_k(x, num_candidates)
    kth = jnp.take_along_axis(vals, (jnp.minimum(k, num_candidates) - 1)[:, None], axis=-1)

    def k_from_bisect(x):
        t, keys = kth_largest_bisect(x, k)
        return keys < t[:, None]

    k_drop = lax.cond(jnp.all(~use_k | (k <= num_candidates)), lambda x: x < kth, k_from_bisect, x)
    return jnp.where(use_k[:, None] & k_drop, -jnp.inf, x), vals, kth


def filter_logits_cpu(x, top_k, top_p, min_p):
    """`filter_logits` on the CPU kernels: min-p and top-p on the kernels' softmax, the top-p cut by
    `cpu_kernels.top_p_thresholds` (the torch sampler's arithmetic, bit for bit), top-k exact as elsewhere."""
    from cpu_kernels import jax_ops as ck

    V = x.shape[1]

    def min_p_cut(x):
        p = ck.log_softmax(x, probs=True)
        return jnp.where(p >= min_p[:, None] * p.max(-1, keepdims=True), x, -jnp.inf)

    def top_p_cut(x):
        p = ck.log_softmax(x, probs=True)
        t = ck.top_p_thresholds(p, jnp.where(top_p < 1.0, top_p, 1.0))
        return jnp.where(p < t[:, None], -jnp.inf, x)

    # each cut only when some row asks for it (a cut a row does not ask for keeps it as it is)
    x = lax.cond(jnp.any(min_p > 0), min_p_cut, lambda x: x, x)
    use_k = (top_k > 0) & (top_k < V)
    x = lax.cond(jnp.any(use_k), lambda x: _top_k_drop(x, jnp.where(use_k, top_k, 1), use_k, min(256, V))[0],
                 lambda x: x, x)
    return lax.cond(jnp.any(top_p < 1.0), top_p_cut, lambda x: x, x)


def filter_logits(x, top_k, top_p, min_p, method: str, num_candidates: int = 256):
    """Temperature-scaled logits [R, V] -> dropped tokens at -inf (sampling_ref.filter_logits per row).

    method "sort": full sorts. "bisect": threshold searches over bit patterns.
    "topk": the `num_candidates` largest logits (lax.top_k) settle every row whose
    k and top-p cut fall among them (the common case: small k, peaked
    distributions); if any row needs more, a lax.cond runs the bisect search.
    """
    R, V = x.shape
    neg_inf = jnp.float32(-jnp.inf)
    p = _softmax(x)
    x = jnp.where(p >= min_p[:, None] * p.max(-1, keepdims=True), x, neg_inf)
    use_k = (top_k > 0) & (top_k < V)
    k = jnp.where(use_k, top_k, 1)
    use_p = top_p < 1.0
    if method == "sort":
        srt = jnp.sort(x, axis=-1)  # ascending
        kth = jnp.take_along_axis(srt, (V - k)[:, None], axis=-1)
        x = jnp.where(use_k[:, None] & (x < kth), neg_inf, x)
        p = _softmax(x)
        ps = -jnp.sort(-p, axis=-1)  # descending
        cum = jnp.cumsum(ps, axis=-1)
        cut = jnp.minimum(jnp.sum(cum < top_p[:, None], axis=-1), V - 1)
        drop = p < jnp.take_along_axis(ps, cut[:, None], axis=-1)
        return jnp.where(use_p[:, None] & drop, neg_inf, x)
    if method == "bisect":
        t, keys = kth_largest_bisect(x, k)
        x = jnp.where(use_k[:, None] & (keys < t[:, None]), neg_inf, x)
        drop = _top_p_drop_bisect(_softmax(x), top_p)
        return jnp.where(use_p[:, None] & drop, neg_inf, x)
    if method != "topk":
        raise ValueError(f"unknown top-k/top-p method {method!r} (sort, bisect, topk)")
    C = min(num_candidates, V)
    x, vals, kth = _top_k_drop(x, k, use_k, C)
    # the candidates' probabilities after top-k, still sorted descending
    lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)
    cvals = jnp.where(use_k[:, None] & (vals < kth), neg_inf, vals)
    ps = jnp.exp(cvals - lse)
    cum = jnp.cumsum(ps, axis=-1)
    p_ok = ~use_p | (cum[:, -1] >= top_p)
    cut = jnp.minimum(jnp.sum(cum < top_p[:, None], axis=-1), C - 1)
    thresh = jnp.take_along_axis(ps, cut[:, None], axis=-1)

    def p_from_candidates(x):
        return jnp.exp(x - lse) < thresh

    def p_from_bisect(x):
        return _top_p_drop_bisect(jnp.exp(x - lse), top_p)

    p_drop = lax.cond(jnp.all(p_ok), p_from_candidates, p_from_bisect, x)
    return jnp.where(use_p[:, None] & p_drop, neg_inf, x)


def inverse_cdf(probs, u, block: int = 256):
    """probs [R, V], u [R] -> first index whose cumulative probability exceeds u * total.

    Two-level search (block sums, then one block) instead of a full cumsum,
    which XLA:CPU runs as a slow reduce-window.
    """
    R, V = probs.shape
    nb = -(-V // block)
    pb = jnp.pad(probs, ((0, 0), (0, nb * block - V))).reshape(R, nb, block)
    cb = jnp.cumsum(pb.sum(-1), axis=-1)  # [R, nb]
    target = u * cb[:, -1]
    b = jnp.minimum(jnp.sum(cb <= target[:, None], axis=-1, dtype=jnp.int32), nb - 1)
    prev = jnp.where(b > 0, jnp.take_along_axis(cb, jnp.maximum(b - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    within = prev[:, None] + jnp.cumsum(jnp.take_along_axis(pb, b[:, None, None], axis=1)[:, 0], axis=-1)
    idx = b * block + jnp.sum(within <= target[:, None], axis=-1, dtype=jnp.int32)
    last_nz = V - 1 - jnp.argmax((probs > 0)[:, ::-1], axis=-1).astype(jnp.int32)
    idx = jnp.minimum(idx, V - 1)
    # rounding between the two levels can land past the mass: fall back like sampling_ref does
    bad = jnp.take_along_axis(probs, idx[:, None], axis=-1)[:, 0] <= 0
    return jnp.where(bad, last_nz, idx)


def argmax_rows(x, block: int = 1024):
    """x [R, V] -> int32 [R]: the first index of each row's maximum (jnp.argmax's result).

    Two passes over blocks of `block` columns (block maxima, then the winning block): XLA:CPU
    vectorizes plain max reductions but not the variadic reduce of argmax, which made a
    row argmax several times slower than this (benchmarks/README.md, "CPU step notes").
    """
    R, V = x.shape
    nb = -(-V // block)
    if nb < 2:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    xb = jnp.pad(x, ((0, 0), (0, nb * block - V)), constant_values=-jnp.inf).reshape(R, nb, block)
    b = jnp.argmax(jnp.max(xb, axis=-1), axis=-1).astype(jnp.int32)  # first block holding the maximum
    within = jnp.argmax(jnp.take_along_axis(xb, b[:, None, None], axis=1)[:, 0], axis=-1).astype(jnp.int32)
    return b * block + within


def log_softmax(x, cpu_kernels: bool = False):
    """Row-wise log_softmax [R, V]: XLA's, or on the CPU kernels the torch sampler's (`cpu_kernels`)."""
    if cpu_kernels:
        from cpu_kernels import jax_ops as ck

        return ck.log_softmax(x)
    return jax.nn.log_softmax(x, axis=-1)


def raw_logprobs(logits, sampled, num_logprobs: int, cpu_kernels: bool = False):
    """Top-N of log_softmax(raw logits) plus the sampled token's logprob and rank (1 = most likely)."""
    lp = log_softmax(logits, cpu_kernels)
    top_lp, top_ids = lax.top_k(lp, num_logprobs)
    tok_lp = jnp.take_along_axis(lp, sampled[:, None], axis=-1)[:, 0]
    rank = jnp.sum(lp > tok_lp[:, None], axis=-1, dtype=jnp.int32) + 1
    return top_ids.astype(jnp.int32), top_lp, tok_lp, rank


SAMPLER_MODES = ("greedy", "sample", "full", "masked", "processed")


def sampler_mode(all_greedy: bool, wants_logprobs: bool, processed: bool, masked: bool = False) -> str:
    """The cheapest compiled sampler that serves a batch (see `sample`)."""
    if processed:
        return "processed"
    if masked:
        return "masked"
    if wants_logprobs:
        return "full"
    return "greedy" if all_greedy else "sample"


def no_logprobs(R: int, N: int):
    """`sample`'s logprob outputs for R rows when no row asked for them: zeros."""
    return (jnp.zeros((R, N), jnp.int32), jnp.zeros((R, N), jnp.float32), jnp.zeros((R,), jnp.float32),
            jnp.zeros((R,), jnp.int32))


def sample(
    logits,  # [R, V] f32 raw logits of the token being generated
    temperature,  # [R] f32
    top_k,  # [R] i32, 0 = off
    top_p,  # [R] f32
    min_p,  # [R] f32
    uniform,  # [R] f32 in [0, 1): the seeded draw
    all_greedy,  # [] bool: every row is greedy (one argmax)
    needs_filtering,  # [] bool: some sampled row uses top-k / top-p / min-p
    want_logprobs,  # [] bool: some row asked for logprobs
    processed=None,  # None or (bias [R, V], output_counts [R, V], prompt_mask [R, V], presence, frequency,
    #                  repetition [R]): penalties and token masks
    token_bitmask=None,  # None or [R, ceil(V / 32)] i32: structured outputs (-1: row unconstrained)
    *,
    mode: str = "full",
    num_logprobs: int,
    method: str = "topk",
    cpu_kernels: bool = False,
):
    """-> (sampled [R] i32, (topk_ids [R, N] i32, topk_logprobs [R, N], sampled_logprobs [R], ranks [R] i32)).

    `mode` (static) is the compiled variant: "greedy" (every row greedy, no logprobs, no
    penalties: one argmax), "sample" (temperature rows too, filtering decided at run time by
    `needs_filtering`), "full" (`all_greedy` and `want_logprobs` decided at run time too),
    "masked" (full, plus the `token_bitmask` of structured outputs), "processed" (full, plus the
    `processed` penalty / token-mask inputs and the bitmask). Variants and not only run-time `lax.cond`s, because on XLA:CPU a cond
    holding a softmax over the logits made the logits matmul before it much slower even when
    the branch was not taken. The logprob arrays are zeros when no row asked for them.
    `cpu_kernels` (static): the softmaxes, the top-p cut and the draw on the CPU kernels (module docstring).
    """
    if mode not in SAMPLER_MODES:
        raise ValueError(f"sampler mode must be one of {SAMPLER_MODES}, got {mode!r}")
    logits = logits.astype(jnp.float32)
    no_lps = no_logprobs(logits.shape[0], num_logprobs)
    if mode == "greedy":
        return argmax_rows(logits), no_lps
    x = logits if token_bitmask is None else apply_token_bitmask(logits, token_bitmask)
    x = x if processed is None else apply_bias_and_penalties(x, *processed)

    def draw(x):
        greedy = temperature < GREEDY_EPS
        xs = _div_rows(x, jnp.where(greedy, 1.0, temperature))
        if cpu_kernels:
            from cpu_kernels import jax_ops as ck

            xs = lax.cond(needs_filtering, lambda v: filter_logits_cpu(v, top_k, top_p, min_p), lambda v: v, xs)
            drawn = ck.inverse_cdf(ck.log_softmax(xs, probs=True), uniform)
        else:
            xs = lax.cond(needs_filtering, lambda v: filter_logits(v, top_k, top_p, min_p, method), lambda v: v, xs)
            drawn = inverse_cdf(_softmax(xs), uniform)
        return jnp.where(greedy, argmax_rows(x), drawn)

    if mode == "sample":
        return draw(x), no_lps
    sampled = lax.cond(all_greedy, argmax_rows, draw, x)
    lps = lax.cond(want_logprobs, lambda ops: raw_logprobs(*ops, num_logprobs, cpu_kernels), lambda _: no_lps,
                   (logits, sampled))
    return sampled, lps
