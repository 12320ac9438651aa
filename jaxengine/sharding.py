"""Tensor parallelism: the mesh and the one place where logical axes meet mesh axes.

The model code never names a mesh axis. Params carry logical axes
(`model.abstract_params`); `ShardingRules` maps them to ('data', 'model'):
attention heads, MLP columns and the vocabulary on 'model', everything else
replicated. An axis whose size does not divide by the mesh axis is replicated
instead (so any TP size runs, just with less sharding). Heads are sharded only
when the *kv* heads divide: q and kv heads then split along the same groups,
the KV cache splits on its interleaved ``2 * Hkv`` axis (each head's K/V pair
stays on one device) and attention runs per device without a collective.
With more devices than kv heads (Llama-3.1-70B's 8 on 16 chips), each kv head
is repeated so that there are as many as devices (`kv_head_repeats`, as vLLM
does): q heads stay sharded and every device stores the one kv head its q
heads read, instead of every device holding all attention weights.

A sparse layer's experts split like the dense MLP by default: each expert's
columns (Ie) over 'model'. With `--enable-expert-parallel` whole experts split
instead (E / N per device; vLLM's EP size is TP x DP, here the 'model' axis:
each data-parallel core is an engine of its own). Either way the routed
experts run under shard_map (`shard_experts`; GSPMD does not partition the
grouped matmul well): every device routes every token, computes its experts'
or columns' share and a psum adds them up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from enginecore.arch import ArchConfig
from enginecore.config import ConfigError
from jaxengine.model import ParamSpec, is_spec

MESH_AXES = ("data", "model")


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, devices=None) -> Mesh:
    """A ('data', 'model') mesh over the first dp * tp devices."""
    devices = list(devices if devices is not None else jax.devices())
    need = tensor_parallel_size * data_parallel_size
    if need > len(devices):
        raise ValueError(
            f"--tensor-parallel-size {tensor_parallel_size} x --data-parallel-size {data_parallel_size} needs "
            f"{need} devices; only {len(devices)} {devices[0].platform} device(s) are visible"
        )
    grid = np.array(devices[:need], dtype=object).reshape(data_parallel_size, tensor_parallel_size)
    return Mesh(grid, MESH_AXES)


def kv_head_repeats(arch: ArchConfig, tensor_parallel_size: int) -> int:
    """How many copies of each kv head shard the heads over `tensor_parallel_size` devices (1: none needed or
    possible: the q heads and the device count must divide evenly)."""
    hq, hkv, tp = arch.num_attention_heads, arch.num_key_value_heads, tensor_parallel_size
    if tp > hkv and tp % hkv == 0 and hq % tp == 0:
        return tp // hkv
    return 1


def repeat_kv_heads(arch: ArchConfig, repeats: int) -> ArchConfig:
    """The architecture as the devices run it: `repeats` copies of each kv head (the same model: q head i reads
    kv head i // (Hq / Hkv) either way)."""
    if repeats == 1:
        return arch
    return dataclasses.replace(arch, num_key_value_heads=arch.num_key_value_heads * repeats)


@dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axis (or None: replicated)."""

    rules: tuple[tuple[str, str | None], ...]
    shard_heads: bool  # attention heads (and the KV cache) split over 'model'

    @classmethod
    def for_model(cls, arch: ArchConfig, mesh: Mesh, expert_parallel: bool = False) -> "ShardingRules":
        """`expert_parallel` (--enable-expert-parallel): whole experts over 'model', not their columns; the
        expert count must divide by the axis (a ConfigError otherwise)."""
        tp = mesh.shape["model"]
        heads = tp > 1 and arch.num_key_value_heads % tp == 0
        if expert_parallel and arch.moe is not None and arch.moe.num_experts % tp:
            raise ConfigError(f"--enable-expert-parallel splits the {arch.moe.num_experts} experts over "
                              f"--tensor-parallel-size {tp} devices, which does not divide them: choose a size "
                              "that divides the expert count, or drop --enable-expert-parallel (each expert's "
                              "columns split instead)")
        rules = {
            "layers": None,
            "vocab": "model",
            "embed": None,
            "q_heads": "model" if heads else None,
            "kv_heads": "model" if heads else None,
            "head_dim": None,
            "mlp": "model",
            "norm": None,
            "experts": "model" if expert_parallel else None,
            "expert_mlp": None if expert_parallel else "model",
        }
        return cls(tuple(rules.items()), heads)

    def mesh_axis(self, logical: str | None) -> str | None:
        if logical is None:
            return None
        d = dict(self.rules)
        if logical not in d:
            raise KeyError(f"no sharding rule for logical axis {logical!r}; known: {sorted(d)}")
        return d[logical]

    def spec(self, shape: tuple[int, ...], logical_axes: tuple[str | None, ...], mesh: Mesh) -> P:
        out = []
        for size, name in zip(shape, logical_axes):
            ax = self.mesh_axis(name)
            out.append(ax if ax is not None and size % mesh.shape[ax] == 0 else None)
        return P(*out)


def param_shardings(abstract, rules: ShardingRules, mesh: Mesh):
    """Pytree of NamedSharding matching the abstract params pytree."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, rules.spec(s.shape, s.logical_axes, mesh)), abstract, is_leaf=is_spec
    )


def kv_cache_sharding(rules: ShardingRules, mesh: Mesh) -> NamedSharding:
    """[NB, block_size, 2 * Hkv, D]: split on the interleaved kv axis when heads are sharded."""
    return NamedSharding(mesh, P(None, None, "model" if rules.shard_heads else None, None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def shard_attention(attention_fn, mesh: Mesh, rules: ShardingRules, opaque: bool = False):
    """Run attention per device on its heads (shard_map) when heads are sharded; as is otherwise.

    `opaque`: attention_fn is a custom call XLA cannot partition (a Mosaic kernel), so with
    replicated heads on a multi-device mesh it still runs under shard_map, every device on all
    heads (XLA would refuse: "Mosaic kernels cannot be automatically partitioned").
    """
    if not rules.shard_heads and not (opaque and mesh.size > 1):
        return attention_fn
    axis = "model" if rules.shard_heads else None
    heads = P(None, axis, None)
    cache = P(None, None, axis, None)
    rep = P()

    def fn(q, k, v, kv_cache, kv_lens, block_tables, cu_q_lens, distribution, **kw):
        inner = lambda *a: attention_fn(*a, **kw)  # noqa: E731
        return jax.shard_map(
            inner,
            mesh=mesh,
            in_specs=(heads, heads, heads, cache, rep, rep, rep, rep),
            out_specs=(heads, cache),
            check_vma=False,
        )(q, k, v, kv_cache, kv_lens, block_tables, cu_q_lens, distribution)

    return fn


def shard_experts(experts_fn, mesh: Mesh, rules: ShardingRules, arch: ArchConfig):
    """`jaxengine.moe.routed_experts` (h, ids, weights, gate, up, down) -> [T, H] run per device under shard_map:
    each device its experts (expert parallel: `first_expert` its first) or its columns of every expert, for every
    token, then a psum over 'model'. As is where neither splits (one device, or sizes that do not divide)."""
    m = arch.moe
    H, E, Ie = arch.hidden_size, m.num_experts, m.intermediate_size
    gate = rules.spec((E, Ie, H), ("experts", "expert_mlp", "embed"), mesh)
    if gate == P(None, None, None):
        return experts_fn
    by_expert = gate[0] is not None
    rep = P()

    def local(h, ids, weights, g, u, d):
        first = jax.lax.axis_index("model") * g.shape[0] if by_expert else 0
        return jax.lax.psum(experts_fn(h, ids, weights, g, u, d, first_expert=first), "model")

    def fn(h, ids, weights, g, u, d):
        return jax.shard_map(local, mesh=mesh, in_specs=(rep, rep, rep, gate, gate, gate), out_specs=rep,
                             check_vma=False)(h, ids, weights, g, u, d)

    return fn


def describe(abstract, rules: ShardingRules, mesh: Mesh) -> dict[str, str]:
    """Leaf path -> partition spec string (for logs and tests)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_spec)
    return {
        jax.tree_util.keystr(path): str(rules.spec(s.shape, s.logical_axes, mesh))
        for path, s in flat
        if isinstance(s, ParamSpec)
    }
