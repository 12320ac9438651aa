"""Float32 weights as they are stored: `qx_gemm`'s panels (torchengine/cpu_kernels.c), shared by both backends.

A GGUF file's Q4_0 / Q4_1 / Q8_0 weights served in float32 are each one rounding of an exact product of its
blocks' values, and a bfloat16 checkpoint's weights served in float32 are bfloat16s: `qx_gemm` rebuilds each
weight exactly from those bytes and sums it in panel_gemm's order, so a decode step of few rows, which streams
its weights from memory, computes the float32 model's bits from a sixth (Q4) or half (BF16) of the bytes. The
torch backend's `torchengine.quant.attach_qx` and the jax backend's `jaxengine.loader.attach_cpu_qx` keep these
panels beside the float32 ones; this module packs them (numpy), reads a GGUF file's groups per linear and checks
the blocks against the float32 panels with the kernels' own rebuild (`rebuilds`).
"""

from __future__ import annotations

import logging
import sys

import numpy as np

from enginecore.arch import ArchConfig, fused_slices, weight_spec
from enginecore.model_loader import Int4Groups, Int8Groups, ModelSource

PANEL = 16  # output rows a panel (panel_gemm's)
QX_KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "BF16": 3}  # the C file's QX_*
# steps of at most this many rows multiply a weight's `qx_gemm` panels (where it has them) instead of its float32
# ones: the same bits in fewer bytes (Q4 0.16, Q8_0 0.27, BF16 0.5 of float32's); rebuilding the weights for every
# few rows costs more than streaming float32 from ~10 (Q4) or ~16 (BF16) rows on (a decode step's linears,
# SmolLM2-135M, 2-core Zen 4, `bench_kernels_ab --what qx [--qx-kind bf16]`: Q4 2.9x at 1 row, 2.3x at 4, 1.0-1.25x
# at 8, 0.8x at 12; BF16 1.9x at 1, 2.1x at 4, 1.8x at 6, 1.4x at 8, 1.1x at 12, 1.04x at 16)
QX_MAX_ROWS = {QX_KINDS["Q4_0"]: 8, QX_KINDS["Q4_1"]: 8, QX_KINDS["Q8_0"]: 8, QX_KINDS["BF16"]: 12}
MAX_QX_ROWS = max(QX_MAX_ROWS.values())
# bytes of a panel's group of 32 k (the C file's qx_group_bytes): 16 scales and 16 offsets (float16), then 32 k
# of 16 nibbles; Q8_0 16 scales, then 32 k of 16 bytes; BF16 32 k of 16 bfloat16s
QX_GROUP_BYTES = {QX_KINDS["Q4_0"]: 64 + 32 * 8, QX_KINDS["Q4_1"]: 64 + 32 * 8, QX_KINDS["Q8_0"]: 32 + 32 * 16,
                  QX_KINDS["BF16"]: 32 * 16 * 2}


logger = logging.getLogger(__name__)
# a bfloat16's bits are a float32's high half: the second uint16 of each float32 on a little-endian machine (all
# that run the AVX2 kernels); elsewhere nothing is bfloat16-exact here
_LITTLE = sys.byteorder == "little"


def enabled() -> bool:
    """Whether the runners keep the weights as stored beside float32 (`XLASERVE_Q4X=off`: float32 only, every
    kind; the variable is named for the first)."""
    import os

    return os.environ.get("XLASERVE_Q4X", "on") != "off"


def bf16_exact(w: np.ndarray) -> bool:
    """Whether every value of the float32 `w` is a bfloat16 (its low 16 bits zero: a bfloat16 checkpoint's weight
    served in float32), so its high halves hold it exactly. Reads the low halves in place (no copy)."""
    return (_LITTLE and w.dtype == np.float32 and w.flags.c_contiguous and w.size > 0
            and not w.view(np.uint16)[..., 0::2].any())


def bf16_copies_fit(nbytes: int) -> bool:
    """Whether bfloat16 copies of `nbytes` fit in a quarter of the memory available (both backends keep them
    beside the float32 weights, so they are half of float32's bytes again); True where that cannot be read."""
    from enginecore.kv_cache import available_memory_bytes

    avail = available_memory_bytes()
    if avail is None or nbytes <= avail // 4:
        return True
    logger.info("bfloat16 weights: their %.1f GiB copy would take more than a quarter of the memory available "
                "(%.1f GiB); float32 only", nbytes / 2**30, avail / 2**30)
    return False


def qx_shape(N: int, K: int, kind: int) -> tuple[int, int, int]:
    """The panels' shape of an [N, K] weight of `kind`: [ceil(N / 16), K / 32, group bytes]."""
    return -(-N // PANEL), K // 32, QX_GROUP_BYTES[kind]


def pack_q4x(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None) -> np.ndarray:
    """Int4Groups arrays (q [N, K] in 0..15, scale / offset [N, K/32], float16-exact; offset None: Q4_0, whose
    weights are scale * (q - 8)) -> `qx_gemm`'s panels, uint8 [ceil(N / 16), K / 32, 320]: per panel and group
    of 32 k, the 16 rows' scales and offsets (float16), then per k 8 bytes, byte j row j's q | row j + 8's << 4
    (zero rows pad the last panel)."""
    N, K = q.shape
    G, P = K // 32, -(-N // PANEL)
    qp = np.zeros((P * PANEL, K), np.uint8)
    qp[:N] = q
    qp = qp.reshape(P, PANEL, G, 32).transpose(0, 2, 3, 1)  # [P, G, 32 k, 16 rows]
    out = np.empty((P, G, QX_GROUP_BYTES[QX_KINDS["Q4_1"]]), np.uint8)
    _pack_f16(out, 0, scale, P)
    _pack_f16(out, 32, offset, P)
    out[:, :, 64:] = (qp[..., :8] | (qp[..., 8:] << 4)).reshape(P, G, 256)
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
    _pack_f16(out, 0, scale, P)
    out[:, :, 32:] = qp.reshape(P, PANEL, G, 32).transpose(0, 2, 3, 1).reshape(P, G, 512).view(np.uint8)
    return out


def bf16_panels(panels: np.ndarray) -> np.ndarray | None:
    """float32 panels [..., NP, K, 16] (panel_gemm's) -> the same weights' QX_BF16 panels [..., NP, K / 32, 1024]
    (the layouts agree: per panel and k the 16 rows), or None unless every value is a bfloat16 and K a multiple
    of 32."""
    *lead, NP, K, rows = panels.shape
    if rows != PANEL or K % 32 or not bf16_exact(panels):
        return None
    return np.ascontiguousarray(panels.view(np.uint16)[..., 1::2]).view(np.uint8).reshape(
        *lead, NP, K // 32, QX_GROUP_BYTES[QX_KINDS["BF16"]])


def rebuilds(lib, what: str, packed: np.ndarray, kind: int, N: int, panels: np.ndarray) -> bool:
    """Whether the qx panels `packed` (of `kind`) rebuild every weight of the float32 panels `panels` ([ceil(N /
    16), K, 16], panel_gemm's) to its bits, as qx_gemm rebuilds them (the kernels' `qx_mismatches`, in place: `lib`
    either backend's build); else a warning that `what` keeps float32 only (a GGUF file's blocks that another
    loader's arithmetic dequantized otherwise)."""
    K = panels.shape[1] if panels.ndim == 3 else -1
    ok = (panels.dtype == np.float32 and panels.flags.c_contiguous and panels.shape == (-(-N // PANEL), K, PANEL)
          and K % 32 == 0 and packed.dtype == np.uint8 and packed.flags.c_contiguous
          and packed.shape == qx_shape(N, K, kind))
    if ok and lib.qx_mismatches(packed.ctypes.data, kind, K, N, panels.ctypes.data) == 0:
        return True
    logger.warning("%s: the GGUF blocks do not give the loaded float32 weight bit for bit; it keeps float32 only",
                   what)
    return False


def gguf_panels(lib, what: str, g: Int4Groups | Int8Groups, panels: np.ndarray) -> tuple[np.ndarray, int] | None:
    """A GGUF file's Q4_0 / Q4_1 / Q8_0 groups of a weight -> (its qx panels, their kind) if they rebuild the
    loaded float32 panels `panels` bit for bit (`rebuilds`), else None."""
    if isinstance(g, Int8Groups):
        packed, kind = pack_q8x(g.q, g.scale), QX_KINDS["Q8_0"]
    else:
        q40 = g.is_q4_0
        packed, kind = pack_q4x(g.q, g.scale, None if q40 else g.offset), QX_KINDS["Q4_0" if q40 else "Q4_1"]
    return (packed, kind) if rebuilds(lib, what, packed, kind, g.q.shape[0], panels) else None


def _pack_f16(out: np.ndarray, at: int, a: np.ndarray | None, P: int) -> None:
    """a [N, G] (None: zeros) as float16 into bytes [at, at + 32) of out [P, G, :], the 16 rows of a panel in order."""
    G = out.shape[1]
    h = np.zeros((P * PANEL, G), np.float16)
    if a is not None:
        h[: a.shape[0]] = a
    out[:, :, at : at + 32] = h.reshape(P, PANEL, G).transpose(0, 2, 1).copy().view(np.uint8)


def gguf_linear_groups(source: ModelSource, arch: ArchConfig) -> tuple[dict[tuple[int, str], Int4Groups],
                                                                       Int8Groups | None]:
    """The decoder linears whose weight the GGUF file stores as Q4_0/Q4_1, every fused part: {(layer, the
    stored linear: "qkv_proj", "o_proj", "gate_up_proj" or "down_proj"): its groups, the rows in the fused
    weight's order}, and the LM head's groups if the file stores it as Q8_0. One pass over the file's quantized
    tensors; a linear with a fused part stored in another type has none."""
    head_name = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
    head = None
    parts: dict[tuple[int, str], dict] = {}  # -> {"q", "scale", "offset": row-assembled arrays, "rows", "N"}
    for hf_name, g in source.iter_quantized_weights():
        if isinstance(g, Int8Groups):
            head = g if hf_name == head_name else head
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
        K = g.q.shape[1]
        p = parts.setdefault((layer, stored), {
            "q": np.zeros((N, K), np.uint8), "scale": np.zeros((N, K // Int4Groups.GROUP), np.float32),
            "offset": np.zeros((N, K // Int4Groups.GROUP), np.float32), "rows": 0, "N": N})
        for key in ("q", "scale", "offset"):
            p[key][rows] = getattr(g, key)
        p["rows"] += rows.stop - rows.start
    return {key: Int4Groups(p["q"], p["scale"], p["offset"]) for key, p in parts.items() if p["rows"] == p["N"]}, head
