"""Pure-torch references for the Triton kernels, plus the CPU attention path.

Nothing here imports triton. Two kinds of code live here:

- `ref_reshape_and_cache` / `ref_unified_attention`: the definitions the
  kernels are tested against. They loop over requests and do float32 math so
  they stay obviously right; speed does not matter.
- `paged_attention_torch`: the same contract as `unified_attention`, written
  to be quick on CPU for small batches (the torch backend's CPU serving path).
  Decode requests are batched (a few gathers + SDPA calls in cache-sized
  groups); requests with more than one new token are handled one by one. It
  reads lengths on the host (free on CPU), so it is not CUDA-graph
  capturable: on a GPU use `triton_kernels.unified_attention`.

Layouts (shared by all functions here and the kernels):
  key_cache, value_cache: [num_blocks, block_size, Hkv, D]; block 0 is the
  null block. A ragged batch of R request slots has q [T, Hq, D],
  cu_q_lens [R+1], kv_lens [R] (cache length including this step's tokens,
  0 for padded slots) and block_tables [R, max_blocks].
"""

from __future__ import annotations

import torch

__all__ = ["ref_reshape_and_cache", "ref_unified_attention", "paged_attention_torch"]


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


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache [NB, BS, Hkv, D], pages [..., n] -> [..., n*BS, Hkv, D], a fresh contiguous copy."""
    if not cache.is_contiguous():
        return cache[pages].flatten(-4, -3)
    # index_select on 2-D rows is several times faster on CPU than advanced indexing.
    rows = cache.view(cache.shape[0], -1).index_select(0, pages.reshape(-1))
    return rows.view(*pages.shape[:-1], pages.shape[-1] * cache.shape[1], *cache.shape[2:])


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
    num_q_heads, head_dim = q.shape[1], q.shape[2]
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
        num_pages = -(-kv_len // block_size)
        pages = block_tables[r, :num_pages].long()
        k = _gather_pages(key_cache, pages)[:kv_len].float()  # [S, Hkv, D]
        v = _gather_pages(value_cache, pages)[:kv_len].float()
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


def _attend(
    q: torch.Tensor,  # [B, Hkv, G*L, D] float32 (G q heads per kv head, L queries each)
    k: torch.Tensor,  # [B, Hkv, S, D] float32
    v: torch.Tensor,  # [B, Hkv, S, D] float32
    visible: torch.Tensor,  # [B, 1, G*L, S] bool; every row has a True
    sm_scale: float,
    soft_cap: float | None,
) -> torch.Tensor:  # [B, Hkv, G*L, D]
    if soft_cap is None:
        # SDPA's CPU kernels are blocked and fused; a boolean mask is allowed.
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=sm_scale)
    logits = _soft_cap(torch.matmul(q, k.transpose(-1, -2)) * sm_scale, soft_cap)
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1), v)


# Gathered float32 K/V per decode group and per thread: groups that stay
# cache-sized measured ~2-4x faster on CPU than one gather of a whole batch.
_DECODE_GATHER_BYTES_PER_THREAD = 2 << 20


def _padded(length: int, block_size: int) -> int:
    return -(-length // block_size) * block_size


def _decode_group(
    q, key_cache, value_cache, cu, kv_lens, block_tables, group_reqs, width, sm_scale, sliding_window, soft_cap, out
):
    """One batched attention for requests with one new token each, padded to `width` cache slots."""
    device = q.device
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    batch = len(group_reqs)
    reqs = torch.tensor(group_reqs, device=device)
    tokens = torch.tensor([cu[r] for r in group_reqs], device=device)
    q_pos = kv_lens[reqs].long()[:, None] - 1  # [B, 1]
    pages = block_tables[reqs, : width // block_size].long()  # [B, n]
    k = _gather_pages(key_cache, pages).float()  # [B, S, Hkv, D]
    v = _gather_pages(value_cache, pages).float()
    k_pos = torch.arange(width, device=device)[None, :]
    visible = k_pos <= q_pos  # [B, S]
    # Slots past a shorter request's length hold whatever was there, maybe
    # NaN; a -inf score does not cancel a NaN (nor does 0 * NaN in P @ V), so
    # zero those rows.
    stale = (~visible).reshape(-1).nonzero().squeeze(1)
    k.view(batch * width, -1).index_fill_(0, stale, 0.0)
    v.view(batch * width, -1).index_fill_(0, stale, 0.0)
    if sliding_window is not None:
        visible &= q_pos - k_pos < sliding_window
    qd = q[tokens].float().view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    o = _attend(qd, k.transpose(1, 2), v.transpose(1, 2), visible[:, None, None, :], sm_scale, soft_cap)
    out[tokens] = o.reshape(batch, num_q_heads, head_dim).to(out.dtype)  # o: [B, Hkv, G, D]


def paged_attention_torch(
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
    """`unified_attention` in plain torch, fast for small CPU batches.

    Decode requests (one new token) are batched: grouped by length under a
    memory budget, each group one gather padded to its longest request and
    one attention call. Longer requests (prefill chunks) run one per call,
    each with its own causal mask. Math is float32; rows past the last
    request are zeroed. Reads lengths on the host.
    """
    num_reqs = _check_attention_args(q, key_cache, value_cache, cu_q_lens, kv_lens, block_tables, num_reqs)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    cu = cu_q_lens[: num_reqs + 1].tolist()
    lens = kv_lens[:num_reqs].tolist()
    q_lens = [cu[r + 1] - cu[r] for r in range(num_reqs)]
    decode = [r for r in range(num_reqs) if q_lens[r] == 1]
    longer = [r for r in range(num_reqs) if q_lens[r] > 1]
    if cu[-1] < num_tokens:
        out[cu[-1] :].zero_()
    device = q.device

    # Decode requests, shortest first, in groups whose gathered float32 K/V
    # stays near cache size: faster on CPU than one big gather, and bounded
    # temporary memory however large the batch.
    decode.sort(key=lambda r: lens[r])
    bytes_per_slot = 2 * num_kv_heads * head_dim * 4
    budget = _DECODE_GATHER_BYTES_PER_THREAD * torch.get_num_threads()
    start = 0
    while start < len(decode):
        end = start + 1
        while end < len(decode):
            if (end + 1 - start) * _padded(lens[decode[end]], block_size) * bytes_per_slot > budget:
                break
            end += 1
        width = _padded(lens[decode[end - 1]], block_size)
        _decode_group(q, key_cache, value_cache, cu, kv_lens, block_tables, decode[start:end], width,
                      sm_scale, sliding_window, soft_cap, out)  # fmt: skip
        start = end

    for r in longer:
        q_len, kv_len = q_lens[r], lens[r]
        num_pages = -(-kv_len // block_size)
        pages = block_tables[r, :num_pages].long()
        k = _gather_pages(key_cache, pages)[:kv_len].float().transpose(0, 1)[None]  # [1, Hkv, S, D]
        v = _gather_pages(value_cache, pages)[:kv_len].float().transpose(0, 1)[None]
        # [L, Hq, D] -> [1, Hkv, G*L, D]: rows ordered (g, l) so each kv head sees one matrix.
        qr = q[cu[r] : cu[r + 1]].float().view(q_len, num_kv_heads, group, head_dim)
        qr = qr.permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * q_len, head_dim)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
        k_pos = torch.arange(kv_len, device=device)[None, :]
        visible = k_pos <= q_pos
        if sliding_window is not None:
            visible &= q_pos - k_pos < sliding_window
        visible = visible.repeat(group, 1)[None, None]  # [1, 1, G*L, S]
        o = _attend(qr, k, v, visible, sm_scale, soft_cap)  # [1, Hkv, G*L, D]
        o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
        out[cu[r] : cu[r + 1]] = o.reshape(q_len, num_q_heads, head_dim).to(out.dtype)
    return out
