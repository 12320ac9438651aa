"""Fill the abstract params from a ModelSource's lazy tensors, tensor by tensor, into their shards.

Each Hugging Face tensor is viewed in the param's head layout and each device's
slice of it is read, cast to the serving dtype on the host and placed
(``jax.make_array_from_callback`` with the param's NamedSharding): no full copy
of a sharded tensor is made on a device, and with a mesh over several processes
(hosts) each process reads only the slices its own devices hold (safetensors:
memory-mapped, so only those bytes; GGUF tensors are dequantized whole first).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from enginecore.arch import DENSE_MLP_PARAMS, MOE_PARAMS, ArchConfig, ModelLoadError, weight_spec
from enginecore.model_checks import expert_tensor_name
from enginecore.model_loader import ModelSource
from cpu_kernels.memory import huge_page_array
from jaxengine.cpu_wing import QX_LINEARS
from jaxengine.model import LayerParams, ModelParams, ParamSpec, abstract_params, is_spec

def param_path(hf_name: str) -> tuple | None:
    """HF tensor name -> ("embed",) / ("layers", i, field) from the shared weight table; None: ignored."""
    found = weight_spec(hf_name)
    if found is None:
        return None
    layer, spec = found
    return (spec.param,) if layer is None else ("layers", layer, spec.param)


def _get(tree: ModelParams, path: tuple):
    if path[0] == "layers":
        return getattr(tree.layers, path[2])
    return getattr(tree, path[0])


def _set(tree: ModelParams, path: tuple, value) -> None:
    if path[0] == "layers":
        setattr(tree.layers, path[2], value)
    else:
        setattr(tree, path[0], value)


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stacked, x, l):
    return jax.lax.dynamic_update_index_in_dim(stacked, x.astype(stacked.dtype), l, 0)


def _layer_sharding(sharding: NamedSharding) -> NamedSharding:
    """The sharding of one layer's slice of a stacked [L, ...] param."""
    return NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))


def stack_index(arch: ArchConfig, name: str, layer: int, param: str) -> int:
    """Where decoder layer `layer`'s `param` sits in its stack: the dense MLP's params stack the dense layers, the
    sparse MLP's the sparse ones (`model.LayerParams`), the rest every layer."""
    if layer >= arch.num_hidden_layers:
        raise ModelLoadError(f"{name}: layer {layer} but the config has {arch.num_hidden_layers} layers")
    dense, sparse = param in DENSE_MLP_PARAMS, param in MOE_PARAMS
    if not (dense or sparse):
        return layer
    if sparse != arch.is_sparse(layer):
        raise ModelLoadError(f"{name}: layer {layer} is {'sparse (MoE)' if arch.is_sparse(layer) else 'dense'} in "
                             "the config (num_experts / decoder_sparse_step / mlp_only_layers)")
    if arch.moe is None:
        return layer
    return arch.moe.sparse_index(layer) if sparse else arch.moe.dense_index(layer)


def load_params(
    source: ModelSource,
    arch: ArchConfig,
    dtype: str,
    shardings: ModelParams,  # pytree of NamedSharding matching abstract_params(arch, dtype)
    log=None,
    kv_repeats: int = 1,
) -> ModelParams:
    """Read every tensor's slices and place them; raises ModelLoadError naming a missing or misshaped tensor.

    `arch` is the architecture the devices run: with `kv_repeats` > 1 it has that many copies of each of the
    checkpoint's kv heads (`jaxengine.sharding.kv_head_repeats`), and K/V projections are repeated to match.

    Stacked per-layer params are allocated sharded on the device and filled one
    layer at a time (a donated dynamic-update-slice): the host holds one tensor's
    slices at a time and no device ever holds more than its own shards; with a mesh
    over several processes each reads only its own devices' slices (`_put`). On one CPU device,
    where the device's memory is the host's, a stacked param is filled in a numpy
    array instead and placed once complete, without a copy (`_host_array`): the
    same values, without the two small XLA programs (zeros, update-slice) each
    stacked shape compiled at load (~2 s of the embedded model's 3.4 s here).

    A sparse layer's experts come one tensor per expert (Hugging Face's) or all of them stacked (GGUF's,
    transformers 5's fused ones). One-expert tensors gather into their layer's [E, ...] slice (`_experts_reader`:
    a device's slice reads its experts' part of each), which then goes the way a stacked tensor goes (so on
    devices it lands sharded, experts or columns, as its param is); the host holds one device's slice of a
    layer's experts of a param at a time.
    """
    t0 = time.perf_counter()
    abstract = abstract_params(arch, dtype)
    out = abstract_params(arch, dtype)  # same structure; leaves replaced as they arrive
    filled: dict[tuple, set[int]] = {}
    gathering: dict[tuple, dict] = {}  # (field, index) -> {expert: its slice reader}
    for name, w in source.iter_lazy_weights():
        path = param_path(name)
        if path is None:
            continue
        found = weight_spec(name)
        expert = found[1].expert if found is not None else None
        repeats = kv_repeats if kv_repeats > 1 and name.endswith(_KV_PROJECTIONS) else 1
        if path == ("lm_head",) and arch.tie_word_embeddings:
            continue
        spec = _get(abstract, path)
        if spec is None:
            raise ModelLoadError(f"{name}: the config does not expect this tensor (check attention_bias / qk_norm / "
                                 "the MoE settings)")
        sharding = _get(shardings, path)
        if path[0] != "layers":
            _check_size(name, _repeated_shape(w.shape, repeats), spec.shape, spec)
            _set(out, path, _put(_reader(w, path[0], spec.shape, repeats), spec.shape, spec.dtype, sharding))
            filled[path] = {0}
            continue
        index = stack_index(arch, name, path[1], path[2])
        key = ("layers", path[2])
        if expert is not None and not 0 <= expert < spec.shape[1]:
            raise ModelLoadError(f"{name}: expert {expert} but the config has {spec.shape[1]} experts")
        one = spec.shape[2:] if expert is not None else spec.shape[1:]
        _check_size(name, _repeated_shape(w.shape, repeats), one, spec)
        read = _reader(w, path[2], one, repeats)
        if expert is not None:  # gathered into the layer's [E, ...] slice, which goes on once complete
            got = gathering.setdefault((path[2], index), {})
            got[expert] = read
            if len(got) < spec.shape[1]:
                continue
            read = _experts_reader(gathering.pop((path[2], index)))
        stacked = _get(out, path)
        if isinstance(stacked, ParamSpec):  # on one CPU device a host array, placed once complete (below)
            stacked = (_host_array(spec.shape, spec.dtype) if _host_memory(sharding) else
                       jax.jit(lambda: jnp.zeros(spec.shape, spec.dtype), out_shardings=sharding)())
        if isinstance(stacked, np.ndarray):
            stacked[index] = read(tuple(slice(None) for _ in spec.shape[1:]))  # cast to the param's dtype by numpy
        else:
            x = _put(read, spec.shape[1:], spec.dtype, _layer_sharding(sharding))
            stacked = _set_layer(stacked, x, jnp.int32(index))
        _set(out, path, stacked)
        filled.setdefault(key, set()).add(index)
    missing = [
        jax.tree_util.keystr(p)
        for p, leaf in jax.tree_util.tree_flatten_with_path(out, is_leaf=is_spec)[0]
        if isinstance(leaf, ParamSpec)
    ]
    for (field, index), got in sorted(gathering.items()):  # a layer's experts of a param, not all there
        layer = _stack_layers(arch, field)[index]
        gap = min(set(range(arch.moe.num_experts)) - got.keys())
        missing.insert(0, f"{expert_tensor_name(arch, layer, gap, field)} (expert {gap} of layer {layer})")
    for key, layers in filled.items():
        n = _get(abstract, ("layers", 0, key[1])).shape[0] if key[0] == "layers" else 1
        if key[0] == "layers" and len(layers) != n:
            gaps = sorted(_stack_layers(arch, key[1])[i] for i in set(range(n)) - layers)
            missing.append(f"{key[1]} of layer(s) {gaps[:5]}")
    if missing:
        raise ModelLoadError(
            f"{source.path}: missing weights for {', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else "")
        )
    for field, host in vars(out.layers).items():  # placed without a copy (`_host_array`)
        if isinstance(host, np.ndarray):
            path = ("layers", 0, field)
            _set(out, path, jax.device_put(host, _get(shardings, path)))
    if log:
        log("loaded %d tensors in %.2fs", sum(len(v) for v in filled.values()), time.perf_counter() - t0)
    return out


def _reader(w, param: str, shape: tuple, repeats: int = 1):
    """index -> that slice of tensor `w` in its param's layout `shape` (the file's reshaped to the param's head
    layout), reading only what the slice needs. K/V projections with `repeats` > 1 (`repeat_heads`) read the
    heads the slice's repeats come from; the experts' down projection, [..., H, Ie] in the file, is stored
    [..., Ie, H] (`model.LayerParams`), so its slice reads the transposed one."""
    if param == "experts_down":
        if tuple(w.shape[-2:]) != tuple(shape[-2:])[::-1]:
            raise ModelLoadError(f"{w.name}: shape {tuple(w.shape)} does not fit the expected "
                                 f"{(*shape[:-2], *shape[-2:][::-1])} ([..., hidden_size, moe_intermediate_size])")
        stored = (*shape[:-2], shape[-1], shape[-2])
        return lambda index: np.swapaxes(w.read((*index[:-2], index[-1], index[-2]), stored), -1, -2)
    if repeats == 1:
        return lambda index: w.read(index, shape)

    def read(index):  # shape [Hkv * r, D, ...]: repeated head h is the file's head h // r
        lo, hi, _ = index[0].indices(shape[0])
        first = lo // repeats
        src = w.read((slice(first, -(-hi // repeats)), *index[1:]), (shape[0] // repeats, *shape[1:]))
        return np.repeat(src, repeats, axis=0)[lo - first * repeats : hi - first * repeats]

    return read


def _experts_reader(reads: dict):
    """A layer's [E, ...] slice of an experts' param from each expert's reader: a slice reads its experts' part."""
    def read(index):
        return np.stack([reads[e](index[1:]) for e in range(len(reads))[index[0]]])

    return read


def _repeated_shape(shape: tuple, repeats: int) -> tuple:
    """A K/V projection's shape with its heads repeated (`repeat_heads`): [Hkv * D * r, ...]."""
    return (shape[0] * repeats, *shape[1:]) if repeats > 1 else tuple(shape)


def _stack_layers(arch: ArchConfig, param: str) -> list[int]:
    """The decoder layers a param's stack holds, in order."""
    layers = range(arch.num_hidden_layers)
    if param in MOE_PARAMS:
        return [l for l in layers if arch.is_sparse(l)]
    if param in DENSE_MLP_PARAMS:
        return [l for l in layers if not arch.is_sparse(l)]
    return list(layers)


_KV_PROJECTIONS = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_proj.bias",
                   "self_attn.v_proj.bias")


def repeat_heads(arr: np.ndarray, repeats: int, head_dim: int) -> np.ndarray:
    """A Hugging Face K/V projection [Hkv * D, ...] (or its bias) with each head repeated: [Hkv * r * D, ...]
    (whole: the reference `_reader`'s slices of repeated heads match)."""
    heads = arr.shape[0] // head_dim
    return np.repeat(arr.reshape(heads, head_dim, *arr.shape[1:]), repeats, axis=0).reshape(
        heads * repeats * head_dim, *arr.shape[1:])


def _host_memory(sharding) -> bool:
    """Whether a param with this sharding lives in the host's memory: one device, a CPU."""
    devices = sharding.device_set
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def _check_size(name: str, got: tuple, shape: tuple, spec: ParamSpec) -> None:
    if int(np.prod(got)) != int(np.prod(shape)):
        raise ModelLoadError(
            f"{name}: shape {tuple(got)} does not fit the expected {shape} (logical {spec.logical_axes})"
        )


def _put(read, shape: tuple, dtype, sharding) -> jax.Array:
    """A param of `shape` placed with `sharding` from `read(index)` (a slice of it): on one CPU device without
    a copy (`_host_array`); else each device's slice read by itself (`jax.make_array_from_callback`), so a
    process reads only the slices its own devices hold (a fully replicated param once)."""
    if _host_memory(sharding):
        host = _host_array(shape, dtype)
        host[...] = read(tuple(slice(None) for _ in shape))
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(
        shape, sharding, lambda index: np.ascontiguousarray(read(index).astype(dtype, copy=False)))


def _host_array(shape: tuple, dtype) -> np.ndarray:
    """An uninitialised array that a CPU device can take without a copy: jax aliases host memory aligned to
    64 bytes and copies anything else (numpy's large arrays are 16 bytes past a page). Whole 2 MiB pages of it
    on huge pages where the OS gives them, as the weights a step streams should be."""
    return huge_page_array(int(np.prod(shape)), dtype).reshape(shape)




# CpuPanels' linears and the (fused) linears a GGUF file's groups are assembled as
_QX_GROUPS = {g: f"{g}_proj" for g in QX_LINEARS}


def attach_cpu_qx(params: ModelParams, source: ModelSource, arch: ArchConfig) -> tuple[ModelParams, int]:
    """The float32 CPU panels (`cpu_wing.pack_cpu_panels`) plus the same weights as stored (`cpu_kernels.layout`), for
    decode steps of few rows: the torch backend's `attach_qx` for the jax one. A GGUF file's linears stored as
    one of `cpu_kernels.layout.GGUF_TYPES` (every layer's in one kind: the wide one where the layers' types differ;
    each checked bit for bit against the loaded float32 weights, a mismatch keeps float32 only) and LM head; else
    linears and an LM head whose values are all bfloat16s (a bfloat16 checkpoint served in float32), or all
    float16s, where the copies fit in a quarter of the memory available, each linear in its own kind (`CpuPanels.qx_kinds`). Returns (the params, how many of the five groups got them)."""
    import dataclasses

    from cpu_kernels import layout as qx
    from cpu_kernels import jax_ops

    p = params.panels
    if p is None:
        return params, 0
    got: dict[str, tuple[np.ndarray, int]] = {}  # group -> (qx panels, kind)
    host = {g: np.asarray(getattr(p, g)) for g in (*_QX_GROUPS, "head")}  # (zero-copy on a CPU)
    lib = jax_ops.lib()
    if getattr(source, "kind", None) == "gguf" and lib is not None:
        groups, head = qx.gguf_linear_groups(source, arch)
        for g, stored in _QX_GROUPS.items():
            gs = [groups.get((l, stored)) for l in range(arch.num_hidden_layers)]
            if any(x is None for x in gs):
                continue
            if len({qx.kind_of(x) for x in gs}) != 1:  # the layers' panels are stacked: one kind, the wide one
                gs = [qx.to_wide(x) for x in gs]
            packed = []
            for l, x in enumerate(gs):
                if not (one := qx.gguf_panels(lib, f"layer {l}'s {g}", x, host[g][l])):
                    break
                packed.append(one)
            else:
                got[g] = (np.stack([b for b, _ in packed]), packed[0][1])
        if head is not None and (h := qx.gguf_panels(lib, "the LM head", head, host["head"][0])):
            got["head"] = (h[0][None], h[1])
    # 16-bit values (bfloat16s, float16s): checked in place, and copied only if they all fit
    if lib is not None:
        got.update(qx.half_copies(lib, {g: a for g, a in host.items() if g not in got}))
    fields = {f"{g}_qx": jax.device_put(b, getattr(p, g).sharding) for g, (b, _) in got.items()}
    if not fields:
        return params, 0
    kinds = tuple(got[g][1] if g in got else -1 for g in QX_LINEARS)
    panels = dataclasses.replace(p, **fields, qx_kinds=kinds, head_qx_kind=got["head"][1] if "head" in got else -1)
    return dataclasses.replace(params, panels=panels), len(fields)


__all__ = ["LayerParams", "attach_cpu_qx", "load_params", "param_path"]
