"""The routed experts on a TPU: the Pallas grouped matmul (megablox `gmm`) over Hugging Face's [out, in] experts.

Why not `jax.lax.ragged_dot` there: libtpu does lower it to a native Mosaic
grouped matmul (a `ragged-dot-none` kernel over whole [K, N] expert blocks,
its grid only the tiles of non-empty groups), but that kernel takes the
experts as [E, K, N] with N minor. gate and up are stored as the checkpoints
give them, [E, out, in] (no transpose at load time), so XLA copies every
expert of the layer into [E, in, out] on every step: for Qwen3-30B-A3B's
128 x 768 x 2048 two 384 MiB temporaries and about 1.6 GB of extra HBM traffic
a layer, 21x what a one-token decode step's 8 experts weigh (down, stored
[E, Ie, H], is ragged_dot's layout already). Where a per-device N is not a
multiple of 128 lanes the chip's own layout of that array puts K minor, and
any kernel copies it. megablox's `gmm` reads [E, N, K] blocks as they are
(`transpose_rhs`; down is [E, K, N]) and skips the empty groups' tiles, so a
decode step reads only the experts its tokens reached; rows routed to another
device's experts fall into one extra group it zeroes.
`benchmarks/bench_tpu_aot.py --moe-block` compiles both and prints the numbers.

`gmm_experts` has `jaxengine.moe.routed_experts`' contract, so the runner hands
it to the model on platform tpu; `interpret` runs the kernel in Pallas'
interpreter (the tests, on a CPU).

Inside the model's scan over layers the experts come in as the layer's slice
of the stacked [Ls, E, N, K] params, and XLA materializes that slice for the
custom call: a copy of every local expert of the layer on every step (for
Qwen3-30B-A3B on 4 chips 3 x 96 MiB a layer, about 3x the bytes a 16-token
decode step's reached experts weigh). Given the whole stack and the `layer`
index instead, `gmm_experts` multiplies it as [Ls E, N, K] (a bitcast) with
the other layers' groups empty, which the kernel never visits: no copy.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp

from jaxengine.moe import local_experts, sort_by_expert

# megablox's package re-exports `gmm` (the custom_vjp function) over its module's name
_megablox = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

# a weight tile of at most this many elements (bf16: 4 MiB, double-buffered 8 MiB): whole experts where they
# fit, which a decode step wants (few grid steps, long DMAs), within v5e's 16 MiB of default scoped VMEM
MAX_WEIGHT_TILE = 2 << 20
ROW_ALIGN = 16  # bf16 rows per sublane tile


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def gmm_tiling(m: int, k: int, n: int) -> tuple[int, int, int]:
    """(tm, tk, tn) for `m` rows (a multiple of tm) of [m, k] @ [k, n] blocks: up to 128 rows a tile, the whole
    contraction and as many output columns as MAX_WEIGHT_TILE allows, halving K, then N, beyond it (K and N
    stay multiples of 128 or whole, as Mosaic's blocks must)."""
    tm = min(128, m)
    tk, tn = k, n
    while tk * tn > MAX_WEIGHT_TILE and tk % 256 == 0 and tk > 512:
        tk //= 2
    while tk * tn > MAX_WEIGHT_TILE and tn % 256 == 0:
        tn //= 2
    return tm, tk, tn


def gmm_experts(h, ids, weights, gate, up, down, *, first_expert=0, layer=None, act=None, interpret=False, **_):
    """sum_k weights[t, k] * expert_{ids[t, k]}(h[t]) over this device's experts -> [T, H].

    h [T, H]; ids, weights [T, k]; gate, up [E_local, Ie, H] ([out, in]); down [E_local, Ie, H] ([in, out], as
    `jaxengine.moe` stores it), or all sparse
    layers' stacks [Ls, E_local, ...] with `layer` (an int32 scalar) the one to multiply; first_expert: the
    global index of gate[0] (an int32 scalar under shard_map): rows routed to other devices add 0.
    `interpret`: False, True or a `pltpu.InterpretParams` (Pallas' interpreter, any platform).
    """
    act = act or (lambda g, u: jax.nn.silu(g) * u)
    T, k = ids.shape
    stacks = 1
    if gate.ndim == 4:  # [Ls, E, N, K] -> [Ls E, N, K], this layer's groups at layer * E
        stacks = gate.shape[0]
        gate, up, down = (w.reshape(-1, *w.shape[2:]) for w in (gate, up, down))
    E, Ie, H = gate.shape[0] // stacks, gate.shape[1], gate.shape[2]
    local, weights, mine = local_experts(ids, weights, first_expert, E)
    order, counts = sort_by_expert(local, mine, E)  # other devices' rows last
    m = _round_up(T * k, ROW_ALIGN)
    m = _round_up(m, min(128, m))
    src = order // k
    rows = h[jnp.pad(src, (0, m - T * k))]  # [m, H]; the padded rows fall in group E
    # E + 1 groups over E experts: megablox computes the first E and zeroes the rows of the last (other devices'
    # rows and the padding)
    sizes = jnp.concatenate([counts, (m - jnp.sum(counts))[None]])
    if stacks > 1:
        full = jnp.zeros((stacks * E + 1,), jnp.int32).at[stacks * E].set(sizes[E])
        sizes = jax.lax.dynamic_update_slice(full, sizes[:E], (layer * E,))
    zero = jnp.zeros((), jnp.int32)

    def mm(x, w, transposed):  # x [m, K] . per group w [E, N, K]^T (transposed) or w [E, K, N] -> [m, N]
        kk, n = (w.shape[2], w.shape[1]) if transposed else (w.shape[1], w.shape[2])
        return _megablox.gmm(x, w, sizes, x.dtype, gmm_tiling(m, kk, n), group_offset=zero,
                             transpose_rhs=transposed, interpret=interpret)

    a = act(mm(rows, gate, True), mm(rows, up, True))  # [m, Ie]
    o = mm(a, down, False)[: T * k]  # [T k, H]
    w = weights.reshape(-1)[order]  # (0 for other devices' rows: local_experts)
    o = jnp.where((w != 0)[:, None], o * w[:, None], 0)
    return jnp.zeros_like(h).at[src].add(o)


def tpu_experts(interpret=False):
    """`gmm_experts` with `interpret` bound: the experts function the runner passes for platform tpu."""
    return functools.partial(gmm_experts, interpret=interpret)


__all__ = ["MAX_WEIGHT_TILE", "gmm_experts", "gmm_tiling", "tpu_experts"]
