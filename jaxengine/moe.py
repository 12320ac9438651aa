"""A sparse layer's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): the router, the routed experts, the shared expert.

`moe_mlp(h, lp, moe)` is the whole block over a layer's slice of the params
(`model.LayerParams`' router / experts_* / shared_* fields), in Hugging Face's
order: probs = softmax(float32 router logits) over every expert, the top_k
kept (renormalised when `norm_topk_prob`), cast to the activations' dtype;
out = sum_k w_k * down_e(silu(gate_e h) * up_e h), plus Qwen2-MoE's shared
expert scaled by sigmoid(h . shared_expert_gate^T).

The routed experts (`routed_experts`) are computed one of four ways, all
with static shapes (new routing never recompiles):

- "ragged": the T*k (token, expert) rows sorted by expert, one grouped matmul
  (`jax.lax.ragged_dot_general`) with the group sizes. Native on TPU (and
  GPU); XLA:CPU lowers it as every row through every group (masked), G times
  the dense method's work.
- "gather": each row multiplies its own expert's weights, gathered (w[ids]):
  reads only the routed experts, what a decode step of few tokens wants.
- "dense": every token through every expert, the outputs combined with the
  routing weights (zero off the top_k): reads each expert once, the most
  work, the fastest on XLA:CPU once most experts are routed to anyway.
- "sorted": the rows sorted by expert, then a loop over the experts and, in
  each, over chunks of C of its rows (a dynamic trip count: only the routed
  rows are multiplied, each expert's weights read once per chunk;
  `sorted_experts`). On XLA's dots 1.4-6x slower than the picked method on
  XLA:CPU (benchmarks/bench_jax_moe.py: an expert's weights reach its dot
  through a dynamic slice), so `pick_method` leaves it out there; on one CPU
  device in float32 the C kernels run it, each expert a panel linear
  (`jaxengine.cpu_wing`): the fastest there at every token count.

`pick_method` chooses by the static row count (a bucket's T). An expert-parallel
device holds experts [first_expert, first_expert + E_local) and computes those
rows only (`jaxengine.sharding.shard_experts` sums the devices' parts).
`moe_reference` is the plain per-expert loop the tests compare against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from enginecore.arch import MoEConfig

METHODS = ("ragged", "gather", "dense", "sorted")
# XLA:CPU: the gather method up to this many (token, expert) rows, every expert dense above it
# (benchmarks/bench_moe.py: equal at ~2 rows per expert)
CPU_GATHER_ROWS_PER_EXPERT = 1
SORTED_CHUNK_ROWS = 256  # the sorted method's rows per product (an expert's weights are read once per chunk)


def route(h, router, moe: MoEConfig):
    """h [T, H], router [E, H] -> (ids [T, k] int32, weights [T, k] in h's dtype)."""
    logits = jax.lax.dot_general(h, router, (((1,), (1,)), ((), ())))  # [T, E], as transformers: in h's dtype
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w, ids = jax.lax.top_k(probs, moe.top_k)
    if moe.norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), w.astype(h.dtype)


def pick_method(rows: int, num_experts: int, platform: str = "cpu") -> str:
    """The routed experts' method for `rows` = T * top_k (token, expert) rows of `num_experts` experts."""
    if platform != "cpu":
        return "ragged"
    return "gather" if rows <= CPU_GATHER_ROWS_PER_EXPERT * num_experts else "dense"


def local_experts(ids, weights, first_expert, num_local: int):
    """ids [T, k] as indices into this device's experts (clipped), and the weights with other devices' rows 0."""
    local = ids - first_expert
    mine = (local >= 0) & (local < num_local)
    return jnp.clip(local, 0, num_local - 1), jnp.where(mine, weights, jnp.zeros_like(weights)), mine


# XLA:CPU runs 2-D dots and batched dots whose operands lie as stored; einsums that contract a weight on another
# axis copy the weight first (a whole layer's experts: ~70 ms at Mixtral-like widths, bench_moe.py). Hence the
# layouts: gate / up [E, Ie, H] (Hugging Face's [out, in]), down [E, Ie, H] ([in, out]: every expert's down in one
# 2-D dot [T, E * Ie] . [E * Ie, H], 4x faster than a batched dot per expert at 64 tokens of 64 experts).


def _gather(h, ids, weights, gate, up, down, act):
    T, k = ids.shape
    flat = ids.reshape(-1)  # [T * k], token-major
    rows = jnp.repeat(h, k, axis=0)  # [T * k, H]
    dg = jax.lax.dot_general
    mv = lambda w, x: dg(w, x, (((2,), (1,)), ((0,), (0,))))  # noqa: E731  w [M, N, K] . x [M, K] -> [M, N]
    a = act(mv(gate[flat], rows), mv(up[flat], rows))  # [T * k, Ie]: the routed experts' weights only
    o = dg(a, down[flat], (((1,), (1,)), ((0,), (0,))))  # [T * k, H]
    return jnp.sum((o * weights.reshape(-1, 1)).reshape(T, k, -1), axis=1)


def _dense(h, ids, weights, gate, up, down, act):
    T = h.shape[0]
    E, Ie, H = gate.shape
    combine = jnp.sum(jnp.where(ids[..., None] == jnp.arange(E), weights[..., None], 0), axis=1)  # [T, E]
    mm = functools.partial(jax.lax.dot_general, dimension_numbers=(((1,), (1,)), ((), ())))
    g = mm(h, gate.reshape(E * Ie, H))  # [T, E * Ie]: every expert at once
    a = act(g, mm(h, up.reshape(E * Ie, H))).reshape(T, E, Ie) * combine[..., None].astype(h.dtype)
    return jax.lax.dot_general(a.reshape(T, E * Ie), down.reshape(E * Ie, H), (((1,), (0,)), ((), ())))


def sort_by_expert(local, mine, num_experts: int):
    """The T * k (token, expert) rows sorted by local expert, other devices' rows last (in no group): (order [T * k],
    row j's sorted place is where order == j; counts [E] int32, the rows of each expert)."""
    flat = jnp.where(mine, local, num_experts).reshape(-1)
    order = jnp.argsort(flat, stable=True)
    counts = jnp.sum(flat[:, None] == jnp.arange(num_experts, dtype=flat.dtype), axis=0, dtype=jnp.int32)
    return order, counts


def _ragged(h, ids, weights, mine, gate, up, down, act):
    k = ids.shape[1]
    order, sizes = sort_by_expert(ids, mine, gate.shape[0])
    rows = h[order // k]  # [T * k, H] grouped by expert
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                             lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))
    grouped = functools.partial(jax.lax.ragged_dot_general, group_sizes=sizes, ragged_dot_dimension_numbers=dims)
    a = act(grouped(rows, gate), grouped(rows, up))  # [T * k, Ie]
    o = jax.lax.ragged_dot(a, down, sizes)  # [T * k, H] (down [E, Ie, H] is ragged_dot's own layout)
    # rows past the groups (other devices' experts) are not defined on every platform: zeroed with their weight
    w = weights.reshape(-1)[order]
    o = jnp.where((w != 0)[:, None], o * w[:, None], 0)
    return jnp.zeros_like(h).at[order // k].add(o)


def sorted_experts(h, ids, weights, num_experts: int, expert_mlp, *, first_expert=0,
                   chunk_rows: int = SORTED_CHUNK_ROWS):
    """The sorted method: sum_k weights[t, k] * expert_{ids[t, k]}(h[t]) over experts [first_expert,
    first_expert + num_experts) -> [T, H], computing only the routed rows.

    expert_mlp(e, x [C, H], live) -> [C, H]: local expert e (an int32 scalar) over x's first `live` rows (the
    other rows' outputs are ignored). The T * k rows sorted by expert; per expert a loop over chunks of C rows of
    its own (as many as it has rows: none for an expert no token chose). Each chunk's outputs are written at its
    rows' place, its rows past `live` zeroed: they are the next experts' rows, which those write later (the
    experts run in order), or the padding / other devices' rows, which stay zero."""
    T, k = ids.shape
    H = h.shape[1]
    E = num_experts
    local, weights, mine = local_experts(ids, weights, first_expert, E)
    order, counts = sort_by_expert(local, mine, E)
    starts = jnp.cumsum(counts) - counts
    C = min(T, chunk_rows)  # (an expert has at most T rows: a token's top_k are distinct)
    rows = jnp.concatenate([h[order // k], jnp.zeros((C, H), h.dtype)])  # [T * k + C, H]: a chunk never clamps

    def expert(e, out):
        def chunk(i, out):
            s = starts[e] + i * C
            live = jnp.minimum(C, counts[e] - i * C)
            o = expert_mlp(e, jax.lax.dynamic_slice_in_dim(rows, s, C), live)
            o = jnp.where((jnp.arange(C) < live)[:, None], o.astype(h.dtype), 0)
            return jax.lax.dynamic_update_slice_in_dim(out, o, s, 0)

        return jax.lax.fori_loop(0, (counts[e] + C - 1) // C, chunk, out)

    out = jax.lax.fori_loop(0, E, expert, jnp.zeros_like(rows))
    back = jnp.zeros_like(order).at[order].set(jnp.arange(T * k, dtype=order.dtype))  # row j's sorted place
    return jnp.sum((out[back] * weights.reshape(-1, 1)).reshape(T, k, H), axis=1)


def _xla_expert_mlp(gate, up, down, act):
    def mlp(e, x, live):
        mm = functools.partial(jax.lax.dot_general, dimension_numbers=(((1,), (1,)), ((), ())))
        a = act(mm(x, gate[e]), mm(x, up[e]))  # (gate[e]: a dynamic slice of the layer's experts)
        return jax.lax.dot_general(a, down[e], (((1,), (0,)), ((), ())))

    return mlp


def routed_experts(h, ids, weights, gate, up, down, *, first_expert=0, method: str | None = None,
                   platform: str = "cpu", act=None):
    """sum_k weights[t, k] * expert_{ids[t, k]}(h[t]) over this device's experts -> [T, H].

    h [T, H]; ids, weights [T, k]; gate, up [E_local, Ie, H] ([out, in]); down [E_local, Ie, H] ([in, out]);
    first_expert: the global index of gate[0] (an int32 scalar under shard_map); rows routed elsewhere add 0.
    method: one of METHODS, None: `pick_method`'s. act(gate, up) -> the gated activation (SiLU by default).
    """
    act = act or (lambda g, u: jax.nn.silu(g) * u)
    E = gate.shape[0]
    method = method or pick_method(ids.size, E, platform)
    if method not in METHODS:
        raise ValueError(f"MoE method must be one of {', '.join(METHODS)}; got {method!r}")
    if method == "sorted":
        return sorted_experts(h, ids, weights, E, _xla_expert_mlp(gate, up, down, act), first_expert=first_expert)
    local, weights, mine = local_experts(ids, weights, first_expert, E)
    if method == "ragged":
        return _ragged(h, local, weights, mine, gate, up, down, act)
    return (_gather if method == "gather" else _dense)(h, local, weights, gate, up, down, act)


def shared_expert(h, lp):
    """Qwen2-MoE's shared expert, gated by sigmoid(h . shared_expert_gate^T); None where the layer has none."""
    if lp.shared_gate_proj is None:
        return None
    dims = (((1,), (1,)), ((), ()))
    mm = functools.partial(jax.lax.dot_general, dimension_numbers=dims)
    out = mm(jax.nn.silu(mm(h, lp.shared_gate_proj)) * mm(h, lp.shared_up_proj), lp.shared_down_proj)
    if lp.shared_expert_gate is not None:
        out = jax.nn.sigmoid(mm(h, lp.shared_expert_gate)) * out
    return out


def moe_mlp(h, lp, moe: MoEConfig, experts=routed_experts):
    """A sparse layer's MLP: h [T, H] (after the MLP norm), lp the layer's params -> [T, H].

    experts(h, ids, weights, gate, up, down) -> [T, H]: `routed_experts` (one device), or its shard_map'd form.
    """
    ids, w = route(h, lp.router, moe)
    out = experts(h, ids, w, lp.experts_gate, lp.experts_up, lp.experts_down)
    shared = shared_expert(h, lp)
    return out if shared is None else out + shared


def moe_reference(h, lp, moe: MoEConfig):
    """The plain form for tests: every expert over every token, masked by the routing, one expert at a time."""
    ids, w = route(h, lp.router, moe)
    out = jnp.zeros(h.shape, jnp.float32)
    for e in range(moe.num_experts):
        g = h @ lp.experts_gate[e].T
        y = (jax.nn.silu(g) * (h @ lp.experts_up[e].T)) @ lp.experts_down[e]
        scale = jnp.sum(jnp.where(ids == e, w, 0), axis=-1)
        out = out + scale[:, None].astype(jnp.float32) * y.astype(jnp.float32)
    shared = shared_expert(h, lp)
    out = out.astype(h.dtype)
    return out if shared is None else out + shared


__all__ = ["METHODS", "moe_mlp", "moe_reference", "pick_method", "route", "routed_experts", "shared_expert",
           "sort_by_expert", "sorted_experts", "local_experts"]
