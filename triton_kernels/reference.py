"""Pure-torch references for the Triton kernels.

Nothing here imports triton. `ref_reshape_and_cache` / `ref_unified_attention`
are the definitions the kernels are tested against: they loop over requests
and do float32 math so they stay obviously right; speed does not matter (the
torch backend's fast CPU attention is `torchengine.attention.TorchAttention`).

Mixture of Experts (`ref_fused_moe`): x [T, H], w13 [E, 2I, H] (each expert's gate
rows, then its up rows), w2 [E, H, I], topk_weights / topk_ids [T, K].

Attention layouts (shared by the attention functions here and the kernels):
  key_cache, value_cache: [num_blocks, block_size, Hkv, D]; block 0 is the
  null block. A ragged batch of R request slots has q [T, Hq, D],
  cu_q_lens [R+1], kv_lens [R] (cache length including this step's tokens,
  0 for padded slots) and block_tables [R, max_blocks].
"""

from __future__ import annotations

import torch

__all__ = ["ref_fused_moe", "ref_reshape_and_cache", "ref_unified_attention"]


def ref_reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    value_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64; < 0 means skip
) -> None:
    """Write each token's K/V into its cache slot (in place); slot < 0 is skipped."""
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    key_cache.view(num_slots, *key_cache.shape[2:])[slots] = key[keep].to(key_cache.dtype)
    value_cache.view(num_slots, *value_cache.shape[2:])[slots] = value[keep].to(value_cache.dtype)


def _check_attention_args(q, key_cache, value_cache, cu_q_lens, kv_lens, block_tables, num_reqs):
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache/value_cache must both be [NB, BS, Hkv, D], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise ValueError(f"cache head dim {key_cache.shape[3]} != q head dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
    num_slots = kv_lens.shape[0]
    if cu_q_lens.shape != (num_slots + 1,) or block_tables.dim() != 2 or block_tables.shape[0] != num_slots:
        raise ValueError(
            f"want cu_q_lens [R+1], kv_lens [R], block_tables [R, max_blocks]; got "
            f"{tuple(cu_q_lens.shape)}, {tuple(kv_lens.shape)}, {tuple(block_tables.shape)}"
        )
    if num_reqs is None:
        return num_slots
    if not 0 <= num_reqs <= num_slots:
        raise ValueError(f"num_reqs={num_reqs} must be in [0, R={num_slots}]")
    return num_reqs


def _soft_cap(logits: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    if soft_cap is None:
        return logits
    return soft_cap * torch.tanh(logits / soft_cap)


def ref_unified_attention(
    q: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    value_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    cu_q_lens: torch.Tensor,  # [R+1]
    kv_lens: torch.Tensor,  # [R]
    block_tables: torch.Tensor,  # [R, max_blocks]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_reqs: int | None = None,
    out: torch.Tensor | None = None,  # [T, Hq, D]
) -> torch.Tensor:  # [T, Hq, D]
    """Ragged paged causal attention, one request at a time, in float32.

    Token j of request r (q_len new tokens) sits at position
    kv_lens[r] - q_len + j and sees cache positions p <= pos (and, with a
    sliding window w, pos - p < w). Rows past the last request are zeroed.
    """
    num_reqs = _check_attention_args(q, key_cache, value_cache, cu_q_lens, kv_lens, block_tables, num_reqs)
    num_q_heads = q.shape[1]
    group = num_q_heads // key_cache.shape[2]
    block_size = key_cache.shape[1]
    if out is None:
        out = torch.empty_like(q)
    out.zero_()
    cu = cu_q_lens.tolist()
    lens = kv_lens.tolist()
    for r in range(num_reqs):
        q_len, kv_len = cu[r + 1] - cu[r], lens[r]
        if q_len == 0:
            continue
        num_blocks_read = -(-kv_len // block_size)
        blocks = block_tables[r, :num_blocks_read].long()
        k = key_cache[blocks].flatten(0, 1)[:kv_len].float()  # [S, Hkv, D]
        v = value_cache[blocks].flatten(0, 1)[:kv_len].float()
        k = k.repeat_interleave(group, dim=1)  # [S, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        qr = q[cu[r] : cu[r + 1]].float()  # [L, Hq, D]
        logits = torch.einsum("lhd,shd->hls", qr, k) * sm_scale
        logits = _soft_cap(logits, soft_cap)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
        k_pos = torch.arange(kv_len, device=q.device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        logits = logits.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        out[cu[r] : cu[r + 1]] = torch.einsum("hls,shd->lhd", probs, v).to(out.dtype)
    return out


def ref_fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K] global expert ids
    *,
    expert_map: torch.Tensor | None = None,  # [E_global]: local index, -1 on another rank (left out)
    w13_bias: torch.Tensor | None = None,  # [E, 2I]
    w2_bias: torch.Tensor | None = None,  # [E, H]
) -> torch.Tensor:  # [T, H] float32
    """out[t] = sum_k topk_weights[t, k] * (w2[e] . (silu(g) * u) + b2[e]), (g, u) = w13[e] . x[t] + b13[e],
    e = topk_ids[t, k], token by token in float32."""
    T, K = topk_ids.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(T, w2.shape[1], dtype=torch.float32, device=x.device)
    for t in range(T):
        for k in range(K):
            e = int(topk_ids[t, k])
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue
            h = w13[e].float() @ x[t].float()
            if w13_bias is not None:
                h = h + w13_bias[e].float()
            y = w2[e].float() @ (torch.nn.functional.silu(h[:inter]) * h[inter:])
            if w2_bias is not None:
                y = y + w2_bias[e].float()
            out[t] += topk_weights[t, k].float() * y
    return out
