"""Fused Mixture-of-Experts: a grouped GEMM over the tokens sorted by expert (vLLM's fused_moe design).

Each token t picks K experts; its T*K (token, expert) pairs, "flat" index t*K + k, are grouped by expert into
blocks of BLOCK_M rows (`moe_align_block_size`: each expert's pairs padded to a multiple of BLOCK_M, so every
block belongs to one expert). Then two launches of one kernel, one program per (block, N-tile), each reading only
its block's expert's weights:

1. h = act(x[t] . w13[e]^T): the gate and up tiles of the same columns in one program, silu(gate) * up
   (GATED) -> intermediate [T*K, I];
2. y = topk_weight * (h . w2[e]^T) -> [T*K, H] float32, summed over the K pairs of a token (torch).

No host syncs anywhere (the block count is bounded from the shapes, the programs past the padded end return
at once), so a CUDA graph can capture it. Expert parallelism: `expert_map` sends another rank's experts to no
block; their rows stay zero. gpt-oss's biases are HAS_BIAS (w13_bias [E, 2I], w2_bias [E, H]); its clamped
SwiGLU would be another ACTIVATION.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels._launch import launching

__all__ = ["fused_moe", "moe_align_block_size"]

_ACTIVATIONS = {"silu": 0}


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [rows of A, K]: x [T, H] (first GEMM, rows t = flat // TOP_K) or h [T*K, I] (second, rows flat)
    w_ptr,  # [E, N or 2N, K]: w13 (GATED: gate rows 0..N-1, up rows N..2N-1) or w2
    bias_ptr,  # [E, N or 2N] (HAS_BIAS; else any pointer)
    topk_weights_ptr,  # [T*K] (MUL_ROUTED_WEIGHT; else any pointer)
    out_ptr,  # [T*K, N]
    sorted_ids_ptr,  # [P] int32 flat pair indices grouped by expert; num_valid marks padding
    expert_ids_ptr,  # [P / BLOCK_M] int32 each block's expert, -1: none (another rank's, or past the end)
    num_post_padded_ptr,  # [1] int32 rows of P in use
    num_valid,  # T*K
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_be,
    stride_om,
    TOP_K: tl.constexpr,  # A's row of pair f is f // TOP_K (1 for the second GEMM)
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,  # 0: silu(gate) * up
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)  # [BLOCK_M]
    row_ok = pair < num_valid
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // TOP_K)[:, None] * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        a = a.to(w.dtype)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        b_ptrs = bias_ptr + expert * stride_be + offs_n
        acc += tl.load(b_ptrs, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_ptrs + N, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        if ACTIVATION == 0:
            acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pair[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [T, K] global expert ids
    block_m: int,
    num_experts: int,  # the experts this rank holds
    expert_map: torch.Tensor | None = None,  # [E_global]: local index, -1 on another rank
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The T*K pairs grouped by (local) expert, each group padded to a multiple of block_m, in torch ops with no
    host sync: (sorted_ids [P] int32: flat pair indices, each expert's in ascending order, T*K for padding;
    expert_ids [P / block_m] int32: each block's expert, -1 past the used blocks; num_post_padded [1] int32: the
    rows in use). P = the bound T*K + E * (block_m - 1), rounded up to block_m."""
    device, E = topk_ids.device, num_experts
    tk = topk_ids.numel()
    flat = topk_ids.reshape(-1).long()
    if expert_map is not None:
        flat = expert_map[flat].long()
    flat = torch.where(flat < 0, E, flat)  # another rank's expert: group E, never placed in a block
    counts = torch.zeros(E + 1, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts[:E] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)  # [E]
    starts = torch.cat([ends - padded, ends.new_zeros(1)])  # [E + 1] (group E's start unused)
    P = -(-(tk + E * (block_m - 1)) // block_m) * block_m
    group, order = torch.sort(flat, stable=True)
    first_of_group = torch.cumsum(counts, 0) - counts  # [E + 1] where each group starts in `order`
    rank = torch.arange(tk, device=device) - first_of_group[group]
    dest = torch.where(group < E, starts[group] + rank, P)  # group E -> the dump slot P
    sorted_ids = torch.full((P + 1,), tk, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, P, block_m, device=device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True)  # the e with starts[e] <= start < ends[e]
    expert_ids = torch.where(expert_ids < E, expert_ids, -1).to(torch.int32)
    return sorted_ids[:P], expert_ids, ends[-1:].to(torch.int32)


def _pick_block_m(num_pairs: int, num_experts: int) -> int:
    # pairs per expert on average: decode-like steps get the smallest tl.dot rows, prefill-like 64 (a weight
    # tile read once per 64 rows)
    return 16 if num_pairs <= 16 * num_experts else 64


def _launch(a, w, bias, topk_weights, out, sorted_ids, expert_ids, num_post, num_valid, *, top_k, gated,
            activation, mul_routed_weight, block_m):
    N = w.shape[1] // 2 if gated else w.shape[1]
    K = w.shape[2]
    block_n = 64
    block_k = 64 if K >= 64 else max(16, triton.next_power_of_2(K))
    grid = (expert_ids.shape[0] * triton.cdiv(N, block_n),)
    with launching(_fused_moe_kernel, a.device):
        _fused_moe_kernel[grid](
            a, w, bias if bias is not None else w, topk_weights if topk_weights is not None else w, out,
            sorted_ids, expert_ids, num_post, num_valid, N, K,
            a.stride(0), w.stride(0), w.stride(1), bias.stride(0) if bias is not None else 0, out.stride(0),
            TOP_K=top_k, GATED=gated, ACTIVATION=_ACTIVATIONS[activation], HAS_BIAS=bias is not None,
            MUL_ROUTED_WEIGHT=mul_routed_weight, DOT_PRECISION="ieee" if w.dtype == torch.float32 else "tf32",
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=2,
        )


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] global expert ids
    *,
    expert_map: torch.Tensor | None = None,  # [E_global]: local index, -1 on another rank
    w13_bias: torch.Tensor | None = None,  # [E, 2I]
    w2_bias: torch.Tensor | None = None,  # [E, H]
    activation: str = "silu",
    block_m: int | None = None,  # rows of a block (16 or more, a power of two); by default from the shapes
) -> torch.Tensor:  # [T, H] in x's dtype
    """sum_k topk_weights[t, k] * w2[e] . act(w13[e] . x[t]) with e = topk_ids[t, k] (module docstring)."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    K = topk_ids.shape[1]
    if w13.shape[2] != H or w2.shape != (E, H, two_i // 2) or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}, "
                         f"topk {tuple(topk_ids.shape)} do not agree")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"fused_moe: activation {activation!r} is not one of {sorted(_ACTIVATIONS)}")
    if block_m is None:
        block_m = _pick_block_m(T * K, E)
    elif block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"fused_moe: block_m={block_m} must be a power of two >= 16")
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, block_m, E, expert_map)
    h = torch.empty((T * K, two_i // 2), dtype=x.dtype, device=x.device)  # rows of unplaced pairs: never read
    _launch(x, w13, w13_bias, None, h, sorted_ids, expert_ids, num_post, T * K, top_k=K, gated=True,
            activation=activation, mul_routed_weight=False, block_m=block_m)
    y = torch.zeros((T * K, H), dtype=torch.float32, device=x.device)  # another rank's pairs stay 0
    _launch(h, w2, w2_bias, topk_weights.reshape(-1).contiguous(), y, sorted_ids, expert_ids, num_post, T * K,
            top_k=1, gated=False, activation=activation, mul_routed_weight=True, block_m=block_m)
    return y.view(T, K, H).sum(dim=1).to(x.dtype)
