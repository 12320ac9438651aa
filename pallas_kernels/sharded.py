"""Tensor parallelism for ragged paged attention: kv heads split over a mesh axis.

Attention is independent per kv head, so each device runs the single-device
kernel on its slice of heads: q on ``Hq``, k/v on ``Hkv``, the cache on its
interleaved ``2 * Hkv`` axis (a contiguous slice keeps each head's K/V pair
together), metadata replicated. No collective is needed; the output stays
sharded on heads, ready for a row-parallel o_proj.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from pallas_kernels.ragged_paged_attention import ragged_paged_attention


def sharded_ragged_paged_attention(
    mesh: Mesh,
    q,             # [T, Hq, D]                    sharded on Hq
    k,             # [T, Hkv, D]                   sharded on Hkv
    v,             # [T, Hkv, D]                   sharded on Hkv
    kv_cache,      # [NB, block_size, 2 * Hkv, D]  sharded on axis 2
    kv_lens,       # [R] int32                     replicated
    block_tables,  # [R * blocks_per_seq] int32    replicated
    cu_q_lens,     # [R + 1] int32                 replicated
    distribution,  # [3] int32                     replicated
    *,
    axis_name: str = "model",
    **kernel_kwargs,
):
    """``ragged_paged_attention`` under ``jax.shard_map`` with kv heads on ``axis_name``.

    Returns ``(out [T, Hq, D] sharded on Hq, kv_cache sharded on axis 2)``.
    ``kernel_kwargs`` go to the kernel (``sm_scale``, chunk and q-block sizes, ``interpret``...).
    """
    n = mesh.shape[axis_name]
    num_kv_heads = k.shape[1]
    if num_kv_heads % n:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} is not divisible by mesh axis {axis_name!r} of size {n}; "
            "replicate kv heads before sharding")
    heads = P(None, axis_name, None)
    cache = P(None, None, axis_name, None)
    rep = P()
    specs = (heads, heads, heads, cache, rep, rep, rep, rep)
    args = (q, k, v, kv_cache, kv_lens, block_tables, cu_q_lens, distribution)
    if AxisType.Explicit in mesh.axis_types:
        # Explicit meshes make shard_map check, not convert, input shardings.
        args = tuple(jax.reshard(x, NamedSharding(mesh, spec)) for x, spec in zip(args, specs))
    fn = jax.shard_map(
        functools.partial(ragged_paged_attention, **kernel_kwargs),
        mesh=mesh,
        in_specs=specs,
        out_specs=(heads, cache),
        check_vma=False,
    )
    return fn(*args)
