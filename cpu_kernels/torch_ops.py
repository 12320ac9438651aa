"""The torch backend's AVX2 CPU kernels (`csrc/`): built on first use, loaded with ctypes.

On an x86 CPU with AVX2, FMA and F16C and a C compiler (`$CC`, else `cc`/`gcc`):

- `gemm`: `--quantization gguf` multiplies Q4_0/Q4_1 weights with it, their activations quantized to 8
  bits per block of 32 like llama.cpp's, and a Q8_0 LM head with 16-bit activations (see the C file);
  elsewhere torch's own int4 kernel runs (bfloat16 activations; 2x slower at one row on a 2-core AVX2
  machine);
- the float32 glue of every CPU step (`rms_norm`, `rope_`, `silu_mul`, `kv_write`, `decode_attention`):
  one call each instead of several torch ops, whose dispatch costs more than their arithmetic at a decode
  step's sizes (`torchengine.cpu_transform`'s modules and `torchengine.attention` use them when `lib()` is not
  None);
- `panel_gemm`: every float32 linear of a CPU step (decoder linears and LM head, any number of rows), from
  weights packed once at load in panels of 16 output rows (`pack_panels`, `torchengine.cpu_transform`):
  no horizontal sums, and for greedy steps the LM head's argmax folded into the tiles, so the [rows, vocab]
  logits are never written (at 64 rows of a hidden-64 model: 3.0 ms where f32_gemm's logits + argmax took
  5.5); 1.05-1.4x f32_gemm from 16 rows on, 1.5-2.7x at one row, on hot weights (bench_dense's shapes);
- `f32_gemm`: the same product on [out, in] weights (8-lane chains; a weight not packed, bench_dense);
- `qx_gemm`: panel_gemm's bits (logits or the greedy argmax) from a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks
  of the same float32 weights, each weight rebuilt as the loader built it (`pack_q4x`, `pack_q8x`,
  `torchengine.quant.attach_qx`; the K-quants' forms too), or from a bfloat16-exact (float16-exact) weight's 16
  bits (`cpu_kernels.layout.half_panels`): a decode step of up to `qx_max_rows()[kind]` rows reads a sixth (Q4) to half
  (BF16, F16) of the bytes;
- `qx_gemm` of kind QX_BDOT: not a form of the float32 weights but bfloat16 products (`VDPBF16PS`, built with
  a target attribute, run where `bdot_supported()`: a CPU with AVX512-BF16): `--dtype bfloat16` on such a CPU
  keeps the float32 model and multiplies every linear and the LM head so (`bdot_panels`,
  `torchengine.cpu_transform.apply_cpu_kernels(bdot=True)`), twice float32's multiply-adds a cycle;
- `decode_layers` (its struct: `_DecodeLayer`; `torchengine.cpu_layers.DecodeLayers` binds a model to it): all
  the layers of a decode step in one call, the kernels above in the order the Python layers call them
  (bit-identical hidden states), without ~15 Python-level calls a layer; `step_layers` (`DecodeLayers.step`)
  the same for any other step but one with prompt logprobs (prompt chunks and the decodes beside them: the
  attention's decode and prefill groups, the sampled rows alone through the last layer's o linear and MLP).

Each kernel computes a row the same way whatever the number of rows in the call, so a request's outputs do
not depend on its neighbours in the batch (preemption, chunked prefill and the prefix cache give the same
tokens: tests/test_structured_outputs.py).

`XLASERVE_CPU_KERNELS=off` turns them all off (torch's ops everywhere; `torch` is its earlier name). The
shared library is cached under `$XLASERVE_CACHE/kernels/` (default `~/.cache/xlaserve`) by a hash of the
source and the compiler (`enginecore.native`), so it is built once a machine (~1 s). It runs on torch's
OpenMP threads: the library links `libgomp.so.1`, which torch has already loaded into the process.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import numpy as np
import torch

from cpu_kernels import layout as qx
from cpu_kernels.build import HEADERS, c_units
from enginecore.native import build_shared
from cpu_kernels.memory import huge_page_array
from enginecore.platform import cpu_kernels_unavailable
from cpu_kernels.layout import QX_GROUP_BYTES, QX_KINDS  # noqa: F401 (this module's API too)

logger = logging.getLogger("xlaserve.torchengine")

MAX_ROWS = 32  # the C file's MAX_ROWS: the 4- and 8-bit kernels' row limit
BLOCK_BYTES = 20  # Q4: {f16 d, f16 m, 16 bytes of nibbles}
Q8_BLOCK_BYTES = 34  # Q8: {f16 d, 32 int8}


@functools.lru_cache(maxsize=None)
def load() -> tuple[ctypes.CDLL | None, str]:
    """(the library, "") or (None, why not)."""
    why = cpu_kernels_unavailable()
    if why:
        return None, why
    path, why = build_shared("cpu_kernels", c_units(), ("-fopenmp",), headers=HEADERS)
    if path is None:
        return None, why
    return open_library(path)


def open_library(path: str) -> tuple[ctypes.CDLL | None, str]:
    """A built cpu_kernels library with its functions' signatures, or (None, why not) (also used by
    benchmarks.bench_kernels_ab for another revision's build)."""
    torch.get_num_threads()  # torch's OpenMP runtime is loaded before ours resolves libgomp.so.1
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:  # e.g. a noexec mount
        return None, f"cannot load {path}: {e}"
    for name, sig in _SIGNATURES.items():
        ret, _, args = sig.rpartition(":")  # "ret: args" (ret: int when not given)
        fn = getattr(lib, name)
        fn.argtypes = [_CTYPES[a] for a in args.split()]
        fn.restype = _CTYPES[ret.strip() or "i"]
    if (lib.q4_block_bytes() != BLOCK_BYTES or lib.q8_block_bytes() != Q8_BLOCK_BYTES
            or lib.max_rows() != MAX_ROWS or not qx.layout_matches(lib)):
        return None, "the C kernels' block layout or row limit does not match cpu_kernels.torch_ops / cpu_kernels.layout"
    return lib, ""


def lib() -> ctypes.CDLL | None:
    """The library, or None where it cannot run (then torch's ops do the work)."""
    return load()[0]


@functools.lru_cache(maxsize=None)
def qx_max_rows() -> dict[int, int]:
    """Steps of at most qx_max_rows()[kind] rows multiply a weight's qx panels of that kind, more its float32 ones
    (`cpu_kernels.layout.max_rows`: the limits of the tiles that run on this CPU)."""
    return qx.max_rows(lib())


def lib_for(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The library if every tensor is a float32 CPU tensor (and it runs here), else None. Callers check the
    layouts their kernel needs."""
    for t in tensors:
        if t.dtype != torch.float32 or not t.is_cpu:
            return None
    return lib()


# argument types of the C functions: p pointer, i int, l long, f float
_CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int, "l": ctypes.c_long, "f": ctypes.c_float, "v": None}
_SIGNATURES = {
    "q4_gemm": "p i i p i p i",
    "q8_gemm": "p i i p i p i",
    "rms_norm": "p i i l p p f p",
    "rope": "p i i i l p p",
    "kv_write": "p p l l i p p p i i",
    "decode_attention": "p l i p p p i p p i i i i f i p i i",
    "prefill_attention": "p l i p p p p i p p i i i i f i p l i i",
    "silu_mul": "p i i p",
    "log_softmax_rows": "p i i l p i",
    "inverse_cdf_rows": "p i i l p p",
    "top_p_thresholds": "p i i l p p",
    "top_n_rows": "p i i l i p p",
    "f32_gemm": "p i i p i p i",
    "panel_gemm": "p i i p i p p i",
    "panel_gemm_part": "v: p i i p i p p i i i i",
    "panel_blocked_rows": "i",
    "panel_gemm_plan": "i i i i p p p",
    "head_best_bytes": "",
    "head_best_init": "v: p l",
    "shares_init": "v: p i i",
    "shares_claim": "p i i i p p p",
    "head_best_argmax": "p i l",
    "shares_count": "i i i i p",
    "pack_panels_f32": "p i i l p",
    "decode_layers": "p i p i p i p p p p p i i i i i i i f f i p p i i",
    "step_layers": "p i p i p i p p p i p p p i i p p p p i p i i i i i i i f f i p p i i",
    "decode_workspace": "l: i i i i i i",
    "qx_gemm": "p i i p i p p i i",
    "qx_gemm_part": "p i i p i p p i i i",
    "qx_mismatches": "l: p i i i p",
    "qx_panel_bytes": "l: i i",
    "bdot_supported": "",
    "qx512_use": "i",
    "pack_bdot_panels": "p l i p",
}


def pack(q: np.ndarray, scale: np.ndarray, offset: np.ndarray) -> torch.Tensor:
    """Int4Groups arrays (q [N, K] in 0..15, scale/offset [N, K/32], float16-exact) -> [N, K/32 * 20] uint8."""
    N, K = q.shape
    G = K // 32
    qg = q.reshape(N, G, 32).astype(np.uint8)
    out = np.empty((N, G, BLOCK_BYTES), np.uint8)
    out[:, :, 0:2] = scale.astype(np.float16).reshape(N, G, 1).view(np.uint8)
    out[:, :, 2:4] = offset.astype(np.float16).reshape(N, G, 1).view(np.uint8)
    out[:, :, 4:] = qg[:, :, :16] | (qg[:, :, 16:] << 4)
    return torch.from_numpy(out.reshape(N, G * BLOCK_BYTES))


def pack_q4x(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> torch.Tensor:
    """`cpu_kernels.layout.pack_q4x` as a tensor: a GGUF file's Q4_1 (Q4_0: offset None) groups as qx_gemm's panels."""
    return torch.from_numpy(qx.pack_q4x(q, scale, offset))


def pack_q8x(q: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """`cpu_kernels.layout.pack_q8x` as a tensor: a GGUF file's Q8_0 groups as qx_gemm's panels."""
    return torch.from_numpy(qx.pack_q8x(q, scale))


def bdot_panels(panels: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 panels [NP, K, 16] -> QX_BDOT's [NP, K / 32, 1024] bytes (`cpu_kernels.layout.bdot_panels`), into `out`
    (contiguous uint8 of as many bytes) when given."""
    dst = None if out is None else out.numpy().reshape(qx.bdot_shape(tuple(panels.shape)))
    return torch.from_numpy(qx.bdot_panels(lib(), panels.numpy(), dst))


def _qx_shape_ok(panels: torch.Tensor, N: int, K: int, kind: int) -> bool:
    """Whether `panels` are `cpu_kernels.layout`'s packers' (`pack_q4x`, `pack_q8x`, ...) of a [N, K] weight of `kind`
    (what qx_gemm reads)."""
    return (kind in QX_GROUP_BYTES and K % 32 == 0 and panels.dtype == torch.uint8 and panels.is_cpu
            and panels.is_contiguous() and tuple(panels.shape) == qx.qx_shape(N, K, kind))


def qx_gemm(lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, N: int, kind: int,
            greedy: bool = False) -> torch.Tensor:
    """x [M, K] float32 . W^T with W [N, K] packed by `pack_q4x` / `pack_q8x` / `cpu_kernels.layout`'s (`kind`: QX_KINDS)
    -> [M, N] float32, or with `greedy` each row's argmax [M] int64: the bits of `panel_gemm` over the dequantized W."""
    x = x.contiguous()
    M, K = x.shape
    if not (x.dtype == torch.float32 and M > 0 and _qx_shape_ok(panels, N, K, kind)):
        raise ValueError(f"cpu_kernels.qx_gemm: bad arguments (x {tuple(x.shape)} {x.dtype}, panels "
                         f"{tuple(panels.shape)} {panels.dtype}, N {N}, kind {kind})")
    out = torch.empty((M,) if greedy else (M, N), dtype=torch.int64 if greedy else torch.float32)
    _check(lib.qx_gemm(x.data_ptr(), M, K, panels.data_ptr(), N, None if greedy else out.data_ptr(),
                       out.data_ptr() if greedy else None, kind, torch.get_num_threads()), "qx_gemm")
    return out


def pack8(q: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """Int8Groups arrays (q [N, K] int8, scale [N, K/32], float16-exact) -> [N, K/32 * 34] uint8 (Q8_0's blocks)."""
    N, K = q.shape
    G = K // 32
    out = np.empty((N, G, Q8_BLOCK_BYTES), np.uint8)
    out[:, :, 0:2] = scale.astype(np.float16).reshape(N, G, 1).view(np.uint8)
    out[:, :, 2:] = q.reshape(N, G, 32).view(np.uint8)
    return torch.from_numpy(out.reshape(N, G * Q8_BLOCK_BYTES))


def f32_gemm(lib: ctypes.CDLL, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 . w^T, w [N, K] float32 contiguous -> [M, N] float32 (any M >= 1)."""
    x = x.contiguous()
    M, K = x.shape
    y = torch.empty((M, w.shape[0]), dtype=torch.float32)
    rc = None
    if w.dim() == 2 and w.shape[1] == K and w.is_contiguous():
        rc = lib.f32_gemm(x.data_ptr(), M, K, w.data_ptr(), w.shape[0], y.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"cpu_kernels.f32_gemm: bad arguments (x {tuple(x.shape)}, w {tuple(w.shape)}; rc {rc})")
    return y


PANEL = qx.PANEL  # vocabulary rows a panel of `pack_panels`


def panels_size(w: torch.Tensor) -> int:
    """Floats `pack_panels` writes for w [V, K]."""
    V, K = w.shape
    return -(-V // PANEL) * PANEL * K


def pack_panels(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """w [V, K] float32 -> [ceil(V / 16), K, 16]: panels of 16 rows, k-major (zero rows pad the last one),
    the layout of `panel_gemm`. Row v of w is panels[v // 16, :, v % 16] (`panel_rows`). Written into `out`
    (contiguous float32, `panels_size(w)` floats: a slice of `huge_page_buffer`) when given."""
    V, K = w.shape
    P = -(-V // PANEL)
    lib_ = lib()
    if lib_ is not None and w.dtype == torch.float32 and w.is_cpu and w.stride(1) == 1 and V > 0 and K > 0:
        if out is None:
            out = torch.empty(P * K * PANEL, dtype=torch.float32)
        assert out.is_contiguous() and out.dtype == torch.float32 and out.numel() == P * K * PANEL
        _check(lib_.pack_panels_f32(w.data_ptr(), V, K, w.stride(0), out.data_ptr()), "pack_panels_f32")
        return out.view(P, K, PANEL)
    padded = torch.zeros((P * PANEL, K), dtype=torch.float32)
    padded[:V] = w
    panels = padded.view(P, PANEL, K).transpose(1, 2)
    if out is None:
        return panels.contiguous()
    return out.view(P, K, PANEL).copy_(panels)


def huge_page_buffer(nfloats: int) -> torch.Tensor:
    """An uninitialised float32 [nfloats] tensor on transparent huge pages where the OS gives them
    (`cpu_kernels.memory.huge_page_array`): `torchengine.cpu_transform` packs every linear and the LM head
    into one."""
    return torch.from_numpy(huge_page_array(nfloats, np.float32))


def panel_rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the matrix `pack_panels` packed: [len(ids), K] (the embedding lookup of a tied head). In
    numpy: a third of torch's cost for the three indexing ops (a decode step's embedding)."""
    i = ids.numpy()
    return torch.from_numpy(panels.numpy()[i // PANEL, :, i % PANEL])


def panel_gemm(lib: ctypes.CDLL, x: torch.Tensor, panels: torch.Tensor, vocab: int, greedy: bool = False) -> torch.Tensor:
    """x [M, K] float32 . W^T with W [vocab, K] packed by `pack_panels`: logits [M, vocab] float32, or with
    `greedy` only each row's argmax [M] int64 (torch.argmax's, of the same logits), never writing the logits."""
    x = x.contiguous()
    M, K = x.shape
    rc = None
    out = torch.empty((M,) if greedy else (M, vocab), dtype=torch.int64 if greedy else torch.float32)
    if (panels.dim() == 3 and panels.shape[1:] == (K, PANEL) and panels.shape[0] * PANEL >= vocab > 0
            and panels.dtype == torch.float32 and panels.is_contiguous() and x.dtype == torch.float32):
        rc = lib.panel_gemm(x.data_ptr(), M, K, panels.data_ptr(), vocab, None if greedy else out.data_ptr(),
                         out.data_ptr() if greedy else None, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"cpu_kernels.panel_gemm: bad arguments (x {tuple(x.shape)}, panels {tuple(panels.shape)}, "
                         f"vocab {vocab}; rc {rc})")
    return out


def gemm(lib: ctypes.CDLL, x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 (M <= MAX_ROWS) . W^T -> [M, N] float32, W packed by `pack` or `pack8`."""
    x = x.contiguous()
    M, K = x.shape
    N = blocks.shape[0]
    fn = None
    if blocks.shape[1] == K // 32 * Q8_BLOCK_BYTES:
        fn = lib.q8_gemm
    elif blocks.shape[1] == K // 32 * BLOCK_BYTES:
        fn = lib.q4_gemm
    rc = None
    if fn is not None and x.dtype == torch.float32 and blocks.dtype == torch.uint8 and blocks.is_contiguous():
        y = torch.empty((M, N), dtype=torch.float32)
        rc = fn(x.data_ptr(), M, K, blocks.data_ptr(), N, y.data_ptr(), torch.get_num_threads())
        if rc == 0:
            return y
    raise ValueError(f"cpu_kernels.gemm: bad arguments (x {tuple(x.shape)} {x.dtype}, blocks {tuple(blocks.shape)}; "
                     f"rc {rc})")


def reference(x: np.ndarray, q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None = None) -> np.ndarray:
    """What the kernel computes (`cpu_kernels.reference`): Q4 with `offset` (8-bit activations), Q8 without
    (16-bit activations)."""
    from cpu_kernels import reference as ref

    return ref.q8_linear(x, q, scale) if offset is None else ref.q4_linear(x, q, scale, offset)


# ---------------------------------------------------------------------------------
# the float32 glue of a step (callers check: CPU float32 tensors, the layouts each states)


def _check(rc: int, name: str) -> None:
    if rc != 0:
        raise ValueError(f"cpu_kernels.{name}: bad arguments (rc {rc})")


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (x.stride(1) == 1) -> x * rsqrt(mean(x^2) + eps) * weight, a new contiguous tensor. With a
    contiguous `residual` [M, K]: residual += x in place first, and residual is normalised instead."""
    M, K = x.shape
    out = torch.empty_like(x)  # float32, contiguous (x's rows are K floats apart or further); half torch.empty's cost
    _check(lib.rms_norm(x.data_ptr(), M, K, x.stride(0), None if residual is None else residual.data_ptr(),
                        weight.data_ptr(), eps, out.data_ptr()), "rms_norm")
    return out


def rope_(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (heads contiguous, token rows any stride) rotated in place by cos/sin [T, 1, D]
    (contiguous, `torchengine.model.apply_rope`'s form); returns x."""
    T, H, D = x.shape
    _check(lib.rope(x.data_ptr(), T, H, D, x.stride(0), cos.data_ptr(), sin.data_ptr()), "rope")
    return x


def silu_mul(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2I] contiguous -> silu(gate) * up [M, I]."""
    M, I2 = gate_up.shape
    out = torch.empty((M, I2 // 2), dtype=torch.float32)
    _check(lib.silu_mul(gate_up.data_ptr(), M, I2 // 2, out.data_ptr()), "silu_mul")
    return out


def log_softmax(lib: ctypes.CDLL, x: torch.Tensor, probs: bool = False) -> torch.Tensor:
    """x [M, V] float32 (x.stride(1) == 1) -> its rows' log_softmax (`probs`: softmax), contiguous: each row on
    one thread in a fixed order, the jax backend's custom call's bits (`sampling_ref.log_softmax`'s formula)."""
    M, V = x.shape
    out = torch.empty((M, V), dtype=torch.float32)
    _check(lib.log_softmax_rows(x.data_ptr(), M, V, x.stride(0), out.data_ptr(), int(probs)), "log_softmax_rows")
    return out


def _per_row(fn, name: str, probs: torch.Tensor, arg: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fn(probs, M, V, row stride, arg [M] float32, out [M]) -> out."""
    M, V = probs.shape
    arg = arg.to(torch.float32).contiguous()
    out = torch.empty(M, dtype=dtype)
    _check(fn(probs.data_ptr(), M, V, probs.stride(0), arg.data_ptr(), out.data_ptr()), name)
    return out


def inverse_cdf(lib: ctypes.CDLL, probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [M, V] float32 (probs.stride(1) == 1), u [M] float32 -> [M] int64: each row's first token whose
    cumulative probability (double, fixed order) exceeds u * total (`sampling_ref.inverse_cdf`)."""
    return _per_row(lib.inverse_cdf_rows, "inverse_cdf_rows", probs, u, torch.int64)


def top_p_thresholds(lib: ctypes.CDLL, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [M, V] float32 (probs.stride(1) == 1), top_p [M] -> [M] float32: keep each row's tokens with
    p >= it (`sampling_ref.filter_logits`' top-p cut, the sorted running sum in double; 0 where top_p >= 1)."""
    return _per_row(lib.top_p_thresholds, "top_p_thresholds", probs, top_p, torch.float32)


def top_n(lib: ctypes.CDLL, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, V] float32 (x.stride(1) == 1) -> (values [M, n], ids [M, n] int64): each row's n largest in
    descending order, ties by lower id (a stable descending sort's first n), in one pass."""
    M, V = x.shape
    vals, ids = torch.empty((M, n), dtype=torch.float32), torch.empty((M, n), dtype=torch.int64)
    _check(lib.top_n_rows(x.data_ptr(), M, V, x.stride(0), n, ids.data_ptr(), vals.data_ptr()), "top_n_rows")
    return vals, ids


# the KV cache dtypes the kernels read and write (cpu_kernels.h's KV_F32, KV_F16, KV_BF16): a 16-bit cache
# is stored rounded to nearest even, as .to() rounds, and read back exactly
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def kv_write(lib: ctypes.CDLL, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, key_cache: torch.Tensor,
             value_cache: torch.Tensor) -> None:
    """k, v [T, Hkv, D] float32 (heads contiguous) into cache slots `slots` [T] int64 (< 0: skipped) of the
    contiguous caches [blocks, block_size, Hkv, D] (a `KV_TYPES` dtype: converted as `.to` would)."""
    T, Hkv, D = k.shape
    _check(lib.kv_write(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), T, slots.data_ptr(),
                        key_cache.data_ptr(), value_cache.data_ptr(), Hkv * D, KV_TYPES[key_cache.dtype]), "kv_write")


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, tokens: torch.Tensor, kv_lens: torch.Tensor,
                     block_tables: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, scale: float,
                     window: int | None, out: torch.Tensor) -> None:
    """One query token per request attends its cached tokens: q [T, Hq, D] (heads contiguous), tokens [n]
    int64 (the query rows), kv_lens [n] int32, block_tables [n, P] int32 contiguous, caches [blocks,
    block_size, Hkv, D] contiguous (a `KV_TYPES` dtype); writes rows `tokens` of out [T, Hq, D] (contiguous)."""
    n = tokens.shape[0]
    _, block_size, Hkv, D = key_cache.shape
    _check(lib.decode_attention(q.data_ptr(), q.stride(0), n, tokens.data_ptr(), kv_lens.data_ptr(),
                                block_tables.data_ptr(), block_tables.shape[1], key_cache.data_ptr(),
                                value_cache.data_ptr(), block_size, q.shape[1], Hkv, D, scale, window or 0,
                                out.data_ptr(), torch.get_num_threads(), KV_TYPES[key_cache.dtype]), "decode_attention")


def prefill_attention(lib: ctypes.CDLL, q: torch.Tensor, q_start: torch.Tensor, q_lens: torch.Tensor,
                      kv_lens: torch.Tensor, block_tables: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, scale: float, window: int | None, out: torch.Tensor) -> None:
    """Request i's q_lens[i] query tokens, rows q_start[i] ... of q [T, Hq, D] (heads contiguous), attend
    their request's cached tokens causally (kv_lens[i] after this step; the queries are the last q_lens[i]),
    with decode_attention's arithmetic for each query (bit for bit: a token's attention is the same decoded,
    prefilled or recomputed). q_start/q_lens/kv_lens [n] int32, block_tables [n, P] int32 contiguous, caches
    [blocks, block_size, Hkv, D] contiguous (a `KV_TYPES` dtype); writes those rows of out [T, Hq, D]
    (contiguous)."""
    n = q_start.shape[0]
    _, block_size, Hkv, D = key_cache.shape
    _check(lib.prefill_attention(q.data_ptr(), q.stride(0), n, q_start.data_ptr(), q_lens.data_ptr(),
                                 kv_lens.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
                                 key_cache.data_ptr(), value_cache.data_ptr(), block_size, q.shape[1], Hkv, D, scale,
                                 window or 0, out.data_ptr(), out.stride(0), torch.get_num_threads(),
                                 KV_TYPES[key_cache.dtype]),
           "prefill_attention")


# ---------------------------------------------------------------------------------
# a decode step's layers in one call


_LINEARS = ("qkv", "o", "gate_up", "down")


class _DecodeLayer(ctypes.Structure):  # the C file's decode_layer
    _fields_ = ([(name, ctypes.c_void_p) for name in ("attn_norm", "qkv_w", "qkv_b", "o_w", "mlp_norm", "gate_up_w",
                                                     "down_w", "key_cache", "value_cache")]
                + [(f"{n}_q4", ctypes.c_void_p) for n in _LINEARS] + [(f"{n}_rows", ctypes.c_int) for n in _LINEARS]
                + [(f"{n}_qx", ctypes.c_void_p) for n in _LINEARS] + [("qx_rows", ctypes.c_int)]
                + [(f"{n}_qx_kind", ctypes.c_int) for n in _LINEARS]
                + [("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p)])
