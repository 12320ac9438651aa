"""The sampling semantics of xlaserve, as executable numpy: the spec both backends match.

Order, for each request row (float32 logits [V] of the token being generated):

0. structured outputs: the grammar's packed token bitmask (int32 words, bit
   ``t % 32`` of word ``t // 32`` set: token t allowed; words past the
   vocabulary ignored) sets every disallowed logit to -inf, before anything else
   (vLLM's order). Logprobs stay those of the raw logits.
1. token masks, additive: ``logits += bias`` where bias holds logit_bias values,
   -inf outside allowed_token_ids, -inf for banned bad-word tokens, -inf for EOS
   and stop_token_ids while fewer than min_tokens were generated.
2. penalties: repetition (tokens in prompt or output: divide positive logits by
   r, multiply negative ones by r), then frequency (``-= f * count_in_output``)
   and presence (``-= p * (count_in_output > 0)``).
3. greedy (temperature < 1e-5): the first index of the maximum.
4. otherwise: ``logits / temperature``; min-p keeps tokens whose probability is
   at least ``min_p * max_prob``; top-k keeps logits >= the k-th largest (ties
   kept); top-p keeps the smallest set of most probable tokens (of what is
   left, renormalised) whose mass reaches top_p, ties at the cut kept; then one
   uniform draw ``u`` picks by inverse CDF in vocabulary order: the first token
   whose cumulative probability exceeds ``u * total``.

The draw ``u`` is counter-based, computed on the host, and depends only on
``(seed, sample_index, position)`` where position is the index of the token
being generated (= number of tokens before it): so a seeded request yields the
same tokens alone or in any batch, on either backend. Unseeded requests get a
seed from the engine's own generator (``--seed``) when they arrive.

``seeded_uniform``: three rounds of SplitMix64,
``k = mix(mix(mix(seed) ^ sample_index) ^ position)``, and ``u = (k >> 40) / 2**24``
(24 bits: exact in float32, in [0, 1)).

Logprobs are those of the raw model distribution (``log_softmax(logits)``,
before any processing), as vLLM returns by default: top-N plus the sampled
token with its rank (1 = most likely).
"""

from __future__ import annotations

import numpy as np

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
GREEDY_EPS = 1e-5


def _mix(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        return x ^ (x >> np.uint64(31))


def seeded_uniform(seed, sample_index, position) -> np.ndarray:
    """float32 in [0, 1) for each (seed, sample_index, position); broadcasts."""
    s = np.asarray(seed, dtype=np.int64).astype(np.uint64) if np.asarray(seed).dtype != np.uint64 else np.asarray(seed)
    i = np.asarray(sample_index, dtype=np.int64).astype(np.uint64)
    p = np.asarray(position, dtype=np.int64).astype(np.uint64)
    k = _mix(_mix(_mix(s) ^ i) ^ p)
    return ((k >> np.uint64(40)).astype(np.float64) / float(1 << 24)).astype(np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(x - m)
    return (x - m - np.log(np.sum(e, axis=-1, keepdims=True))).astype(np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    return np.exp(log_softmax(x))


def unpack_bitmask(bitmask: np.ndarray, vocab_size: int) -> np.ndarray:
    """[..., W] int32 packed bitmask -> [..., vocab_size] bool (True: allowed)."""
    bits = (bitmask[..., :, None].astype(np.int64) >> np.arange(32)) & 1
    flat = bits.reshape(*bitmask.shape[:-1], bitmask.shape[-1] * 32).astype(bool)
    if flat.shape[-1] < vocab_size:  # a narrow mask allows nothing past its end
        pad = np.zeros((*flat.shape[:-1], vocab_size - flat.shape[-1]), bool)
        flat = np.concatenate([flat, pad], axis=-1)
    return flat[..., :vocab_size]


def apply_token_bitmask(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """logits [V], bitmask [W] int32 -> logits with disallowed tokens at -inf."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    return np.where(allowed, logits, -np.inf).astype(np.float32)


def apply_penalties(
    logits: np.ndarray,  # [V]
    output_counts: np.ndarray,  # [V] counts of each token in the output
    prompt_mask: np.ndarray,  # [V] bool: token occurs in the prompt
    presence: float,
    frequency: float,
    repetition: float,
) -> np.ndarray:
    x = logits.astype(np.float32).copy()
    if repetition != 1.0:
        seen = prompt_mask | (output_counts > 0)
        x = np.where(seen, np.where(x > 0, x / np.float32(repetition), x * np.float32(repetition)), x)
    x = x - np.float32(frequency) * output_counts.astype(np.float32)
    x = x - np.float32(presence) * (output_counts > 0).astype(np.float32)
    return x.astype(np.float32)


def filter_logits(x: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Temperature-scaled logits [V] -> logits with dropped tokens at -inf."""
    x = x.astype(np.float32).copy()
    if min_p > 0.0:
        p = softmax(x)
        x = np.where(p >= np.float32(min_p) * p.max(), x, -np.inf).astype(np.float32)
    if 0 < top_k < x.shape[-1]:
        kth = np.sort(x)[::-1][top_k - 1]
        x = np.where(x >= kth, x, -np.inf).astype(np.float32)
    if top_p < 1.0:
        p = softmax(x)
        ps = np.sort(p)[::-1]
        cum = np.cumsum(ps, dtype=np.float32)
        cut = int(np.searchsorted(cum, np.float32(top_p), side="left"))
        cut = min(cut, len(ps) - 1)
        thresh = ps[cut]
        x = np.where(p >= thresh, x, -np.inf).astype(np.float32)
    return x


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    cum = np.cumsum(probs.astype(np.float32), dtype=np.float32)
    idx = int(np.searchsorted(cum, np.float32(u) * cum[-1], side="right"))
    if idx >= len(probs):
        idx = int(np.nonzero(probs > 0)[0][-1])
    return idx


def sample_row(
    logits: np.ndarray,  # [V] raw float32 logits
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    u: float = 0.5,
    bias: np.ndarray | None = None,  # [V]
    output_counts: np.ndarray | None = None,  # [V]
    prompt_mask: np.ndarray | None = None,  # [V]
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
    token_bitmask: np.ndarray | None = None,  # [ceil(V / 32)] i32, structured outputs
) -> int:
    x = logits.astype(np.float32)
    if token_bitmask is not None:
        x = apply_token_bitmask(x, token_bitmask)
    if bias is not None:
        x = (x + bias.astype(np.float32)).astype(np.float32)
    if output_counts is not None:
        x = apply_penalties(x, output_counts, prompt_mask, presence, frequency, repetition)
    if temperature < GREEDY_EPS:
        return int(np.argmax(x))
    x = (x / np.float32(temperature)).astype(np.float32)
    x = filter_logits(x, top_k, top_p, min_p)
    return inverse_cdf(softmax(x), u)


def topk_logprobs(logprobs: np.ndarray, token: int, k: int) -> tuple[list[int], list[float], int]:
    """(ids, logprobs, rank): the sampled token first, then the top-k (ties by lower id)."""
    order = np.argsort(-logprobs, kind="stable")[:k] if k > 0 else np.zeros(0, np.int64)
    rank = int(np.sum(logprobs > logprobs[token])) + 1
    ids = [int(token)] + [int(t) for t in order]
    lps = [float(logprobs[token])] + [float(logprobs[t]) for t in order]
    return ids, lps, rank
