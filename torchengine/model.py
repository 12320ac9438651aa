"""One Llama-family decoder for every supported architecture, read top to bottom.

Llama 2/3, SmolLM2 (tied embeddings), Mistral (explicit head_dim, optional
sliding window), Qwen2 (q/k/v biases) and Qwen3 (per-head RMSNorm of q and k)
differ only in their `enginecore.arch.ArchConfig`, whose field names this file
reads as they are.

The model sees one ragged step: all scheduled tokens flattened into
`input_ids [T]` with their `positions [T]`. It owns no KV cache and knows
nothing about blocks: every attention layer calls the `AttentionFn` handed to
`forward`, `attn(layer_idx, q, k, v) -> o`, which writes k/v into the paged
cache and attends (see `torchengine.attention`). Tensor parallelism is applied
afterwards as a transform (`torchengine.tensor_parallel`), so this file stays
single-device code.

Weights come from `ModelSource.iter_weights()` (numpy, Hugging Face names and
[out, in] layout) through the shared weight table (`enginecore.arch.WEIGHTS`);
q/k/v and gate/up are fused into one matmul each. Parameters are named after
their logical names (`attn.qkv_proj`, `mlp.down_proj`, ...).
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cpu_kernels import layout as qx
from enginecore.arch import ArchConfig, ModelLoadError, fused_slices, rope_cos_sin, weight_spec
from cpu_kernels import torch_ops

# attn(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> o [T, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated (rotate-half convention), math in float32.

    cos [T, 1, D] is cos(pos * freq) repeated for both halves and sin [T, 1, D] is -sin, +sin (the tables
    `Transformer.forward` looks up once a step): x * cos + swap_halves(x) * sin is transformers'
    `x * cos + rotate_half(x) * sin`, in three ops (on a CPU each op of a decode step costs more in dispatch
    than in arithmetic, so q and k of a layer are rotated in one call). On a CPU with `cpu_kernels.torch_ops`,
    a float32 x is rotated in place, in one call.
    """
    T, H, D = x.shape
    lib = torch_ops.lib_for(x)
    if lib is not None and x.stride(2) == 1 and x.stride(1) == D:
        return torch_ops.rope_(lib, x, cos, sin)
    xf = x if x.dtype == torch.float32 else x.float()
    swapped = xf.view(T, H, 2, D // 2).flip(2).view(T, H, D)
    out = torch.addcmul(xf * cos, swapped, sin)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


# ---------------------------------------------------------------------------------
# layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, given the residual stream, (norm(residual + x), residual + x) (on a CPU with the
        kernels, float32: the add in place on `residual`, in the same call)."""
        lib = torch_ops.lib_for(x) if residual is None else torch_ops.lib_for(x, residual)
        if lib is not None and x.dim() == 2 and x.stride(1) == 1 and (residual is None or residual.is_contiguous()):
            out = torch_ops.rms_norm(lib, x, self.weight, self.eps, residual)  # one call: F.rms_norm is six ops
            return out if residual is None else (out, residual)
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one op for the same arithmetic
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class _Loaded:
    """Mixed into the modules `build_model` makes on the meta device: their parameters always come from
    `load_weights` (or whoever builds one), so torch's random init is skipped. Run on meta tensors, that init
    imported torch._dynamo, ~2.4 s of every start on 2 cores."""

    def reset_parameters(self) -> None:
        pass


class _Embedding(_Loaded, nn.Embedding):
    pass


class _Head(_Loaded, nn.Linear):
    pass


def bdot_panels(panels: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 panels [NP, K, 16] -> QX_BDOT's [NP, K / 32, 1024] bytes (`cpu_kernels.layout.bdot_panels`), into `out`
    (contiguous uint8 of as many bytes) when given."""
    dst = None if out is None else out.numpy().reshape(qx.bdot_shape(tuple(panels.shape)))
    return torch.from_numpy(qx.bdot_panels(torch_ops.lib(), panels.numpy(), dst))


class Linear(_Loaded, nn.Linear):
    """nn.Linear; on a CPU with `cpu_kernels.torch_ops`, float32, once packed (`pack`, at load): the weight
    in `cpu_kernels.panel_gemm`'s panels, for every step (before that, `cpu_kernels.f32_gemm`).

    One kernel for every row count: a token's hidden state must not depend on whether its step was a decode,
    a mixed step or a recompute after preemption (MKL's sgemm for some steps and the kernel for others
    gave different bits), and at a decode step's few rows the kernel reads the weights at up to twice
    MKL's speed.
    """

    panels: torch.Tensor | None = None  # [ceil(out / 16), in, 16] once packed; `weight` is None then
    # this float32 weight as a GGUF file's Q4_1 or Q4_0 blocks, or as bfloat16 where every value is one
    # (`torchengine.quant.attach_qx`; qx_kind: torch_ops.QX_KINDS): `cpu_kernels.qx_gemm`'s panels, for steps of
    # up to torch_ops.qx_max_rows()[qx_kind] rows (the same bits). QX_BDOT (`Transformer.pack_cpu_weights(bdot=
    # True)`): the weight in bfloat16 for every step, `panels` None
    qx: torch.Tensor | None = None
    qx_kind = torch_ops.QX_KINDS["Q4_1"]

    def packable(self) -> bool:
        return self.panels is None and self.weight is not None and torch_ops.lib_for(self.weight) is not None

    def pack(self, out: torch.Tensor | None = None) -> bool:
        """The weight into panels (`cpu_kernels.pack_panels`, into `out` when given), where the kernels run on
        it; the [out, in] matrix is freed. True if packed."""
        if not self.packable():
            return False
        self.panels = torch_ops.pack_panels(self.weight.detach(), out)
        self.weight = None
        return True

    def to_bdot(self, out: torch.Tensor | None = None) -> None:
        """The packed weight rounded to bfloat16 in QX_BDOT's panels (`cpu_kernels.layout.bdot_panels`, into the bytes
        `out` when given), which then multiply every step; the float32 panels are dropped."""
        self.qx = bdot_panels(self.panels, out)
        self.qx_kind, self.panels = torch_ops.QX_KINDS["BDOT"], None

    def matrix(self) -> torch.Tensor:
        """The [out, in] weight, packed or not (a copy when packed: for checks, not for steps)."""
        if self.panels is None:
            return self.weight
        return self.panels.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None or self.qx is not None:
            if x.shape[0] == 0:
                return x.new_empty((0, self.out_features))
            if self.qx is not None and x.shape[0] <= torch_ops.qx_max_rows()[self.qx_kind]:
                y = torch_ops.qx_gemm(torch_ops.lib(), x, self.qx, self.out_features, self.qx_kind)
            else:
                y = torch_ops.panel_gemm(torch_ops.lib(), x, self.panels, self.out_features)
            return y if self.bias is None else y.add_(self.bias)
        lib = torch_ops.lib_for(x, self.weight)
        if lib is not None and x.dim() == 2 and x.shape[0] > 0 and self.weight.is_contiguous():
            y = torch_ops.f32_gemm(lib, x, self.weight)
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        # per-device head counts: the tensor-parallel transform divides them
        self.num_heads, self.num_kv_heads = arch.num_attention_heads, arch.num_key_value_heads
        self.head_dim = D = arch.head_dim
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * D
        self.qkv_proj = Linear(arch.hidden_size, qkv_out, bias=arch.attention_bias)
        self.o_proj = Linear(self.num_heads * D, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(D, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(D, arch.rms_norm_eps) if arch.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H], or [len(keep), H] for rows `keep` alone (their attention output gathered before
        o_proj; every row's K and V are written all the same)."""
        T, hd = x.shape[0], self.head_dim
        q_size, kv_size = self.num_heads * hd, self.num_kv_heads * hd
        qkv = self.qkv_proj(x)
        qk = qkv[:, : q_size + kv_size].view(T, self.num_heads + self.num_kv_heads, hd)
        v = qkv[:, q_size + kv_size :].view(T, self.num_kv_heads, hd)
        if self.q_norm is not None:
            # as rows of D: on a CPU the C rms_norm, the one-call layers' (cpu_kernels.torch_ops.DecodeLayers) bits
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads].reshape(-1, hd)).view(T, self.num_heads, hd),
                            self.k_norm(qk[:, self.num_heads :].reshape(-1, hd)).view(T, self.num_kv_heads, hd)], dim=1)
        qk = apply_rope(qk, cos, sin)  # q and k heads together
        o = attn(self.layer_idx, qk[:, : self.num_heads], qk[:, self.num_heads :], v)  # [T, Hq, D]
        if keep is not None:
            o = o[keep]
        return self.o_proj(o.reshape(o.shape[0], q_size))


class MLP(nn.Module):
    def __init__(self, arch: ArchConfig):
        super().__init__()
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)  # fused
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        lib = torch_ops.lib_for(gate_up)
        if lib is not None and gate_up.is_contiguous():
            return self.down_proj(torch_ops.silu_mul(lib, gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.attn = Attention(arch, layer_idx)
        self.mlp_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionFn, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) -> (this layer's MLP output, the residual stream before it): the stream's adds are
        done by the next norm (vLLM's fused add + RMSNorm). The first layer gets residual None. With `keep`
        (row indices), both for those rows alone: the o linear and the MLP run on them only."""
        if residual is None:
            residual, h = x, self.attn_norm(x)
        else:
            h, residual = self.attn_norm(x, residual)
        if keep is not None:
            residual = residual[keep]
        h, residual = self.mlp_norm(self.attn(h, cos, sin, attn, keep), residual)
        return self.mlp(h), residual


class Transformer(nn.Module):
    """The decoder. `forward` -> hidden states [T, H]; `compute_logits` on the rows you need."""

    def __init__(self, arch: ArchConfig, max_positions: int):
        super().__init__()
        self.arch = arch
        self.max_positions = max_positions
        self.tp_rank, self.tp_size = 0, 1  # set by torchengine.tensor_parallel.apply_tensor_parallel
        # LM heads of 2 to this many rows run weights first (compute_logits); the runner sets it on a CPU
        self.weights_first_rows = 0
        # --quantization gguf (torchengine.quant): the LM head as the file stores it (or in bfloat16) for steps
        # of up to lm_head_small_rows rows: normed hidden [N, H] -> logits [N, V] float32
        self.lm_head_small: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.lm_head_small_rows = 0
        # the LM head as a GGUF file's Q8_0 blocks, or as bfloat16 where every value is one
        # (`torchengine.quant.attach_qx`): `cpu_kernels.qx_gemm`'s panels of the same weights, of head_qx_kind,
        # for steps of up to torch_ops.qx_max_rows()[head_qx_kind] rows (the same bits)
        self.head_qx: torch.Tensor | None = None
        self.head_qx_kind = torch_ops.QX_KINDS["Q8_0"]
        self.embed = _Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_hidden_layers))
        self.final_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # tied models read the embedding matrix in compute_logits (no shared Parameter to keep tied)
        self.lm_head = None if arch.tie_word_embeddings else _Head(arch.hidden_size, arch.vocab_size, bias=False)
        # on a CPU with the kernels, float32: the LM head in `cpu_kernels.panel_gemm`'s panels (pack_lm_head), which
        # then replace the [V, H] matrix (a tied model's embedding lookup reads them too)
        self.head_panels: torch.Tensor | None = None
        self.cpu_arena: torch.Tensor | None = None  # pack_cpu_weights' one buffer of every panel (QX_BDOT's: their bytes)
        # [max_positions, D] float32 whatever the model dtype, in apply_rope's form: filled by init_rope()
        self.register_buffer("rope_cos", torch.empty(max_positions, arch.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(max_positions, arch.head_dim), persistent=False)

    def init_rope(self) -> None:
        device = self.embed.weight.device
        cos, sin = rope_cos_sin(self.arch, self.max_positions)  # [P, D/2] each
        self.rope_cos = torch.from_numpy(np.concatenate([cos, cos], -1)).to(device)
        self.rope_sin = torch.from_numpy(np.concatenate([-sin, sin], -1)).to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T], positions [T] -> hidden [T, H] (before the final norm); with `keep` (row indices, the
        rows a step samples from) hidden [len(keep), H] of those rows: the last layer runs its o linear and MLP
        on them alone (on the CPU panels, which give a row the same bits whatever the row count, the same bits;
        docs/design-notes.md)."""
        cos = self.rope_cos[positions][:, None, :]  # [T, 1, D] f32, shared by every layer
        sin = self.rope_sin[positions][:, None, :]
        x, residual = self.embed(input_ids), None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, cos, sin, attn, keep if i == last else None)
        return residual + x

    def pack_cpu_weights(self, bdot: bool = False) -> int:
        """On a CPU with `cpu_kernels.torch_ops` and float32 weights: every `Linear` (the 4-bit linears'
        float32 copies too) and the LM head into `cpu_kernels.panel_gemm`'s panels, for every step (the LM head
        also gives greedy tokens without logits: `greedy_tokens`); the [out, in] matrices are freed (a tied
        embedding is then looked up in the LM head's panels). Returns how many were packed. Call once, after
        loading (and after `torchengine.quant`, which reads the matrices).

        `bdot` (`--dtype bfloat16` where `cpu_kernels.layout.bdot_runs`): every linear and the LM head in QX_BDOT's
        bfloat16 panels instead, multiplied by their inputs rounded to bfloat16 at every step; the rest of the
        model (embedding, norms, RoPE, attention, the residual stream) float32."""
        linears = [m for m in self.modules() if isinstance(m, Linear) and m.packable()]
        head = None
        if self.head_panels is None and self.head_qx is None:
            w = self.embed.weight if self.lm_head is None else self.lm_head.weight
            head = w if torch_ops.lib_for(w) is not None else None
        sizes = [torch_ops.panels_size(m.weight) for m in linears] + ([torch_ops.panels_size(head)] if head is not None else [])
        if not sizes:
            return 0
        # one buffer for all of them, on huge pages where the OS gives them (`cpu_kernels.huge_page_buffer`);
        # QX_BDOT's panels take 2 bytes a float32 panel's float
        arena, offsets = torch_ops.huge_page_buffer(sum(sizes) // (2 if bdot else 1)), np.cumsum([0] + sizes)
        self.cpu_arena = arena
        if bdot:  # each through float32 panels of its own, dropped once rounded
            raw = arena.view(torch.uint8)
            for m, a, b in zip(linears, offsets, offsets[1:]):
                m.pack()
                m.to_bdot(raw[2 * a : 2 * b])
            if head is not None:
                self.head_qx = bdot_panels(torch_ops.pack_panels(head), raw[2 * offsets[-2] : 2 * offsets[-1]])
                self.head_qx_kind, self.lm_head = torch_ops.QX_KINDS["BDOT"], None
            return len(sizes)
        for m, a, b in zip(linears, offsets, offsets[1:]):
            m.pack(arena[a:b])
        if head is not None:
            self.head_panels = torch_ops.pack_panels(head, arena[offsets[-2] : offsets[-1]])
            if self.lm_head is None:
                self.embed = PanelEmbedding(self.head_panels)
            self.lm_head = None
        return len(sizes)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [N, H] -> logits [N, V] float32
        h = self.final_norm(hidden)
        n = h.shape[0]
        if self.lm_head_small is not None and 0 < n <= self.lm_head_small_rows:
            return self.lm_head_small(h)
        if self.head_panels is not None or self.head_qx is not None:  # a row's logits the same whatever the rows
            if n == 0:
                return h.new_empty((0, self.arch.vocab_size))
            if self._head_qx(n):  # the same bits
                return torch_ops.qx_gemm(torch_ops.lib(), h, self.head_qx, self.arch.vocab_size, self.head_qx_kind)
            return torch_ops.panel_gemm(torch_ops.lib(), h, self.head_panels, self.arch.vocab_size)
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        if n > 0 and w.is_contiguous():
            lib = torch_ops.lib_for(h, w)
            if lib is not None:  # as Linear: each row's logits the same whatever the row count; 2-3x MKL at 1-4
                return torch_ops.f32_gemm(lib, h, w)
        if 0 < n <= self.weights_first_rows:
            # w @ h^T: on a CPU 2-4x faster than h @ w^T for a few rows of a large vocabulary (MKL's small-M
            # gemm reads the weight badly; see jaxengine.model.dense and benchmarks/bench_dense.py). One row
            # goes as two: MKL's matrix-vector product reads [V, H] at half the speed of its 2-column gemm.
            hh = h.expand(2, h.shape[1]).contiguous() if n == 1 else h
            return torch.mm(w, hh.t())[:, :n].t().contiguous().float()
        return F.linear(h, w).float()

    def _head_qx(self, rows: int) -> bool:
        """Whether `rows` rows multiply the LM head's qx panels (`head_qx`) instead of its float32 ones."""
        return self.head_qx is not None and rows <= torch_ops.qx_max_rows()[self.head_qx_kind]

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, H] -> [N] int64, `compute_logits(hidden).argmax(-1)` without writing the logits (the LM
        head in panels, folding each tile into a running maximum); None where that path does not run (then
        compute the logits)."""
        # not with a small-rows LM head (--quantization gguf): the logits path takes it for chunks of few rows,
        # so a greedy row's token would depend on whether its neighbours need logits. head_qx is one too, but
        # gives the float32 panels' bits, so either path gives the same token
        if ((self.head_panels is None and self.head_qx is None) or hidden.shape[0] == 0
                or self.lm_head_small is not None):
            return None
        if self._head_qx(hidden.shape[0]):  # the same tokens
            return torch_ops.qx_gemm(torch_ops.lib(), self.final_norm(hidden), self.head_qx,
                                       self.arch.vocab_size, self.head_qx_kind, greedy=True)
        return torch_ops.panel_gemm(torch_ops.lib(), self.final_norm(hidden), self.head_panels,
                                      self.arch.vocab_size, greedy=True)


class PanelEmbedding(nn.Module):
    """A tied embedding looked up in the LM head's panels (`Transformer.pack_cpu_weights`): ids [T] -> [T, H]."""

    def __init__(self, panels: torch.Tensor):
        super().__init__()
        self.panels = panels

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch_ops.panel_rows(self.panels, ids)


# ---------------------------------------------------------------------------------
# building and loading


def build_model(arch: ArchConfig, max_positions: int, device: torch.device, dtype: torch.dtype,
                tp: tuple[int, int, object] | None = None) -> Transformer:
    """An uninitialised model on `device` (no random init: weights come from `load_weights`).

    `tp=(rank, world_size, group)` applies the tensor-parallel transform while the model is still on the
    meta device, so a rank allocates only its share and `load_weights` reads only that share.
    """
    with torch.device("meta"):
        model = Transformer(arch, max_positions)
        if tp is not None:
            from torchengine.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(model, *tp)
    model = model.to_empty(device=device).to(dtype)
    model.init_rope()
    return model.eval().requires_grad_(False)


def to_tensor(arr: np.ndarray) -> torch.Tensor:
    """A tensor of `arr`'s values: sharing a writable contiguous array's memory (a dequantized GGUF tensor), else
    a contiguous copy (a memory-mapped file, which torch must not alias; a strided view)."""
    if arr.dtype.name == "bfloat16":  # ml_dtypes: torch cannot read it directly
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(arr if arr.flags.writeable and arr.flags.c_contiguous else np.array(arr, copy=True))


# Where each logical parameter (enginecore.arch.WEIGHTS) lives in this model.
_TOP_PARAMS = {"embed": "embed.weight", "final_norm": "final_norm.weight", "lm_head": "lm_head.weight"}
_LAYER_PARAMS = {
    "attn_norm": "attn_norm.weight", "mlp_norm": "mlp_norm.weight",
    "qkv_proj": "attn.qkv_proj.weight", "qkv_bias": "attn.qkv_proj.bias", "o_proj": "attn.o_proj.weight",
    "q_norm": "attn.q_norm.weight", "k_norm": "attn.k_norm.weight",
    "gate_up_proj": "mlp.gate_up_proj.weight", "down_proj": "mlp.down_proj.weight",
}


def _tp_share(arr: np.ndarray, dim: int, rank: int, tp_size: int) -> np.ndarray:
    """Rank's contiguous 1/tp_size of `arr` along `dim` (a view: a memory-mapped checkpoint reads only it)."""
    n = arr.shape[dim] // tp_size
    return arr[rank * n : (rank + 1) * n] if dim == 0 else arr[:, rank * n : (rank + 1) * n]


@torch.no_grad()
def load_weights(model: Transformer, weights: Iterable[tuple[str, np.ndarray]]) -> None:
    """Copy Hugging Face-named numpy weights into `model`; every parameter must be filled exactly."""
    arch = model.arch
    rank, tp_size = model.tp_rank, model.tp_size
    params = dict(model.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}
    for hf_name, arr in weights:
        found = weight_spec(hf_name)
        if found is None:
            continue
        layer, spec = found
        if spec.param == "lm_head" and arch.tie_word_embeddings:
            continue  # some tied checkpoints still store a copy
        stored = spec.fused or spec.param
        name = _TOP_PARAMS[stored] if layer is None else f"layers.{layer}.{_LAYER_PARAMS[stored]}"
        if name not in params:
            raise ModelLoadError(f"weight {hf_name} has no place in this model (check attention_bias / qk_norm)")
        if tp_size > 1 and spec.tp_dim is not None:
            arr = _tp_share(arr, spec.tp_dim, rank, tp_size)
        dst = params[name] if spec.fused is None else params[name][fused_slices(arch, spec.fused, tp_size)[spec.param]]
        src = to_tensor(arr)
        if tuple(src.shape) != tuple(dst.shape):
            raise ModelLoadError(f"weight {hf_name}: shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(src)
        filled[name] += dst.numel()
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise ModelLoadError(f"weights missing from the checkpoint: {', '.join(missing[:8])}")
