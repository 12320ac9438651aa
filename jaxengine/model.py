"""One Llama-family decoder for every supported architecture, as pure functions over a params pytree.

Llama 2/3, SmolLM2 (tied embeddings), Mistral, Qwen2 (q/k/v biases) and Qwen3
(per-head q/k RMSNorm) differ only in their `enginecore.arch.ArchConfig`,
whose field names this file reads as they are. Weights are registered
dataclass pytrees; `abstract_params` gives every leaf's shape, dtype and
*logical* axes, which `sharding.py` maps to the mesh and `loader.py` fills
tensor by tensor. Linear weights keep the Hugging Face [out, in] orientation
(split into heads where there are heads): no transpose at load time, XLA
contracts either side for free; but for the experts' down projection, stored
[E, Ie, H] so that every expert's down is one 2-D dot (`jaxengine.moe`).
Mixture-of-Experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) stack their sparse
layers' MLP params over the sparse layers and the dense MLP's over the dense
ones; `forward` scans each run of consecutive layers of one kind.

`forward(params, kv_cache, input_ids, md, rope, ...) -> (hidden, kv_cache)` runs
all scheduled tokens of one ragged step; `compute_logits` projects only the
rows the sampler needs. Both are one path in XLA's ops; a platform's kernels
come in from its runner, as `attention_fn` does: a `ModelKernels` of linears,
norms, RoPE, activation and LM head, or every layer in one call
(`jaxengine.cpu_wing` on a CPU, over the weights the runner packed at load).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp

from enginecore.arch import DENSE_MLP_PARAMS, MOE_PARAMS, ArchConfig
from jaxengine.moe import moe_mlp, routed_experts

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def jnp_dtype(name: str):
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


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
    # the dense MLP, stacked over the Ld dense layers (every layer of a dense model; None: no dense layer)
    gate_proj: jax.Array | None = None  # [Ld, I, H]
    up_proj: jax.Array | None = None  # [Ld, I, H]
    down_proj: jax.Array | None = None  # [Ld, H, I]
    q_bias: jax.Array | None = None  # [L, Hq, D] (Qwen2)
    k_bias: jax.Array | None = None  # [L, Hkv, D]
    v_bias: jax.Array | None = None  # [L, Hkv, D]
    q_norm: jax.Array | None = None  # [L, D] (Qwen3)
    k_norm: jax.Array | None = None  # [L, D]
    # the sparse MLP (`jaxengine.moe`), stacked over the Ls sparse layers (None: a dense model)
    router: jax.Array | None = None  # [Ls, E, H]
    experts_gate: jax.Array | None = None  # [Ls, E, Ie, H]
    experts_up: jax.Array | None = None  # [Ls, E, Ie, H]
    experts_down: jax.Array | None = None  # [Ls, E, Ie, H]: [in, out], transposed at load (`jaxengine.moe`)
    shared_gate_proj: jax.Array | None = None  # [Ls, Is, H] (Qwen2-MoE's shared expert)
    shared_up_proj: jax.Array | None = None  # [Ls, Is, H]
    shared_down_proj: jax.Array | None = None  # [Ls, H, Is]
    shared_expert_gate: jax.Array | None = None  # [Ls, 1, H]


@jax.tree_util.register_dataclass
@dataclass
class ModelParams:
    embed: jax.Array | None  # [V, H]; None when a kernel layout holds it (the LM head's panels, tied)
    layers: LayerParams  # stacked [L, ...]
    final_norm: jax.Array  # [H]
    lm_head: jax.Array | None = None  # [V, H]; None when tied to embed (or packed)
    # the linears in a kernel's layout (`jaxengine.cpu_wing.CpuPanels` on a CPU), read by the injected
    # `ModelKernels` alone; then the layers' linear fields are None
    panels: object | None = None


def abstract_params(arch: ArchConfig, dtype: str) -> ModelParams:
    """The params pytree with ParamSpec leaves (shapes, dtypes, logical axes)."""
    H, I, D, V = arch.hidden_size, arch.intermediate_size, arch.head_dim, arch.vocab_size
    Hq, Hkv = arch.num_attention_heads, arch.num_key_value_heads
    dt = jnp_dtype(dtype)
    L = arch.num_hidden_layers

    def spec(shape, axes):
        return ParamSpec(tuple(shape), dt, tuple(axes))

    moe = arch.moe
    Ls = moe.num_sparse_layers if moe is not None else 0

    def lspec(shape, axes, n=L):
        return spec((n, *shape), ("layers", *axes))

    def layer() -> LayerParams:
        lp = LayerParams(
            attn_norm=lspec((H,), ("norm",)),
            q_proj=lspec((Hq, D, H), ("q_heads", "head_dim", "embed")),
            k_proj=lspec((Hkv, D, H), ("kv_heads", "head_dim", "embed")),
            v_proj=lspec((Hkv, D, H), ("kv_heads", "head_dim", "embed")),
            o_proj=lspec((H, Hq, D), ("embed", "q_heads", "head_dim")),
            mlp_norm=lspec((H,), ("norm",)),
        )
        if L - Ls:
            lp.gate_proj = lspec((I, H), ("mlp", "embed"), L - Ls)
            lp.up_proj = lspec((I, H), ("mlp", "embed"), L - Ls)
            lp.down_proj = lspec((H, I), ("embed", "mlp"), L - Ls)
        if Ls:
            E, Ie, Is = moe.num_experts, moe.intermediate_size, moe.shared_expert_intermediate_size
            lp.router = lspec((E, H), (None, "embed"), Ls)  # (tiny: every device routes every token)
            lp.experts_gate = lspec((E, Ie, H), ("experts", "expert_mlp", "embed"), Ls)
            lp.experts_up = lspec((E, Ie, H), ("experts", "expert_mlp", "embed"), Ls)
            lp.experts_down = lspec((E, Ie, H), ("experts", "expert_mlp", "embed"), Ls)
            if Is:
                lp.shared_gate_proj = lspec((Is, H), ("mlp", "embed"), Ls)
                lp.shared_up_proj = lspec((Is, H), ("mlp", "embed"), Ls)
                lp.shared_down_proj = lspec((H, Is), ("embed", "mlp"), Ls)
            if moe.shared_expert_gate:
                lp.shared_expert_gate = lspec((1, H), (None, "embed"), Ls)
        if arch.attention_bias:
            lp.q_bias = lspec((Hq, D), ("q_heads", "head_dim"))
            lp.k_bias = lspec((Hkv, D), ("kv_heads", "head_dim"))
            lp.v_bias = lspec((Hkv, D), ("kv_heads", "head_dim"))
        if arch.qk_norm:
            lp.q_norm = lspec((D,), ("norm",))
            lp.k_norm = lspec((D,), ("norm",))
        return lp

    return ModelParams(
        embed=spec((V, H), ("vocab", "embed")),
        layers=layer(),
        final_norm=spec((H,), ("norm",)),
        lm_head=None if arch.tie_word_embeddings else spec((V, H), ("vocab", "embed")),
    )


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


# ---------------------------------------------------------------------------------
# rope


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
class RaggedMetadata:
    """One ragged step's request metadata on device: the attention kernels' contract."""

    kv_lens: jax.Array  # [R] i32 tokens in the cache after this step; 0 for padded requests
    block_tables: jax.Array  # [R * blocks_per_seq] i32 flattened block tables
    cu_q_lens: jax.Array  # [R + 1] i32
    distribution: jax.Array  # [3] i32 (decode_end, prefill_end, mixed_end)


# attention_fn(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], kv_cache, kv_lens, block_tables, cu_q_lens, distribution,
#              *, sm_scale, sliding_window) -> (out [T,Hq,D], kv_cache)
AttentionFn = Callable


def dense(h, w, weights_first_rows: int = 0, preferred_element_type=None):
    """h [T, K] . w [N, K] (Hugging Face's [out, in]) -> [T, N].

    For 2 to `weights_first_rows` rows (one row is a matrix-vector product either way) it is
    computed weights first: w . h^T -> [N, T], then transposed. On XLA:CPU that
    orientation runs 1.5-2.5x faster for a few rows (decode steps of 2-32 tokens: the
    LM head of a 49k vocabulary at 4 rows 6 ms instead of 11-17 ms; equal at 64 rows,
    slower at 512), `benchmarks/bench_dense.py`. The optimization barrier keeps XLA's
    algebraic simplifier from folding the transpose back into the dot (it rewrites
    transpose(dot(a, b)) as dot(b^T, a^T), the slow orientation again); the transpose
    itself copies [N, T], a few hundred KB at most.
    """
    dims = (((1,), (1,)), ((), ()))
    if not 1 < h.shape[0] <= weights_first_rows:
        return jax.lax.dot_general(h, w, dims, preferred_element_type=preferred_element_type)
    out = jax.lax.dot_general(w, h, dims, preferred_element_type=preferred_element_type)
    return jax.lax.optimization_barrier(out).T


def as_out_in(name: str, w, stacked: bool = False):
    """A linear's weight as [N, K] ([L, N, K] when stacked over layers): reshapes only (bitcasts)."""
    lead = w.shape[:1] if stacked else ()
    if name == "o_proj":  # [H, Hq, D]
        return w.reshape(*lead, w.shape[len(lead)], -1)
    return w.reshape(*lead, -1, w.shape[-1])  # [N..., K]


# the linears that read one input, in output order (vLLM's QKVParallelLinear, MergedColumnParallelLinear): a
# kernel may multiply a group as one matrix
LINEAR_GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                 "down": ("down_proj",)}


def xla_linear(params: ModelParams, lp: LayerParams, layer, h, group: str, weights_first_rows: int = 0):
    """h [T, K] through this layer's linears of LINEAR_GROUPS[group] (lp: the layer's slice) -> a tuple of
    [T, N_i], one per linear: XLA's 2-D dots (`dense`), the fastest on XLA:CPU too."""
    return tuple(dense(h, as_out_in(n, getattr(lp, n)), weights_first_rows) for n in LINEAR_GROUPS[group])


def xla_head(params: ModelParams, h, live=None, weights_first_rows: int = 0):
    """h [N, H] (after the final norm) -> float32 logits [N, V]; every row is computed (`live` is a kernel's)."""
    w = params.embed if params.lm_head is None else params.lm_head
    return dense(h, w, weights_first_rows, preferred_element_type=jnp.float32)


def embed(params: ModelParams, ids):
    """The embeddings of token ids [T] -> [T, H]."""
    return params.embed[ids]


def silu_and_mul(gate, up):
    """The MLP's activation: gate, up [T, I] -> silu(gate) * up."""
    return jax.nn.silu(gate) * up


def rope_angles(cos, sin):
    """Each token's cos / sin [T, D / 2], gathered from the tables, as `rope` takes them (here: as they are)."""
    return cos, sin


def xla_moe(params: ModelParams, lp: LayerParams, layer, h, moe, experts=routed_experts):
    """A sparse layer's MLP on XLA's ops (`jaxengine.moe.moe_mlp`; `experts`: the routed experts' function)."""
    return moe_mlp(h, lp, moe, experts=experts)


@dataclass(frozen=True)
class ModelKernels:
    """How `forward`, `compute_logits` and `greedy_tokens` compute their pieces: XLA's ops by default (TPU, GPU and
    any CPU), the kernels of a platform where its runner injects them (`jaxengine.cpu_wing.model_kernels`), as it
    injects `attention_fn`. The model has this one path; a kernel reads whatever weight layout its runner packed
    into `ModelParams.panels`."""

    # (params, lp, layer, h [T, K], group) -> a [T, N_i] per linear of LINEAR_GROUPS[group]; lp: the layer's
    # slice of params.layers, layer its index (an int32 scalar in the scan)
    linear: Callable = xla_linear
    # (params, h [N, H] after the final norm, live) -> float32 logits [N, V]; live (an int32 scalar or None):
    # rows past the first `live` are padding, which a kernel may leave zero
    head: Callable = xla_head
    # (params, h, live) -> [N] int32, head's argmax per row without its logits; None: the sampler takes it
    head_argmax: Callable | None = None
    embed: Callable = embed  # (params, ids [T]) -> [T, H]
    norm: Callable = rms_norm  # (x [..., K], w [K], eps) -> RMSNorm
    rope_angles: Callable = rope_angles  # (cos, sin [T, D / 2]) -> rope's cos, sin (once a step, not per layer)
    rope: Callable = apply_rope  # (x [T, N, D], cos, sin) -> x rotated
    gated_act: Callable = silu_and_mul  # (gate, up [T, I]) -> [T, I]
    # (params, x [T, H], cos, sin, kv_cache, md, keep, all_rows) -> (hidden, kv_cache): every layer of a step
    # at once, in place of the scan over `_layer` (the same arithmetic); None: the scan
    layers: Callable | None = None
    # (params, lp, layer, h [T, H] after the MLP norm, MoEConfig) -> [T, H]: a sparse layer's MLP (`xla_moe`; the
    # runner's is shard_map'd over the mesh, `jaxengine.sharding.shard_experts`)
    moe: Callable = xla_moe

    @classmethod
    def xla(cls, weights_first_rows: int = 0) -> ModelKernels:
        """XLA's ops, with steps of 2 to `weights_first_rows` rows multiplied weights first (`dense`; 0: never,
        what TPU and GPU want: their compilers pick the layouts)."""
        if not weights_first_rows:
            return cls()
        return cls(linear=functools.partial(xla_linear, weights_first_rows=weights_first_rows),
                   head=functools.partial(xla_head, weights_first_rows=weights_first_rows))


def _layer(params: ModelParams, lp: LayerParams, layer, x, kv_cache, md: RaggedMetadata, cos, sin,
           arch: ArchConfig, attention_fn, kernels: ModelKernels):
    """One decoder layer; lp holds this layer's slice of params.layers, `layer` its index."""
    T = x.shape[0]
    Hq, Hkv, D, eps = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, arch.rms_norm_eps
    norm = kernels.norm

    def lin(h, group):  # h [T, K] -> a [T, N_i] per linear of the group
        return kernels.linear(params, lp, layer, h, group)

    h = norm(x, lp.attn_norm, eps)
    q, k, v = lin(h, "qkv")
    q, k, v = q.reshape(T, Hq, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
    if lp.q_bias is not None:
        q, k, v = q + lp.q_bias, k + lp.k_bias, v + lp.v_bias
    if lp.q_norm is not None:
        q = norm(q, lp.q_norm, eps)
        k = norm(k, lp.k_norm, eps)
    q, k = kernels.rope(q, cos, sin), kernels.rope(k, cos, sin)
    kv_dt = kv_cache.dtype  # (q stays in its dtype: the Pallas wrapper casts it, the XLA and CPU paths read it whole)
    attn, kv_cache = attention_fn(
        q, k.astype(kv_dt), v.astype(kv_dt), kv_cache, md.kv_lens, md.block_tables,
        md.cu_q_lens, md.distribution, sm_scale=arch.sm_scale, sliding_window=arch.sliding_window,
    )
    (o,) = lin(attn.astype(x.dtype).reshape(T, Hq * D), "o")
    x = x + o
    h = norm(x, lp.mlp_norm, eps)
    if lp.router is not None:  # a sparse layer
        return x + kernels.moe(params, lp, layer, h, arch.moe), kv_cache
    (down,) = lin(kernels.gated_act(*lin(h, "gate_up")), "down")
    return x + down, kv_cache


def layer_runs(arch: ArchConfig) -> tuple[tuple[int, int, bool], ...]:
    """The decoder's runs of consecutive layers of one kind, (start, stop, sparse): one run for a uniform model
    (each run is one scan: its layers' params stack alike)."""
    kinds = [arch.is_sparse(l) for l in range(arch.num_hidden_layers)]
    runs, start = [], 0
    for l in range(1, len(kinds) + 1):
        if l == len(kinds) or kinds[l] != kinds[start]:
            runs.append((start, l, kinds[start]))
            start = l
    return tuple(runs)


def run_params(layers: LayerParams, arch: ArchConfig, start: int, stop: int, sparse: bool) -> LayerParams:
    """Layers [start, stop) of one kind: each field cut from its own stack (the dense MLP's over the dense layers,
    the sparse MLP's over the sparse ones), the other kind's MLP None. A whole stack is passed as it is."""
    n = stop - start
    mlp_start = start if arch.moe is None else (arch.moe.sparse_index(start) if sparse
                                                 else arch.moe.dense_index(start))

    def cut(a, lo):
        return a if a is None or (lo == 0 and a.shape[0] == n) else a[lo:lo + n]

    fields = {}
    for f in dataclasses.fields(layers):
        a = getattr(layers, f.name)
        if f.name in DENSE_MLP_PARAMS or f.name in MOE_PARAMS:
            fields[f.name] = cut(a, mlp_start) if (f.name in MOE_PARAMS) == sparse else None
        else:
            fields[f.name] = cut(a, start)
    return LayerParams(**fields)


def forward(
    params: ModelParams,
    kv_cache,  # [L * num_blocks, block_size, 2 * Hkv, D]: layer l owns blocks [l * num_blocks, (l + 1) * num_blocks)
    input_ids,  # [T] i32
    positions,  # [T] i32
    md: RaggedMetadata,
    rope,  # (cos, sin) [max_positions, D/2] f32 tables (enginecore.arch.rope_cos_sin)
    arch: ArchConfig,
    attention_fn: AttentionFn,
    kernels: ModelKernels = ModelKernels(),
    scan_layers: bool = True,
    keep=None,
    all_rows=None,
):
    """All scheduled tokens through the decoder. Returns (hidden [T, H] before the final norm, kv_cache).

    `kernels`: how the pieces are computed (`ModelKernels`: XLA's ops unless the runner injects others).
    `keep` [R] / `all_rows` [1] (int32): unless all_rows[0], the caller reads only hidden's rows keep[:requests];
    `kernels.layers` may leave the others' last layer undone, the scan computes every row.

    One cache array holds every layer (layer l's block b is row l * num_blocks + b), so
    a scan over layers carries it and updates it in place, and the attention kernels
    see the plain 4-D cache they expect with block ids offset per layer.
    """
    L = arch.num_hidden_layers
    num_blocks = kv_cache.shape[0] // L
    x = kernels.embed(params, input_ids)
    cos, sin = kernels.rope_angles(rope[0][positions], rope[1][positions])
    if kernels.layers is not None:
        return kernels.layers(params, x, cos, sin, kv_cache, md, keep, all_rows)

    def layer(x, cache, lp, l):
        md_l = RaggedMetadata(md.kv_lens, md.block_tables + l * num_blocks, md.cu_q_lens, md.distribution)
        return _layer(params, lp, l, x, cache, md_l, cos, sin, arch, attention_fn, kernels)

    def body(carry, xs):
        lp, l = xs
        return layer(*carry, lp, l), None

    for start, stop, sparse in layer_runs(arch):  # (one run, the whole stack, for a uniform model)
        lps = run_params(params.layers, arch, start, stop, sparse)
        if scan_layers:
            (x, kv_cache), _ = jax.lax.scan(body, (x, kv_cache), (lps, jnp.arange(start, stop, dtype=jnp.int32)))
        else:
            for i in range(stop - start):
                lp = jax.tree.map(lambda a: a[i], lps)
                x, kv_cache = layer(x, kv_cache, lp, start + i)
    return x, kv_cache


def compute_logits(params: ModelParams, hidden, arch: ArchConfig, kernels: ModelKernels = ModelKernels(),
                   live=None):
    """hidden [N, H] (before the final norm) -> float32 logits [N, V]. `live` (an int32 scalar, traced): the rows
    past the first `live` are padding, which a kernel may leave zero (`ModelKernels.head`)."""
    return kernels.head(params, kernels.norm(hidden, params.final_norm, arch.rms_norm_eps), live)


def greedy_tokens(params: ModelParams, hidden, arch: ArchConfig, kernels: ModelKernels = ModelKernels(),
                  live=None):
    """hidden [N, H] -> [N] int32, `compute_logits(...).argmax(-1)` without writing the logits
    (`ModelKernels.head_argmax`); None where the kernels have no such head (then take the logits' argmax)."""
    if kernels.head_argmax is None:
        return None
    return kernels.head_argmax(params, kernels.norm(hidden, params.final_norm, arch.rms_norm_eps), live)


def kv_cache_shape(arch: ArchConfig, num_blocks: int, block_size: int, *, kv_heads: int,
                   head_dim: int) -> tuple[int, int, int, int]:
    """All layers in one array: [L * num_blocks, block_size, 2 * kv_heads, head_dim] (as stored: the Pallas
    path on TPU pads heads and head_dim, `jaxengine.platform.pallas_cache_heads`)."""
    return (arch.num_hidden_layers * num_blocks, block_size, 2 * kv_heads, head_dim)


__all__ = [
    "LINEAR_GROUPS",
    "LayerParams",
    "ModelKernels",
    "ModelParams",
    "ParamSpec",
    "RaggedMetadata",
    "abstract_params",
    "compute_logits",
    "dense",
    "embed",
    "forward",
    "jnp_dtype",
    "kv_cache_shape",
    "greedy_tokens",
    "layer_runs",
    "run_params",
    "xla_moe",
]
