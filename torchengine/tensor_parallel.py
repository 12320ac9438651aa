"""Tensor parallelism as a transform of a built model (gpt-fast style).

The runner applies it to the model while it is still on the meta device, so
each rank allocates only its share; `torchengine.model.load_weights` then
reads each rank's slice of every split checkpoint tensor. Applied to a loaded
model, it slices the loaded weights (the same shares).

`apply_tensor_parallel(model, rank, world_size, group)` keeps rank's share of
every attention and MLP projection, Megatron's split:

- column-parallel (output rows split): the fused q/k/v projection (q, k and v
  each split by heads, then fused again) and the fused gate/up projection;
- row-parallel (input columns split): the attention output and the down
  projection, followed by an all-reduce (sum) over `group`.

Each rank then holds Hq/N query heads and Hkv/N KV heads (its KV cache is
that much smaller), and the model code itself stays single-device: the
all-reduce is a forward hook. Embeddings, norms and the LM head are
replicated, so every rank computes the same logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from enginecore.arch import FUSED, param_rows
from torchengine.model import Linear, Transformer


def _shard_rows(w: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return w.chunk(world_size, dim=0)[rank]


def _column_parallel(linear: nn.Linear, sizes: list[int], rank: int, world_size: int) -> nn.Linear:
    """Split each fused part (rows `sizes`) across ranks and keep this rank's rows of each."""
    w = torch.cat([_shard_rows(p, rank, world_size) for p in linear.weight.split(sizes, dim=0)])
    b = None
    if linear.bias is not None:
        b = torch.cat([_shard_rows(p, rank, world_size) for p in linear.bias.split(sizes, dim=0)])
    return _linear(w, b)


def _row_parallel(linear: nn.Linear, rank: int, world_size: int, group) -> nn.Linear:
    # the bias is added once, on rank 0, so the all-reduce sums it exactly once
    b = None
    if linear.bias is not None:
        b = linear.bias.detach() if rank == 0 else torch.zeros_like(linear.bias)
    out = _linear(linear.weight.chunk(world_size, dim=1)[rank], b)
    out.register_forward_hook(_all_reduce_hook(group))
    return out


def _linear(w: torch.Tensor, b: torch.Tensor | None) -> Linear:
    with torch.device("meta"):
        lin = Linear(w.shape[1], w.shape[0], bias=b is not None, dtype=w.dtype)
    lin.weight = nn.Parameter(w.clone(), requires_grad=False)  # clone: drop the full tensor
    if b is not None:
        lin.bias = nn.Parameter(b.clone(), requires_grad=False)
    return lin


def _all_reduce_hook(group):
    def hook(module, inputs, output):
        dist.all_reduce(output, op=dist.ReduceOp.SUM, group=group)
        return output

    return hook


def apply_tensor_parallel(model: Transformer, rank: int, world_size: int, group=None) -> Transformer:
    """Shard `model` in place for `rank` of `world_size`; returns it."""
    if world_size == 1:
        return model
    a = model.arch
    for what, n in (("attention heads", a.num_attention_heads), ("KV heads", a.num_key_value_heads),
                    ("intermediate size", a.intermediate_size)):
        if n % world_size:
            raise ValueError(f"tensor parallel size {world_size} does not divide the model's {what} ({n})")
    qkv = [param_rows(a, p) for p in FUSED["qkv_proj"]]
    gate_up = [param_rows(a, p) for p in FUSED["gate_up_proj"]]
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        attn.qkv_proj = _column_parallel(attn.qkv_proj, qkv, rank, world_size)
        attn.o_proj = _row_parallel(attn.o_proj, rank, world_size, group)
        attn.num_heads, attn.num_kv_heads = a.num_attention_heads // world_size, a.num_key_value_heads // world_size
        mlp.gate_up_proj = _column_parallel(mlp.gate_up_proj, gate_up, rank, world_size)
        mlp.down_proj = _row_parallel(mlp.down_proj, rank, world_size, group)
    model.tp_rank, model.tp_size = rank, world_size
    return model
