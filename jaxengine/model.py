"""One Llama-family decoder for every supported architecture, as pure functions over a params pytree.

Llama 2/3 (llama3 and linear rope scaling), SmolLM2 (tied embeddings),
Mistral, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm) differ only in
`DecoderConfig`. Weights are registered dataclass pytrees; `abstract_params`
gives every leaf's shape, dtype and *logical* axes, which `sharding.py` maps to
the mesh and `loader.py` fills tensor by tensor. Linear weights keep the
Hugging Face [out, in] orientation (split into heads where there are heads):
no transpose at load time, XLA contracts either side for free.

`forward(params, kv_caches, input_ids, md, ...) -> (hidden, kv_caches)` runs
all scheduled tokens of one ragged step; `compute_logits` projects only the
rows the sampler needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from enginecore.model_loader import ArchConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass(frozen=True)
class DecoderConfig:
    """Everything the forward pass needs; built from the loader's ArchConfig."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: tuple | None  # sorted items of the HF dict (hashable)
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    sliding_window: int | None
    dtype: str = "float32"  # weights and activations
    kv_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads={self.num_q_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        for name in ("dtype", "kv_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(DTYPES)}; got {getattr(self, name)!r}")

    @classmethod
    def from_arch(cls, arch: ArchConfig, dtype: str = "float32", kv_dtype: str | None = None) -> "DecoderConfig":
        rs = tuple(sorted(arch.rope_scaling.items())) if arch.rope_scaling else None
        return cls(
            vocab_size=arch.vocab_size,
            hidden_size=arch.hidden_size,
            intermediate_size=arch.intermediate_size,
            num_layers=arch.num_hidden_layers,
            num_q_heads=arch.num_attention_heads,
            num_kv_heads=arch.num_key_value_heads,
            head_dim=arch.head_dim,
            rope_theta=arch.rope_theta,
            rope_scaling=rs,
            rms_norm_eps=arch.rms_norm_eps,
            tie_word_embeddings=arch.tie_word_embeddings,
            attention_bias=arch.attention_bias,
            qk_norm=arch.qk_norm,
            sliding_window=arch.sliding_window,
            dtype=dtype,
            kv_dtype=kv_dtype or dtype,
        )

    @property
    def jnp_dtype(self):
        return DTYPES[self.dtype]

    @property
    def sm_scale(self) -> float:
        return self.head_dim**-0.5

    def num_params(self) -> int:
        H, I, D = self.hidden_size, self.intermediate_size, self.head_dim
        attn = H * D * (2 * self.num_q_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * H * I + 2 * H
        emb = self.vocab_size * H * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + H


# ---------------------------------------------------------------------------------
# params


@dataclass(frozen=True)
class ParamSpec:
    """An abstract leaf: what `abstract_params` returns in place of an array."""

    shape: tuple[int, ...]
    dtype: object
    logical_axes: tuple[str | None, ...]

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.logical_axes):
            raise ValueError(f"shape {self.shape} and logical axes {self.logical_axes} differ in rank")


@jax.tree_util.register_dataclass
@dataclass
class LayerParams:
    """Every layer's weights stacked on a leading [L] axis (the forward scans over it)."""

    attn_norm: jax.Array  # [L, H]
    q_proj: jax.Array  # [L, Hq, D, H]
    k_proj: jax.Array  # [L, Hkv, D, H]
    v_proj: jax.Array  # [L, Hkv, D, H]
    o_proj: jax.Array  # [L, H, Hq, D]
    mlp_norm: jax.Array  # [L, H]
    gate_proj: jax.Array  # [L, I, H]
    up_proj: jax.Array  # [L, I, H]
    down_proj: jax.Array  # [L, H, I]
    q_bias: jax.Array | None = None  # [L, Hq, D] (Qwen2)
    k_bias: jax.Array | None = None  # [L, Hkv, D]
    v_bias: jax.Array | None = None  # [L, Hkv, D]
    q_norm: jax.Array | None = None  # [L, D] (Qwen3)
    k_norm: jax.Array | None = None  # [L, D]


@jax.tree_util.register_dataclass
@dataclass
class ModelParams:
    embed: jax.Array  # [V, H]
    layers: LayerParams  # stacked [L, ...]
    final_norm: jax.Array  # [H]
    lm_head: jax.Array | None = None  # [V, H]; None when tied to embed


def abstract_params(cfg: DecoderConfig) -> ModelParams:
    """The params pytree with ParamSpec leaves (shapes, dtypes, logical axes)."""
    H, I, D, V = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.vocab_size
    Hq, Hkv = cfg.num_q_heads, cfg.num_kv_heads
    dt = cfg.jnp_dtype

    L = cfg.num_layers

    def spec(shape, axes):
        return ParamSpec(tuple(shape), dt, tuple(axes))

    def lspec(shape, axes):
        return spec((L, *shape), ("layers", *axes))

    def layer() -> LayerParams:
        lp = LayerParams(
            attn_norm=lspec((H,), ("norm",)),
            q_proj=lspec((Hq, D, H), ("q_heads", "head_dim", "embed")),
            k_proj=lspec((Hkv, D, H), ("kv_heads", "head_dim", "embed")),
            v_proj=lspec((Hkv, D, H), ("kv_heads", "head_dim", "embed")),
            o_proj=lspec((H, Hq, D), ("embed", "q_heads", "head_dim")),
            mlp_norm=lspec((H,), ("norm",)),
            gate_proj=lspec((I, H), ("mlp", "embed")),
            up_proj=lspec((I, H), ("mlp", "embed")),
            down_proj=lspec((H, I), ("embed", "mlp")),
        )
        if cfg.attention_bias:
            lp.q_bias = lspec((Hq, D), ("q_heads", "head_dim"))
            lp.k_bias = lspec((Hkv, D), ("kv_heads", "head_dim"))
            lp.v_bias = lspec((Hkv, D), ("kv_heads", "head_dim"))
        if cfg.qk_norm:
            lp.q_norm = lspec((D,), ("norm",))
            lp.k_norm = lspec((D,), ("norm",))
        return lp

    return ModelParams(
        embed=spec((V, H), ("vocab", "embed")),
        layers=layer(),
        final_norm=spec((H,), ("norm",)),
        lm_head=None if cfg.tie_word_embeddings else spec((V, H), ("vocab", "embed")),
    )


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


# ---------------------------------------------------------------------------------
# rope


def rope_inv_freq(cfg: DecoderConfig) -> np.ndarray:
    """[D/2] float32 inverse frequencies, with llama3 or linear scaling applied (as transformers does)."""
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    rs = dict(cfg.rope_scaling) if cfg.rope_scaling else None
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        factor = float(rs["factor"])
        if kind == "linear":
            inv = inv / factor
        elif kind == "llama3":
            low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
            old = float(rs["original_max_position_embeddings"])
            low_wl, high_wl = old / low, old / high
            wl = 2 * math.pi / inv
            scaled = np.where(wl > low_wl, inv / factor, inv)
            smooth = (old / wl - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wl < high_wl) & ~(wl > low_wl)
            inv = np.where(medium, smoothed, scaled)
        else:
            raise ValueError(f"rope_scaling type {kind!r} is not supported (llama3, linear)")
    return inv.astype(np.float32)


def apply_rope(x, cos, sin):
    """x [T, N, D]; cos/sin [T, D/2] f32. Rotate-half convention (Hugging Face's)."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


# ---------------------------------------------------------------------------------
# forward


def rms_norm(x, w, eps: float):
    """In float32; the weight multiplies after casting back (transformers' order)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclass
class AttentionMetadata:
    """The ragged step's metadata, on device (the attention kernels' contract)."""

    positions: jax.Array  # [T] i32
    kv_lens: jax.Array  # [R] i32
    page_indices: jax.Array  # [R * pages_per_seq] i32
    cu_q_lens: jax.Array  # [R + 1] i32
    distribution: jax.Array  # [3] i32


# attention_fn(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], kv_cache, kv_lens, page_indices, cu_q_lens,
#              distribution, *, sm_scale, sliding_window) -> (out [T,Hq,D], kv_cache)
AttentionFn = Callable


def _layer(lp: LayerParams, x, kv_cache, md: AttentionMetadata, cos, sin, cfg: DecoderConfig, attention_fn):
    """One decoder layer; lp holds this layer's slice. Linears run as 2-D dots (fastest on XLA:CPU)."""
    T = x.shape[0]
    Hq, D = cfg.num_q_heads, cfg.head_dim

    def proj(h, w):  # h [T, H], w [N, D, H] -> [T, N, D]
        return (h @ w.reshape(-1, w.shape[-1]).T).reshape(T, w.shape[0], w.shape[1])

    h = rms_norm(x, lp.attn_norm, cfg.rms_norm_eps)
    q, k, v = proj(h, lp.q_proj), proj(h, lp.k_proj), proj(h, lp.v_proj)
    if lp.q_bias is not None:
        q, k, v = q + lp.q_bias, k + lp.k_bias, v + lp.v_bias
    if lp.q_norm is not None:
        q = rms_norm(q, lp.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, lp.k_norm, cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kv_dt = kv_cache.dtype
    attn, kv_cache = attention_fn(
        q.astype(kv_dt), k.astype(kv_dt), v.astype(kv_dt), kv_cache, md.kv_lens, md.page_indices,
        md.cu_q_lens, md.distribution, sm_scale=cfg.sm_scale, sliding_window=cfg.sliding_window,
    )
    x = x + attn.astype(x.dtype).reshape(T, Hq * D) @ lp.o_proj.reshape(lp.o_proj.shape[0], Hq * D).T
    h = rms_norm(x, lp.mlp_norm, cfg.rms_norm_eps)
    g, u = h @ lp.gate_proj.T, h @ lp.up_proj.T
    x = x + (jax.nn.silu(g) * u) @ lp.down_proj.T
    return x, kv_cache


def forward(
    params: ModelParams,
    kv_cache,  # [L * num_blocks, page_size, 2 * Hkv, D]: layer l owns pages [l * num_blocks, (l + 1) * num_blocks)
    input_ids,  # [T] i32
    md: AttentionMetadata,
    cfg: DecoderConfig,
    attention_fn: AttentionFn,
    scan_layers: bool = True,
):
    """All scheduled tokens through the decoder. Returns (hidden [T, H] before the final norm, kv_cache).

    One cache array holds every layer (layer l's page p is row l * num_blocks + p), so
    a scan over layers carries it and updates it in place, and the attention kernels
    see the plain 4-D cache they expect with page indices offset per layer.
    """
    L = cfg.num_layers
    num_blocks = kv_cache.shape[0] // L
    x = params.embed[input_ids]
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    ang = md.positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)

    def layer(x, cache, lp, l):
        md_l = AttentionMetadata(md.positions, md.kv_lens, md.page_indices + l * num_blocks, md.cu_q_lens,
                                 md.distribution)
        return _layer(lp, x, cache, md_l, cos, sin, cfg, attention_fn)

    if scan_layers:
        def body(carry, xs):
            lp, l = xs
            return layer(*carry, lp, l), None

        (x, kv_cache), _ = jax.lax.scan(body, (x, kv_cache), (params.layers, jnp.arange(L, dtype=jnp.int32)))
    else:
        for l in range(L):
            lp = jax.tree.map(lambda a: a[l], params.layers)
            x, kv_cache = layer(x, kv_cache, lp, l)
    return x, kv_cache


def compute_logits(params: ModelParams, hidden, cfg: DecoderConfig):
    """hidden [N, H] (before the final norm) -> float32 logits [N, V]."""
    h = rms_norm(hidden, params.final_norm, cfg.rms_norm_eps)
    w = params.embed if params.lm_head is None else params.lm_head
    return jnp.einsum("nh,vh->nv", h, w, preferred_element_type=jnp.float32)


def kv_cache_shape(cfg: DecoderConfig, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
    """All layers in one array: [L * num_blocks, block_size, 2 * Hkv, D]."""
    return (cfg.num_layers * num_blocks, block_size, 2 * cfg.num_kv_heads, cfg.head_dim)


def kv_cache_bytes_per_block(cfg: DecoderConfig, block_size: int) -> int:
    """All layers together."""
    return cfg.num_layers * block_size * 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(DTYPES[cfg.kv_dtype]).itemsize


__all__ = [
    "AttentionMetadata",
    "DecoderConfig",
    "LayerParams",
    "ModelParams",
    "ParamSpec",
    "abstract_params",
    "compute_logits",
    "forward",
    "kv_cache_shape",
    "rope_inv_freq",
]
