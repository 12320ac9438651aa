"""GGUF files for the tests: encoders for the types the gguf package cannot encode (Q4_K, Q6_K, IQ4_NL, IQ4_XS;
`q4_k`, `q6_k`, `iq4`), `encode` for any type, and `write_gguf` / `requantized_gguf`, which the session fixtures
`mixed_gguf` and `iq4_gguf` (tests/conftest.py) are made with. tests/test_gguf_writer.py reads what they write
back with the gguf package's reader and with enginecore.model_loader."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import gguf
import numpy as np

T = gguf.GGMLQuantizationType


def encode(w: np.ndarray, ty: T) -> np.ndarray:
    """float32 [N, K] -> its GGUF blocks of type `ty` as the file stores them ([N, K / block * bytes] uint8; F32
    and F16: the values): ours where the gguf package has no encoder, else its own."""
    ours = {T.Q4_K: q4_k, T.Q6_K: q6_k, T.IQ4_NL: lambda a: iq4(a, 32), T.IQ4_XS: lambda a: iq4(a, 256)}
    return ours[ty](w) if ty in ours else gguf.quants.quantize(w, ty)


def write_gguf(path: str, arch: str, fields: Iterable[tuple[str, object, gguf.GGUFValueType, object]],
               tensors: Iterable[tuple[str, np.ndarray, T]]) -> str:
    """A GGUF file of `arch` with `fields` ((key, value, value type, an array's item type or None), in order) and
    `tensors` ((name, data as `encode` gives it, its type), in order). Returns `path`."""
    w = gguf.GGUFWriter(path, arch)
    for key, value, vtype, sub_type in fields:
        w.add_key_value(key, value, vtype, sub_type=sub_type)
    for name, data, ty in tensors:
        w.add_tensor(name, data, raw_dtype=ty)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def requantized_gguf(src_path: str, path: str, types: Callable[[str, int], T | None]) -> str:
    """The GGUF file at `src_path` with each tensor that `types(tensor name, layer)` names a GGML type for
    requantized to it (`encode`), the rest as stored; its tokenizer and metadata copied. Returns `path`."""
    src = gguf.GGUFReader(src_path)
    fields = [(f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
              for f in src.fields.values() if f.name != "general.architecture" and not f.name.startswith("GGUF.")]

    def tensors():
        for t in src.tensors:
            to = types(t.name, int(t.name.split(".")[1]) if t.name.startswith("blk.") else -1)
            if to is None:
                yield t.name, t.data, t.tensor_type
            else:
                yield t.name, encode(gguf.quants.dequantize(t.data, t.tensor_type), to), to

    return write_gguf(path, src.fields["general.architecture"].contents(), fields, tensors())


def q4_k(w):
    """float32 [N, K] (K a multiple of 256) -> GGUF Q4_K super-blocks [N, K / 256 * 144] uint8, roughly (per 32
    weights (d * sc) * q - dmin * mn, six-bit sc and mn packed in 12 bytes, q's nibbles as the gguf package reads
    them)."""
    N, K = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)  # [blocks, sub-blocks, 32]
    lo = np.minimum(x.min(axis=2), 0)
    s = (x.max(axis=2) - lo) / 15
    d = (s.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(axis=1) / 63).astype(np.float16).astype(np.float32)

    def six(a, u):
        return np.clip(np.round(np.divide(a, u[:, None], out=np.zeros_like(a), where=u[:, None] > 0)), 0, 63)

    sc, mn = six(s, d).astype(np.uint8), six(-lo, dmin).astype(np.uint8)
    eff, off = (d[:, None] * sc)[..., None], (dmin[:, None] * mn)[..., None]
    q = np.clip(np.round(np.divide(x + off, eff, out=np.zeros_like(x), where=eff != 0)), 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, mn[:, :4] | (mn[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4], axis=1)
    qs = (q[:, 0::2] | q[:, 1::2] << 4).reshape(-1, 128)  # chunk c: sub-block 2c low, 2c + 1 high
    out = np.concatenate([d.astype(np.float16)[:, None].view(np.uint8), dmin.astype(np.float16)[:, None].view(
        np.uint8), scales, qs], axis=1)
    return out.reshape(N, -1)


def iq4(w, block):
    """float32 [N, K] -> GGUF IQ4_NL blocks (block 32: d, 16 bytes of nibbles) or IQ4_XS super-blocks (256: d, the
    eight sub-blocks' six-bit scales sc, d * (sc - 32) theirs, in two bits each of a uint16 and four bytes of
    nibbles, then 8 x 16 bytes), [N, K / block * bytes] uint8, roughly: each weight the index of the nearest of
    IQ4_NL's 16 values times its scale; nibbles as the gguf package reads them (element j < 16 the low one of byte
    j, j + 16 its high one, a sub-block of 32 at a time)."""
    N, K = w.shape
    values = np.asarray(gguf.quants.IQ4_NL.kvalues, np.float32)
    x = w.reshape(-1, block // 32, 32).astype(np.float32)  # [blocks, sub-blocks, 32]
    s = np.abs(x).max(axis=2) / 127  # per sub-block
    if block == 32:
        d = s[:, 0].astype(np.float16)
        eff = d.astype(np.float32)[:, None]
        head = [d[:, None].view(np.uint8)]
    else:
        d = (s.max(axis=1) / 31).astype(np.float16)
        sc = np.clip(np.round(np.divide(s, d.astype(np.float32)[:, None], out=np.zeros_like(s),
                                        where=d[:, None] > 0)), -32, 31).astype(np.int64) + 32
        eff = d.astype(np.float32)[:, None] * (sc - 32).astype(np.float32)
        hi = sum((sc[:, j] >> 4) << (2 * j) for j in range(8)).astype("<u2")
        lo = (sc[:, 0::2] & 15) | (sc[:, 1::2] & 15) << 4
        head = [d[:, None].view(np.uint8), hi[:, None].view(np.uint8), lo.astype(np.uint8)]
    scaled = np.divide(x, eff[..., None], out=np.zeros_like(x), where=eff[..., None] != 0)
    idx = np.abs(scaled[..., None] - values).argmin(axis=-1).astype(np.uint8)  # [blocks, sub-blocks, 32]
    qs = (idx[..., :16] | idx[..., 16:] << 4).reshape(len(x), -1)
    return np.concatenate([*head, qs], axis=1).reshape(N, -1)


def q6_k(w):
    """float32 [N, K] (K a multiple of 256) -> GGUF Q6_K super-blocks [N, K / 256 * 210] uint8, roughly (per 16
    weights a scale d * sc, q - 32 in [-32, 31]; ql's nibbles and qh's 2-bit pairs laid out as the gguf package
    reads them)."""
    N, K = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)  # [blocks, groups of 16, 16]
    s = np.abs(x).max(axis=2) / 31  # per group
    d = (s.max(axis=1) / 127).astype(np.float16).astype(np.float32)  # per block
    sc = np.clip(np.round(np.divide(s, d[:, None], out=np.zeros_like(s), where=d[:, None] > 0)), -128, 127)
    eff = (d[:, None] * sc)[..., None]
    q = np.clip(np.round(np.divide(x, eff, out=np.zeros_like(x), where=eff != 0)), -32, 31).astype(np.int64) + 32
    q = q.reshape(-1, 2, 128)  # [blocks, half h, r]
    ql = np.zeros((len(q), 2, 64), np.int64)
    qh = np.zeros((len(q), 2, 32), np.int64)
    for part in range(2):  # r // 64: the nibble
        ql |= (q[:, :, part * 64 : (part + 1) * 64] & 15) << (4 * part)
    for part in range(4):  # r // 32: the 2-bit pair
        qh |= (q[:, :, part * 32 : (part + 1) * 32] >> 4) << (2 * part)
    out = np.concatenate([ql.reshape(-1, 128).astype(np.uint8), qh.reshape(-1, 64).astype(np.uint8),
                          sc.astype(np.int8).view(np.uint8), d.astype(np.float16)[:, None].view(np.uint8)], axis=1)
    return out.reshape(N, -1)
