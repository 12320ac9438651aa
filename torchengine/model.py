"""One Llama-family decoder for every supported architecture, read top to bottom.

Llama 2/3 (default, linear and llama3 rope scaling), SmolLM2 (tied
embeddings), Mistral (explicit head_dim, optional sliding window), Qwen2 (q/k/v
biases) and Qwen3 (per-head RMSNorm of q and k) differ only in `ModelArgs`.

The model sees one ragged step: all scheduled tokens flattened into
`input_ids [T]` with their `positions [T]`. It owns no KV cache and knows
nothing about pages: every attention layer calls the `AttentionFn` handed to
`forward`, `attn(layer_idx, q, k, v) -> o`, which writes k/v into the paged
cache and attends (see `torchengine.attention`). Tensor parallelism is applied
afterwards as a transform (`torchengine.tensor_parallel`), so this file stays
single-device code.

Weights come from `ModelSource.iter_weights()` (numpy, Hugging Face names and
[out, in] layout); q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from enginecore.model_loader import ArchConfig, ModelLoadError

# attn(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> o [T, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ModelArgs:
    """Everything that distinguishes one supported architecture from another."""

    vocab_size: int
    dim: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3" | "linear", ...}
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3
    sliding_window: int | None = None  # Mistral

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")

    @classmethod
    def from_arch(cls, a: ArchConfig) -> "ModelArgs":
        return cls(
            vocab_size=a.vocab_size,
            dim=a.hidden_size,
            intermediate_size=a.intermediate_size,
            n_layers=a.num_hidden_layers,
            n_heads=a.num_attention_heads,
            n_kv_heads=a.num_key_value_heads,
            head_dim=a.head_dim,
            rope_theta=a.rope_theta,
            rope_scaling=a.rope_scaling,
            norm_eps=a.rms_norm_eps,
            tie_word_embeddings=a.tie_word_embeddings,
            qkv_bias=a.attention_bias,
            qk_norm=a.qk_norm,
            sliding_window=a.sliding_window,
        )


# ---------------------------------------------------------------------------------
# rotary embeddings


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:  # [D/2] f32
    """Inverse frequencies, computed exactly as transformers does (float32, on the CPU)."""
    d = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = args.rope_scaling
    if not sc:
        return inv_freq
    kind = sc.get("rope_type", sc.get("type"))
    factor = float(sc["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
        old_len = sc["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ModelLoadError(f"rope_scaling type {kind!r} is not supported (llama3, linear)")


def rope_tables(args: ModelArgs, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_positions, D/2] float32 (the two rotary halves share them)."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rope_inv_freq(args)[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, 1, D/2] (rotate-half convention), math in float32."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


# ---------------------------------------------------------------------------------
# layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        # per-device head counts: the tensor-parallel transform divides them
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        qkv_out = (args.n_heads + 2 * args.n_kv_heads) * args.head_dim
        self.wqkv = nn.Linear(args.dim, qkv_out, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        T, hd = x.shape[0], self.head_dim
        q_size, kv_size = self.n_heads * hd, self.n_kv_heads * hd
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(T, self.n_heads, hd)
        k = k.view(T, self.n_kv_heads, hd)
        v = v.view(T, self.n_kv_heads, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attn(self.layer_idx, q, k, v)  # [T, Hq, D]
        return self.wo(o.reshape(T, q_size))


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w13 = nn.Linear(args.dim, 2 * args.intermediate_size, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, layer_idx)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, attn)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder. `forward` -> hidden states [T, dim]; `compute_logits` on the rows you need."""

    def __init__(self, args: ModelArgs, max_positions: int):
        super().__init__()
        self.args = args
        self.max_positions = max_positions
        self.tp_rank, self.tp_size = 0, 1  # set by torchengine.tensor_parallel.apply_tensor_parallel
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # tied models read the embedding matrix in compute_logits (no shared Parameter to keep tied)
        self.output = None if args.tie_word_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        # [max_positions, D/2] float32 whatever the model dtype: filled by init_rope()
        self.register_buffer("rope_cos", torch.empty(max_positions, args.head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(max_positions, args.head_dim // 2), persistent=False)

    def init_rope(self) -> None:
        device = self.tok_embeddings.weight.device
        self.rope_cos, self.rope_sin = (t.to(device) for t in rope_tables(self.args, self.max_positions))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn) -> torch.Tensor:
        # input_ids [T], positions [T] -> hidden [T, dim] (before the final norm)
        cos = self.rope_cos[positions][:, None, :]  # [T, 1, D/2] f32
        sin = self.rope_sin[positions][:, None, :]
        x = self.tok_embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden [N, dim] -> logits [N, V] float32
        w = self.tok_embeddings.weight if self.output is None else self.output.weight
        return F.linear(self.norm(hidden), w).float()


# ---------------------------------------------------------------------------------
# building and loading


def build_model(args: ModelArgs, max_positions: int, device: torch.device, dtype: torch.dtype,
                tp: tuple[int, int, object] | None = None) -> Transformer:
    """An uninitialised model on `device` (no random init: weights come from `load_weights`).

    `tp=(rank, world_size, group)` applies the tensor-parallel transform while the model is still on the
    meta device, so a rank allocates only its share and `load_weights` reads only that share.
    """
    with torch.device("meta"):
        model = Transformer(args, max_positions)
        if tp is not None:
            from torchengine.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(model, *tp)
    model = model.to_empty(device=device).to(dtype)
    model.init_rope()
    return model.eval().requires_grad_(False)


def _to_tensor(arr: np.ndarray) -> torch.Tensor:
    if arr.dtype.name == "bfloat16":  # ml_dtypes: torch cannot read it directly
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(arr, copy=True))


_LAYER_PARTS = {
    "input_layernorm.weight": ("attention_norm.weight", None),
    "post_attention_layernorm.weight": ("ffn_norm.weight", None),
    "self_attn.q_proj.weight": ("attention.wqkv.weight", "q"),
    "self_attn.k_proj.weight": ("attention.wqkv.weight", "k"),
    "self_attn.v_proj.weight": ("attention.wqkv.weight", "v"),
    "self_attn.q_proj.bias": ("attention.wqkv.bias", "q"),
    "self_attn.k_proj.bias": ("attention.wqkv.bias", "k"),
    "self_attn.v_proj.bias": ("attention.wqkv.bias", "v"),
    "self_attn.o_proj.weight": ("attention.wo.weight", None),
    "self_attn.q_norm.weight": ("attention.q_norm.weight", None),
    "self_attn.k_norm.weight": ("attention.k_norm.weight", None),
    "mlp.gate_proj.weight": ("feed_forward.w13.weight", "gate"),
    "mlp.up_proj.weight": ("feed_forward.w13.weight", "up"),
    "mlp.down_proj.weight": ("feed_forward.w2.weight", None),
}


# weights the tensor-parallel transform splits: column-parallel by output rows (dim 0), row-parallel by input
# columns (dim 1); see torchengine.tensor_parallel
_COLUMN_PARALLEL = ("q", "k", "v", "gate", "up")
_ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def _fused_rows(args: ModelArgs, part: str, tp_size: int = 1) -> slice:
    """Rows of a fused weight that one Hugging Face tensor (this rank's share of it) fills."""
    q, kv = args.n_heads * args.head_dim // tp_size, args.n_kv_heads * args.head_dim // tp_size
    inter = args.intermediate_size // tp_size
    return {
        "q": slice(0, q),
        "k": slice(q, q + kv),
        "v": slice(q + kv, q + 2 * kv),
        "gate": slice(0, inter),
        "up": slice(inter, 2 * inter),
    }[part]


def _tp_share(arr: np.ndarray, dim: int, rank: int, tp_size: int) -> np.ndarray:
    """Rank's contiguous 1/tp_size of `arr` along `dim` (a view: a memory-mapped checkpoint reads only it)."""
    n = arr.shape[dim] // tp_size
    return arr[rank * n : (rank + 1) * n] if dim == 0 else arr[:, rank * n : (rank + 1) * n]


@torch.no_grad()
def load_weights(model: Transformer, weights: Iterable[tuple[str, np.ndarray]]) -> None:
    """Copy Hugging Face-named numpy weights into `model`; every parameter must be filled exactly."""
    args = model.args
    rank, tp_size = model.tp_rank, model.tp_size
    params = dict(model.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}
    for hf_name, arr in weights:
        if hf_name == "model.embed_tokens.weight":
            name, part = "tok_embeddings.weight", None
        elif hf_name == "model.norm.weight":
            name, part = "norm.weight", None
        elif hf_name == "lm_head.weight":
            if args.tie_word_embeddings:
                continue  # some tied checkpoints still store a copy
            name, part = "output.weight", None
        elif hf_name.startswith("model.layers."):
            idx, rest = hf_name[len("model.layers."):].split(".", 1)
            if tp_size > 1 and rest in _ROW_PARALLEL:
                arr = _tp_share(arr, 1, rank, tp_size)
            if rest.endswith("rotary_emb.inv_freq"):
                continue
            if rest not in _LAYER_PARTS:
                raise ModelLoadError(f"unexpected weight {hf_name}")
            local, part = _LAYER_PARTS[rest]
            name = f"layers.{idx}.{local}"
        else:
            raise ModelLoadError(f"unexpected weight {hf_name}")
        if name not in params:
            raise ModelLoadError(f"weight {hf_name} has no place in a model with {args}")
        if tp_size > 1 and part in _COLUMN_PARALLEL:
            arr = _tp_share(arr, 0, rank, tp_size)
        dst = params[name] if part is None else params[name][_fused_rows(args, part, tp_size)]
        src = _to_tensor(arr)
        if tuple(src.shape) != tuple(dst.shape):
            raise ModelLoadError(f"weight {hf_name}: shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(src)
        filled[name] += dst.numel()
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise ModelLoadError(f"weights missing from the checkpoint: {', '.join(missing[:8])}")
