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

A sparse layer's `SparseMoeBlock` keeps its router replicated (every rank
routes every token alike) and sums its output over the ranks once, after the
routed and the shared experts (one all-reduce, as the dense MLP's):

- by default each expert's intermediate size I is split (w13's gate rows and
  up rows each, w2's columns: every expert a column- then row-parallel MLP);
- with `enable_expert_parallel`, whole experts: rank r holds experts
  r*E/N .. (r+1)*E/N - 1 and computes their contributions for all tokens
  (vLLM's EP over the TP group); the shared expert stays split by its I.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from enginecore.arch import FUSED, param_rows
from torchengine.model import MLP, Linear, SparseMoeBlock, Transformer


def _shard_rows(w: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return w.chunk(world_size, dim=0)[rank]


def _column_parallel(linear: nn.Linear, sizes: list[int], rank: int, world_size: int) -> nn.Linear:
    """Split each fused part (rows `sizes`) across ranks and keep this rank's rows of each."""
    w = torch.cat([_shard_rows(p, rank, world_size) for p in linear.weight.split(sizes, dim=0)])
    b = None
    if linear.bias is not None:
        b = torch.cat([_shard_rows(p, rank, world_size) for p in linear.bias.split(sizes, dim=0)])
    return _linear(w, b)


def _row_parallel(linear: nn.Linear, rank: int, world_size: int, group, reduce: bool = True) -> nn.Linear:
    """Rank's input columns; its output all-reduced (`reduce`; else a partial sum the caller reduces)."""
    # the bias is added once, on rank 0, so the all-reduce sums it exactly once
    b = None
    if linear.bias is not None:
        b = linear.bias.detach() if rank == 0 else torch.zeros_like(linear.bias)
    out = _linear(linear.weight.chunk(world_size, dim=1)[rank], b)
    if reduce:
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


def _shard_mlp(mlp: MLP, rank: int, world_size: int, group, reduce: bool = True) -> None:
    """Column-parallel gate/up, row-parallel down, all-reduced after down (`reduce`; a MoE block's shared expert
    leaves its partial sum to the block's one all-reduce)."""
    inter = mlp.down_proj.in_features
    mlp.gate_up_proj = _column_parallel(mlp.gate_up_proj, [inter, inter], rank, world_size)
    mlp.down_proj = _row_parallel(mlp.down_proj, rank, world_size, group, reduce)


def _shard_moe(block: SparseMoeBlock, rank: int, world_size: int, group, expert_parallel: bool) -> None:
    E, two_i, _ = block.w13.shape
    if expert_parallel:
        n = E // world_size
        block.first_expert = rank * n
        w13, w2 = block.w13[rank * n : (rank + 1) * n], block.w2[rank * n : (rank + 1) * n]
    else:
        inter = two_i // 2
        gate, up = block.w13.split(inter, dim=1)
        w13 = torch.cat([gate.chunk(world_size, dim=1)[rank], up.chunk(world_size, dim=1)[rank]], dim=1)
        w2 = block.w2.chunk(world_size, dim=2)[rank]
    block.w13 = nn.Parameter(w13.clone(), requires_grad=False)  # clone: drop the full stacks
    block.w2 = nn.Parameter(w2.clone(), requires_grad=False)
    block.init_expert_map()
    if block.shared_expert is not None:
        _shard_mlp(block.shared_expert, rank, world_size, group, reduce=False)
    block.register_forward_hook(_all_reduce_hook(group))  # routed + shared partial sums, once


def apply_tensor_parallel(model: Transformer, rank: int, world_size: int, group=None,
                          enable_expert_parallel: bool = False) -> Transformer:
    """Shard `model` in place for `rank` of `world_size`; returns it. `enable_expert_parallel`: a MoE layer's
    experts whole on each rank, E / world_size of them (module docstring)."""
    if world_size == 1:
        return model
    a = model.arch
    sizes = [("attention heads", a.num_attention_heads), ("KV heads", a.num_key_value_heads)]
    if any(not a.is_sparse(i) for i in range(a.num_hidden_layers)):
        sizes.append(("intermediate size", a.intermediate_size))
    if a.moe is not None and a.moe.num_sparse_layers:
        sizes.append(("expert count", a.moe.num_experts) if enable_expert_parallel
                     else ("expert intermediate size (moe_intermediate_size)", a.moe.intermediate_size))
        if a.moe.shared_expert_intermediate_size:
            sizes.append(("shared expert intermediate size", a.moe.shared_expert_intermediate_size))
    for what, n in sizes:
        if n % world_size:
            raise ValueError(f"tensor parallel size {world_size} does not divide the model's {what} ({n})"
                             + (" (--enable-expert-parallel splits the experts instead)"
                                if what.startswith("expert intermediate") else ""))
    qkv = [param_rows(a, p) for p in FUSED["qkv_proj"]]
    for layer in model.layers:
        attn, mlp = layer.attn, layer.mlp
        attn.qkv_proj = _column_parallel(attn.qkv_proj, qkv, rank, world_size)
        attn.o_proj = _row_parallel(attn.o_proj, rank, world_size, group)
        attn.num_heads, attn.num_kv_heads = a.num_attention_heads // world_size, a.num_key_value_heads // world_size
        if isinstance(mlp, SparseMoeBlock):
            _shard_moe(mlp, rank, world_size, group, enable_expert_parallel)
        else:
            _shard_mlp(mlp, rank, world_size, group)
    model.tp_rank, model.tp_size = rank, world_size
    model.expert_parallel = enable_expert_parallel and a.moe is not None
    return model
