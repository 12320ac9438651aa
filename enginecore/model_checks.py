"""Checks of untrusted model files, made before anything is allocated from what they declare.

A model folder or GGUF file may come from anywhere: truncated by a failed
download, or written to make a loader hang or allocate terabytes. Every size
in a file is therefore checked against the bytes that actually follow it and
against fixed limits before it is used, and the weights' shapes are checked
against the config before a backend allocates a parameter of the config's
size:

- GGUF: the header is read once with bounds checks (`read_gguf`, which is
  also our GGUF reader: the `gguf` package's reader trusts declared counts, so
  it would loop for 2**64 iterations over an array past the end of the file,
  and it took 4 s to parse SmolLM2's 49k-token vocabulary at every start).
- safetensors: the header length is capped (100 MB, as the safetensors library
  does), each entry's dtype, shape and offsets must agree with each other and
  lie inside the file (`safetensors_entries`).
- config.json / GGUF metadata: every size is a positive integer under a limit
  (`check_arch`); the tensors the architecture needs must all be present with
  the shapes it implies (`check_declared_weights`).
- weights: NaN or infinite values are refused as the tensors stream in
  (`check_finite`).

Errors are `ModelLoadError`s that name the file, the value and the limit.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from enginecore.arch import DENSE_MLP_PARAMS, MOE_PARAMS, ArchConfig, ModelLoadError, weight_spec

# The safetensors library's own cap on the JSON header.
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
# Far above every supported model (Llama 3 405B: 126 layers, hidden 16384, 128k positions, vocab 128k),
# far below what would exhaust memory from a config alone.
ARCH_LIMITS = {
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 20,
    "num_hidden_layers": 1 << 10,
    "num_attention_heads": 1 << 10,
    "num_key_value_heads": 1 << 10,
    "head_dim": 1 << 11,
    "max_position_embeddings": 1 << 22,
}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")
_FINITE_CHUNK = 1 << 22  # elements per isfinite() call: no temporary the size of a whole tensor


# ---- configs -----------------------------------------------------------------------


def check_arch(arch: ArchConfig, source: str) -> None:
    """Every size a positive integer under its limit; the rest of the numbers finite."""
    for name, limit in ARCH_LIMITS.items():
        v = getattr(arch, name)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 < v <= limit:
            raise ModelLoadError(f"{source}: {name} is {v!r}; it must be a positive integer of at most {limit}")
    for name in ("rope_theta", "rms_norm_eps"):
        v = getattr(arch, name)
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ModelLoadError(f"{source}: {name} is {v!r}; it must be a positive finite number")
    if arch.moe is not None:
        for name, v, limit in (("num_experts", arch.moe.num_experts, 1 << 12),
                               ("moe_intermediate_size", arch.moe.intermediate_size, 1 << 20),
                               ("shared_expert_intermediate_size", arch.moe.shared_expert_intermediate_size + 1,
                                1 << 20)):
            if not 0 < v <= limit:
                raise ModelLoadError(f"{source}: {name} is {v!r}; it must be a positive integer of at most {limit}")
    if arch.sliding_window is not None and (not isinstance(arch.sliding_window, int) or arch.sliding_window < 1):
        raise ModelLoadError(f"{source}: sliding_window is {arch.sliding_window!r}; it must be a positive integer")


def arch_from_config_json(cfg_path: str) -> ArchConfig:
    """config.json -> ArchConfig: malformed JSON, missing keys and wrong types are ModelLoadErrors."""
    try:
        with open(cfg_path, "rb") as f:
            raw = f.read(MAX_SAFETENSORS_HEADER_BYTES + 1)
    except OSError as e:
        raise ModelLoadError(f"{cfg_path}: cannot read ({e.strerror})") from None
    if len(raw) > MAX_SAFETENSORS_HEADER_BYTES:
        raise ModelLoadError(f"{cfg_path}: larger than {MAX_SAFETENSORS_HEADER_BYTES} bytes; not a model config")
    try:
        cfg = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_path}: not a JSON object")
    # auto_map (Hugging Face remote code) is ignored: the architectures served here are built in
    try:
        arch = ArchConfig.from_hf_dict(cfg, cfg_path)
    except ModelLoadError:
        raise
    except KeyError as e:
        raise ModelLoadError(f"{cfg_path}: missing key {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError) as e:
        raise ModelLoadError(f"{cfg_path}: invalid value ({type(e).__name__}: {e})") from None
    check_arch(arch, cfg_path)
    return arch


# ---- the weights the config implies --------------------------------------------------


def expected_shape(arch: ArchConfig, param: str) -> tuple[int, ...]:
    """The full shape of a logical param as Hugging Face stores it ([E, out, in] for the stacked experts)."""
    H, I, V, D = arch.hidden_size, arch.intermediate_size, arch.vocab_size, arch.head_dim
    q, kv = arch.num_attention_heads * D, arch.num_key_value_heads * D
    shapes = {
        "embed": (V, H), "lm_head": (V, H), "final_norm": (H,), "attn_norm": (H,), "mlp_norm": (H,),
        "q_proj": (q, H), "k_proj": (kv, H), "v_proj": (kv, H), "o_proj": (H, q),
        "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,), "q_norm": (D,), "k_norm": (D,),
        "gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I),
    }
    if arch.moe is not None:
        m = arch.moe
        E, Ie, Is = m.num_experts, m.intermediate_size, m.shared_expert_intermediate_size
        shapes.update({"router": (E, H), "experts_gate": (E, Ie, H), "experts_up": (E, Ie, H),
                       "experts_down": (E, H, Ie), "shared_gate_proj": (Is, H), "shared_up_proj": (Is, H),
                       "shared_down_proj": (H, Is), "shared_expert_gate": (1, H)})
    if param not in shapes:
        raise ModelLoadError(f"{param}: this tensor has no place in a dense {arch.architecture}")
    return shapes[param]


def required_params(arch: ArchConfig, layer: int | None = None) -> tuple[set[str], set[str]]:
    """(top-level params, per-layer params of `layer`, or of a dense layer) the architecture cannot run without."""
    top = {"embed", "final_norm"} | (set() if arch.tie_word_embeddings else {"lm_head"})
    params = {"attn_norm", "q_proj", "k_proj", "v_proj", "o_proj", "mlp_norm"}
    if layer is not None and arch.is_sparse(layer):
        params |= {"router", "experts_gate", "experts_up", "experts_down"}
        if arch.moe.shared_expert_intermediate_size:
            params |= {"shared_gate_proj", "shared_up_proj", "shared_down_proj"}
        if arch.moe.shared_expert_gate:
            params.add("shared_expert_gate")
    else:
        params |= {"gate_proj", "up_proj", "down_proj"}
    if arch.attention_bias:
        params |= {"q_bias", "k_bias", "v_bias"}
    if arch.qk_norm:
        params |= {"q_norm", "k_norm"}
    return top, params


def check_declared_weights(arch: ArchConfig, declared: Iterable[tuple[str, tuple[int, ...]]], source: str) -> None:
    """Shapes from the file headers against the config, before any backend allocates a parameter."""
    top_needed, _ = required_params(arch)
    seen: set[tuple[int | None, str]] = set()
    experts_seen: dict[tuple[int, str], set[int]] = {}  # (layer, param) -> experts given one tensor each
    for name, shape in declared:
        found = weight_spec(name)
        if found is None:
            continue
        layer, spec = found
        if layer is not None and layer >= arch.num_hidden_layers:
            raise ModelLoadError(f"{source}: tensor {name} is for layer {layer} but the config has "
                                 f"{arch.num_hidden_layers} layers")
        if layer is not None and spec.param in (MOE_PARAMS if not arch.is_sparse(layer) else DENSE_MLP_PARAMS):
            kind = "sparse (MoE)" if arch.is_sparse(layer) else "dense"
            raise ModelLoadError(f"{source}: tensor {name} does not belong in layer {layer}, which the config makes "
                                 f"{kind} (check num_experts / decoder_sparse_step / mlp_only_layers)")
        want = expected_shape(arch, spec.param)
        if spec.expert is not None:
            if spec.expert >= arch.moe.num_experts:
                raise ModelLoadError(f"{source}: tensor {name} is for expert {spec.expert} but the config has "
                                     f"{arch.moe.num_experts} experts (num_experts / num_local_experts)")
            want = want[1:]
            experts_seen.setdefault((layer, spec.param), set()).add(spec.expert)
        else:
            seen.add((layer, spec.param))
        if tuple(shape) != want:
            raise ModelLoadError(f"{source}: tensor {name} has shape {list(shape)}; the config implies {list(want)}")
    for (layer, param), experts in experts_seen.items():
        if len(experts) == arch.moe.num_experts:
            seen.add((layer, param))
        elif (layer, param) not in seen:
            gap = min(set(range(arch.moe.num_experts)) - experts)
            raise ModelLoadError(f"{source}: missing tensor {expert_tensor_name(arch, layer, gap, param)} (expert "
                                 f"{gap} of {arch.moe.num_experts} in layer {layer})")
    missing = [p for p in sorted(top_needed) if (None, p) not in seen]
    for layer in range(arch.num_hidden_layers):
        missing += [f"layer {layer} {p}" for p in sorted(required_params(arch, layer)[1]) if (layer, p) not in seen]
    if missing:
        raise ModelLoadError(f"{source}: the config needs tensors the file does not have: {', '.join(missing[:6])}"
                             + (f" and {len(missing) - 6} more" if len(missing) > 6 else ""))


_HF_EXPERT_NAME = {"experts_gate": "gate_proj", "experts_up": "up_proj", "experts_down": "down_proj"}
_MIXTRAL_EXPERT_NAME = {"experts_gate": "w1", "experts_up": "w3", "experts_down": "w2"}


def expert_tensor_name(arch: ArchConfig, layer: int, expert: int, param: str) -> str:
    """The Hugging Face name of one expert's tensor of `param` (experts_gate / experts_up / experts_down)."""
    if arch.model_type == "mixtral":
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{_MIXTRAL_EXPERT_NAME[param]}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{_HF_EXPERT_NAME[param]}.weight"


def check_finite(name: str, arr: np.ndarray, source: str) -> None:
    """NaN / inf weights give garbage text with no error anywhere else: refuse them at load."""
    if arr.dtype.kind in "biu":
        return
    flat = arr.reshape(-1)
    for i in range(0, flat.size, _FINITE_CHUNK):
        chunk = flat[i : i + _FINITE_CHUNK]
        ok = np.isfinite(chunk)
        if not ok.all():
            bad = i + int(np.argmin(ok))
            raise ModelLoadError(f"{source}: tensor {name} holds a non-finite value ({float(flat[bad])}) at flat "
                                 f"index {bad}; the checkpoint is corrupt")


# ---- safetensors ---------------------------------------------------------------------

_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}


def safetensors_entries(path: str, check_extent: bool = True
                        ) -> tuple[int, list[tuple[str, str, tuple[int, ...], int, int]]]:
    """(data offset, [(name, dtype, shape, start, end)]) of a safetensors file, every field checked;
    `check_extent=False` leaves out whether the data lies inside the file (checked again when it is read)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ModelLoadError(f"{path}: corrupt safetensors header (length {n} > file size {size})")
        if n > MAX_SAFETENSORS_HEADER_BYTES:
            raise ModelLoadError(f"{path}: safetensors header of {n} bytes; the limit is "
                                 f"{MAX_SAFETENSORS_HEADER_BYTES}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ModelLoadError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors header (not a JSON object)")
    base = 8 + n
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name}"
        if not isinstance(info, dict):
            raise ModelLoadError(f"{where}: header entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _ST_ITEMSIZE:
            raise ModelLoadError(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or len(shape) > 8 or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ModelLoadError(f"{where}: shape {shape!r} is not a list of at most 8 non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise ModelLoadError(f"{where}: data_offsets {offsets!r} is not a pair of integers")
        s, e = offsets
        if not 0 <= s <= e:
            raise ModelLoadError(f"{where}: data_offsets {offsets} are not 0 <= start <= end")
        if check_extent and base + e > size:
            raise ModelLoadError(f"{path}: truncated: tensor {name} ends at byte {base + e}, past the end of the "
                                 f"file ({size} bytes)")
        nbytes = math.prod(shape) * _ST_ITEMSIZE[dtype]
        if nbytes != e - s:
            raise ModelLoadError(f"{where}: shape {shape} of {dtype} is {nbytes} bytes but its data_offsets span "
                                 f"{e - s}")
        out.append((name, dtype, tuple(shape), s, e))
    return base, out


# ---- GGUF ----------------------------------------------------------------------------

# value type -> struct format (uint8, int8, uint16, int16, uint32, int32, float32, bool, -, -, uint64, int64, float64)
_GGUF_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGML_MAX_DIMS = 4
_MAX_GGUF_NESTING = 3


class _Cursor:
    """Reads a GGUF header with every length checked against the bytes left in the file."""

    def __init__(self, buf, path: str):
        self.buf, self.path, self.pos, self.end = buf, path, 0, len(buf)
        self.endian = "<"

    @property
    def left(self) -> int:
        return self.end - self.pos

    def fail(self, what: str):
        raise ModelLoadError(f"{self.path}: not a readable GGUF file ({what} at byte {self.pos}; the file has "
                             f"{self.end} bytes): truncated or corrupt")

    def need(self, nbytes: int, what: str) -> None:
        if nbytes > self.left:
            self.fail(f"{what} needs {nbytes} bytes, {self.left} are left")

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        self.need(n, what)
        v = struct.unpack_from(self.endian + fmt, self.buf, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str) -> bytes:
        n = self.unpack("Q", f"the length of {what}")
        self.need(n, what)
        s = self.buf[self.pos : self.pos + n]
        self.pos += n
        return s

    def value(self, vtype: int, what: str, depth: int = 0):
        """One metadata value: a number, a str, or a list of them."""
        fmt = _GGUF_FORMATS.get(vtype)
        if fmt is not None:
            return self.unpack(fmt, what)
        if vtype == _GGUF_STRING:
            return self.string(what).decode("utf-8", "replace")
        if vtype != _GGUF_ARRAY:
            self.fail(f"{what} has unknown value type {vtype}")
        if depth >= _MAX_GGUF_NESTING:
            self.fail(f"{what} nests arrays more than {_MAX_GGUF_NESTING} deep")
        itype = self.unpack("I", f"the item type of {what}")
        count = self.unpack("Q", f"the length of {what}")
        if itype in _GGUF_FORMATS:
            dtype = np.dtype(_GGUF_FORMATS[itype]).newbyteorder(self.endian)
            self.need(count * dtype.itemsize, f"{what} ({count} items)")
            arr = np.frombuffer(self.buf, dtype, count, self.pos)
            self.pos += count * dtype.itemsize
            return arr.tolist()
        # strings take 8 bytes at least, arrays 12: a count the file cannot hold fails here, not after
        # count iterations
        self.need(count * (8 if itype == _GGUF_STRING else 12), f"{what} ({count} items)")
        if itype == _GGUF_STRING:  # the vocabulary: the hot loop of a GGUF start
            buf, pos, end, out = self.buf, self.pos, self.end, []
            lens = struct.Struct(self.endian + "Q").unpack_from
            for _ in range(count):
                if end - pos < 8:
                    self.pos = pos
                    self.fail(f"the length of an item of {what} needs 8 bytes, {end - pos} are left")
                (n,) = lens(buf, pos)
                pos += 8
                if n > end - pos:
                    self.pos = pos
                    self.fail(f"an item of {what} needs {n} bytes, {end - pos} are left")
                out.append(buf[pos : pos + n].decode("utf-8", "replace"))
                pos += n
            self.pos = pos
            return out
        return [self.value(itype, what, depth + 1) for _ in range(count)]


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # as the file declares it: innermost dimension first
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray  # the tensor's bytes, flat uint8, memory-mapped (gguf.quants.dequantize reads it)


@dataclass
class GGUFFile:
    path: str
    metadata: dict  # key -> number | str | list
    tensors: list[GGUFTensor]

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)


def read_gguf(path: str) -> GGUFFile:
    """Read a GGUF header with bounds checks (ModelLoadError naming what does not fit); tensors stay on disk,
    memory-mapped."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise ModelLoadError(f"{path}: not a readable GGUF file (it is empty)") from None
    try:
        c = _Cursor(buf, path)
        c.need(4, "the magic number")
        if buf[:4] != b"GGUF":
            c.fail("no GGUF magic number")
        c.pos = 4
        version = c.unpack("I", "the version")
        if version & 0xFFFF == 0:  # written big-endian
            c.endian = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in (2, 3):
            c.fail(f"version {version} is not supported (2, 3)")
        n_tensors = c.unpack("Q", "the tensor count")
        n_kv = c.unpack("Q", "the metadata count")
        c.need(n_kv * 13, f"{n_kv} metadata entries")
        metadata = {}
        for i in range(n_kv):
            key = c.string(f"metadata key {i}").decode("utf-8", "replace")
            metadata[key] = c.value(c.unpack("I", f"the type of {key}"), key)
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            c.fail(f"general.alignment {alignment!r} is not a power of two")
        c.need(n_tensors * 24, f"{n_tensors} tensor descriptions")
        tensors = []
        for i in range(n_tensors):
            name = c.string(f"tensor name {i}").decode("utf-8", "replace")
            n_dims = c.unpack("I", f"the dimension count of {name}")
            if not 1 <= n_dims <= _GGML_MAX_DIMS:
                c.fail(f"tensor {name} has {n_dims} dimensions (1 to {_GGML_MAX_DIMS})")
            dims = [c.unpack("Q", f"a dimension of {name}") for _ in range(n_dims)]
            ttype = c.unpack("I", f"the type of {name}")
            offset = c.unpack("Q", f"the data offset of {name}")
            known = ttype in GGMLQuantizationType._value2member_map_ and \
                GGMLQuantizationType(ttype) in GGML_QUANT_SIZES
            if not known:
                c.fail(f"tensor {name} has unknown type {ttype}")
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            tensors.append((name, dims, GGMLQuantizationType(ttype), block, type_size, offset))
        data_start = -(-c.pos // alignment) * alignment
        file_bytes = np.memmap(path, np.uint8, mode="r") if tensors else None
        out = []
        for name, dims, qtype, block, type_size, offset in tensors:
            n = math.prod(dims)
            if n % block:
                c.fail(f"tensor {name} has {n} elements, not a multiple of its type's block of {block}")
            start = data_start + offset
            end = start + n // block * type_size
            if end > c.end:
                raise ModelLoadError(f"{path}: tensor {name} ({'x'.join(map(str, dims))}) ends at byte {end}, "
                                     f"past the end of the file ({c.end} bytes): truncated or corrupt")
            out.append(GGUFTensor(name, tuple(dims), qtype, file_bytes[start:end]))
        return GGUFFile(path, metadata, out)
    finally:
        buf.close()
