"""Unified ragged paged attention: decode and chunked prefill in one launch.

The batch is vLLM's ragged layout: q [T, Hq, D] holds every request's new
tokens back to back (cu_q_lens), the cache holds blocks of block_size tokens
(block_tables), kv_lens counts each request's tokens including the new ones.

Grid (dim 0): q blocks. A q block is BLOCK_Q consecutive new tokens of one
request times the Hq/Hkv query heads that share one kv head, so a block has
BLOCK_M = BLOCK_Q * Hq/Hkv rows and every K/V tile it loads serves all of
them. Request r owns programs [cu_q_lens[r] // BLOCK_Q + r, ...): counting
this way gives each request at least ceil(q_len / BLOCK_Q) programs and the
total is at most T // BLOCK_Q + R + 1, a bound from shapes alone, so the
launch never reads lengths on the host and can be captured in a CUDA graph.
A program finds its request by binary search over cu_q_lens. The "+1" is a
virtual request covering the padding rows after cu_q_lens[num_reqs]; its
programs write zeros. Programs past the end of their request return.

Grid (dim 1): kv heads. Grid (dim 2): kv splits. With more than one split
each program walks a slice of the kv tiles and writes float32 partials
(running max, sum, unnormalised output); `_merge_splits_kernel` combines
them. Splitting keeps the GPU busy when there are few (request, kv head)
pairs and long contexts, i.e. small decode batches.

Inside a program: online softmax in float32, base-2 exponentials, K/V tiles
of TILE_N cache positions gathered block by block through the block table, so
TILE_N and block_size are independent. Sliding windows skip whole tiles
before the window.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from triton_kernels._launch import launching
from triton_kernels.reference import _check_attention_args

__all__ = ["unified_attention", "AttentionConfig", "pick_config"]


@triton.jit(do_not_specialize=["num_tokens", "num_reqs"])
def _unified_attention_kernel(
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [NB, BS, Hkv, D]
    v_cache_ptr,  # [NB, BS, Hkv, D]
    out_ptr,  # [T, Hq, D]; unused with NUM_SPLITS > 1
    part_m_ptr,  # [T, Hq, NUM_SPLITS] f32 running max (log2 units); NUM_SPLITS > 1 only
    part_l_ptr,  # [T, Hq, NUM_SPLITS] f32 running sum
    part_acc_ptr,  # [T, Hq, NUM_SPLITS, HEAD_DIM_PAD] f32 unnormalised output
    cu_q_lens_ptr,  # [R+1]
    kv_lens_ptr,  # [R]
    block_tables_ptr,  # [R, max_blocks]
    num_tokens,  # T
    num_reqs,  # requests searched, <= R
    max_blocks,  # block_tables.shape[1]
    sm_scale,
    soft_cap,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_bt_r,
    NUM_Q_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: no window
    USE_SOFT_CAP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Largest r in [0, num_reqs] whose first program is <= pid; r == num_reqs
    # is the padding tail. Metadata is cast to int32 so the loop-carried
    # types do not depend on the caller's index dtype.
    lo = pid * 0
    hi = num_reqs + pid * 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        mid_first = tl.load(cu_q_lens_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        right = mid_first <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid - 1)
    req = lo
    is_real = req < num_reqs  # else: the padding tail
    q_start = tl.load(cu_q_lens_ptr + req).to(tl.int32)
    q_end = tl.load(cu_q_lens_ptr + req + 1, mask=is_real, other=0).to(tl.int32)
    q_end = tl.where(is_real, q_end, num_tokens)
    q_len = q_end - q_start
    q_block = pid - (q_start // BLOCK_Q + req)
    if q_block * BLOCK_Q >= q_len:
        return
    kv_len = tl.load(kv_lens_ptr + req, mask=is_real, other=0).to(tl.int32)
    context_len = kv_len - q_len

    # Row m of the block: new token q_block * BLOCK_Q + m // QUERIES_PER_KV
    # of the request, q head kv_head * QUERIES_PER_KV + m % QUERIES_PER_KV.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_idx = q_block * BLOCK_Q + offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_ok = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (q_idx < q_len)
    d_ok = offs_d < HEAD_DIM
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q_pos = context_len + q_idx  # absolute position of each row's token

    # Cache positions this block can see: [window start of its first token,
    # its last token]. The tail sees nothing and only writes zeros.
    last_pos = context_len + tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_stop = tl.where(is_real, tl.minimum(last_pos + 1, max_blocks * CACHE_BLOCK_SIZE), 0)
    tile_lo = pid * 0
    if SLIDING_WINDOW > 0:
        first_pos = context_len + q_block * BLOCK_Q
        tile_lo = tl.maximum(first_pos - SLIDING_WINDOW + 1, 0) // TILE_N
    tile_hi = tl.cdiv(kv_stop, TILE_N)
    if NUM_SPLITS > 1:
        split = tl.program_id(2)
        per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_hi, tile_lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * stride_bt_r
    k_head = k_cache_ptr + kv_head * stride_k_h
    v_head = v_cache_ptr + kv_head * stride_v_h
    offs_n = tl.arange(0, TILE_N)
    log2e = 1.4426950408889634
    for tile in range(tile_lo, tile_hi):
        kv_pos = tile * TILE_N + offs_n
        kv_ok = kv_pos < kv_stop
        block = tl.load(table + kv_pos // CACHE_BLOCK_SIZE, mask=kv_ok, other=0).to(tl.int64)
        in_block = kv_pos % CACHE_BLOCK_SIZE
        k = tl.load(  # [HEAD_DIM_PAD, TILE_N]
            k_head + (block * stride_k_b + in_block * stride_k_s)[None, :] + offs_d[:, None],
            mask=d_ok[:, None] & kv_ok[None, :],
            other=0.0,
        )
        s = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, TILE_N] f32
        if USE_SOFT_CAP:
            # soft_cap * tanh(x / soft_cap), tanh from one exp so it never overflows.
            x = s * (sm_scale / soft_cap)
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = tl.where(x < 0, -t, t) * (soft_cap * log2e)
        else:
            s = s * (sm_scale * log2e)
        visible = (kv_pos[None, :] <= q_pos[:, None]) & kv_ok[None, :] & row_ok[:, None]
        if SLIDING_WINDOW > 0:
            visible = visible & (q_pos[:, None] - kv_pos[None, :] < SLIDING_WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(  # [TILE_N, HEAD_DIM_PAD]
            v_head + (block * stride_v_b + in_block * stride_v_s)[:, None] + offs_d[None, :],
            mask=kv_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (token * NUM_Q_HEADS + head) * NUM_SPLITS + tl.program_id(2)  # [BLOCK_M] int64
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    part_m_ptr,  # [T, Hq, NUM_SPLITS] f32
    part_l_ptr,  # [T, Hq, NUM_SPLITS] f32
    part_acc_ptr,  # [T, Hq, NUM_SPLITS, HEAD_DIM_PAD] f32
    out_ptr,  # [T, Hq, D]
    stride_o_t,
    stride_o_h,
    NUM_Q_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    part = (token * NUM_Q_HEADS + head) * NUM_SPLITS + offs_s  # [NUM_SPLITS]
    m = tl.load(part_m_ptr + part)
    l = tl.load(part_l_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :])  # [NUM_SPLITS, HEAD_DIM_PAD]
    m_max = tl.max(m, 0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_ref)  # empty splits (m = -inf) weigh 0
    total = tl.sum(w * l, 0)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_o_t + head * stride_o_h + offs_d,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Launch shape of one call; chosen from tensor shapes only (CUDA-graph safe)."""

    block_m: int  # rows per q block = block_q tokens x (Hq / Hkv) heads, padded to a power of two
    block_q: int  # new tokens per q block
    tile_n: int  # cache positions per K/V tile
    num_splits: int  # kv splits (grid dim 2); > 1 adds the merge kernel
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_config(
    num_tokens: int,
    num_slots: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    num_kv_splits: int | None = None,
) -> AttentionConfig:
    """Block sizes for a batch of `num_tokens` new tokens over `num_slots` requests.

    Batches averaging more than 4 new tokens per request are prefill-like and
    get 64-row q blocks (K/V tiles are re-read once per q block, so bigger
    blocks read less); decode-like batches get 16 rows, the smallest tl.dot
    accepts. float32 always gets 16 rows: its exact (ieee) dots spill
    registers at 64 rows on sm_90. The number of kv splits, unless given, grows until the grid has
    about four programs per SM (1 on CPU).
    """
    queries_per_kv = num_q_heads // num_kv_heads
    prefill_like = num_tokens > 4 * max(num_slots, 1) and dtype != torch.float32
    block_m = max(64 if prefill_like else 16, triton.next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    tile_n = 64 if head_dim <= 128 else 32
    if num_kv_splits is None:
        num_kv_splits = 1
        if device.type == "cuda":
            programs = (num_tokens // block_q + num_slots + 1) * num_kv_heads
            target = 4 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
            while num_kv_splits < 16 and programs * num_kv_splits < target:
                num_kv_splits *= 2
    elif num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1):
        raise ValueError(f"num_kv_splits={num_kv_splits} must be a power of two >= 1")
    num_warps = 8 if block_m >= 64 and head_dim > 64 else 4
    return AttentionConfig(block_m, block_q, tile_n, num_kv_splits, num_warps, num_stages=2)


def unified_attention(
    q: torch.Tensor,  # [T, Hq, D]
    key_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    value_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    cu_q_lens: torch.Tensor,  # [R+1] int32
    kv_lens: torch.Tensor,  # [R] int32
    block_tables: torch.Tensor,  # [R, max_blocks] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    num_reqs: int | None = None,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    num_kv_splits: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Causal paged attention over a ragged batch of decode and prefill requests.

    Same contract as `triton_kernels.reference.ref_unified_attention`; the
    new tokens' K/V must already be in the cache. Rows after
    cu_q_lens[num_reqs] are written with zeros. `num_kv_splits` (a power of
    two) overrides the split-KV heuristic; 1 disables splitting. No host
    synchronisation: safe inside CUDA-graph capture.
    """
    num_reqs = _check_attention_args(q, key_cache, value_cache, cu_q_lens, kv_lens, block_tables, num_reqs)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q dtype {q.dtype} not supported (float16, bfloat16, float32)")
    if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        raise ValueError(f"cache dtypes {key_cache.dtype}/{value_cache.dtype} must equal q dtype {q.dtype}")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key_cache/value_cache must be contiguous in the head dim")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window} must be >= 1 or None")
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap={soft_cap} must be > 0 or None")
    for name, t in (("cu_q_lens", cu_q_lens), ("kv_lens", kv_lens), ("block_tables", block_tables)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} dtype {t.dtype} must be int32 (or int64)")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("cu_q_lens", cu_q_lens),
                    ("kv_lens", kv_lens), ("block_tables", block_tables)):  # fmt: skip
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(
            f"out must be a [T, Hq, D] {q.dtype} tensor with unit last stride, got {tuple(out.shape)} {out.dtype}"
        )
    if num_tokens == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    cu_q_lens, kv_lens, block_tables = cu_q_lens.contiguous(), kv_lens.contiguous(), block_tables.contiguous()

    cfg = pick_config(num_tokens, num_reqs, num_q_heads, num_kv_heads, head_dim, q.dtype, q.device, num_kv_splits)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    if cfg.num_splits > 1:
        part_m = torch.empty((num_tokens, num_q_heads, cfg.num_splits), dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty((*part_m.shape, head_dim_pad), dtype=torch.float32, device=q.device)
    else:
        part_m = part_l = part_acc = out  # never touched
    grid = (num_tokens // cfg.block_q + num_reqs + 1, num_kv_heads, cfg.num_splits)
    with launching(_unified_attention_kernel, q.device):
        _unified_attention_kernel[grid](
            q, key_cache, value_cache, out, part_m, part_l, part_acc,
            cu_q_lens, kv_lens, block_tables,
            num_tokens, num_reqs, block_tables.shape[1],
            float(sm_scale), float(soft_cap or 0.0),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_tables.stride(0),
            NUM_Q_HEADS=num_q_heads,
            QUERIES_PER_KV=num_q_heads // num_kv_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            CACHE_BLOCK_SIZE=block_size,
            BLOCK_Q=cfg.block_q,
            BLOCK_M=cfg.block_m,
            TILE_N=cfg.tile_n,
            SLIDING_WINDOW=sliding_window or 0,
            USE_SOFT_CAP=soft_cap is not None,
            NUM_SPLITS=cfg.num_splits,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
        if cfg.num_splits > 1:
            _merge_splits_kernel[(num_tokens, num_q_heads)](
                part_m, part_l, part_acc, out, out.stride(0), out.stride(1),
                NUM_Q_HEADS=num_q_heads,
                NUM_SPLITS=cfg.num_splits,
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=head_dim_pad,
                num_warps=4,
            )  # fmt: skip
    return out
