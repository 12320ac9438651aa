"""A Mixture-of-Experts layer's routing and expert compute, chosen by device (vLLM's `fused_moe` split).

- `select_experts(router_logits, top_k, renormalize)`: transformers' router (softmax in float32 over all
  experts, the top_k largest, divided by their sum when renormalizing), no host syncs.
- `fused_moe(x, w13, w2, topk_weights, topk_ids, ...)`: out[t] = sum_k w[t, k] * expert_{id[t, k]}(x[t]), where an
  expert is down(act(gate_up(x))) of its stacked weights w13 [E, 2I, H] (gate rows, then up) and w2 [E, H, I].
  On CUDA the Triton grouped GEMM (`triton_kernels.fused_moe`: no host syncs, so CUDA graphs capture it); on a
  CPU `fused_moe_sorted` (below). A float32 model on the CPU kernels runs its experts as panels instead
  (`torchengine.cpu_transform.CpuExperts`, the same `expert_groups` and sum order).

Expert parallelism: a rank holds E_local experts and `expert_map` [E] maps a global expert id to its local index,
-1 for another rank's; those contributions are left out here and summed by the layer's all-reduce.

gpt-oss's experts slot in through `w13_bias` [E, 2I], `w2_bias` [E, H] and `activation` (only "silu", SwiGLU,
is implemented; a clamped SwiGLU is one more entry of `ACTIVATIONS` and of the kernel's ACTIVATION).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from enginecore.platform import CPU_WEIGHTS_FIRST_ROWS


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# name -> gate_up [N, 2I] -> [N, I]
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"silu": _silu_and_mul}


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, K] in `dtype` (the logits' by default), topk_ids [T, K] int64).

    transformers' order: softmax over all experts in float32, top_k, renormalize, then the cast."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype or router_logits.dtype), ids


def _check_args(x, w13, w2, topk_weights, topk_ids, expert_map, activation) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"fused_moe: want x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    E, two_i, H = w13.shape
    if x.shape[1] != H or w2.shape != (E, H, two_i // 2) or two_i % 2:
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not "
                         "agree (w13 [E, 2I, H], w2 [E, H, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: topk_weights {tuple(topk_weights.shape)} and topk_ids "
                         f"{tuple(topk_ids.shape)} must both be [T={x.shape[0]}, K]")
    if expert_map is not None and expert_map.dim() != 1:
        raise ValueError(f"fused_moe: expert_map must be [E_global], got {tuple(expert_map.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation {activation!r} is not one of {sorted(ACTIVATIONS)}")


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] global expert ids
    *,
    expert_map: torch.Tensor | None = None,  # [E_global] int: local index, -1 on another rank
    w13_bias: torch.Tensor | None = None,  # [E, 2I]
    w2_bias: torch.Tensor | None = None,  # [E, H]
    activation: str = "silu",
) -> torch.Tensor:  # [T, H]
    """The routed experts' weighted sum for every token (module docstring); the kernel by device."""
    _check_args(x, w13, w2, topk_weights, topk_ids, expert_map, activation)
    if x.is_cuda:
        from triton_kernels import fused_moe as triton_fused_moe

        return triton_fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map, w13_bias=w13_bias,
                                w2_bias=w2_bias, activation=activation)
    return fused_moe_sorted(x, w13, w2, topk_weights, topk_ids, expert_map=expert_map, w13_bias=w13_bias,
                            w2_bias=w2_bias, activation=activation)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] . w [out, in]^T (+ b). 2 to CPU_WEIGHTS_FIRST_ROWS rows weights first, w . x^T: MKL's small-M
    gemm reads the weight at a fraction of the bandwidth (an expert of a decode batch gets a few rows; see
    `Transformer.compute_logits`); one row as F.linear (its matrix-vector product is the fast one there)."""
    if 1 < x.shape[0] <= CPU_WEIGHTS_FIRST_ROWS and x.device.type == "cpu":
        y = torch.mm(w, x.t()).t()
        return y if b is None else y + b
    return F.linear(x, w, b)


# Up to this many (token, expert) pairs a step groups them in Python (a decode step's few rows: a few list
# operations instead of the sort's half-dozen torch ops); more, by the stable sort.
PYTHON_GROUPING_PAIRS = 256


def expert_groups(topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_local: int,
                  expert_map: torch.Tensor | None = None):
    """The routed (token, expert) pairs grouped by local expert, in ascending expert order (transformers' sum
    order), each expert's tokens in token order: yields (e, rows [n] int64 or None for a one-token step (its
    row 0), weights [n, 1]). Another rank's experts (expert_map -1) are left out. One host sync (the ids or the
    per-expert counts): fine on a CPU, not for CUDA graphs."""
    T, K = topk_ids.shape
    flat = topk_ids.reshape(-1)
    if expert_map is not None:
        flat = expert_map[flat]
    w_flat = topk_weights.reshape(-1, 1)
    if T * K <= PYTHON_GROUPING_PAIRS:
        ids = flat.tolist()
        if T == 1:  # no gathers: the token's row as it is, its weights as views
            for e, k in sorted((e, k) for k, e in enumerate(ids) if 0 <= e < num_local):
                yield e, None, w_flat[k : k + 1]
            return
        groups: dict[int, list[int]] = {}
        for p, e in enumerate(ids):
            if 0 <= e < num_local:
                groups.setdefault(e, []).append(p)
        for e in sorted(groups):
            pairs = torch.tensor(groups[e], dtype=torch.int64)
            yield e, pairs // K, w_flat.index_select(0, pairs)
        return
    flat = torch.where(flat < 0, num_local, flat)  # another rank's expert: a bucket past the last, never computed
    order = torch.argsort(flat, stable=True)  # [T*K] pair indices t*K + k
    counts = torch.bincount(flat, minlength=num_local + 1)[:num_local].tolist()
    rows_all = order // K
    weights_all = w_flat.index_select(0, order)
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, rows_all[start : start + n], weights_all[start : start + n]
            start += n


def accumulate(out: torch.Tensor, rows: torch.Tensor | None, y: torch.Tensor, weights: torch.Tensor) -> None:
    """out[rows] += y * weights (rows None: out's one row), the same float32 operations either way."""
    y = y * weights.to(y.dtype)
    if rows is None:
        out.add_(y)
    else:
        out.index_add_(0, rows, y)


def sum_routed_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_local: int,
                       expert_map: torch.Tensor | None,
                       expert_mlp: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """sum_k w[t, k] * expert_mlp(id[t, k], x[t]) over this rank's experts: expert_mlp(e, rows [n, H]) -> [n, H]
    runs once per expert that has tokens (`expert_groups`), so a step reads only its routed experts' weights; the
    weighted rows are summed into each token in ascending expert order (transformers' order, so float32 gives
    its sums)."""
    out = torch.zeros_like(x)
    for e, rows, weights in expert_groups(topk_weights, topk_ids, num_local, expert_map):
        accumulate(out, rows, expert_mlp(e, x if rows is None else x.index_select(0, rows)), weights)
    return out


def fused_moe_sorted(x, w13, w2, topk_weights, topk_ids, *, expert_map=None, w13_bias=None, w2_bias=None,
                     activation: str = "silu") -> torch.Tensor:
    """The CPU path on torch's matmuls: `sum_routed_experts` with one matmul pair per routed expert."""
    act = ACTIVATIONS[activation]

    def expert_mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
        h = _linear(rows, w13[e], None if w13_bias is None else w13_bias[e])
        return _linear(act(h), w2[e], None if w2_bias is None else w2_bias[e])

    return sum_routed_experts(x, topk_weights, topk_ids, w13.shape[0], expert_map, expert_mlp)
