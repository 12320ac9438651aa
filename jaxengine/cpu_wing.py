"""The CPU kernels' side of the jax model: the weight layout they read, and the `attention_fn` and `ModelKernels`
the runner injects.

On one CPU device in float32 (`runner.JaxModelRunner` decides) the linears and the LM head are packed at load
(`pack_cpu_panels`: `CpuPanels`; `loader.attach_cpu_qx` adds the weights as stored) and `model_kernels` gives
`model.forward` the `cpu_kernels.jax_ops` custom calls in place of XLA's ops: the linears on the panels,
RMSNorm, RoPE and SiLU as the torch backend computes them (so the two backends' logits are the same bits), the
LM head's argmax for greedy rows, and by default every layer of a step in one call (`jax_ops.layers`: the same
kernels in the same order, without a call per kernel). `attention` is the attention over the paged cache in place
(any model on one CPU device, 16-bit ones included). A model with a feature these kernels do not implement
(`uncovered`) runs on XLA's ops instead, which the runner logs once.

A Mixture-of-Experts model runs the same kernels but for its sparse layers' routing (XLA's ops): each expert is
packed as one more panel linear (`CpuPanels.experts_gate_up` / `experts_down`), which the sorted method of
`jaxengine.moe.sorted_experts` multiplies by that expert's routed rows only (`_moe`); no `layers` call (its
layers are the dense MLP's).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from cpu_kernels import jax_ops
from enginecore.arch import ArchConfig
from jaxengine.attention import ragged_paged_attention_xla, token_blocks, token_rows
from jaxengine.model import LINEAR_GROUPS, LayerParams, ModelKernels, ModelParams, RaggedMetadata, as_out_in

QX_LINEARS = ("qkv", "o", "gate_up", "down")  # CpuPanels.qx_kinds' order

# ArchConfig's fields whose every value the kernels implement (biases, q/k norms, sliding windows, rope scaling
# through the tables). A field added to it for a new feature (a soft cap, sinks, MoE) is absent until the kernels
# learn it: a model that sets one off its default runs on XLA's ops.
COVERED_FIELDS = frozenset({
    "architecture", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps",
    "tie_word_embeddings", "max_position_embeddings", "attention_bias", "qk_norm", "sliding_window", "hidden_act",
    "torch_dtype", "bos_token_id", "eos_token_id",
})
MAX_HEAD_DIM = 1024  # the rope and layers kernels' limit (xla_ffi.cc)


def uncovered(arch: ArchConfig) -> list[str]:
    """What of `arch` the CPU kernels do not implement (empty: they run the whole model)."""
    gaps = [f"{f.name}={getattr(arch, f.name)!r}" for f in dataclasses.fields(arch)
            if f.name not in COVERED_FIELDS and f.name != "moe" and getattr(arch, f.name) != f.default]
    if arch.moe is not None and arch.moe.intermediate_size % 2:  # (silu_mul splits its input in halves)
        gaps.append(f"Mixture-of-Experts experts of odd width {arch.moe.intermediate_size}")
    if arch.head_dim % 2 or arch.head_dim > MAX_HEAD_DIM:
        gaps.append(f"head_dim {arch.head_dim} (the kernels take even ones up to {MAX_HEAD_DIM})")
    return gaps


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
    # a MoE model's experts, each a panel linear: index sparse layer * E + expert (None: a dense model)
    experts_gate_up: jax.Array | None = None  # [Ls * E, 2 Ie / 16, H, 16]
    experts_down: jax.Array | None = None  # [Ls * E, H / 16, Ie, 16]

    def qx_for(self, group: str, rows: int) -> tuple[jax.Array | None, int]:
        """(group's qx panels, their kind) for a step of `rows` tokens, or (None, -1) where the float32 panels
        run it."""
        kind = self.head_qx_kind if group == "head" else self.qx_kinds[QX_LINEARS.index(group)]
        qx = getattr(self, f"{group}_qx")
        return (qx, kind) if qx is not None and kind >= 0 and rows <= jax_ops.qx_max_rows()[kind] else (None, -1)


def linear_outputs(arch: ArchConfig) -> dict[str, int]:
    """Each linear's output width."""
    Hq, Hkv, D, I, H = (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, arch.intermediate_size,
                        arch.hidden_size)
    return {"q_proj": Hq * D, "k_proj": Hkv * D, "v_proj": Hkv * D, "o_proj": H, "gate_proj": I, "up_proj": I,
            "down_proj": H}


def panel_outputs(arch: ArchConfig) -> dict[str, int]:
    """Each `CpuPanels` linear's output width."""
    widths = linear_outputs(arch)
    return {**{g: sum(widths[n] for n in names) for g, names in LINEAR_GROUPS.items()}, "head": arch.vocab_size}


def pack_cpu_panels(params: ModelParams, bdot: bool = False) -> ModelParams:
    """The float32 params of one CPU device with every linear and the LM head packed for
    `cpu_kernels.panel_linear` (`CpuPanels`): the same model, in the torch backend's CPU weight layout, all in
    one buffer on huge pages where the OS gives them (a step streams them all). Consumes `params`: each
    weight is dropped from it once packed (the extra memory is one group's weights, not the model's). A tied
    embedding is then looked up in the LM head's panels (`model_kernels`' embed).

    `bdot` (`--dtype bfloat16` where `cpu_kernels.layout.bdot_runs`): every linear and the LM head in QX_BDOT's
    bfloat16 panels only (`cpu_kernels.pack_onto_huge_pages(bdot=True)`), which every step multiplies (the torch
    backend's `apply_cpu_kernels(bdot=True)`, the same bits); a tied embedding stays the float32 matrix, as the
    torch backend's does."""
    from cpu_kernels.layout import QX_KINDS

    lp = params.layers

    def as_rows(n):  # (the weight, its [L, N, K] shape: `as_out_in`'s reshape, traced, not run)
        w = getattr(lp, n)
        return w, jax.eval_shape(functools.partial(as_out_in, n, stacked=True), w).shape

    # (a MoE model without dense layers has no gate_up / down)
    groups = {group: [as_rows(n) for n in names] for group, names in LINEAR_GROUPS.items()
              if all(getattr(lp, n) is not None for n in names)}
    for names in LINEAR_GROUPS.values():
        for n in names:
            setattr(lp, n, None)
    if lp.experts_gate is not None:  # each expert one panel linear, [Ls * E, N, K]
        if bdot:
            raise ValueError("bfloat16 panels (QX_BDOT) do not take Mixture-of-Experts models")
        Ls, E, Ie, H = lp.experts_gate.shape
        groups["experts_gate_up"] = [(lp.experts_gate, (Ls * E, Ie, H)), (lp.experts_up, (Ls * E, Ie, H))]
        groups["experts_down"] = [(jnp.swapaxes(lp.experts_down, 2, 3), (Ls * E, H, Ie))]  # ([in, out] as stored)
        lp.experts_gate = lp.experts_up = lp.experts_down = None
    tied = params.lm_head is None
    head = params.embed if tied else params.lm_head
    groups["head"] = [(head, (1, *head.shape))]
    params.lm_head = None
    if tied and not bdot:
        params.embed = None
    packed = jax_ops.pack_onto_huge_pages(groups, bdot=bdot, keep=("head",) if tied and bdot else ())
    if bdot:
        kind = QX_KINDS["BDOT"]
        panels = CpuPanels(**dict.fromkeys(packed), **{f"{g}_qx": a for g, a in packed.items()},
                           qx_kinds=(kind,) * len(QX_LINEARS), head_qx_kind=kind)  # (no float32 panels)
    else:
        panels = CpuPanels(**{**dict.fromkeys(("qkv", "o", "gate_up", "down", "head")), **packed})
    return ModelParams(embed=params.embed, layers=lp, final_norm=params.final_norm, panels=panels)


# ---- the kernels `model.forward` is handed -------------------------------------------------------------------


def attention(q, k, v, kv_cache, kv_lens, block_tables, cu_q_lens, distribution, *, sm_scale: float,
              sliding_window: int | None = None, soft_cap: float | None = None):
    """`attention.ragged_paged_attention_xla`'s contract on the C kernels: the new K/V written by
    `jax_ops.kv_write` (in place: XLA:CPU has no bfloat16 / float16 scatter and wraps one in conversions of the
    whole cache to float32 and back), the decode rows by `jax_ops.decode_attention`, the prefill and mixed rows by
    `jax_ops.prefill_attention` (the cache read in place, every query with the same arithmetic). Queries of 16
    bits (a 16-bit model's) are read exactly into float32, the output rounded back. A soft cap, or a query or
    cache dtype the kernels do not take, runs XLA's path."""
    if (soft_cap is not None or q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16)
            or kv_cache.dtype not in jax_ops.KV_DTYPES):
        return ragged_paged_attention_xla(q, k, v, kv_cache, kv_lens, block_tables, cu_q_lens, distribution,
                                          sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    T, Hq, D = q.shape
    R, block_size = kv_lens.shape[0], kv_cache.shape[1]
    table, req, pos, valid = token_rows(T, kv_lens, block_tables, cu_q_lens, distribution)
    slots = jnp.where(valid, token_blocks(table, req, pos, block_size) * block_size + pos % block_size, -1)
    kv_cache = jax_ops.kv_write(k, v, kv_cache, slots)
    # decode rows: request r's only query is token cu_q_lens[r]
    row_valid = jnp.arange(R, dtype=jnp.int32) < distribution[0]
    tok = jnp.clip(cu_q_lens[:R], 0, T - 1)
    q32 = q.astype(jnp.float32)
    dec = jax_ops.decode_attention(q32[tok], kv_cache, table, kv_lens, distribution[0], sm_scale=sm_scale,
                                   sliding_window=sliding_window)
    out = jnp.zeros((T, Hq, D), jnp.float32).at[jnp.where(row_valid, tok, T)].set(dec, mode="drop")
    out = jax_ops.prefill_attention(q32, kv_cache, table, kv_lens, cu_q_lens, distribution, out, sm_scale=sm_scale,
                                    sliding_window=sliding_window)
    return out.astype(q.dtype), kv_cache


def model_kernels(arch: ArchConfig, layers: bool = True) -> ModelKernels:
    """The `ModelKernels` of a model whose params went through `pack_cpu_panels` (`uncovered(arch)` empty):
    `layers`: every layer of a step in one call (`jax_ops.layers`; never a MoE model's), else a scan making a
    call per kernel."""
    sparse = arch.moe is not None
    return ModelKernels(
        linear=functools.partial(_linear, arch),
        head=functools.partial(_head, arch),
        head_argmax=functools.partial(_head, arch, argmax=True),
        embed=_embed,
        norm=jax_ops.rms_norm,
        rope_angles=_rope_angles,
        rope=jax_ops.rope,
        gated_act=_silu_mul,
        layers=functools.partial(_layers, arch) if layers and not sparse else None,
        **({"moe": functools.partial(_moe, arch)} if sparse else {}),
    )


def _stack_index(arch: ArchConfig, layer, sparse: bool):
    """Decoder layer `layer`'s index in its MLP's stack (the sparse layers' or the dense ones')."""
    moe = arch.moe
    if moe is None or all(moe.sparse_layers) or not any(moe.sparse_layers):
        return layer
    at = moe.sparse_index if sparse else moe.dense_index
    return jnp.asarray([at(l) for l in range(arch.num_hidden_layers)], jnp.int32)[layer]


def _moe(arch: ArchConfig, params: ModelParams, lp: LayerParams, layer, h, moe):
    """`ModelKernels.moe`: the sorted method (`jaxengine.moe.sorted_experts`) with each expert's linears on its
    panels, reading only that expert's weights and multiplying only its routed rows (the kernels' `live`)."""
    from jaxengine.moe import moe_mlp, sorted_experts

    p, E, Ie, H = params.panels, moe.num_experts, moe.intermediate_size, arch.hidden_size
    first = _stack_index(arch, layer, sparse=True) * E

    def expert_mlp(e, x, live):
        a = jax_ops.silu_mul(jax_ops.panel_linear(x, p.experts_gate_up, first + e, 2 * Ie, live))
        return jax_ops.panel_linear(a, p.experts_down, first + e, H, live)

    def experts(h, ids, w, *_):
        return sorted_experts(h.astype(jnp.float32), ids, w, E, expert_mlp).astype(h.dtype)

    return moe_mlp(h, lp, moe, experts=experts)


def cpu_linear(panels: CpuPanels, h, group: str, layer, arch: ArchConfig, argmax: bool = False, live=None):
    """h [T, K] . the CPU panels' `group` of `layer` (`cpu_kernels.panel_linear`), from its qx panels where
    the step has few enough rows (`qx_linear`, the same bits); `argmax`: each row's argmax of it instead;
    `live`: of h's first `live` rows only (the kernels' `live`; the qx panels are still chosen by h's rows,
    which `live` cannot change at trace time)."""
    n = panel_outputs(arch)[group]
    qx, kind = panels.qx_for(group, h.shape[0])
    if qx is not None:
        return (jax_ops.qx_argmax if argmax else jax_ops.qx_linear)(h, qx, layer, n, kind, live)
    return (jax_ops.panel_argmax if argmax else jax_ops.panel_linear)(h, getattr(panels, group), layer, n, live)


def _linear(arch: ArchConfig, params: ModelParams, lp: LayerParams, layer, h, group: str):
    """`ModelKernels.linear`: the group in one product on its panels, split into its linears' outputs."""
    if group in ("gate_up", "down"):  # (stacked over the dense layers)
        layer = _stack_index(arch, layer, sparse=False)
    out = cpu_linear(params.panels, h, group, layer, arch)
    names = LINEAR_GROUPS[group]
    if len(names) == 1:
        return (out,)
    widths = linear_outputs(arch)
    cuts = [sum(widths[n] for n in names[:i]) for i in range(1, len(names))]
    return tuple(jnp.split(out, cuts, axis=1))


def _head(arch: ArchConfig, params: ModelParams, h, live=None, argmax: bool = False):
    return cpu_linear(params.panels, h, "head", 0, arch, argmax=argmax, live=live)


def _embed(params: ModelParams, ids):
    """A tied embedding packed into the LM head's panels is looked up there."""
    if params.embed is None:
        return jax_ops.panel_rows(params.panels.head[0], ids)
    return params.embed[ids]


def _rope_angles(cos, sin):
    return jax_ops.rope_tables(cos.astype(jnp.float32), sin.astype(jnp.float32))


def _silu_mul(gate, up):
    # (the concatenation of `_linear`'s split halves: XLA folds it back into the product's output)
    return jax_ops.silu_mul(jnp.concatenate([gate, up], axis=1))


def _layers(arch: ArchConfig, params: ModelParams, x, cos, sin, kv_cache, md: RaggedMetadata, keep=None,
            all_rows=None):
    """`ModelKernels.layers`: the small per-layer parameters as `jax_ops.layers` takes them (q/k/v biases side by
    side, as the qkv panels' outputs lie; empty where absent)."""
    lp, p, L = params.layers, params.panels, arch.num_hidden_layers
    none = jnp.zeros((0,), jnp.float32)
    bias = none if lp.q_bias is None else jnp.concatenate(
        [b.reshape(L, -1) for b in (lp.q_bias, lp.k_bias, lp.v_bias)], axis=1)
    R = md.kv_lens.shape[0]
    present = [k for q, k in zip((p.qkv_qx, p.o_qx, p.gate_up_qx, p.down_qx), p.qx_kinds) if q is not None]
    rows = min((jax_ops.qx_max_rows()[k] for k in present), default=0)
    f32 = [none if w is None else w for w in (p.qkv, p.o, p.gate_up, p.down)]  # (None: QX_BDOT's take every step)
    return jax_ops.layers(x, lp.attn_norm, lp.mlp_norm, *f32, bias,
                          none if lp.q_norm is None else lp.q_norm, none if lp.k_norm is None else lp.k_norm, cos,
                          sin, kv_cache, md.block_tables.reshape(R, -1), md.kv_lens, md.cu_q_lens, md.distribution,
                          keep, all_rows,
                          (p.qkv_qx, p.o_qx, p.gate_up_qx, p.down_qx),  # (the call takes them for <= rows tokens)
                          num_heads=arch.num_attention_heads, eps=arch.rms_norm_eps, sm_scale=arch.sm_scale,
                          sliding_window=arch.sliding_window, qx_kinds=p.qx_kinds, qx_rows=rows)


__all__ = ["COVERED_FIELDS", "CpuPanels", "QX_LINEARS", "attention", "cpu_linear", "linear_outputs", "model_kernels",
           "pack_cpu_panels", "panel_outputs", "uncovered"]
