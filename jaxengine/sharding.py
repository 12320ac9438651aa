"""Tensor parallelism: the mesh and the one place where logical axes meet mesh axes.

The model code never names a mesh axis. Params carry logical axes
(`model.abstract_params`); `ShardingRules` maps them to ('data', 'model'):
attention heads, MLP columns and the vocabulary on 'model', everything else
replicated. An axis whose size does not divide by the mesh axis is replicated
instead (so any TP size runs, just with less sharding). Heads are sharded only
when the *kv* heads divide: q and kv heads then split along the same groups,
the KV cache splits on its interleaved ``2 * Hkv`` axis (each head's K/V pair
stays on one device) and attention runs per device without a collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from enginecore.arch import ArchConfig
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


@dataclass(frozen=True)
class ShardingRules:
    """Logical axis name -> mesh axis (or None: replicated)."""

    rules: tuple[tuple[str, str | None], ...]
    shard_heads: bool  # attention heads (and the KV cache) split over 'model'

    @classmethod
    def for_model(cls, arch: ArchConfig, mesh: Mesh) -> "ShardingRules":
        tp = mesh.shape["model"]
        heads = tp > 1 and arch.num_key_value_heads % tp == 0
        rules = {
            "layers": None,
            "vocab": "model",
            "embed": None,
            "q_heads": "model" if heads else None,
            "kv_heads": "model" if heads else None,
            "head_dim": None,
            "mlp": "model",
            "norm": None,
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


def describe(abstract, rules: ShardingRules, mesh: Mesh) -> dict[str, str]:
    """Leaf path -> partition spec string (for logs and tests)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=is_spec)
    return {
        jax.tree_util.keystr(path): str(rules.spec(s.shape, s.logical_axes, mesh))
        for path, s in flat
        if isinstance(s, ParamSpec)
    }
