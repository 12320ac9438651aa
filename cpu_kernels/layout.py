"""Float32 weights as they are stored: `qx_gemm`'s panels (cpu_kernels/csrc), shared by both backends.

A GGUF file's Q4_0 / Q4_1 / Q8_0 weights served in float32 are each one rounding of an exact product of its
blocks' values, and a bfloat16 checkpoint's weights served in float32 are bfloat16s: `qx_gemm` rebuilds each
weight exactly from those bytes and sums it in panel_gemm's order, so a decode step of few rows, which streams
its weights from memory, computes the float32 model's bits from a sixth (Q4) or half (BF16) of the bytes. The
torch backend's `torchengine.quant.attach_qx` and the jax backend's `jaxengine.loader.attach_cpu_qx` keep these
panels beside the float32 ones; this module packs them (numpy), reads a GGUF file's groups per linear and checks
the blocks against the float32 panels with the kernels' own rebuild (`rebuilds`).

One kind is not a form of the float32 weights: QX_BDOT, bfloat16 products (`--dtype bfloat16` on a CPU with
AVX512-BF16, `bdot_runs`): the weights rounded to bfloat16 (`bdot_panels`), every step of every row count.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Callable

import numpy as np

from enginecore import envs
from enginecore.arch import ArchConfig, fused_slices, weight_spec
from enginecore.model_loader import GGUF_FORMS, Int4Groups, Int8Groups, Iq4Groups, ModelSource, WideGroups

PANEL = 16  # output rows a panel (panel_gemm's)
# the C file's QX_*; BDOT is not a form of the float32 weights but bfloat16 arithmetic (`bdot_panels`)
QX_KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "BF16": 3, "Q4_K": 4, "I8": 5, "F16": 6, "IQ4": 7, "BDOT": 8}
# the GGUF types whose weights the panels take (Q4_K as Q4_1's form with float32 scales: QX_Q4_K; Q5_0, d * (q -
# 16), as Q8_0's; IQ4_NL and IQ4_XS, a float32 scale times one of 16 int8s a nibble indexes, as QX_IQ4's; Q5_K,
# Q6_K, Q3_K, Q2_K and Q5_1, and a linear whose parts or layers mix forms, as QX_I8's int8 weights with float32
# scales and offsets per 16)
GGUF_TYPES = tuple(t for form in GGUF_FORMS for t in form.TYPES)
# steps of at most this many rows multiply a weight's `qx_gemm` panels (where it has them) instead of its float32
# ones: the same bits in fewer bytes (Q4 0.16, Q8_0 0.27, BF16 0.5 of float32's), until rebuilding the weights
# costs more than streaming float32 (`max_rows(lib)` picks the table of the tiles that run). Each limit is the
# largest row count at which the stored panels still beat float32's, measured with `python -m
# benchmarks.bench_kernels_ab --what qx [--qx-kind bf16|i8|q4k|iq4|f16] --rows ...` (the results in
# benchmarks/README.md and HISTORY.md, bench_kernels_ab). QX_MAX_ROWS: the 256-bit tiles, which rebuild the
# weights for every 4 (BF16, F16: 6) rows; they run where the CPU has no AVX-512, so their limits are set on a
# Zen 3 against float32's k-blocked order from 6 rows (the C file's COMPUTE_BOUND_ROWS_AVX2). QX512_MAX_ROWS: the
# AVX-512 tiles, which rebuild them once for up to 16 rows (set on a Zen 4). BDOT: every step (no float32 panels)
QX_MAX_ROWS = {QX_KINDS["Q4_0"]: 8, QX_KINDS["Q4_1"]: 8, QX_KINDS["Q8_0"]: 8, QX_KINDS["BF16"]: 8,
               QX_KINDS["Q4_K"]: 8, QX_KINDS["I8"]: 4, QX_KINDS["F16"]: 8, QX_KINDS["IQ4"]: 8,
               QX_KINDS["BDOT"]: 1 << 30}
QX512_MAX_ROWS = {**{k: 20 for k in QX_MAX_ROWS}, QX_KINDS["BF16"]: 24, QX_KINDS["F16"]: 24,
                  QX_KINDS["BDOT"]: 1 << 30}
# bytes of a panel's group of 32 k (the C file's qx_group_bytes): 16 scales and 16 offsets (float16), then 32 k
# of 16 nibbles; Q8_0 16 scales, then 32 k of 16 bytes; BF16 32 k of 16 bfloat16s; Q4_K Q4_1's with float32
# scales and offsets; I8 float32 scales and offsets of k 0-15, then of k 16-31, then 32 k of 16 int8s; F16 as BF16;
# IQ4 16 float32 scales, then Q4's nibbles; BDOT 16 pairs of k of 16 rows' two bfloat16s
QX_GROUP_BYTES = {QX_KINDS["Q4_0"]: 64 + 32 * 8, QX_KINDS["Q4_1"]: 64 + 32 * 8, QX_KINDS["Q8_0"]: 32 + 32 * 16,
                  QX_KINDS["BF16"]: 32 * 16 * 2, QX_KINDS["Q4_K"]: 128 + 32 * 8, QX_KINDS["I8"]: 256 + 32 * 16,
                  QX_KINDS["F16"]: 32 * 16 * 2, QX_KINDS["IQ4"]: 64 + 32 * 8, QX_KINDS["BDOT"]: 32 * 16 * 2}


logger = logging.getLogger(__name__)
# a bfloat16's bits are a float32's high half: the second uint16 of each float32 on a little-endian machine (all
# that run the AVX2 kernels); elsewhere nothing is bfloat16-exact here
_LITTLE = sys.byteorder == "little"


def layout_matches(lib) -> bool:
    """Whether the kernels' library (`lib`, either backend's build, `qx_panel_bytes` declared) reads every kind's
    group in QX_GROUP_BYTES bytes, and no other kind: the packers here and the C reader agree."""
    return (all(lib.qx_panel_bytes(k, 32) == b for k, b in QX_GROUP_BYTES.items())
            and lib.qx_panel_bytes(max(QX_KINDS.values()) + 1, 32) == -1)


def max_rows(lib) -> dict[int, int]:
    """The row limits of the tiles the kernels' library `lib` (either backend's build, or None) runs here: its
    AVX-512 ones where it has them (`qx512_use`), else the 256-bit ones."""
    return QX512_MAX_ROWS if lib is not None and lib.qx512_use(-1) else QX_MAX_ROWS


def enabled() -> bool:
    """Whether the runners keep the weights as stored beside float32 (`XLASERVE_Q4X=off`: float32 only, every
    kind; the variable is named for the first)."""
    return envs.XLASERVE_Q4X


def bf16_exact(w: np.ndarray, chunk: int = 1 << 20) -> bool:
    """Whether every value of the float32 `w` is a bfloat16 (its low 16 bits zero: a bfloat16 checkpoint's weight
    served in float32), so its high halves hold it exactly. Reads the low halves in place (no copy), a chunk at a
    time: a float32 model's first chunk ends it."""
    if not (_LITTLE and w.dtype == np.float32 and w.flags.c_contiguous and w.size > 0):
        return False
    low = w.reshape(-1).view(np.uint16)[0::2]
    return not any(low[i : i + chunk].any() for i in range(0, low.size, chunk))


def half_copies_fit(nbytes: int) -> bool:
    """Whether 16-bit copies of `nbytes` fit in a quarter of the memory available (both backends keep them
    beside the float32 weights, so they are half of float32's bytes again); True where that cannot be read."""
    from enginecore.kv_cache import available_memory_bytes

    avail = available_memory_bytes()
    if avail is None or nbytes <= avail // 4:
        return True
    logger.info("16-bit weights: their %.1f GiB copy would take more than a quarter of the memory available "
                "(%.1f GiB); float32 only", nbytes / 2**30, avail / 2**30)
    return False


def qx_shape(N: int, K: int, kind: int) -> tuple[int, int, int]:
    """The panels' shape of an [N, K] weight of `kind`: [ceil(N / 16), K / 32, group bytes]."""
    return -(-N // PANEL), K // 32, QX_GROUP_BYTES[kind]


def q4_kind(g: Int4Groups) -> int:
    """The qx kind that holds a 4-bit weight's groups exactly: Q4_0's form (every offset -8 scale), Q4_1's where
    the scales and offsets are float16s (a GGUF file's Q4_0 / Q4_1), else Q4_K's float32 ones (its Q4_K)."""
    if g.is_q4_0:
        return QX_KINDS["Q4_0"]
    f16 = all(np.array_equal(a.astype(np.float16).astype(np.float32), a) for a in (g.scale, g.offset))
    return QX_KINDS["Q4_1" if f16 else "Q4_K"]


Groups = Int4Groups | Int8Groups | WideGroups | Iq4Groups


def kind_of(g: Groups) -> int:
    """The qx kind whose panels hold a GGUF weight's groups exactly (Q8_0's for the 8-bit form, I8 for the wide,
    IQ4 for IQ4_NL's and IQ4_XS's)."""
    return (QX_KINDS["Q8_0"] if isinstance(g, Int8Groups) else QX_KINDS["I8"] if isinstance(g, WideGroups)
            else QX_KINDS["IQ4"] if isinstance(g, Iq4Groups) else q4_kind(g))


def to_wide(g: Groups) -> WideGroups:
    """Any form's groups as WideGroups, the same weights to the bit: a 4-bit weight of Q4_0's form (every offset
    -8 scale) as (q - 8) * scale (its zeros keep the scale's sign), other 4-bit ones q * scale + offset, 8-bit
    ones q * scale (offset -0.0), IQ4 ones their values * scale (offset -0.0)."""
    if isinstance(g, WideGroups):
        return g
    N, K = g.q.shape
    q = (Iq4Groups.VALUES[g.q] if isinstance(g, Iq4Groups) else g.q).reshape(N, -1, 32).astype(np.int8)
    if isinstance(g, (Int8Groups, Iq4Groups)) or g.is_q4_0:
        offset = np.full_like(g.scale, -0.0)
        q = q if isinstance(g, (Int8Groups, Iq4Groups)) else q - np.int8(8)
    else:  # (a weight's form, not a group's: a Q4_K group of scale 0 and offset -0.0 is no Q4_0 one)
        offset = g.offset
    return WideGroups(q.reshape(N, K), np.repeat(g.scale, 2, axis=1), np.repeat(offset.astype(np.float32), 2, axis=1))


def pack_i8x(g: WideGroups) -> np.ndarray:
    """WideGroups -> `qx_gemm`'s QX_I8 panels, uint8 [ceil(N / 16), K / 32, 768]: per panel and group of 32 k, the
    16 rows' scales and offsets (float32) of k 0-15, then of k 16-31, then per k the 16 rows' q (int8; zero rows
    pad the last panel)."""
    N, K = g.q.shape
    G, P = K // 32, -(-N // PANEL)
    qp = np.zeros((P * PANEL, K), np.int8)
    qp[:N] = g.q
    out = np.empty((P, G, QX_GROUP_BYTES[QX_KINDS["I8"]]), np.uint8)
    for i, a in enumerate((g.scale[:, 0::2], g.offset[:, 0::2], g.scale[:, 1::2], g.offset[:, 1::2])):
        _pack_scales(out, 64 * i, a, P, np.float32)
    out[:, :, 256:] = qp.reshape(P, PANEL, G, 32).transpose(0, 2, 3, 1).reshape(P, G, 512).view(np.uint8)
    return out


def pack_q4x(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, kind: int = QX_KINDS["Q4_1"]) -> np.ndarray:
    """Int4Groups arrays (q [N, K] in 0..15, scale / offset [N, K/32]; offset None: Q4_0, whose weights are
    scale * (q - 8)), or Iq4Groups' (kind IQ4, no offsets) -> `qx_gemm`'s panels of `kind` (Q4_0 / Q4_1:
    float16-exact scales, Q4_K / IQ4: float32), uint8 [ceil(N / 16), K / 32, group bytes]: per panel and group of
    32 k, the 16 rows' scales and offsets (float16 or float32; IQ4 scales only), then per k 8 bytes, byte j row j's
    q | row j + 8's << 4 (zero rows pad the last panel)."""
    N, K = q.shape
    G, P = K // 32, -(-N // PANEL)
    qp = np.zeros((P * PANEL, K), np.uint8)
    qp[:N] = q
    qp = qp.reshape(P, PANEL, G, 32).transpose(0, 2, 3, 1)  # [P, G, 32 k, 16 rows]
    out = np.empty((P, G, QX_GROUP_BYTES[kind]), np.uint8)
    dt = np.float32 if kind in (QX_KINDS["Q4_K"], QX_KINDS["IQ4"]) else np.float16
    sb = PANEL * np.dtype(dt).itemsize  # bytes of a group's 16 scales
    _pack_scales(out, 0, scale, P, dt)
    if kind != QX_KINDS["IQ4"]:
        _pack_scales(out, sb, offset, P, dt)
    out[:, :, QX_GROUP_BYTES[kind] - 256 :] = (qp[..., :8] | (qp[..., 8:] << 4)).reshape(P, G, 256)
    return out


def pack_q8x(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Int8Groups arrays (q [N, K] int8, scale [N, K/32], float16-exact; w = q * scale: Q8_0) -> `qx_gemm`'s
    panels, uint8 [ceil(N / 16), K / 32, 544]: per panel and group of 32 k, the 16 rows' scales (float16), then
    per k the 16 rows' q (zero rows pad the last panel)."""
    N, K = q.shape
    G, P = K // 32, -(-N // PANEL)
    qp = np.zeros((P * PANEL, K), np.int8)
    qp[:N] = q
    out = np.empty((P, G, QX_GROUP_BYTES[QX_KINDS["Q8_0"]]), np.uint8)
    _pack_scales(out, 0, scale, P, np.float16)
    out[:, :, 32:] = qp.reshape(P, PANEL, G, 32).transpose(0, 2, 3, 1).reshape(P, G, 512).view(np.uint8)
    return out


def half_kind(panels: np.ndarray, chunk: int = 1 << 20) -> int:
    """The 16-bit qx kind that may hold float32 panels [..., NP, K, 16] exactly: BF16 where every value is a
    bfloat16 (the low halves read in place), else F16 where the first `chunk` values are float16s (a float16
    checkpoint's, a GGUF file's F16 tensor: `half_panels` checks the rest), else -1 (K not a multiple of 32 too)."""
    if panels.shape[-1] != PANEL or panels.shape[-2] % 32 or panels.dtype != np.float32:
        return -1
    if bf16_exact(panels):
        return QX_KINDS["BF16"]
    head = panels.reshape(-1)[:chunk]
    with np.errstate(over="ignore", invalid="ignore"):
        back = head.astype(np.float16).astype(np.float32)
    return QX_KINDS["F16"] if np.array_equal(back.view(np.uint32), head.view(np.uint32)) else -1


def half_panels(lib, what: str, panels: np.ndarray, kind: int) -> np.ndarray | None:
    """float32 panels [..., NP, K, 16] of `half_kind` `kind` -> the same weights as its qx panels [..., NP, K / 32,
    1024] (per panel and k the 16 rows' 16-bit values: the float32 panels' layout), each leading index checked by
    the kernels' own rebuild (`rebuilds`, `lib`); None (with a warning) where one differs."""
    *lead, NP, K, _ = panels.shape
    if kind == QX_KINDS["BF16"]:
        halves = np.ascontiguousarray(panels.view(np.uint16)[..., 1::2])
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            halves = panels.astype(np.float16)
    out = halves.view(np.uint8).reshape(*lead, NP, K // 32, QX_GROUP_BYTES[kind])
    for i in np.ndindex(*lead):
        if not rebuilds(lib, what, out[i], kind, NP * PANEL, panels[i]):
            return None
    return out


def bdot_shape(panels_shape: tuple) -> tuple:
    """float32 panels' shape [..., NP, K, 16] -> their QX_BDOT panels' [..., NP, K / 32, 1024] (bytes)."""
    *lead, NP, K, _ = panels_shape
    return (*lead, NP, K // 32, QX_GROUP_BYTES[QX_KINDS["BDOT"]])


def bdot_panels(lib, panels: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 panels [..., NP, K, 16] (panel_gemm's, K % 32 == 0) -> QX_BDOT's [..., NP, K / 32, 1024]: the
    weights rounded to bfloat16 as the KV cache's bfloat16 writes and torch's `.to(torch.bfloat16)` round (to
    nearest even), per pair of k the 16 rows' two values, k even first: the order in which VDPBF16PS multiplies
    them by the activations' pairs (`--dtype bfloat16` on a CPU with AVX512-BF16: `bdot_runs`). Packed by the
    kernels' library `lib` (`pack_bdot_panels`, on its threads), into `out` where given (contiguous uint8 of
    `bdot_shape`)."""
    *lead, NP, K, _ = panels.shape
    src = np.ascontiguousarray(panels, np.float32)
    if out is None:
        out = np.empty(bdot_shape(panels.shape), np.uint8)
    elif out.shape != bdot_shape(panels.shape) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"bdot_panels: out {out.shape} {out.dtype} for panels {panels.shape}")
    if lib.pack_bdot_panels(src.ctypes.data, src.size // (K * PANEL), K, out.ctypes.data) != 0:
        raise ValueError(f"bdot_panels: panels {panels.shape} (K a multiple of 32 expected)")
    return out


def bdot_runs(lib: Callable, arch: ArchConfig, platform: str, dtype: str, tp_size: int) -> bool:
    """Whether `--dtype bfloat16` runs as the float32 model with its linears and LM head in QX_BDOT, both backends'
    rule (each adds what only it knows: torch's `--quantization`, jax's `cpu_linears`): bfloat16 on a CPU, one
    process, the kernels' library (`lib()`, asked for only then) built with QX_BDOT on a CPU with AVX512-BF16,
    every linear's inputs a multiple of 32."""
    if platform != "cpu" or dtype != "bfloat16" or tp_size != 1:
        return False
    kernels = lib()
    if kernels is None or not kernels.bdot_supported():
        return False
    return all(k % 32 == 0 for k in (arch.hidden_size, arch.num_attention_heads * arch.head_dim,
                                     arch.intermediate_size))


def half_copies(lib, panels: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, int]]:
    """{name: float32 panels} -> {name: (16-bit qx panels, kind)} for those whose every value is a bfloat16 or a
    float16 (`half_kind`, then `half_panels`' check), if the copies of them all fit in a quarter of the memory
    available (`half_copies_fit`, before any is made), else {}: both backends' policy for 16-bit weights."""
    kinds = {n: k for n, p in panels.items() if (k := half_kind(p)) >= 0}
    if not kinds or not half_copies_fit(sum(panels[n].nbytes // 2 for n in kinds)):
        return {}
    return {n: (b, k) for n, k in kinds.items() if (b := half_panels(lib, n, panels[n], k)) is not None}


def rebuilds(lib, what: str, packed: np.ndarray, kind: int, N: int, panels: np.ndarray) -> bool:
    """Whether the qx panels `packed` (of `kind`) rebuild every weight of the float32 panels `panels` ([ceil(N /
    16), K, 16], panel_gemm's) to its bits, as qx_gemm rebuilds them (the kernels' `qx_mismatches`, in place: `lib`
    either backend's build); else a warning that `what` keeps float32 only (a GGUF file's blocks that another
    loader's arithmetic dequantized otherwise, a float16 cast that was not exact)."""
    K = panels.shape[1] if panels.ndim == 3 else -1
    ok = (panels.dtype == np.float32 and panels.flags.c_contiguous and panels.shape == (-(-N // PANEL), K, PANEL)
          and K % 32 == 0 and packed.dtype == np.uint8 and packed.flags.c_contiguous
          and packed.shape == qx_shape(N, K, kind))
    if ok and lib.qx_mismatches(packed.ctypes.data, kind, K, N, panels.ctypes.data) == 0:
        return True
    logger.warning("%s: its %s panels do not give the loaded float32 weight bit for bit; it keeps float32 only",
                   what, next((n for n, k in QX_KINDS.items() if k == kind), kind))
    return False


def gguf_panels(lib, what: str, g: Groups, panels: np.ndarray) -> tuple[np.ndarray, int] | None:
    """A GGUF file's groups of a weight (`gguf_linear_groups`) -> (its qx panels, their kind) if they rebuild the
    loaded float32 panels `panels` bit for bit (`rebuilds`), else None."""
    kind = kind_of(g)
    if isinstance(g, Int8Groups):
        packed = pack_q8x(g.q, g.scale)
    elif isinstance(g, WideGroups):
        packed = pack_i8x(g)
    else:
        packed = pack_q4x(g.q, g.scale, None if kind in (QX_KINDS["Q4_0"], QX_KINDS["IQ4"]) else g.offset, kind)
    return (packed, kind) if rebuilds(lib, what, packed, kind, g.q.shape[0], panels) else None


def _pack_scales(out: np.ndarray, at: int, a: np.ndarray | None, P: int, dt) -> None:
    """a [N, G] (None: zeros) as `dt` (float16 or float32) into out [P, G, :] from byte `at`, the 16 rows of a
    panel in order."""
    G = out.shape[1]
    h = np.zeros((P * PANEL, G), dt)
    if a is not None:
        h[: a.shape[0]] = a
    n = PANEL * np.dtype(dt).itemsize
    out[:, :, at : at + n] = h.reshape(P, PANEL, G).transpose(0, 2, 1).copy().view(np.uint8)


def gguf_linear_groups(source: ModelSource, arch: ArchConfig, types=GGUF_TYPES, wide: bool = True) -> tuple[
        dict[tuple[int, str], Groups], Groups | None]:
    """The decoder linears whose weight the GGUF file stores as types of `types` (Q4_0 / Q4_1 / Q4_K: Int4Groups;
    Q8_0 / Q5_0: Int8Groups; IQ4_NL / IQ4_XS: Iq4Groups; Q5_K / Q6_K / Q3_K / Q2_K / Q5_1: WideGroups), every fused
    part: {(layer, the stored linear: "qkv_proj", "o_proj", "gate_up_proj" or "down_proj"): its groups, the rows in
    the fused weight's order}, and the LM head's groups if the file stores it as one of them. Parts of one form
    assemble in it (`kind_of` finds the panels that hold them all); with `wide`, parts of several forms, or 4-bit
    parts some of Q4_0's form and some not, as WideGroups (`to_wide`: the qx panels' case), else 4-bit parts as
    Int4Groups and other mixes not at all (`--quantization gguf`'s 4-bit linears). One pass over the file's
    quantized tensors, each linear assembled once its parts are read; a linear with a part stored in a type not in
    `types` has none."""
    head_name = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
    head = None
    parts: dict[tuple[int, str], tuple[int, list]] = {}  # -> (fused rows, [(their rows, groups)])
    out = {}
    for hf_name, g in source.iter_quantized_weights(types):
        if hf_name == head_name:
            head = g
            continue
        found = weight_spec(hf_name)
        if found is None or found[0] is None:
            continue
        layer, spec = found
        stored = spec.fused or spec.param
        if stored not in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            continue
        if spec.fused:
            slices = fused_slices(arch, spec.fused, 1)
            rows, N = slices[spec.param], max(s.stop for s in slices.values())
        else:
            rows, N = slice(0, g.q.shape[0]), g.q.shape[0]
        ps = parts.setdefault((layer, stored), (N, []))[1]
        ps.append((rows, g))
        if sum(r.stop - r.start for r, _ in ps) == N:
            if (one := _assemble(N, parts.pop((layer, stored))[1], wide)) is not None:
                out[(layer, stored)] = one
    return out, head


def _assemble(N: int, ps: list, wide: bool) -> Groups | None:
    """A fused linear's parts [(its rows, groups)] -> the linear's groups (a lone part as it is), or None."""
    if len(ps) == 1 and ps[0][0] == slice(0, N):
        return ps[0][1]
    forms = {type(g) for _, g in ps}
    if len(forms) > 1 or Int4Groups in forms and len({g.is_q4_0 for _, g in ps}) > 1:
        if not wide and forms != {Int4Groups}:
            return None
        if wide:
            ps = [(r, to_wide(g)) for r, g in ps]
    cls, K = type(ps[0][1]), ps[0][1].q.shape[1]
    fields = {f.name: np.zeros((N, K if f.name == "q" else K // cls.GROUP),
                               ps[0][1].q.dtype if f.name == "q" else np.float32) for f in dataclasses.fields(cls)}
    for r, g in ps:
        for f, a in fields.items():
            a[r] = getattr(g, f)
    return cls(**fields)
