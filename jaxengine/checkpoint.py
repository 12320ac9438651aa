"""Converted params as an orbax checkpoint: dequantize/cast/shard once, restore fast on later starts.

`convert_to_orbax(source, out_dir, dtype)` writes a folder that every part of
xlaserve can open: config.json + tokenizer + model.safetensors (so
`resolve_model` and the torch backend still work) and, next to them,
``orbax/`` with the params already in the serving dtype and the jax layout,
plus ``xlaserve_orbax.json`` (dtype, format version). Serving that folder with
``--load-format orbax`` (or ``auto``, which prefers the checkpoint on the jax
backend) restores every tensor straight into its NamedSharding: no GGUF
dequantization, no dtype cast, no per-tensor reshape.
"""

from __future__ import annotations

import json
import logging
import os
import time

import jax

from enginecore.hf_folder import save_hf_folder
from enginecore.model_loader import ORBAX_MARKER, ORBAX_SUBDIR, ModelLoadError, ModelSource, is_orbax_checkpoint
from enginecore.arch import ArchConfig
from jaxengine.model import LayerParams, ModelParams, abstract_params, is_spec, jnp_dtype

logger = logging.getLogger("xlaserve.jax")

FORMAT_VERSION = 1


def _to_dict(params: ModelParams) -> dict:
    d = {"embed": params.embed, "final_norm": params.final_norm,
         "layers": {k: v for k, v in vars(params.layers).items() if v is not None}}
    if params.lm_head is not None:
        d["lm_head"] = params.lm_head
    return d


def _from_dict(d: dict) -> ModelParams:
    return ModelParams(embed=d["embed"], layers=LayerParams(**d["layers"]), final_norm=d["final_norm"],
                       lm_head=d.get("lm_head"))


def save_params(params: ModelParams, out_dir: str, arch: ArchConfig, dtype: str) -> str:
    """Write params (any sharding) as an orbax checkpoint under out_dir/orbax + the marker file."""
    import orbax.checkpoint as ocp

    path = os.path.join(os.path.abspath(out_dir), ORBAX_SUBDIR)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, _to_dict(params), force=True)
        ckptr.wait_until_finished()
    with open(os.path.join(out_dir, ORBAX_MARKER), "w") as f:
        json.dump({"format": FORMAT_VERSION, "dtype": dtype, "num_layers": arch.num_hidden_layers,
                   "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size}, f, indent=2)
    return path


def load_orbax_params(folder: str, arch: ArchConfig, dtype: str, shardings: ModelParams) -> ModelParams:
    """Restore into the given shardings; casts if the checkpoint was saved in another dtype."""
    import orbax.checkpoint as ocp

    if not is_orbax_checkpoint(folder):
        raise ModelLoadError(
            f"{folder}: not an xlaserve orbax checkpoint (no {ORBAX_MARKER} + {ORBAX_SUBDIR}/); create one with "
            "jaxengine.checkpoint.convert_to_orbax"
        )
    with open(os.path.join(folder, ORBAX_MARKER)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_VERSION:
        raise ModelLoadError(
            f"{folder}/{ORBAX_MARKER}: format {meta.get('format')} is not {FORMAT_VERSION}; re-convert")
    if meta.get("num_layers") != arch.num_hidden_layers or meta.get("vocab_size") != arch.vocab_size:
        raise ModelLoadError(f"{folder}: the orbax params do not match config.json (layers/vocab differ)")
    saved_dtype = jax.numpy.dtype(meta["dtype"])
    abstract = abstract_params(arch, dtype)
    target = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, saved_dtype, sharding=sh), abstract, shardings, is_leaf=is_spec
    )
    t0 = time.perf_counter()
    with ocp.StandardCheckpointer() as ckptr:
        restored = _from_dict(ckptr.restore(os.path.join(os.path.abspath(folder), ORBAX_SUBDIR), _to_dict(target)))
    if saved_dtype != jnp_dtype(dtype):
        restored = jax.tree.map(lambda a: a.astype(jnp_dtype(dtype)), restored)
    logger.info("jax: orbax params restored in %.2fs", time.perf_counter() - t0)
    return restored


def convert_to_orbax(source: ModelSource, out_dir: str, dtype: str = "float32",
                     write_safetensors: bool = True) -> str:
    """Convert any loadable model (GGUF or HF folder) into a folder with orbax params; returns out_dir.

    The params are produced by the normal loader (so they are exactly what serving
    would compute) on the default device, then saved.
    """
    from jaxengine.loader import load_params
    from jaxengine.sharding import ShardingRules, make_mesh, param_shardings

    os.makedirs(out_dir, exist_ok=True)
    arch = source.config
    mesh = make_mesh(1)
    shardings = param_shardings(abstract_params(arch, dtype), ShardingRules.for_model(arch, mesh), mesh)
    params = load_params(source, arch, dtype, shardings)
    if write_safetensors:
        save_hf_folder(source, out_dir, dtype="float32" if dtype != "float16" else "float16")
    else:
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(source.config.to_hf_dict(), f, indent=2)
    save_params(params, out_dir, arch, dtype)
    return out_dir


__all__ = ["convert_to_orbax", "is_orbax_checkpoint", "load_orbax_params", "save_params"]
