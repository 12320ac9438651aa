"""One Llama-family decoder for every supported architecture, as pure functions over a params pytree.

Llama 2/3, SmolLM2 (tied embeddings), Mistral, Qwen2 (q/k/v biases) and Qwen3
(per-head q/k RMSNorm) differ only in their `enginecore.arch.ArchConfig`,
whose field names this file reads as they are. Weights are registered
dataclass pytrees; `abstract_params` gives every leaf's shape, dtype and
*logical* axes, which `sharding.py` maps to the mesh and `loader.py` fills
tensor by tensor. Linear weights keep the Hugging Face [out, in] orientation
(split into heads where there are heads): no transpose at load time, XLA
contracts either side for free. On one CPU device in float32 the runner then
packs them for the CPU custom call (`pack_cpu_panels`, `CpuPanels`).

`forward(params, kv_cache, input_ids, md, rope, ...) -> (hidden, kv_cache)` runs
all scheduled tokens of one ragged step; `compute_logits` projects only the
rows the sampler needs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp

from enginecore.arch import ArchConfig

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
    gate_proj: jax.Array  # [L, I, H]
    up_proj: jax.Array  # [L, I, H]
    down_proj: jax.Array  # [L, H, I]
    q_bias: jax.Array | None = None  # [L, Hq, D] (Qwen2)
    k_bias: jax.Array | None = None  # [L, Hkv, D]
    v_bias: jax.Array | None = None  # [L, Hkv, D]
    q_norm: jax.Array | None = None  # [L, D] (Qwen3)
    k_norm: jax.Array | None = None  # [L, D]


QX_LINEARS = ("qkv", "o", "gate_up", "down")  # CpuPanels.qx_kinds' order


@jax.tree_util.register_dataclass
@dataclass
class CpuPanels:
    """The linears' weights packed for `cpu_kernels.jax_ops.panel_linear` (`pack_cpu_panels`), each
    [L, NP, K, 16]: panels of 16 output rows, k-major. q/k/v are one linear, gate/up another. None (every one)
    where QX_BDOT's qx panels take every step (`pack_cpu_panels(bdot=True)`: `--dtype bfloat16`)."""

    qkv: jax.Array | None  # [L, (Hq + 2 Hkv) D / 16, H, 16]
    o: jax.Array | None  # [L, H / 16, Hq D, 16]
    gate_up: jax.Array | None  # [L, 2 I / 16, H, 16]
    down: jax.Array | None  # [L, H / 16, I, 16]
    head: jax.Array | None  # [1, V / 16, H, 16]: the LM head (the embedding when tied: then looked up here)
    # the same weights as stored (`attach_cpu_qx`): qx panels [L, NP, K / 32, group bytes] of qx_kinds' kind
    # (`cpu_kernels.layout`: a GGUF file's blocks, a bfloat16 checkpoint's halves), None where a linear has none;
    # steps of up to `cpu_kernels.qx_max_rows()[kind]` tokens multiply them instead (the same bits, fewer bytes)
    qkv_qx: jax.Array | None = None
    o_qx: jax.Array | None = None
    gate_up_qx: jax.Array | None = None
    down_qx: jax.Array | None = None
    head_qx: jax.Array | None = None  # [1, V / 16, H / 32, group bytes] of head_qx_kind
    qx_kinds: tuple = field(default=(-1, -1, -1, -1), metadata=dict(static=True))  # qkv's, o's, gate_up's, down's
    head_qx_kind: int = field(default=-1, metadata=dict(static=True))

    def qx_for(self, group: str, rows: int) -> tuple[jax.Array | None, int]:
        """(group's qx panels, their kind) for a step of `rows` tokens, or (None, -1) where the float32 panels
        run it."""
        from cpu_kernels.jax_ops import qx_max_rows

        kind = self.head_qx_kind if group == "head" else self.qx_kinds[QX_LINEARS.index(group)]
        qx = getattr(self, f"{group}_qx")
        return (qx, kind) if qx is not None and kind >= 0 and rows <= qx_max_rows()[kind] else (None, -1)


@jax.tree_util.register_dataclass
@dataclass
class ModelParams:
    embed: jax.Array | None  # [V, H]; None when packed into panels.head (tied, on a CPU)
    layers: LayerParams  # stacked [L, ...]
    final_norm: jax.Array  # [H]
    lm_head: jax.Array | None = None  # [V, H]; None when tied to embed (or packed)
    panels: CpuPanels | None = None  # a CPU's float32 linears (then the layers' linear fields are None)


def abstract_params(arch: ArchConfig, dtype: str) -> ModelParams:
    """The params pytree with ParamSpec leaves (shapes, dtypes, logical axes)."""
    H, I, D, V = arch.hidden_size, arch.intermediate_size, arch.head_dim, arch.vocab_size
    Hq, Hkv = arch.num_attention_heads, arch.num_key_value_heads
    dt = jnp_dtype(dtype)
    L = arch.num_hidden_layers

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


def _as_out_in(name: str, w, stacked: bool = False):
    """A linear's weight as [N, K] ([L, N, K] when stacked over layers): reshapes only (bitcasts)."""
    lead = w.shape[:1] if stacked else ()
    if name == "o_proj":  # [H, Hq, D]
        return w.reshape(*lead, w.shape[len(lead)], -1)
    return w.reshape(*lead, -1, w.shape[-1])  # [N..., K]


def _layer(lp: LayerParams, x, kv_cache, md: RaggedMetadata, cos, sin, arch: ArchConfig, attention_fn,
           weights_first_rows: int = 0, panels=None, norm=rms_norm, rope=apply_rope):
    """One decoder layer; lp holds this layer's slice. Linears run as 2-D dots (fastest on XLA:CPU), or
    through `panels(h, group)` when given (`forward`: the CPU custom call on every layer's packed weights;
    groups "qkv", "o", "gate_up", "down"); `norm` and `rope(x, cos, sin)` are the RMSNorm and RoPE (`forward`
    picks the CPU custom calls' with the panels, and passes `rope`'s tables)."""
    T = x.shape[0]
    Hq, Hkv, D, eps = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, arch.rms_norm_eps

    def lin(h, name):  # h [T, K] -> [T, N]
        if panels is not None:
            return panels(h, {"o_proj": "o", "down_proj": "down"}[name])
        return dense(h, _as_out_in(name, getattr(lp, name)), weights_first_rows)

    h = norm(x, lp.attn_norm, eps)
    if panels is not None:
        q, k, v = jnp.split(panels(h, "qkv"), [Hq * D, (Hq + Hkv) * D], axis=1)
    else:
        q, k, v = lin(h, "q_proj"), lin(h, "k_proj"), lin(h, "v_proj")
    q, k, v = q.reshape(T, Hq, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
    if lp.q_bias is not None:
        q, k, v = q + lp.q_bias, k + lp.k_bias, v + lp.v_bias
    if lp.q_norm is not None:
        q = norm(q, lp.q_norm, eps)
        k = norm(k, lp.k_norm, eps)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    kv_dt = kv_cache.dtype  # (q stays in its dtype: the Pallas wrapper casts it, the XLA and CPU paths read it whole)
    attn, kv_cache = attention_fn(
        q, k.astype(kv_dt), v.astype(kv_dt), kv_cache, md.kv_lens, md.block_tables,
        md.cu_q_lens, md.distribution, sm_scale=arch.sm_scale, sliding_window=arch.sliding_window,
    )
    x = x + lin(attn.astype(x.dtype).reshape(T, Hq * D), "o_proj")
    h = norm(x, lp.mlp_norm, eps)
    if panels is not None:
        from cpu_kernels.jax_ops import silu_mul

        act = silu_mul(panels(h, "gate_up"))
    else:
        act = jax.nn.silu(lin(h, "gate_proj")) * lin(h, "up_proj")
    x = x + lin(act, "down_proj")
    return x, kv_cache


def forward(
    params: ModelParams,
    kv_cache,  # [L * num_blocks, block_size, 2 * Hkv, D]: layer l owns blocks [l * num_blocks, (l + 1) * num_blocks)
    input_ids,  # [T] i32
    positions,  # [T] i32
    md: RaggedMetadata,
    rope,  # (cos, sin) [max_positions, D/2] f32 tables (enginecore.arch.rope_cos_sin)
    arch: ArchConfig,
    attention_fn: AttentionFn,
    scan_layers: bool = True,
    weights_first_rows: int = 0,
    cpu_layers: bool = False,
    keep=None,
    all_rows=None,
):
    """All scheduled tokens through the decoder. Returns (hidden [T, H] before the final norm, kv_cache).

    `keep` [R] / `all_rows` [1] (int32): with `cpu_layers`, unless all_rows[0], only hidden's rows
    keep[:requests] are wanted (`cpu_kernels.layers` then runs the last layer's o linear and MLP on them
    alone); the other paths compute every row.

    `weights_first_rows`: steps of 2 to this many (padded) tokens run their linears weights first
    (`dense`; one row is a matrix-vector product either way); 0 never (what TPU and GPU want:
    their compilers pick the layouts).

    With `params.panels` (`pack_cpu_panels`: float32 on one CPU device, the runner decides) the linears run
    as `cpu_kernels.jax_ops.panel_linear` on every layer's packed weights where they lie (the scan then
    carries only the small per-layer parameters: XLA:CPU copies a dynamic slice of the stacked weights
    before a dot reads it, every layer of every step). With `cpu_layers` too (the runner decides), every
    layer runs in one custom call, `cpu_kernels.layers`: the same kernels in the same order (the same bits),
    without a call per kernel (~9 a layer, each waking XLA's threads anew).

    One cache array holds every layer (layer l's block b is row l * num_blocks + b), so
    a scan over layers carries it and updates it in place, and the attention kernels
    see the plain 4-D cache they expect with block ids offset per layer.
    """
    L = arch.num_hidden_layers
    num_blocks = kv_cache.shape[0] // L
    x = embed(params, input_ids)
    cos, sin = rope[0][positions], rope[1][positions]

    layers, panels_for, norm, rope_fn = params.layers, lambda l: None, rms_norm, apply_rope
    if params.panels is not None:
        from cpu_kernels.jax_ops import rms_norm as norm
        from cpu_kernels.jax_ops import rope as rope_fn
        from cpu_kernels.jax_ops import rope_tables

        panels_for = lambda l: lambda h, g: cpu_linear(params.panels, h, g, l, arch)  # noqa: E731
        cos, sin = rope_tables(cos.astype(jnp.float32), sin.astype(jnp.float32))  # once a step, not per layer
        if cpu_layers:
            return _cpu_layers(params, x, cos, sin, kv_cache, md, arch, keep, all_rows)

    def layer(x, cache, lp, l):
        md_l = RaggedMetadata(md.kv_lens, md.block_tables + l * num_blocks, md.cu_q_lens, md.distribution)
        return _layer(lp, x, cache, md_l, cos, sin, arch, attention_fn, weights_first_rows, panels_for(l), norm,
                      rope_fn)

    if scan_layers:
        def body(carry, xs):
            lp, l = xs
            return layer(*carry, lp, l), None

        (x, kv_cache), _ = jax.lax.scan(body, (x, kv_cache), (layers, jnp.arange(L, dtype=jnp.int32)))
    else:
        for l in range(L):
            lp = jax.tree.map(lambda a: a[l], layers)
            x, kv_cache = layer(x, kv_cache, lp, l)
    return x, kv_cache


def _cpu_layers(params: ModelParams, x, cos, sin, kv_cache, md: RaggedMetadata, arch: ArchConfig, keep=None,
                all_rows=None):
    """`forward`'s layers as one custom call (`cpu_kernels.layers`): the small per-layer parameters as the
    kernel takes them (q/k/v biases side by side, as the qkv panels' outputs lie; empty where absent)."""
    from cpu_kernels.jax_ops import layers

    lp, p, L = params.layers, params.panels, arch.num_hidden_layers
    none = jnp.zeros((0,), jnp.float32)
    bias = none if lp.q_bias is None else jnp.concatenate(
        [b.reshape(L, -1) for b in (lp.q_bias, lp.k_bias, lp.v_bias)], axis=1)
    R = md.kv_lens.shape[0]
    from cpu_kernels.jax_ops import qx_max_rows

    present = [k for q, k in zip((p.qkv_qx, p.o_qx, p.gate_up_qx, p.down_qx), p.qx_kinds) if q is not None]
    rows = min((qx_max_rows()[k] for k in present), default=0)
    f32 = [none if w is None else w for w in (p.qkv, p.o, p.gate_up, p.down)]  # (None: QX_BDOT's take every step)
    return layers(x, lp.attn_norm, lp.mlp_norm, *f32, bias,
                  none if lp.q_norm is None else lp.q_norm, none if lp.k_norm is None else lp.k_norm, cos, sin,
                  kv_cache, md.block_tables.reshape(R, -1), md.kv_lens, md.cu_q_lens, md.distribution, keep, all_rows,
                  (p.qkv_qx, p.o_qx, p.gate_up_qx, p.down_qx),  # (the call takes them for steps of <= rows tokens)
                  num_heads=arch.num_attention_heads, eps=arch.rms_norm_eps, sm_scale=arch.sm_scale,
                  sliding_window=arch.sliding_window, qx_kinds=p.qx_kinds, qx_rows=rows)


def cpu_linear(panels: CpuPanels, h, group: str, layer, arch: ArchConfig, argmax: bool = False, live=None):
    """h [T, K] . the CPU panels' `group` of `layer` (`cpu_kernels.panel_linear`), from its qx panels where
    the step has few enough rows (`qx_linear`, the same bits); `argmax`: each row's argmax of it instead;
    `live`: of h's first `live` rows only (the kernels' `live`; the qx panels are still chosen by h's rows,
    which `live` cannot change at trace time)."""
    from cpu_kernels import jax_ops

    n = panel_outputs(arch)[group]
    qx, kind = panels.qx_for(group, h.shape[0])
    if qx is not None:
        return (jax_ops.qx_argmax if argmax else jax_ops.qx_linear)(h, qx, layer, n, kind, live)
    return (jax_ops.panel_argmax if argmax else jax_ops.panel_linear)(h, getattr(panels, group), layer, n,
                                                                               live)


def compute_logits(params: ModelParams, hidden, arch: ArchConfig, weights_first_rows: int = 0, live=None):
    """hidden [N, H] (before the final norm) -> float32 logits [N, V] (`forward` for weights_first_rows).
    `live` (an int32 scalar, traced): the rows past the first `live` are padding, which the CPU panels do not
    multiply (their logits are zeros); elsewhere every row is."""
    if params.panels is not None:
        from cpu_kernels.jax_ops import rms_norm as cpu_rms_norm

        h = cpu_rms_norm(hidden, params.final_norm, arch.rms_norm_eps)
        return cpu_linear(params.panels, h, "head", 0, arch, live=live)
    h = rms_norm(hidden, params.final_norm, arch.rms_norm_eps)
    w = params.embed if params.lm_head is None else params.lm_head
    return dense(h, w, weights_first_rows, preferred_element_type=jnp.float32)


def greedy_tokens(params: ModelParams, hidden, arch: ArchConfig, live=None):
    """hidden [N, H] -> [N] int32, `compute_logits(...).argmax(-1)` without writing the logits, on the CPU
    panels (`cpu_kernels.panel_argmax`; `live`: compute_logits', the padding's tokens 0); None without them
    (then take the logits' argmax)."""
    if params.panels is None:
        return None
    from cpu_kernels.jax_ops import rms_norm as cpu_rms_norm

    return cpu_linear(params.panels, cpu_rms_norm(hidden, params.final_norm, arch.rms_norm_eps), "head", 0, arch,
                      argmax=True, live=live)


def embed(params: ModelParams, ids):
    """The embeddings of token ids [T] -> [T, H] (from the LM head's panels when the embedding is tied and
    packed)."""
    if params.embed is None:
        from cpu_kernels.jax_ops import panel_rows

        return panel_rows(params.panels.head[0], ids)
    return params.embed[ids]


def panel_outputs(arch: ArchConfig) -> dict[str, int]:
    """Each `CpuPanels` linear's output width."""
    Hq, Hkv, D = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
    return {"qkv": (Hq + 2 * Hkv) * D, "o": arch.hidden_size, "gate_up": 2 * arch.intermediate_size,
            "down": arch.hidden_size, "head": arch.vocab_size}


# the linears each CpuPanels field packs, in output order
PANEL_GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                "down": ("down_proj",)}


def pack_cpu_panels(params: ModelParams, bdot: bool = False) -> ModelParams:
    """The float32 params of one CPU device with every linear and the LM head packed for
    `cpu_kernels.panel_linear` (`CpuPanels`): the same model, in the torch backend's CPU weight layout, all in
    one buffer on huge pages where the OS gives them (a step streams them all). Consumes `params`: each
    weight is dropped from it once packed (the extra memory is one group's weights, not the model's). A tied
    embedding is then looked up in the LM head's panels (`embed`).

    `bdot` (`--dtype bfloat16` where `cpu_kernels.layout.bdot_runs`): every linear and the LM head in QX_BDOT's
    bfloat16 panels only (`cpu_kernels.pack_onto_huge_pages(bdot=True)`), which every step multiplies (the torch
    backend's `pack_cpu_weights(bdot=True)`, the same bits); a tied embedding stays the float32 matrix, as the
    torch backend's does."""
    from cpu_kernels.layout import QX_KINDS
    from cpu_kernels.jax_ops import pack_onto_huge_pages

    lp = params.layers

    def as_rows(n):  # (the weight, its [L, N, K] shape: `_as_out_in`'s reshape, traced, not run)
        w = getattr(lp, n)
        return w, jax.eval_shape(functools.partial(_as_out_in, n, stacked=True), w).shape

    groups = {group: [as_rows(n) for n in names] for group, names in PANEL_GROUPS.items()}
    for names in PANEL_GROUPS.values():
        for n in names:
            setattr(lp, n, None)
    tied = params.lm_head is None
    head = params.embed if tied else params.lm_head
    groups["head"] = [(head, (1, *head.shape))]
    params.lm_head = None
    if tied and not bdot:
        params.embed = None
    packed = pack_onto_huge_pages(groups, bdot=bdot, keep=("head",) if tied and bdot else ())
    if bdot:
        kind = QX_KINDS["BDOT"]
        panels = CpuPanels(**dict.fromkeys(packed), **{f"{g}_qx": a for g, a in packed.items()},
                           qx_kinds=(kind,) * len(QX_LINEARS), head_qx_kind=kind)  # (no float32 panels)
    else:
        panels = CpuPanels(**packed)
    return ModelParams(embed=params.embed, layers=lp, final_norm=params.final_norm, panels=panels)


def kv_cache_shape(arch: ArchConfig, num_blocks: int, block_size: int, *, kv_heads: int,
                   head_dim: int) -> tuple[int, int, int, int]:
    """All layers in one array: [L * num_blocks, block_size, 2 * kv_heads, head_dim] (as stored: the Pallas
    path on TPU pads heads and head_dim, `jaxengine.platform.pallas_cache_heads`)."""
    return (arch.num_hidden_layers * num_blocks, block_size, 2 * kv_heads, head_dim)


__all__ = [
    "CpuPanels",
    "LayerParams",
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
    "pack_cpu_panels",
    "panel_outputs",
]
