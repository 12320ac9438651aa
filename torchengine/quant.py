"""`--quantization gguf` on a CPU: a GGUF file's 4-bit linears multiplied as they are stored.

A Q4_0 / Q4_1 weight is groups of 32 values along the input dimension, each
w = q * scale + offset with q in 0..15 (`enginecore.model_loader.Int4Groups`,
read from the file's blocks, not dequantized). Two kernels compute with that form:

- `cpu_kernels.torch_ops` (x86 with AVX2, FMA and F16C, and a C compiler): the
  weights in llama.cpp's Q4_1 block layout, the activations quantized to 8 bits
  per block of 32 like llama.cpp's, integer dot products (2x torch's kernel at
  one row on a 2-core AVX2 machine). Results are the dequantized model's up to
  that activation rounding (~1/254 of a block's largest value), as llama.cpp's are.
- torch's own (`_weight_int4pack_mm_for_cpu`, the one gpt-fast and torchao use),
  elsewhere or with `XLASERVE_CPU_KERNELS=off`: w = (q - 8) * scale + zero with
  zero = offset + 8 * scale, from bfloat16 activations, scales and zeros.

Either reads ~5 bits a weight instead of 32. Both are slower than the dense
float32 matmul from some tens of rows, so steps of more than `max_rows` tokens
(prefill) multiply the dequantized float32 weight the model keeps as well.
Greedy tokens may part from `transformers`' after a while; the jax backend has
no such path (XLA:CPU converts a narrow weight to float32 in memory first).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cpu_kernels import layout as qx
from enginecore.model_loader import Int4Groups, Int8Groups, ModelSource
from cpu_kernels.layout import gguf_linear_groups, gguf_panels
from cpu_kernels import torch_ops
from torchengine.cpu_transform import CpuLinear, CpuLMHead

logger = logging.getLogger("xlaserve.torchengine")

_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
MAX_ROWS = 16  # steps of at most this many tokens use torch's 4-bit kernel (measured: bench_dense)
Q4_MAX_ROWS = torch_ops.MAX_ROWS  # and the AVX2 kernel's (its limit; still faster than dense f32 there)
_MODULES = {"qkv_proj": "attn.qkv_proj", "o_proj": "attn.o_proj", "gate_up_proj": "mlp.gate_up_proj",
            "down_proj": "mlp.down_proj"}


class Int4Linear(nn.Module):
    """A linear layer with its weight twice: 4-bit (few rows) and dense float32 (many rows)."""

    def __init__(self, dense: nn.Linear, g: Int4Groups, max_rows: int | None = None, kernel: str = "auto"):
        super().__init__()
        self.dense = dense
        # plain attributes, not buffers (this path is CPU-only, nothing moves them): a decode step reads them
        # 120 times, and a module's buffer lookup costs more than the attribute
        self.bias = None if dense.bias is None else dense.bias.detach()  # shares the parameter's storage
        self.lib = torch_ops.load()[0] if kernel == "auto" else None  # "torch": torch's kernel
        if self.lib is not None:
            self.blocks = torch_ops.pack(g.q, g.scale, g.offset)
            self.max_rows = Q4_MAX_ROWS if max_rows is None else min(max_rows, Q4_MAX_ROWS)
        else:
            q = torch.from_numpy(g.q.astype(np.int32))
            scale = torch.from_numpy(g.scale)
            zero = torch.from_numpy(g.offset) + 8 * scale
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
            # [K / 32, N, 2] bfloat16: the kernel's layout
            self.scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
            self.max_rows = MAX_ROWS if max_rows is None else max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return self.dense(x)
        if self.lib is not None:
            y = torch_ops.gemm(self.lib, x if x.dtype == torch.float32 else x.float(), self.blocks)
        else:
            y = _int4_mm(x.to(torch.bfloat16), self.packed, Int4Groups.GROUP, self.scales_zeros)
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return y if self.bias is None else y + self.bias

    def decode_parts(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int] | None:
        """What `torchengine.cpu_layers.DecodeLayers` reads, where it runs this linear as `forward` does (the AVX2 kernel's
        blocks, the dense copy in `CpuLinear`'s float32 panels): (panels, bias, blocks, row limit)."""
        dense = getattr(self.dense, "decode_parts", None)
        parts = None if dense is None else dense()
        if (self.lib is None or parts is None or parts[0] is None or not self.blocks.is_contiguous()
                or self.blocks.shape[1] != self.dense.in_features // 32 * torch_ops.BLOCK_BYTES
                or self.max_rows > torch_ops.MAX_ROWS):
            return None
        return parts[0], self.bias, self.blocks, self.max_rows


def _stored_linears(model, source: ModelSource, types=qx.GGUF_TYPES, wide: bool = True) -> tuple[
        dict[str, tuple[nn.Module, qx.Groups]], qx.Groups | None]:
    """The decoder linears whose weight the GGUF file stores as a type of `types`, every fused part:
    {module path: (the module, its groups with the rows in the module's order)}, and the LM head's groups if the
    file stores it as one of them (`cpu_kernels.layout.gguf_linear_groups`, `wide` as there)."""
    groups, head = gguf_linear_groups(source, model.arch, types, wide)
    modules = dict(model.named_modules())
    found = {}
    for (layer, stored), g in groups.items():
        path = f"layers.{layer}.{_MODULES[stored]}"
        m = modules.get(path)
        if m is not None and _shape(m) == g.q.shape:
            found[path] = (m, g)
    return found, head


def _shape(m: nn.Module) -> tuple[int, ...] | None:
    """A linear's [out, in] (`Linear`'s or, packed, `CpuLinear`'s); None for another module."""
    return (m.out_features, m.in_features) if hasattr(m, "out_features") else None


def quantize_gguf_linears(model, source: ModelSource) -> int:
    """Give every linear whose weight the GGUF file stores as Q4_0/Q4_1 (all its fused parts) a 4-bit
    path; the model's dense weights must already be loaded. Returns how many linears got one.

    The LM head gets a path for steps of few rows too (`_quantize_lm_head`): the file's Q8_0 blocks where
    the AVX2 kernel runs, else bfloat16 for one row.
    """
    lib, why = torch_ops.load()
    moe = model.arch.moe
    if moe is not None and moe.num_sparse_layers:
        # (cpu_kernels.layout.gguf_linear_groups reads the attention and dense MLP linears only)
        logger.info("--quantization gguf: the experts and shared experts of the %d sparse layers stay float32 (the "
                    "file's blocks dequantized, torchengine.moe's matmuls): there is no 4-bit expert kernel",
                    moe.num_sparse_layers)
    found, head = _stored_linears(model, source, ("Q4_0", "Q4_1", "Q8_0"), wide=False)
    found = {p: (m, g) for p, (m, g) in found.items() if isinstance(g, Int4Groups)}  # Int4Linear's float16 blocks
    modules = dict(model.named_modules())
    for path, (lin, g) in found.items():
        parent_path, _, attr = path.rpartition(".")
        setattr(modules[parent_path], attr, Int4Linear(lin, g))
    if found:
        logger.info("4-bit linears: %s", "the AVX2 kernel (cpu_kernels/csrc)" if lib is not None
                    else f"torch's int4 kernel ({why})")
        q8 = head if isinstance(head, Int8Groups) and lib is not None and model.tp_size == 1 else None
        _quantize_lm_head(model, q8, lib)
    return len(found)


def attach_qx(model, source: ModelSource) -> int:
    """Without --quantization: give float32 weights that are stored in fewer bytes a copy as those bytes,
    `cpu_kernels.qx_gemm`'s panels (`CpuLinear.qx`, `CpuLMHead.qx`), which steps of few rows multiply
    instead of the float32 panels: the same bits (each weight rebuilt exactly as loaded, the same FMA chains),
    a fraction of the bytes a decode step streams.

    - A GGUF file's linears and LM head stored as one of `cpu_kernels.layout.GGUF_TYPES` (0.16 (Q4_1) to 0.38 (the
      wide form) of the bytes): each weight's blocks are checked against its float32 panels first
      (`cpu_kernels.layout.gguf_panels`); one that differs (another loader's arithmetic) keeps float32 only.
    - Any other float32 weight whose every value is a bfloat16 (a bfloat16 checkpoint, which most Hugging Face
      models are, served in float32, the CPU's default dtype), or a float16 (a float16 checkpoint, a GGUF file's
      F16 tensors): those 16 bits (0.5 of the bytes), where they fit in a quarter of the memory available.

    Call after `torchengine.cpu_transform.apply_cpu_kernels`: both read the float32 panels (as
    `jaxengine.loader.attach_cpu_qx` does). Returns how many weights got them."""
    lib = torch_ops.lib()
    if lib is None or getattr(model, "tp_size", 1) != 1:
        return 0
    n = 0
    lm_head = _packed_head(model)
    if getattr(source, "kind", None) == "gguf":
        found, head = _stored_linears(model, source)
        for path, (lin, g) in found.items():
            if type(lin) is CpuLinear and lin.panels is not None and lin.qx is None:
                if got := gguf_panels(lib, path, g, lin.panels.numpy()):
                    lin.qx, lin.qx_kind = torch.from_numpy(got[0]), got[1]
                    n += 1
        if head is not None and lm_head is not None:
            if got := gguf_panels(lib, "the LM head", head, lm_head.panels.numpy()):
                lm_head.qx, lm_head.qx_kind = torch.from_numpy(got[0]), got[1]
                n += 1
    return n + _attach_halves(model)


def _packed_head(model) -> CpuLMHead | None:
    """The model's LM head where it is in float32 panels without qx ones yet."""
    head = getattr(model, "lm_head", None)
    return head if type(head) is CpuLMHead and head.panels is not None and head.qx is None else None


def _attach_halves(model) -> int:
    """attach_qx's 16-bit part: every `CpuLinear` without qx panels, and the LM head, whose values are all
    bfloat16s, or else all float16s, gets them as QX_BF16 / QX_F16 panels (`cpu_kernels.layout.half_copies`)."""
    mods = {n: m for n, m in model.named_modules() if type(m) is CpuLinear and m.qx is None and m.panels is not None}
    panels = {n: m.panels.numpy() for n, m in mods.items()}
    head = _packed_head(model)
    if head is not None:
        panels["the LM head"] = head.panels.numpy()
    got = qx.half_copies(torch_ops.lib(), panels)
    for n, (b, k) in got.items():
        if n == "the LM head":
            head.qx, head.qx_kind = torch.from_numpy(b), k
        else:
            mods[n].qx, mods[n].qx_kind = torch.from_numpy(b), k
    return len(got)


def _quantize_lm_head(model, q8: Int8Groups | None, lib) -> None:
    """The LM head for steps of few rows: the file's Q8_0 blocks `q8` with the AVX2 kernel (exactly the
    file's weights, a quarter of float32's bytes), else a bfloat16 copy for one row (half the bytes)."""
    if q8 is not None:
        blocks = torch_ops.pack8(q8.q, q8.scale)
        model.lm_head_small = lambda h: torch_ops.gemm(lib, h.float(), blocks)
        model.lm_head_small_rows = Q4_MAX_ROWS
        logger.info("LM head: the file's Q8_0 blocks, the AVX2 kernel for steps of <= %d rows", Q4_MAX_ROWS)
        return
    w = model.embed.weight if model.lm_head is None else model.lm_head.weight
    w16 = w.to(torch.bfloat16)
    model.lm_head_small = lambda h: F.linear(h.to(torch.bfloat16), w16).float()
    model.lm_head_small_rows = 1
