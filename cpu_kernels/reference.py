"""numpy references of the C kernels (`csrc/`), as `pallas_kernels.reference` (pure JAX) and
`triton_kernels.reference` (pure torch) are for theirs.

Nothing here imports torch or jax: these are the definitions `tests/test_cpu_kernels_reference.py` holds the
kernels to, through `cpu_kernels.torch_ops`' bindings. Where a kernel promises bits, its reference computes
them: `panel_gemm` (one float32 FMA chain per output over k in ascending order: `fma32`), the greedy head's
argmax, the KV cache's 16-bit rounding, the qx panels' rebuilt weights. Elsewhere (sums the kernels split into
8-lane chains, their vectorised exp) a reference computes in float64, and the tests allow the float32 rounding
of the kernel's own order.

Layouts are the kernels': caches [num_blocks, block_size, Hkv, D] (block 0 the null block), slots and block
tables as vLLM's; a bfloat16 cache is held here as its uint16 bits (numpy has no bfloat16).
"""

from __future__ import annotations

import numpy as np

from cpu_kernels.layout import PANEL, QX_GROUP_BYTES, QX_KINDS
from enginecore import sampling_ref
from enginecore.model_loader import Iq4Groups

QK = 32  # weights a GGUF block (and a qx group) along k


# ---------------------------------------------------------------------------------
# float32 arithmetic as the kernels do it


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once, as `_mm256_fmadd_ps` (float32 arrays, broadcasting). The product is exact
    in float64; the sum is rounded to odd in float64 (its error from TwoSum), which rounding to float32 then
    turns into the single correct rounding (53 >= 24 + 2 bits): no double rounding."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c = np.asarray(c, np.float64)
    t = p + c
    tb = t - p
    err = (p - (t - tb)) + (c - tb)
    fix = (err != 0) & ((t.view(np.uint64) & np.uint64(1)) == 0)  # inexact and even: step to the odd neighbour
    t = np.where(fix, np.nextafter(t, np.where(err > 0, np.inf, -np.inf)), t)
    return t.astype(np.float32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even as torch's `.to(torch.bfloat16)` and the
    kernels' cache writes (overflow to inf; a NaN stays a NaN, quieted)."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
    nan = np.isnan(np.asarray(x, np.float32))
    return np.where(nan, (u >> np.uint64(16)) | np.uint64(0x40), rounded).astype(np.uint16)


def bf16_values(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> their float32 values (exact: a bfloat16 is a float32's high half)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def cache_values(cache: np.ndarray) -> np.ndarray:
    """A KV cache of any of the kernels' types (float32; float16; bfloat16 as uint16 bits) -> float32 values."""
    if cache.dtype == np.uint16:
        return bf16_values(cache)
    return cache.astype(np.float32)


# ---------------------------------------------------------------------------------
# the glue of a step (glue.c)


def rms_norm(
    x: np.ndarray,  # [M, K] float32
    w: np.ndarray,  # [K] float32
    eps: float,
    residual: np.ndarray | None = None,  # [M, K] float32: the residual stream, x added to it first
) -> tuple[np.ndarray, np.ndarray | None]:
    """(h * rsqrt(mean(h^2) + eps) * w [M, K] float64, residual + x [M, K] float32 or None) with h = x, or with
    a residual h = residual + x (that sum is float32's, the bits the kernel writes back)."""
    h = x.astype(np.float32) if residual is None else (residual.astype(np.float32) + x.astype(np.float32))
    h64 = h.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(h64 * h64, axis=-1, keepdims=True) + eps)
    return h64 * inv * w.astype(np.float64), None if residual is None else h


def rope_tables(angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """angles [T, D/2] (position * inverse frequency) -> the kernel's tables in swap-halves form, cos [T, D] =
    (cos, cos) and sin [T, D] = (-sin, sin) (`torchengine.model`'s rope_cos / rope_sin), float32."""
    c, s = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    return np.concatenate([c, c], -1), np.concatenate([-s, s], -1)


def rope(
    x: np.ndarray,  # [T, H, D]
    cos: np.ndarray,  # [T, D] (cos, cos)
    sin: np.ndarray,  # [T, D] (-sin, sin)
) -> np.ndarray:  # [T, H, D] float64
    """Rotate-half RoPE as the kernel computes it: x * cos + swap_halves(x) * sin, each head alike."""
    half = x.shape[-1] // 2
    x64 = x.astype(np.float64)
    swapped = np.concatenate([x64[..., half:], x64[..., :half]], -1)
    return x64 * cos[:, None].astype(np.float64) + swapped * sin[:, None].astype(np.float64)


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    """gate_up [M, 2I] (a fused gate/up projection's output) -> silu(gate) * up [M, I], float64."""
    g, u = np.split(gate_up.astype(np.float64), 2, axis=-1)
    with np.errstate(over="ignore"):
        return g / (1.0 + np.exp(-g)) * u


def kv_write(
    k: np.ndarray,  # [T, Hkv, D] float32
    v: np.ndarray,  # [T, Hkv, D] float32
    slots: np.ndarray,  # [T] int64: block * block_size + offset; < 0 (padding) writes nothing
    key_cache: np.ndarray,  # [NB, BS, Hkv, D] float32, float16 or uint16 (bfloat16 bits)
    value_cache: np.ndarray,  # [NB, BS, Hkv, D], key_cache's type
) -> None:
    """Each real token's K and V rows into its slot, in place, converted to the cache's type as `.to` rounds
    (to nearest even)."""
    keep = slots >= 0
    for src, cache in ((k, key_cache), (v, value_cache)):
        rows = src[keep].astype(np.float32)
        flat = cache.reshape(-1, *cache.shape[2:])  # a view: caches are contiguous
        with np.errstate(over="ignore"):  # a float16 cache's overflow is inf, as .to gives
            flat[slots[keep]] = bf16_bits(rows) if cache.dtype == np.uint16 else rows.astype(cache.dtype)


# ---------------------------------------------------------------------------------
# float32 linears and the greedy head (panels.c)


def f32_linear(
    x: np.ndarray,  # [M, K]
    w: np.ndarray,  # [N, K]: `f32_gemm`'s [out, in] weight
) -> np.ndarray:  # [M, N] float64
    return x.astype(np.float64) @ w.astype(np.float64).T


def pack_panels(w: np.ndarray) -> np.ndarray:
    """w [V, K] -> panels [ceil(V / 16), K, 16]: row v at [v // 16, :, v % 16], zero rows padding the last
    panel (`panel_gemm`'s layout, what `torch_ops.pack_panels` and the C packer write)."""
    V, K = w.shape
    P = -(-V // PANEL)
    padded = np.zeros((P * PANEL, K), w.dtype)
    padded[:V] = w
    return np.ascontiguousarray(padded.reshape(P, PANEL, K).transpose(0, 2, 1))


def panel_weights(panels: np.ndarray, V: int) -> np.ndarray:
    """The inverse of `pack_panels`: panels [P, K, 16] -> w [V, K]."""
    P, K, _ = panels.shape
    return panels.transpose(0, 2, 1).reshape(P * PANEL, K)[:V]


def panel_gemm(
    x: np.ndarray,  # [M, K] float32
    panels: np.ndarray,  # [ceil(V / 16), K, 16] float32 (`pack_panels`)
    V: int,
) -> np.ndarray:  # [M, V] float32
    """The kernel's bits: every output one float32 FMA chain over k in ascending order from 0."""
    w = panel_weights(panels, V).astype(np.float32)
    x = x.astype(np.float32)
    y = np.zeros((x.shape[0], V), np.float32)
    for k in range(x.shape[1]):
        y = fma32(x[:, k : k + 1], w[None, :, k], y)
    return y


def greedy_argmax(logits: np.ndarray) -> np.ndarray:
    """logits [M, V] -> [M] int64: each row's first index of its maximum, the first NaN if it has one (torch's
    argmax, the greedy head's)."""
    nan = np.isnan(logits)
    first = np.argmax(np.where(nan, -np.inf, logits), axis=-1)
    return np.where(nan.any(-1), np.argmax(nan, axis=-1), first).astype(np.int64)


# ---------------------------------------------------------------------------------
# GGUF blocks, activations quantized per block (gguf_linear.c)


def quantize_activations(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] float32 (K % 32 == 0) -> (xq [M, K / 32, 32] int64, dx [M, K / 32] float32): llama.cpp's Q8
    activations (levels 127) or the Q8_0 head's 16-bit ones (levels 32767): per row and block of 32, dx =
    max|x| / levels and xq = rint(x / dx) (computed as x * (1 / dx) in float32, 0 for a block of zeros)."""
    M, K = x.shape
    xb = x.reshape(M, K // QK, QK).astype(np.float32)
    dx = (np.abs(xb).max(-1) / np.float32(levels)).astype(np.float32)
    inv = np.where(dx > 0, np.float32(1) / np.where(dx > 0, dx, 1), 0).astype(np.float32)
    return np.rint(xb * inv[..., None]).astype(np.int64), dx


def q4_linear(
    x: np.ndarray,  # [M, K] float32
    q: np.ndarray,  # [N, K] in 0..15
    scale: np.ndarray,  # [N, K / 32] float16-exact (d)
    offset: np.ndarray,  # [N, K / 32] float16-exact (m)
) -> np.ndarray:  # [M, N] float64
    """`q4_gemm` over Q4_1 blocks (w = q * d + m; `torch_ops.pack`): per block d * dx * sum(q * xq), an exact
    integer sum of 8-bit activations, plus m * sum(x), summed in float64."""
    xq, dx = quantize_activations(x, 127)
    return _block_sums(q, scale, xq, dx) + np.einsum(
        "ng,mg->mn", offset.astype(np.float16).astype(np.float64),
        x.reshape(*xq.shape).astype(np.float64).sum(-1))


def q8_linear(
    x: np.ndarray,  # [M, K] float32
    q: np.ndarray,  # [N, K] int8
    scale: np.ndarray,  # [N, K / 32] float16-exact (d)
) -> np.ndarray:  # [M, N] float64
    """`q8_gemm` over Q8_0 blocks (w = q * d; `torch_ops.pack8`), with 16-bit activations: the LM head's
    logits decide the tokens, which 8-bit ones would move by enough to flip a near-tie."""
    xq, dx = quantize_activations(x, 32767)
    return _block_sums(q, scale, xq, dx)


def _block_sums(q, scale, xq, dx) -> np.ndarray:
    N, K = q.shape
    isum = np.einsum("ngj,mgj->mng", q.reshape(N, K // QK, QK).astype(np.int64), xq)  # exact
    d = scale.astype(np.float16).astype(np.float64)
    return (isum * d[None] * dx[:, None, :].astype(np.float64)).sum(-1)


# ---------------------------------------------------------------------------------
# the weights as stored: qx panels rebuilt (qx.c; packed by cpu_kernels.layout)


def qx_weights(
    packed: np.ndarray,  # [ceil(N / 16), K / 32, QX_GROUP_BYTES[kind]] uint8 (`layout.pack_q4x` / `pack_q8x` / ...)
    kind: int,  # a QX_KINDS value but BDOT (which is bfloat16 arithmetic, not a form of the weights)
    N: int,
) -> np.ndarray:  # [N, K] float32
    """The float32 weights `qx_gemm` rebuilds from its panels, as the loader computed them: Q4_1 / Q4_K / I8
    q * d + m rounded once, Q4_0 d * (q - 8), Q8_0 q * d, IQ4 value[q] * d (exact products), BF16 / F16 the
    16-bit values (exact). Per group of 32 k a panel holds the 16 rows' scales (and offsets), then per k the 16
    rows' q."""
    P, G, nbytes = packed.shape
    if nbytes != QX_GROUP_BYTES[kind] or kind == QX_KINDS["BDOT"]:
        raise ValueError(f"qx_weights: {nbytes} bytes a group for kind {kind} (want {QX_GROUP_BYTES.get(kind)})")
    b = np.ascontiguousarray(packed)

    def floats(lo, dt):  # [P, G, 16] the 16 rows' values of dt from byte lo of each group
        n = PANEL * np.dtype(dt).itemsize
        return b[:, :, lo : lo + n].copy().view(dt).astype(np.float32)

    if kind in (QX_KINDS["BF16"], QX_KINDS["F16"]):
        halves = b.view(np.uint16).reshape(P, G * QK, PANEL)  # [P, K, 16]: the float32 panels' layout
        w = bf16_values(halves) if kind == QX_KINDS["BF16"] else halves.view(np.float16).astype(np.float32)
        return panel_weights(w, N)
    if kind in (QX_KINDS["Q8_0"], QX_KINDS["I8"]):
        qs = b[:, :, nbytes - QK * PANEL :].view(np.int8).reshape(P, G, QK, PANEL).astype(np.float32)
    else:  # nibbles: byte j of a k holds row j's q (low) and row j + 8's (high)
        nib = b[:, :, nbytes - QK * 8 :].reshape(P, G, QK, 8)
        qs = np.concatenate([nib & 15, nib >> 4], -1).astype(np.int64)  # [P, G, 32 k, 16 rows]
        qs = (Iq4Groups.VALUES[qs] if kind == QX_KINDS["IQ4"] else qs).astype(np.float32)
    if kind == QX_KINDS["I8"]:  # a scale and an offset for k 0-15, another pair for k 16-31
        d = np.concatenate([np.repeat(floats(0, np.float32)[:, :, None], 16, 2),
                            np.repeat(floats(128, np.float32)[:, :, None], 16, 2)], 2)
        m = np.concatenate([np.repeat(floats(64, np.float32)[:, :, None], 16, 2),
                            np.repeat(floats(192, np.float32)[:, :, None], 16, 2)], 2)
    else:
        wide = kind in (QX_KINDS["Q4_K"], QX_KINDS["IQ4"])
        dt = np.float32 if wide else np.float16
        d = floats(0, dt)[:, :, None]  # [P, G, 1, 16]
        m = floats(PANEL * np.dtype(dt).itemsize, dt)[:, :, None] if kind in (
            QX_KINDS["Q4_1"], QX_KINDS["Q4_K"]) else None
    if kind == QX_KINDS["Q4_0"]:
        w = (qs - np.float32(8)) * d
    elif m is not None:
        w = fma32(qs, d, m)
    else:  # Q8_0, IQ4
        w = qs * d
    return panel_weights(w.reshape(P, G * QK, PANEL).astype(np.float32), N)


def qx_gemm(
    x: np.ndarray,  # [M, K] float32
    packed: np.ndarray,  # qx panels of `kind` (see `qx_weights`)
    kind: int,
    N: int,
) -> np.ndarray:  # [M, N] float32
    """panel_gemm's bits over the rebuilt weights (the kernel's promise: either may run a step)."""
    return panel_gemm(x, pack_panels(qx_weights(packed, kind, N)), N)


# ---------------------------------------------------------------------------------
# paged attention (attention.c)


def paged_attention(
    q: np.ndarray,  # [T, Hq, D] float32
    q_start: np.ndarray,  # [n] int: request i's first query row
    q_lens: np.ndarray,  # [n] int: its query rows, the last q_lens[i] of its kv_lens[i] tokens
    kv_lens: np.ndarray,  # [n] int: its cached tokens after this step
    block_tables: np.ndarray,  # [n, P] int: its blocks
    key_cache: np.ndarray,  # [NB, BS, Hkv, D] float32 / float16 / uint16 (bfloat16 bits)
    value_cache: np.ndarray,  # [NB, BS, Hkv, D]
    scale: float,
    window: int | None = None,  # a query at position p attends keys k with p - k < window
) -> np.ndarray:  # [T, Hq, D] float64: the query rows written, the others 0
    """Causal attention over a block table, GQA (query head h reads kv head h // (Hq / Hkv)), an exact softmax
    in float64 over the cache's values. A query with nothing to attend (kv_len 0) gives zeros."""
    T, Hq, D = q.shape
    _, bs, Hkv, _ = key_cache.shape
    G = Hq // Hkv
    kc, vc = cache_values(key_cache).astype(np.float64), cache_values(value_cache).astype(np.float64)
    out = np.zeros((T, Hq, D))
    for i in range(len(q_start)):
        L, ql, s = int(kv_lens[i]), int(q_lens[i]), int(q_start[i])
        if ql == 0 or L == 0:
            continue
        pos = np.arange(L)
        slots = block_tables[i][pos // bs].astype(np.int64) * bs + pos % bs
        K = np.repeat(kc.reshape(-1, Hkv, D)[slots], G, axis=1)  # [L, Hq, D]
        V = np.repeat(vc.reshape(-1, Hkv, D)[slots], G, axis=1)
        qr = q[s : s + ql].astype(np.float64)  # [ql, Hq, D]
        logits = np.einsum("qhd,khd->hqk", qr, K) * scale
        qpos = np.arange(L - ql, L)[:, None]
        visible = pos[None, :] <= qpos
        if window:
            visible &= qpos - pos[None, :] < window
        logits = np.where(visible[None], logits, -np.inf)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[s : s + ql] = np.einsum("hqk,khd->qhd", p, V)
    return out


def decode_attention(
    q: np.ndarray,  # [T, Hq, D] float32
    tokens: np.ndarray,  # [n] int: request i's one query row
    kv_lens: np.ndarray,  # [n] int
    block_tables: np.ndarray,  # [n, P] int
    key_cache: np.ndarray,  # [NB, BS, Hkv, D]
    value_cache: np.ndarray,  # [NB, BS, Hkv, D]
    scale: float,
    window: int | None = None,
) -> np.ndarray:  # [T, Hq, D] float64: rows `tokens` written
    """`paged_attention` with one query a request, at position kv_len - 1."""
    return paged_attention(q, tokens, np.ones(len(tokens), np.int64), kv_lens, block_tables, key_cache, value_cache,
                           scale, window)


# ---------------------------------------------------------------------------------
# the samplers' rows (sampler.c): the spec is enginecore.sampling_ref; where the kernels sum in double (the
# draw's and the top-p cut's running sums), so do these


def log_softmax_rows(x: np.ndarray, probs: bool = False) -> np.ndarray:
    """x [M, V] float32 -> its rows' log_softmax (`probs`: softmax) [M, V] float32: `sampling_ref`'s."""
    with np.errstate(divide="ignore", invalid="ignore"):  # an all -inf row is NaN, a NaN row too
        return sampling_ref.softmax(x) if probs else sampling_ref.log_softmax(x)


def top_n_rows(x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """x [M, V] -> (values [M, n], ids [M, n] int64): each row's n largest, descending, ties by lower id (a
    stable descending sort's head; `sampling_ref.topk_logprobs`' order)."""
    ids = np.argsort(-x, axis=-1, kind="stable")[:, :n].astype(np.int64)
    return np.take_along_axis(x, ids, -1), ids


def inverse_cdf_rows(
    probs: np.ndarray,  # [M, V] float32
    u: np.ndarray,  # [M] float32 in [0, 1)
) -> np.ndarray:  # [M] int64
    """Each row's first token whose cumulative probability (float64) exceeds u * total (`sampling_ref.
    inverse_cdf`'s rule); where rounding leaves none, the last token with a nonzero probability."""
    out = np.empty(len(probs), np.int64)
    for i, (p, ui) in enumerate(zip(probs, u)):
        cum = np.cumsum(p.astype(np.float64))
        idx = int(np.searchsorted(cum, np.float64(np.float32(ui)) * cum[-1], side="right"))
        if idx >= len(p):
            nz = np.flatnonzero(p > 0)
            idx = int(nz[-1]) if len(nz) else len(p) - 1
        out[i] = idx
    return out


def top_p_thresholds(
    probs: np.ndarray,  # [M, V] float32
    top_p: np.ndarray,  # [M]
) -> np.ndarray:  # [M] float32
    """Each row's top-p cut (`sampling_ref.filter_logits`' rule): sorted descending, the first probability at
    which the running sum (float64) reaches top_p (the last if none does); keep p >= it. 0 where top_p >= 1."""
    out = np.zeros(len(probs), np.float32)
    for i, (p, tp) in enumerate(zip(probs, top_p)):
        if np.float32(tp) >= 1:
            continue
        ps = np.sort(p.astype(np.float32))[::-1]
        cut = int(np.searchsorted(np.cumsum(ps.astype(np.float64)), np.float64(np.float32(tp)), side="left"))
        out[i] = ps[min(cut, len(ps) - 1)]
    return out
