"""The CPU kernels (`cpu_kernels.torch_ops`) as a load-time transform of the torch model.

`torchengine.model` is plain torch. After loading, on a CPU where the kernels run and the model is float32,
`apply_cpu_kernels` swaps in modules that call them, as gpt-fast's `quantize.py` swaps in quantized linears:

- every `Linear` (the 4-bit linears' float32 copies too) -> `CpuLinear`: the weight in `panel_gemm`'s panels,
  all of them and the LM head's in one buffer on huge pages (`torch_ops.huge_page_buffer`); the [out, in]
  matrices are freed. `torchengine.quant.attach_qx` may then give a linear (and the head) `qx_gemm` panels of
  the same weights as stored, for steps of few rows;
- the LM head -> `CpuLMHead` (logits, and greedy tokens without writing the logits), and a tied embedding ->
  `PanelEmbedding` (looked up in the head's panels);
- the RMSNorms -> `CpuRMSNorm` (the residual add in the same call; Qwen3's q/k norms on rows of head_dim);
- each attention's `rope_fn` and each MLP's `act_fn` -> the kernels' RoPE (in place) and SiLU-and-mul.

A Mixture-of-Experts layer (`torchengine.model.SparseMoeBlock`): its router, shared expert and shared-expert gate
are `Linear`s and become `CpuLinear`s like the others; each expert's w13 and w2 are packed as panels too
(`CpuExperts`, the stacks freed), a step multiplying only its routed experts' panels by their rows. The one-call
layers refuse the model (the routing is Python's).

`bdot` (`--dtype bfloat16` where `cpu_kernels.layout.bdot_runs`): every linear and the LM head in QX_BDOT's
bfloat16 panels instead, multiplied by their inputs rounded to bfloat16 at every step; the rest float32.

Each kernel computes a row the same way whatever the number of rows in the call (so a request's tokens do not
depend on its neighbours), and each CPU module falls back to torch's ops for an input its kernel does not take.
The one-call layers (`torchengine.cpu_layers.DecodeLayers`) read these modules' panels (`decode_parts`). What
the kernels do not cover stays torch's, logged once (a model that is not float32).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from cpu_kernels import torch_ops
from torchengine.model import MLP, Linear, RMSNorm, SparseMoeBlock, Transformer, apply_rope, silu_and_mul
from torchengine.moe import ACTIVATIONS, sum_routed_experts

logger = logging.getLogger("xlaserve.torchengine")

BDOT = torch_ops.QX_KINDS["BDOT"]
_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
          "_forward_pre_hooks_with_kwargs")


class CpuLinear(nn.Module):
    """A float32 linear on `panel_gemm`'s panels, for every row count (one kernel: a token's hidden state must not
    depend on whether its step was a decode, a mixed step or a recompute; at a decode step's few rows it reads the
    weights at up to twice MKL's speed). With `qx` panels (`torchengine.quant.attach_qx`: a GGUF file's blocks or
    a 16-bit checkpoint's values of the same weights), steps of up to `torch_ops.qx_max_rows()[qx_kind]` rows
    multiply those instead: the same bits from fewer bytes. QX_BDOT (`to_bdot`): bfloat16 products every step,
    no float32 panels."""

    def __init__(self, in_features: int, out_features: int, panels: torch.Tensor | None,
                 bias: torch.Tensor | None, lib: ctypes.CDLL):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # plain attributes, not buffers: a decode step of the Python layers reads them ~120 times
        self.panels = panels  # [ceil(out / 16), in, 16] float32; None with QX_BDOT
        self.bias = bias  # [out] float32 or None
        self.qx: torch.Tensor | None = None  # qx_gemm's panels of qx_kind (uint8)
        self.qx_kind = torch_ops.QX_KINDS["Q4_1"]
        self.lib = lib

    @classmethod
    def pack(cls, linear: nn.Linear, lib: ctypes.CDLL, out: torch.Tensor | None = None) -> "CpuLinear":
        """`linear`'s weight packed into panels (into `out`, `torch_ops.panels_size` floats, when given); its hooks
        (tensor parallelism's all-reduce) come along."""
        bias = None if linear.bias is None else linear.bias.detach()  # (shares the parameter's storage)
        cpu = cls(linear.in_features, linear.out_features, torch_ops.pack_panels(linear.weight.detach(), out), bias,
                  lib)
        for name in _HOOKS:
            if hasattr(linear, name):
                getattr(cpu, name).update(getattr(linear, name))
        return cpu

    def to_bdot(self, out: torch.Tensor | None = None) -> None:
        """The panels rounded to bfloat16 in QX_BDOT's layout (into the bytes `out` when given), which then
        multiply every step; the float32 panels are dropped."""
        self.qx, self.qx_kind, self.panels = torch_ops.bdot_panels(self.panels, out), BDOT, None

    def matrix(self) -> torch.Tensor:
        """The [out, in] weight unpacked (a copy: for checks, not for steps)."""
        if self.panels is None:
            raise ValueError("CpuLinear.matrix: the weight is in QX_BDOT's bfloat16 panels only")
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def decode_parts(self) -> tuple[torch.Tensor | None, torch.Tensor | None, None, int] | None:
        """What `torchengine.cpu_layers.DecodeLayers` reads: (float32 panels, bias, no 4-bit blocks, 0); its qx panels
        separately."""
        if self.panels is None and not (self.qx is not None and self.qx_kind == BDOT):
            return None
        return self.panels, self.bias, None, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x.new_empty((0, self.out_features))
        if self.qx is not None and x.shape[0] <= torch_ops.qx_max_rows()[self.qx_kind]:
            y = torch_ops.qx_gemm(self.lib, x, self.qx, self.out_features, self.qx_kind)
        else:
            y = torch_ops.panel_gemm(self.lib, x, self.panels, self.out_features)
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qx_kind={self.qx_kind}"


class CpuLMHead(nn.Module):
    """The LM head in panels, `CpuLinear`'s for logits (normed hidden [N, H] -> [N, V] float32), and `greedy`:
    each row's argmax [N] int64 with the tiles folded into a running maximum, the logits never written (the
    same tokens as the logits' argmax). `qx`, `qx_kind` as `CpuLinear`'s."""

    def __init__(self, panels: torch.Tensor | None, vocab: int, lib: ctypes.CDLL):
        super().__init__()
        self.panels, self.vocab, self.lib = panels, vocab, lib  # panels [ceil(V / 16), H, 16]; None with QX_BDOT
        self.qx: torch.Tensor | None = None
        self.qx_kind = torch_ops.QX_KINDS["Q8_0"]

    def _use_qx(self, rows: int) -> bool:
        return self.qx is not None and rows <= torch_ops.qx_max_rows()[self.qx_kind]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.shape[0] == 0:
            return h.new_empty((0, self.vocab))
        if self._use_qx(h.shape[0]):
            return torch_ops.qx_gemm(self.lib, h, self.qx, self.vocab, self.qx_kind)
        return torch_ops.panel_gemm(self.lib, h, self.panels, self.vocab)

    def greedy(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, H] (N > 0), normed -> [N] int64."""
        if self._use_qx(h.shape[0]):  # the float32 panels' bits, so the same tokens
            return torch_ops.qx_gemm(self.lib, h, self.qx, self.vocab, self.qx_kind, greedy=True)
        return torch_ops.panel_gemm(self.lib, h, self.panels, self.vocab, greedy=True)


class PanelEmbedding(nn.Module):
    """A tied embedding looked up in the LM head's panels: ids [T] -> [T, H]."""

    def __init__(self, panels: torch.Tensor):
        super().__init__()
        self.panels = panels

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch_ops.panel_rows(self.panels, ids)


class CpuRMSNorm(RMSNorm):
    """RMSNorm of [T, H] rows in one call (F.rms_norm is six ops), the residual add in place in the same call;
    any other input on torch's ops."""

    def __init__(self, norm: RMSNorm, lib: ctypes.CDLL):
        nn.Module.__init__(self)  # (not RMSNorm's: this one takes the loaded norm's weight, not a new one)
        self.eps, self.weight, self.lib = norm.eps, norm.weight, lib

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if (x.dim() == 2 and x.stride(1) == 1 and x.dtype == torch.float32
                and (residual is None or (residual.dtype == torch.float32 and residual.is_contiguous()))):
            out = torch_ops.rms_norm(self.lib, x, self.weight, self.eps, residual)
            return out if residual is None else (out, residual)
        return super().forward(x, residual)


class CpuRope:
    """`apply_rope` for an attention's `rope_fn`: a float32 x [T, H, D] with contiguous heads rotated in place,
    in one call; any other on torch's ops."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
            return torch_ops.rope_(self.lib, x, cos, sin)
        return apply_rope(x, cos, sin)


class CpuSiluAndMul:
    """`silu_and_mul` for an MLP's `act_fn`: a contiguous float32 gate_up [T, 2I] in one call."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype == torch.float32 and gate_up.is_contiguous():
            return torch_ops.silu_mul(self.lib, gate_up)
        return silu_and_mul(gate_up)


class CpuExperts:
    """A `SparseMoeBlock`'s experts as `panel_gemm` panels, one pair per local expert: w13[e] [2I, H] and
    w2[e] [H, I]. Called as the block's `experts`: (x [T, H], topk_weights, topk_ids [T, K], expert_map) ->
    [T, H], `torchengine.moe.sum_routed_experts`' sum (ascending expert order) with the panels' products, which
    give a row the same bits whatever rows share its expert (MKL's small-row GEMMs do not, and read a weight
    at about half the speed at a decode step's few rows)."""

    def __init__(self, w13: list[torch.Tensor], w2: list[torch.Tensor], two_i: int, hidden: int,
                 lib: ctypes.CDLL, activation: str = "silu", w13_bias: torch.Tensor | None = None,
                 w2_bias: torch.Tensor | None = None):
        self.w13, self.w2, self.two_i, self.hidden, self.lib = w13, w2, two_i, hidden, lib
        self.activation, self.w13_bias, self.w2_bias = activation, w13_bias, w2_bias

    def __len__(self) -> int:
        return len(self.w13)

    def matrices(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (w13 [2I, H], w2 [H, I]) unpacked (copies, for checks)."""
        def unpack(p, rows):
            return p.transpose(1, 2).reshape(-1, p.shape[1])[:rows]

        return unpack(self.w13[e], self.two_i), unpack(self.w2[e], self.hidden)

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 expert_map: torch.Tensor | None = None) -> torch.Tensor:
        def expert_mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
            h = torch_ops.panel_gemm(self.lib, rows, self.w13[e], self.two_i)
            if self.w13_bias is not None:
                h.add_(self.w13_bias[e])
            h = torch_ops.silu_mul(self.lib, h) if self.activation == "silu" else ACTIVATIONS[self.activation](h)
            y = torch_ops.panel_gemm(self.lib, h, self.w2[e], self.hidden)
            return y if self.w2_bias is None else y.add_(self.w2_bias[e])

        return sum_routed_experts(x.contiguous(), topk_weights, topk_ids, len(self.w13), expert_map, expert_mlp)


@dataclass(frozen=True)
class CpuWeights:
    """What `apply_cpu_kernels` packed."""

    packed: int  # weights put in panels: the linears, the LM head and each expert's two
    arena: torch.Tensor | None  # the one buffer of all their panels (QX_BDOT's: their bytes); None if none


def apply_cpu_kernels(model: Transformer, bdot: bool = False) -> CpuWeights:
    """Swap `model`'s modules for the CPU kernels' (this module's docstring), in place, where the kernels run and
    the model is float32; a no-op elsewhere. Call once, after loading and after `torchengine.quant`'s
    `quantize_gguf_linears` (which reads the matrices); a second call packs nothing."""
    lib, why = torch_ops.load()
    if lib is None:
        return CpuWeights(0, None)  # (the runner logs why)
    if model.final_norm.weight.dtype != torch.float32 or not model.final_norm.weight.is_cpu:
        logger.info("CPU kernels: the model runs on torch's ops (%s %s weights; the kernels take float32 on a CPU)",
                    model.final_norm.weight.device.type, model.final_norm.weight.dtype)
        return CpuWeights(0, None)
    for layer in model.layers:
        for name in ("attn_norm", "mlp_norm"):
            if type(getattr(layer, name)) is RMSNorm:
                setattr(layer, name, CpuRMSNorm(getattr(layer, name), lib))
        for name in ("q_norm", "k_norm"):  # (Qwen3: rows of head_dim, as the one-call layers normalise them)
            if type(getattr(layer.attn, name)) is RMSNorm:
                setattr(layer.attn, name, CpuRMSNorm(getattr(layer.attn, name), lib))
        layer.attn.rope_fn = CpuRope(lib)
        for mlp in layer.mlp.modules():  # the dense MLP, or a MoE layer's shared expert
            if isinstance(mlp, MLP):
                mlp.act_fn = CpuSiluAndMul(lib)
    if type(model.final_norm) is RMSNorm:
        model.final_norm = CpuRMSNorm(model.final_norm, lib)
    return _pack_weights(model, lib, bdot)


def _pack_weights(model: Transformer, lib: ctypes.CDLL, bdot: bool) -> CpuWeights:
    """Every float32 `Linear` -> `CpuLinear` and the LM head -> `CpuLMHead`, their panels in one buffer."""
    modules = dict(model.named_modules())
    linears = [(name, m) for name, m in modules.items()
               if type(m) is Linear and torch_ops.lib_for(m.weight) is not None]
    head = None
    if model.lm_head is None or isinstance(model.lm_head, nn.Linear):  # not already a CpuLMHead
        w = model.embed.weight if model.lm_head is None else model.lm_head.weight
        head = w if torch_ops.lib_for(w) is not None else None
    blocks = [m for m in modules.values() if isinstance(m, SparseMoeBlock) and m.experts is None
              and torch_ops.lib_for(m.w13, m.w2) is not None]
    sizes = [torch_ops.panels_size(m.weight) for _, m in linears] + ([torch_ops.panels_size(head)] if head is not None
                                                                     else [])
    expert_sizes = [torch_ops.panels_size(b.w13[0]) + torch_ops.panels_size(b.w2[0]) for b in blocks]
    if not sizes and not blocks:
        return CpuWeights(0, None)
    # one buffer for all of them, on huge pages where the OS gives them; QX_BDOT's panels take 2 bytes a float,
    # the experts' float32 panels come after them
    dense = sum(sizes) // (2 if bdot else 1)
    arena = torch_ops.huge_page_buffer(dense + sum(n * len(b.w13) for n, b in zip(expert_sizes, blocks)))
    offsets = np.cumsum([0] + sizes)
    start = dense
    for block in blocks:
        w13, w2 = [], []
        for e in range(block.w13.shape[0]):
            for w, dst in ((block.w13[e], w13), (block.w2[e], w2)):
                n = torch_ops.panels_size(w)
                dst.append(torch_ops.pack_panels(w.detach(), arena[start : start + n]))
                start += n
        two_i, hidden = block.w13.shape[1], block.w2.shape[1]
        block.experts = CpuExperts(w13, w2, two_i, hidden, lib, block.activation)
        block.w13 = block.w2 = None  # freed (the experts are the panels now)
    raw = arena.view(torch.uint8)
    for (name, m), a, b in zip(linears, offsets, offsets[1:]):
        if bdot:  # each through float32 panels of its own, dropped once rounded
            cpu = CpuLinear.pack(m, lib)
            cpu.to_bdot(raw[2 * a : 2 * b])
        else:
            cpu = CpuLinear.pack(m, lib, arena[a:b])
        parent, _, attr = name.rpartition(".")
        setattr(modules[parent], attr, cpu)
        m.weight = None  # freed now, not when `modules` goes (the peak stays one matrix above the panels)
    if head is not None:
        a, b = offsets[-2], offsets[-1]
        if bdot:
            cpu_head = CpuLMHead(None, model.arch.vocab_size, lib)
            cpu_head.qx, cpu_head.qx_kind = torch_ops.bdot_panels(torch_ops.pack_panels(head), raw[2 * a : 2 * b]), BDOT
        else:
            cpu_head = CpuLMHead(torch_ops.pack_panels(head, arena[a:b]), model.arch.vocab_size, lib)
            if model.lm_head is None:  # tied: the embedding matrix is freed, looked up in the panels
                model.embed = PanelEmbedding(cpu_head.panels)
        model.lm_head = cpu_head
    return CpuWeights(len(sizes) + sum(2 * len(b.experts) for b in blocks), arena)
