"""The jax backend's CPU kernels, as XLA custom calls (`csrc/xla_ffi.cc`, linking the C topics of `csrc/`).

- `panel_linear(x, panels, l, n)`: `x [T, K] . W_l^T` for every layer's `W [n, K]` packed by `pack_panels`
  and stacked `[L, NP, K, 16]`, `l` a traced int32 scalar: every linear and the LM head of the jax backend
  on a CPU in float32 (`jaxengine.cpu_wing`). `model.forward` calls it inside its scan over layers,
  where XLA's own dot is handed its layer's weight through a dynamic-slice, which XLA:CPU materializes:
  every step copied all the weights before reading them. The product is the torch backend's `panel_gemm`
  (the same machine code, the same weights layout): a row's result does not depend on the other rows, and
  is the torch backend's bit for bit.
- `panel_argmax(x, panels, l, n)`: each row's argmax of that product without writing it: greedy sampling's LM
  head (the torch backend's `greedy_tokens`: the same tokens).
- `qx_linear`, `qx_argmax` (and `layers`' qx): the same from the weights as stored (`cpu_kernels.layout`: a GGUF
  file's blocks, a bfloat16 checkpoint's halves; `loader.attach_cpu_qx`), the same bits from fewer bytes.
- `decode_attention(q, cache, table, kv_lens, num_decode)`: the decode rows of a ragged step over
  jaxengine's paged cache, read in place (XLA's path gathers every row's blocks into temporaries first);
  the torch backend's `decode_attention` with the cache's interleaved K/V strides.
- `rms_norm(x, w, eps)`: RMSNorm as the torch backend computes it, a row's result independent of the row count
  (XLA:CPU reduces a row in another order from 8 rows up), wherever the linears run on panels; `silu_mul` and
  `rope` likewise, so the two backends' logits are the same bits on a CPU.
- `prefill_attention(...)`: its prefill and mixed rows, each query with decode attention's arithmetic (the
  torch backend's `prefill_attention`): a token's attention is the same decoded, prefilled or recomputed.
- `layers(...)`: every decoder layer of a step in one call, the kernels above in the order `model.forward`'s
  scan calls them (the same bits), its phases run by XLA's threads held for the call instead of woken for
  each of ~300 custom calls a step (the default; compilation_config={"cpu_layers": False}: the scan).
- `zeros(shape, dtype)`: jnp.zeros whose whole pages go back to the OS instead of being written: the KV cache,
  committed page by page as steps first write it (the torch backend's CPU cache is a fresh mapping likewise).
- `log_softmax`, `inverse_cdf`, `top_p_thresholds`: the sampler's row work (`sampler.sample(...,
  cpu_kernels=True)`), the torch sampler's kernels: the same logprobs and seeded draws on both backends.

Both split their work across XLA's intra-op threads (no second thread pool competing for the cores).
They run where the torch backend's AVX2 kernels run (x86-64 with AVX2/FMA/F16C and C/C++ compilers;
`XLASERVE_CPU_KERNELS=off` turns both backends' kernels off); the library is built once a machine into
`$XLASERVE_CACHE/kernels/` (`enginecore.native`). Elsewhere `available()` says why and XLA's ops run.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from cpu_kernels import layout as qx
from cpu_kernels.build import CSRC, HEADERS, XLA_FFI_SOURCE, c_units
from enginecore.native import build_shared
from enginecore.platform import cpu_kernels_unavailable

logger = logging.getLogger("xlaserve.jaxengine")

PANEL_LINEAR = "xlaserve_cpu_panel_linear"
PANEL_ARGMAX = "xlaserve_cpu_panel_argmax"
QX_LINEAR = "xlaserve_cpu_qx_linear"
QX_ARGMAX = "xlaserve_cpu_qx_argmax"
DECODE_ATTENTION = "xlaserve_cpu_decode_attention"
PREFILL_ATTENTION = "xlaserve_cpu_prefill_attention"
KV_WRITE = "xlaserve_cpu_kv_write"
RMS_NORM = "xlaserve_cpu_rms_norm"
SILU_MUL = "xlaserve_cpu_silu_mul"
ROPE = "xlaserve_cpu_rope"
LOG_SOFTMAX = "xlaserve_cpu_log_softmax"
INVERSE_CDF = "xlaserve_cpu_inverse_cdf"
TOP_P_THRESHOLDS = "xlaserve_cpu_top_p_thresholds"
LAYERS = "xlaserve_cpu_layers"
ZEROS = "xlaserve_cpu_zeros"
PANEL = qx.PANEL  # output rows a panel (cpu_kernels.torch_ops.PANEL)


def available() -> str:
    """"" once the custom calls are registered with XLA's CPU platform, else why they cannot run here."""
    return _library()[1]


def lib() -> ctypes.CDLL | None:
    """The library (its custom calls registered), or None where it cannot run here (`available` says why)."""
    return _library()[0]


@functools.lru_cache(maxsize=None)
def qx_max_rows() -> dict[int, int]:
    """Steps of at most qx_max_rows()[kind] tokens multiply a linear's qx panels of that kind, more its float32
    ones (`cpu_kernels.layout.max_rows`: the limits of the tiles that run on this CPU)."""
    return qx.max_rows(lib())


@functools.lru_cache(maxsize=None)
def _library() -> tuple[ctypes.CDLL | None, str]:
    """(the library, its custom calls registered, "") or (None, why not)."""
    why = cpu_kernels_unavailable()
    if why:
        return None, why
    # built against this jaxlib's FFI headers: its version is in the flags, so the library's hash
    # (enginecore.native) changes with it. No OpenMP: the work is split between XLA's threads.
    cxx = ["-O2", "-std=c++17", "-fPIC", f"-I{jax.ffi.include_dir()}", f"-I{CSRC}", f"-DXLASERVE_JAXLIB={jaxlib.__version__}"]
    path, why = build_shared("jax_cpu_kernels", [*c_units(openmp=False), (XLA_FFI_SOURCE, "c++", cxx)],
                             headers=HEADERS)
    if path is None:
        return None, why
    try:
        lib = ctypes.CDLL(path)
        jax.ffi.register_ffi_target(PANEL_LINEAR, jax.ffi.pycapsule(lib.XlaserveCpuPanelLinear), platform="cpu")
        jax.ffi.register_ffi_target(PANEL_ARGMAX, jax.ffi.pycapsule(lib.XlaserveCpuPanelArgmax), platform="cpu")
        jax.ffi.register_ffi_target(QX_LINEAR, jax.ffi.pycapsule(lib.XlaserveCpuQxLinear), platform="cpu")
        jax.ffi.register_ffi_target(QX_ARGMAX, jax.ffi.pycapsule(lib.XlaserveCpuQxArgmax), platform="cpu")
        jax.ffi.register_ffi_target(DECODE_ATTENTION, jax.ffi.pycapsule(lib.XlaserveCpuDecodeAttention),
                                    platform="cpu")
        jax.ffi.register_ffi_target(PREFILL_ATTENTION, jax.ffi.pycapsule(lib.XlaserveCpuPrefillAttention),
                                    platform="cpu")
        jax.ffi.register_ffi_target(RMS_NORM, jax.ffi.pycapsule(lib.XlaserveCpuRmsNorm), platform="cpu")
        jax.ffi.register_ffi_target(SILU_MUL, jax.ffi.pycapsule(lib.XlaserveCpuSiluMul), platform="cpu")
        jax.ffi.register_ffi_target(ROPE, jax.ffi.pycapsule(lib.XlaserveCpuRope), platform="cpu")
        for name, fn in ((LOG_SOFTMAX, lib.XlaserveCpuLogSoftmax), (INVERSE_CDF, lib.XlaserveCpuInverseCdf),
                         (TOP_P_THRESHOLDS, lib.XlaserveCpuTopPThresholds), (LAYERS, lib.XlaserveCpuLayers),
                         (KV_WRITE, lib.XlaserveCpuKvWrite),
                         (ZEROS, lib.XlaserveCpuZeros)):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn), platform="cpu")
        lib.pack_panels_f32.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
        lib.pack_panels_f32.restype = ctypes.c_int
        lib.qx_mismatches.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        lib.qx_mismatches.restype = ctypes.c_long
        lib.qx_panel_bytes.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.qx_panel_bytes.restype = ctypes.c_long
        lib.pack_bdot_panels.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p]
        lib.pack_bdot_panels.restype = ctypes.c_int
        lib.qx512_use.argtypes = [ctypes.c_int]
        lib.panel_blocked_rows.argtypes = [ctypes.c_int]
    except (OSError, AttributeError, ValueError) as e:
        return None, f"cannot load {path}: {e}"
    if not qx.layout_matches(lib):
        return None, f"{path}: the qx panels' layout does not match cpu_kernels.layout"
    return lib, ""


def pack_panels(w):
    """w [..., N, K] -> [..., ceil(N / 16), K, 16]: panels of 16 output rows, k-major, zero rows padding the
    last (cpu_kernels.torch_ops.pack_panels' layout). Row v of w is panels[..., v // 16, :, v % 16]."""
    *lead, N, K = w.shape
    NP = -(-N // PANEL)
    w = jnp.pad(w, [(0, 0)] * len(lead) + [(0, NP * PANEL - N), (0, 0)])
    return jnp.swapaxes(w.reshape(*lead, NP, PANEL, K), -1, -2)


def pack_onto_huge_pages(groups: dict, bdot: bool = False, keep: tuple = ()) -> dict:
    """{name: [(w, shape), ...]}, each w a float32 CPU array read as `shape` [..., N_i, K] (a reshape: a group's
    leading dims and K shared) -> {name: `pack_panels` of the group's rows concatenated}, every group in one
    buffer on transparent huge pages where the OS gives them (`cpu_kernels.memory.huge_page_array`; each result
    zero-copy over its slice, with its source's sharding). Packed on the host by the kernels'
    `pack_panels_f32`, a leading index at a time: as jnp ops each shape was an XLA program compiled and run at
    load (~4 s of a start for the embedded model). Each source is deleted once packed (but those of the groups
    named in `keep`), so the extra memory is one group's weights, not the model's. A result jax would copy
    instead of aliasing keeps its copy (small pages): the same values either way. Traced (`abstract_inputs`'
    eval_shape of `jaxengine.cpu_wing.pack_cpu_panels`): `pack_panels`, for the shapes.

    `bdot`: each group's panels rounded to QX_BDOT's bfloat16 ones instead (`cpu_kernels.layout.bdot_panels`: [...,
    NP, K / 32, 1024] bytes), through float32 panels of its own that are dropped once rounded."""
    from cpu_kernels.memory import describe_huge_pages, huge_page_array

    if any(isinstance(w, jax.core.Tracer) for ws in groups.values() for w, _ in ws):
        packed = {k: pack_panels(jnp.concatenate([w.reshape(s) for w, s in ws], axis=-2)) for k, ws in groups.items()}
        return {k: jnp.zeros(qx.bdot_shape(p.shape), jnp.uint8) for k, p in packed.items()} if bdot else packed
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"the CPU kernels do not run here ({why}): nothing runs on panels")
    shapes = {}
    for k, ws in groups.items():
        *lead, _, K = ws[0][1]
        if any(tuple(s[:-2]) != tuple(lead) or s[-1] != K for _, s in ws):
            raise ValueError(f"{k}: weights of different leading shapes or K: {[s for _, s in ws]}")
        shapes[k] = (*lead, -(-sum(s[-2] for _, s in ws) // PANEL), K, PANEL)
    stored = {k: qx.bdot_shape(s) if bdot else s for k, s in shapes.items()}
    arena, out, o = huge_page_array(sum(int(np.prod(s)) for s in stored.values()), np.uint8 if bdot else np.float32), {}, 0
    for k, ws in groups.items():
        *lead, NP, K, _ = shapes[k]
        dst = arena[o : o + int(np.prod(stored[k]))].reshape(stored[k])
        f32 = np.empty(shapes[k], np.float32) if bdot else dst
        rows = np.empty((sum(s[-2] for _, s in ws), K), np.float32)  # one leading index's rows, concatenated
        src = [np.asarray(w).reshape(s) for w, s in ws]  # views of the jax arrays' buffers
        for i in np.ndindex(*lead):
            r = 0
            for a in src:
                rows[r : r + a.shape[-2]] = a[i]
                r += a.shape[-2]
            out_i = f32[i]
            if lib.pack_panels_f32(rows.ctypes.data, len(rows), K, K, out_i.ctypes.data):
                raise ValueError(f"{k}: cannot pack rows of {K} floats")
        del src, a, out_i, rows
        if bdot:
            qx.bdot_panels(lib, f32, out=dst)
            del f32
        sharding = ws[0][0].sharding
        if k not in keep:
            for w, _ in ws:
                w.delete()
        out[k] = jax.device_put(dst, sharding)
        o += dst.size
    logger.info("CPU panels in one buffer%s: %s", " (QX_BDOT's bfloat16)" if bdot else "", describe_huge_pages(arena))
    return out


def zeros(shape, dtype):
    """jnp.zeros(shape, dtype) whose whole pages are handed back to the OS instead of written (`xla_ffi.cc`'s
    zero_pages; docs/design-notes.md, "Start-up"): the jax CPU KV cache."""
    return jax.ffi.ffi_call(ZEROS, jax.ShapeDtypeStruct(tuple(shape), dtype))()


def panel_rows(panels, ids):
    """Rows `ids` of the [N, K] matrix `pack_panels` packed into panels [NP, K, 16] -> [len(ids), K]."""
    return panels[ids // PANEL, :, ids % PANEL]


def _live(x, live):
    """The int32 scalar of the rows a head call computes: all of x's, or the first `live` (traced; the rest's
    outputs are zeros)."""
    return jnp.asarray(x.shape[0] if live is None else live, jnp.int32).reshape(())


def panel_linear(x, panels, layer, n: int, live=None):
    """x [T, K] float32, panels [L, NP, K, 16] float32 (`pack_panels` of L stacked [n, K] weights), layer an
    int32 scalar -> [T, n] float32 = x . W_layer^T. `live` (an int32 scalar, traced): only x's first `live` rows
    are multiplied, the other rows' outputs are zeros (a sample program's padded rows)."""
    call = jax.ffi.ffi_call(PANEL_LINEAR, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x, panels, jnp.asarray(layer, jnp.int32).reshape(()), _live(x, live))


def panel_argmax(x, panels, layer, n: int, live=None):
    """`panel_linear(x, panels, layer, n)`'s argmax per row -> [T] int32 (the first index of the maximum, NaN
    counting as the largest: jnp.argmax's), without writing the [T, n] products: greedy sampling's LM head,
    the torch backend's `greedy_tokens`. `live`: `panel_linear`'s (the other rows' tokens are 0)."""
    call = jax.ffi.ffi_call(PANEL_ARGMAX, jax.ShapeDtypeStruct((x.shape[0],), jnp.int32))
    return call(x, panels, jnp.asarray(layer, jnp.int32).reshape(()), _live(x, live), n=np.int32(n))


def qx_linear(x, qx, layer, n: int, kind: int, live=None):
    """`panel_linear` from the same weights' qx panels [L, NP, K / 32, group bytes] of `kind`
    (`cpu_kernels.layout`: a GGUF file's blocks or a bfloat16 checkpoint's halves): the same bits."""
    call = jax.ffi.ffi_call(QX_LINEAR, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    return call(x, qx, jnp.asarray(layer, jnp.int32).reshape(()), _live(x, live), kind=np.int32(kind))


def qx_argmax(x, qx, layer, n: int, kind: int, live=None):
    """`panel_argmax` from the same weights' qx panels (`qx_linear`'s): the same tokens."""
    call = jax.ffi.ffi_call(QX_ARGMAX, jax.ShapeDtypeStruct((x.shape[0],), jnp.int32))
    return call(x, qx, jnp.asarray(layer, jnp.int32).reshape(()), _live(x, live), n=np.int32(n),
                kind=np.int32(kind))


def rms_norm(x, w, eps: float):
    """x [..., K] float32, w [K] -> x / sqrt(mean(x^2) + eps) * w, float32: the torch backend's rms_norm, each
    row's sum of squares one FMA chain whatever the number of rows (XLA's reduction order changes with it)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    call = jax.ffi.ffi_call(RMS_NORM, jax.ShapeDtypeStruct(x2.shape, jnp.float32))
    return call(x2, jnp.asarray(w, jnp.float32), eps=np.float32(eps)).reshape(shape)


def silu_mul(gu):
    """gu [M, 2I] float32 (gate then up) -> silu(gate) * up [M, I]: the torch backend's silu_mul."""
    M, I2 = gu.shape
    return jax.ffi.ffi_call(SILU_MUL, jax.ShapeDtypeStruct((M, I2 // 2), jnp.float32))(gu)


def rope_tables(cos, sin):
    """Each token's angles cos / sin [T, D / 2] -> the kernel's tables [T, D]: (cos, cos) and (-sin, sin)
    (`model.forward` builds them once a step for every layer's `rope`)."""
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1)


def rope(x, cos, sin):
    """x [T, H, D] float32, cos / sin [T, D] (`rope_tables`) -> x rotated, rotate-half convention
    (`model.apply_rope`): the torch backend's rope, without the fused multiply-adds XLA would use."""
    return jax.ffi.ffi_call(ROPE, jax.ShapeDtypeStruct(x.shape, jnp.float32))(x, cos, sin)


def log_softmax(x, probs: bool = False):
    """x [M, V] float32 -> each row's log_softmax (`probs`: softmax), `sampling_ref`'s formula: the torch
    backend's `log_softmax_rows`, a row on one thread in a fixed order (XLA's reductions change order with
    the row count, and its exp differs from the kernel's), so both backends give the same logprobs."""
    call = jax.ffi.ffi_call(LOG_SOFTMAX, jax.ShapeDtypeStruct(x.shape, jnp.float32))
    return call(x.astype(jnp.float32), probs=np.int32(probs))


def inverse_cdf(probs, u):
    """probs [M, V] float32, u [M] -> int32 [M]: each row's first token whose cumulative probability exceeds
    u * total (`sampling_ref.inverse_cdf`; the torch backend's `inverse_cdf_rows`, the same draw)."""
    call = jax.ffi.ffi_call(INVERSE_CDF, jax.ShapeDtypeStruct(probs.shape[:1], jnp.int32))
    return call(probs, u.astype(jnp.float32))


def top_p_thresholds(probs, top_p):
    """probs [M, V] float32, top_p [M] -> [M] float32: keep the tokens with p >= it (`sampling_ref`'s top-p
    cut; 0 where top_p >= 1); the torch backend's `top_p_thresholds`."""
    call = jax.ffi.ffi_call(TOP_P_THRESHOLDS, jax.ShapeDtypeStruct(probs.shape[:1], jnp.float32))
    return call(probs, top_p.astype(jnp.float32))


# the caches the attention calls read: float32, or float16 / bfloat16 (`--kv-cache-dtype`; the torch backend's
# kernels on the same values, read back exactly into float32)
KV_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def kv_write(k, v, cache, slots):
    """k, v [T, Hkv, D] into cache [NB, block_size, 2 * Hkv, D] (`KV_DTYPES`; K of kv head h at 2h, V at 2h + 1)
    at rows slots [T] (block * block_size + offset; negative: padding, not written), rounded to the cache's
    type; -> the cache, updated in place. A slot outside the cache is an error."""
    call = jax.ffi.ffi_call(KV_WRITE, jax.ShapeDtypeStruct(cache.shape, cache.dtype), input_output_aliases={2: 0})
    return call(k.astype(jnp.float32), v.astype(jnp.float32), cache, slots.astype(jnp.int32))


def decode_attention(q, cache, table, kv_lens, num_decode, *, sm_scale: float, sliding_window: int | None = None):
    """Rows [0, num_decode) of q [R, Hq, D] (float32), one query each, attend their kv_lens[i] cached tokens
    (their own included; the last `sliding_window` only when set) in blocks table[i, :] of cache
    [NB, block_size, 2 * Hkv, D] (`KV_DTYPES`; K of kv head h at 2h, V at 2h + 1). -> [R, Hq, D] float32, rows
    from num_decode on zero. Exact softmax in float32. A kv_len past the table or a block id outside the
    cache is an error, not a read out of bounds."""
    call = jax.ffi.ffi_call(DECODE_ATTENTION, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, cache, table.astype(jnp.int32), kv_lens.astype(jnp.int32),
                jnp.asarray(num_decode, jnp.int32).reshape(()), scale=np.float32(sm_scale),
                window=np.int32(sliding_window or 0))


def prefill_attention(q, cache, table, kv_lens, cu_q_lens, distribution, out, *, sm_scale: float,
                      sliding_window: int | None = None):
    """The prefill and mixed rows of a ragged step (requests [distribution[0], distribution[2]), queries
    cu_q_lens[r] ..., the last of their kv_lens[r] tokens) attend their cached tokens causally in blocks
    table[r, :] of cache [NB, block_size, 2 * Hkv, D] (`KV_DTYPES`), each query with `decode_attention`'s
    arithmetic (bit for bit). -> out [T, Hq, D] with those rows written, the others kept. An out-of-range
    block id, length or row is an error, not a read out of bounds."""
    call = jax.ffi.ffi_call(PREFILL_ATTENTION, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            input_output_aliases={6: 0})
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    return call(q, cache, i32(table), i32(kv_lens), i32(cu_q_lens), i32(distribution), out.astype(jnp.float32),
                scale=np.float32(sm_scale), window=np.int32(sliding_window or 0))


def layers(x, attn_norm, mlp_norm, qkv, o, gate_up, down, qkv_bias, q_norm, k_norm, cos, sin, kv_cache, table,
           kv_lens, cu_q_lens, distribution, keep=None, all_rows=None, qx=None, *, num_heads: int, eps: float,
           sm_scale: float, sliding_window: int | None = None, qx_kinds: tuple = (-1, -1, -1, -1), qx_rows: int = 0):
    """Every decoder layer of a ragged step in one call (`model.forward` on a CPU with the panels): x [T, H] the
    embeddings; attn_norm, mlp_norm [L, H]; qkv, o, gate_up, down the `cpu_wing.CpuPanels`;
    qkv_bias [L, (Hq + 2 Hkv) D] and q_norm, k_norm [L, D], or empty arrays where the model has none; cos, sin
    [T, D] (`rope_tables`); kv_cache [L * NB, bs, 2 Hkv, D] (layer l's block b at row l * NB + b; float32,
    float16 or bfloat16: `KV_DTYPES`), updated in place; table [R, W], kv_lens [R], cu_q_lens [R + 1],
    distribution [3]: `model.RaggedMetadata`'s. keep [R] (the rows the step samples from, `logits_indices`:
    distinct) and all_rows [1]: unless all_rows[0] (or keep is None), only hidden's rows keep[:requests] are
    wanted, and the last layer's o linear and MLP run on those rows alone (the same bits; the other rows hold
    the residual stream before that layer's attention). qx: (qkv, o, gate_up, down)'s qx panels of `qx_kinds`
    (`qx_linear`'s, a kind each; None or an empty array: none), which steps of up to `qx_rows` tokens multiply instead (the
    same bits). Only the real tokens (cu_q_lens[requests]) are computed; the bucket's padding rows of hidden are
    zeros.
    -> (hidden [T, H] before the final norm, kv_cache). The per-layer custom calls' kernels in their order, so
    the same bits as through them, with the work of all layers split between the same XLA threads, held for
    the call (each custom call woke them anew): layers.c's run_layers, which the torch backend's
    `torchengine.cpu_layers.DecodeLayers` runs too. A block or row outside the cache or the tokens is an error."""
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
    call = jax.ffi.ffi_call(LAYERS, (jax.ShapeDtypeStruct(x.shape, jnp.float32),
                                     jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype)),
                            input_output_aliases={12: 1})
    if keep is None:
        keep, all_rows = jnp.zeros(kv_lens.shape, jnp.int32), jnp.ones((1,), jnp.int32)
    elif all_rows is None:
        all_rows = jnp.zeros((1,), jnp.int32)
    none = jnp.zeros((0, 0, 0, 0), jnp.uint8)
    qx = tuple(none if q is None else q for q in (qx or (None,) * 4))
    return call(f32(x), f32(attn_norm), f32(mlp_norm), qkv, o, gate_up, down, f32(qkv_bias), f32(q_norm),
                f32(k_norm), f32(cos), f32(sin), kv_cache, i32(table), i32(kv_lens), i32(cu_q_lens),
                i32(distribution), i32(keep), i32(all_rows).reshape(1), *qx, eps=np.float32(eps),
                scale=np.float32(sm_scale), window=np.int32(sliding_window or 0), num_heads=np.int32(num_heads),
                qx_kinds=_bytes(qx_kinds), qx_rows=np.int32(qx_rows))


def _bytes(kinds) -> np.int32:
    """Four small ints (-1: none) as the bytes of one int32, the first the lowest (a custom call's attributes are
    scalars)."""
    return np.array(sum((k & 0xFF) << 8 * i for i, k in enumerate(kinds)), np.uint32).view(np.int32)[()]


__all__ = ["DECODE_ATTENTION", "INVERSE_CDF", "LAYERS", "LOG_SOFTMAX", "PANEL", "PANEL_ARGMAX", "PANEL_LINEAR",
           "QX_ARGMAX", "QX_LINEAR", "qx_argmax", "qx_linear",
           "PREFILL_ATTENTION", "RMS_NORM", "ROPE", "SILU_MUL", "SOURCE", "TOP_P_THRESHOLDS", "ZEROS", "available",
           "decode_attention", "inverse_cdf", "layers", "log_softmax", "pack_onto_huge_pages", "pack_panels",
           "panel_argmax", "panel_linear", "panel_rows", "prefill_attention", "rms_norm", "rope", "rope_tables",
           "silu_mul", "top_p_thresholds", "zeros"]
