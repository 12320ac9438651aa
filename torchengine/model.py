"""One Llama-family decoder for every supported architecture, read top to bottom.

Llama 2/3, SmolLM2 (tied embeddings), Mistral (explicit head_dim, optional
sliding window), Qwen2 (q/k/v biases) and Qwen3 (per-head RMSNorm of q and k)
differ only in their `enginecore.arch.ArchConfig`, whose field names this file
reads as they are. The Mixture-of-Experts Mixtral, Qwen2-MoE and Qwen3-MoE
replace the MLP of their sparse layers (`arch.is_sparse(i)`) by a
`SparseMoeBlock` (router, stacked experts, optional shared expert), whose
expert compute is `torchengine.moe.fused_moe`.

The model sees one ragged step: all scheduled tokens flattened into
`input_ids [T]` with their `positions [T]`. It owns no KV cache and knows
nothing about blocks: every attention layer calls the `AttentionFn` handed to
`forward`, `attn(layer_idx, q, k, v) -> o`, which writes k/v into the paged
cache and attends (see `torchengine.attention`). Tensor parallelism is applied
afterwards as a transform (`torchengine.tensor_parallel`), and so are the CPU
kernels (`torchengine.cpu_transform` swaps in their modules after loading), so
this file stays single-device, single-path torch code.

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

from enginecore.arch import ArchConfig, ModelLoadError, fused_slices, rope_cos_sin, weight_spec
from enginecore.model_checks import expert_tensor_name
from torchengine.moe import fused_moe, select_experts

# attn(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> o [T, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated (rotate-half convention), math in float32.

    cos [T, 1, D] is cos(pos * freq) repeated for both halves and sin [T, 1, D] is -sin, +sin (the tables
    `Transformer.forward` looks up once a step): x * cos + swap_halves(x) * sin is transformers'
    `x * cos + rotate_half(x) * sin`, in three ops (on a CPU each op of a decode step costs more in dispatch
    than in arithmetic, so q and k of a layer are rotated in one call).
    """
    T, H, D = x.shape
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
        """norm(x); or, given the residual stream, (norm(residual + x), residual + x)."""
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


class Linear(_Loaded, nn.Linear):
    """nn.Linear (`F.linear`). On a CPU with the kernels, float32, `torchengine.cpu_transform` replaces every one
    with a `CpuLinear` after loading."""

    def matrix(self) -> torch.Tensor:
        """The [out, in] weight (`CpuLinear.matrix` unpacks its panels: for checks, not for steps)."""
        return self.weight


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate, then up) -> silu(gate) * up [T, I] (vLLM's SiluAndMul)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


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
        # (qk [T, H, D], cos, sin) -> rotated qk; a plain attribute, not a module: the CPU transform sets its own
        self.rope_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = apply_rope

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
            # as rows of D: on a CPU the C rms_norm, the one-call layers' (torchengine.cpu_layers.DecodeLayers) bits
            qk = torch.cat([self.q_norm(qk[:, : self.num_heads].reshape(-1, hd)).view(T, self.num_heads, hd),
                            self.k_norm(qk[:, self.num_heads :].reshape(-1, hd)).view(T, self.num_kv_heads, hd)], dim=1)
        qk = self.rope_fn(qk, cos, sin)  # q and k heads together
        o = attn(self.layer_idx, qk[:, : self.num_heads], qk[:, self.num_heads :], v)  # [T, Hq, D]
        if keep is not None:
            o = o[keep]
        return self.o_proj(o.reshape(o.shape[0], q_size))


class MLP(nn.Module):
    def __init__(self, arch: ArchConfig, intermediate_size: int | None = None):
        super().__init__()
        inter = arch.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * inter, bias=False)  # fused
        self.down_proj = Linear(inter, arch.hidden_size, bias=False)
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul  # [T, 2I] -> [T, I]; as rope_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """A sparse layer's MLP: each token's top_k of E SwiGLU experts, weighted by the router's probabilities
    (`torchengine.moe.select_experts`), plus an optional shared expert every token passes, scaled by
    sigmoid(x . shared_expert_gate^T) (Qwen2-MoE).

    The experts are stacked Parameters, w13 [E, 2I, H] (each expert's gate rows, then its up rows, as
    `MLP.gate_up_proj`) and w2 [E, H, I]. The tensor-parallel transform shards them (each expert's I, or whole
    experts with expert parallelism: then `expert_map` [E] maps a global expert id to a local one, -1 for another
    rank's) and sums the block's output over ranks once, shared expert included.
    """

    def __init__(self, arch: ArchConfig):
        super().__init__()
        m = arch.moe
        self.num_experts, self.top_k, self.renormalize = m.num_experts, m.top_k, m.norm_topk_prob
        H, I = arch.hidden_size, m.intermediate_size
        self.router = Linear(H, m.num_experts, bias=False)  # replicated on every rank
        self.w13 = nn.Parameter(torch.empty(m.num_experts, 2 * I, H), requires_grad=False)  # [E, 2I, H]
        self.w2 = nn.Parameter(torch.empty(m.num_experts, H, I), requires_grad=False)  # [E, H, I]
        self.activation = "silu"  # torchengine.moe.ACTIVATIONS
        # (x, topk_weights, topk_ids, expert_map) -> [T, H] in place of fused_moe on w13 / w2, which are then None:
        # the CPU kernels' packed experts (torchengine.cpu_transform.CpuExperts)
        self.experts: Callable[..., torch.Tensor] | None = None
        # expert parallelism (the TP transform): this rank holds experts first_expert .. first_expert + len(w13);
        # expert_map [E] int64 (init_expert_map, on the weights' device) maps global ids to those, -1 elsewhere
        self.first_expert = 0
        self.expert_map: torch.Tensor | None = None
        self.shared_expert = MLP(arch, m.shared_expert_intermediate_size) if m.shared_expert_intermediate_size else None
        self.shared_expert_gate = Linear(H, 1, bias=False) if m.shared_expert_gate else None

    def init_expert_map(self) -> None:
        """expert_map for the experts this rank holds, on their device (None when it holds them all)."""
        n = self.w13.shape[0]
        if n == self.num_experts:
            self.expert_map = None
            return
        m = torch.full((self.num_experts,), -1, dtype=torch.int64, device=self.w13.device)
        m[self.first_expert : self.first_expert + n] = torch.arange(n, device=self.w13.device)
        self.expert_map = m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H] (on one rank of several: its share of the sum, all-reduced by the TP transform)."""
        weights, ids = select_experts(self.router(x), self.top_k, self.renormalize, x.dtype)  # [T, K] each
        if self.experts is not None:
            out = self.experts(x, weights, ids, self.expert_map)
        else:
            out = fused_moe(x, self.w13, self.w2, weights, ids, expert_map=self.expert_map,
                            activation=self.activation)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.attn = Attention(arch, layer_idx)
        self.mlp_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp: MLP | SparseMoeBlock = SparseMoeBlock(arch) if arch.is_sparse(layer_idx) else MLP(arch)

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
        # and, with expert parallelism, whole experts per rank instead of each expert's columns
        self.expert_parallel = False
        # LM heads of 2 to this many rows run weights first (compute_logits); the runner sets it on a CPU
        self.weights_first_rows = 0
        # --quantization gguf (torchengine.quant): the LM head as the file stores it (or in bfloat16) for steps
        # of up to lm_head_small_rows rows: normed hidden [N, H] -> logits [N, V] float32
        self.lm_head_small: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.lm_head_small_rows = 0
        self.embed = _Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_hidden_layers))
        self.final_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # tied models read the embedding matrix in compute_logits (no shared Parameter to keep tied). A transform
        # may put a head module of its own here, tied or not (`torchengine.cpu_transform.CpuLMHead`): normed
        # hidden [N, H] -> logits [N, V] float32, with `greedy(h) -> [N]` tokens where it gives them without logits
        self.lm_head: nn.Module | None = (None if arch.tie_word_embeddings
                                          else _Head(arch.hidden_size, arch.vocab_size, bias=False))
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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [N, H] -> logits [N, V] float32
        h = self.final_norm(hidden)
        n = h.shape[0]
        if self.lm_head_small is not None and 0 < n <= self.lm_head_small_rows:
            return self.lm_head_small(h)
        if self.lm_head is not None and not isinstance(self.lm_head, _Head):
            return self.lm_head(h)  # a transform's head
        w = self.embed.weight if self.lm_head is None else self.lm_head.weight
        if 0 < n <= self.weights_first_rows:
            # w @ h^T: on a CPU 2-4x faster than h @ w^T for a few rows of a large vocabulary (MKL's small-M
            # gemm reads the weight badly; see jaxengine.model.dense and benchmarks/bench_dense.py). One row
            # goes as two: MKL's matrix-vector product reads [V, H] at half the speed of its 2-column gemm.
            hh = h.expand(2, h.shape[1]).contiguous() if n == 1 else h
            return torch.mm(w, hh.t())[:, :n].t().contiguous().float()
        return F.linear(h, w).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, H] -> [N] int64, `compute_logits(hidden).argmax(-1)` without writing the logits, where the LM
        head gives them so (its `greedy`); None elsewhere (then compute the logits)."""
        greedy = getattr(self.lm_head, "greedy", None)
        # not with a small-rows LM head (--quantization gguf): the logits path takes it for chunks of few rows,
        # so a greedy row's token would depend on whether its neighbours need logits
        if greedy is None or hidden.shape[0] == 0 or self.lm_head_small is not None:
            return None
        return greedy(self.final_norm(hidden))


# ---------------------------------------------------------------------------------
# building and loading


def build_model(arch: ArchConfig, max_positions: int, device: torch.device, dtype: torch.dtype,
                transform: Callable[[Transformer], object] | None = None) -> Transformer:
    """An uninitialised model on `device` (no random init: weights come from `load_weights`).

    `transform(model)` runs while the model is still on the meta device: tensor parallelism
    (`torchengine.tensor_parallel.apply_tensor_parallel`) shards it there, so a rank allocates only its share and
    `load_weights` reads only that share. (A transform handed in: this file stays single-device code.)
    """
    with torch.device("meta"):
        model = Transformer(arch, max_positions)
        if transform is not None:
            transform(model)
    model = model.to_empty(device=device).to(dtype)
    model.init_rope()
    for m in model.modules():
        if isinstance(m, SparseMoeBlock):
            m.init_expert_map()  # (a transform's, made on the meta device, is rebuilt here)
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
    # a sparse layer's (SparseMoeBlock)
    "router": "mlp.router.weight", "experts_gate_up": "mlp.w13", "experts_down": "mlp.w2",
    "shared_gate_up_proj": "mlp.shared_expert.gate_up_proj.weight",
    "shared_down_proj": "mlp.shared_expert.down_proj.weight", "shared_expert_gate": "mlp.shared_expert_gate.weight",
}


def _tp_share(arr: np.ndarray, dim: int, rank: int, tp_size: int) -> np.ndarray:
    """Rank's contiguous 1/tp_size of `arr` along `dim` (a view: a memory-mapped checkpoint reads only it)."""
    n = arr.shape[dim] // tp_size
    return arr[(slice(None),) * dim + (slice(rank * n, (rank + 1) * n),)]


@torch.no_grad()
def load_weights(model: Transformer, weights: Iterable[tuple[str, np.ndarray]]) -> None:
    """Copy Hugging Face-named numpy weights into `model`; every parameter must be filled exactly."""
    arch = model.arch
    rank, tp_size = model.tp_rank, model.tp_size
    params = dict(model.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}
    experts_filled: set[tuple[int, str, int]] = set()  # (layer, experts_gate / _up / _down, global expert)
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
        if spec.experts:
            found = _expert_share(model, params[name], arr, spec, layer)
            if found is None:
                continue  # another rank's expert
            dst, arr = found
            block = model.layers[layer].mlp
            got = range(block.first_expert, block.first_expert + block.w13.shape[0]) if spec.expert is None \
                else (spec.expert,)
            experts_filled.update((layer, spec.param, e) for e in got)
        else:
            if tp_size > 1 and spec.tp_dim is not None:
                arr = _tp_share(arr, spec.tp_dim, rank, tp_size)
            dst = params[name]
            if spec.fused is not None:
                dst = dst[fused_slices(arch, spec.fused, tp_size)[spec.param]]
        src = to_tensor(arr)
        if tuple(src.shape) != tuple(dst.shape):
            raise ModelLoadError(f"weight {hf_name}: shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(src)
        filled[name] += dst.numel()
    missing = _missing_experts(model, experts_filled)
    missing += [n for n, p in params.items() if filled[n] != p.numel() and not n.endswith((".mlp.w13", ".mlp.w2"))]
    if missing:
        raise ModelLoadError(f"weights missing from the checkpoint: {', '.join(missing[:8])}")


def _missing_experts(model: Transformer, filled: set[tuple[int, str, int]]) -> list[str]:
    """HF's names of the expert tensors this rank needs that no checkpoint tensor filled."""
    out = []
    for i, layer in enumerate(model.layers):
        block = layer.mlp
        if isinstance(block, SparseMoeBlock):
            out += [expert_tensor_name(model.arch, i, e, param)
                    for e in range(block.first_expert, block.first_expert + block.w13.shape[0])
                    for param in ("experts_gate", "experts_up", "experts_down") if (i, param, e) not in filled]
    return out


def _expert_share(model: Transformer, param: torch.Tensor, arr: np.ndarray, spec, layer: int):
    """Where a checkpoint's expert tensor goes in this rank's stacked `param` [E_local, rows, cols]: (the
    destination view, the source's share), or None for an expert another rank holds. `arr` is one expert's
    [out, in] (HF's per-expert tensors, spec.expert = e) or all of them stacked [E, out, in] (expert None)."""
    block = model.layers[layer].mlp
    first, n_local = block.first_expert, param.shape[0]
    split = model.tp_size > 1 and not model.expert_parallel  # each expert's I split over the ranks
    if spec.expert is not None:
        if not first <= spec.expert < first + n_local:
            return None
        dst = param[spec.expert - first]
        if split:
            arr = _tp_share(arr, spec.tp_dim, model.tp_rank, model.tp_size)
    else:
        dst = param
        arr = arr[first : first + n_local]
        if split:  # the expert's [out, in] is dims 1, 2 of the stack
            arr = _tp_share(arr, spec.tp_dim + 1, model.tp_rank, model.tp_size)
    if spec.fused is not None:
        rows = fused_slices(model.arch, spec.fused, model.tp_size if split else 1)[spec.param]
        dst = dst[rows] if dst.dim() == 2 else dst[:, rows]
    return dst, arr

