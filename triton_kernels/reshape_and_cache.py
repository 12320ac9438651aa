"""KV-cache write: scatter this step's K/V rows into their paged cache slots.

One program per token copies its [Hkv, D] key and value rows to slot
slot_mapping[t] (block slot // block_size, row slot % block_size). Slots < 0
are skipped, so padded tokens can either point at the null block (block 0)
or be dropped. No host synchronisation: safe inside CUDA-graph capture.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels._launch import launching

__all__ = ["reshape_and_cache"]


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    key_cache_ptr,  # [NB, BS, Hkv, D]
    value_cache_ptr,  # [NB, BS, Hkv, D]
    slot_mapping_ptr,  # [T]
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    CACHE_BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // CACHE_BLOCK_SIZE
    in_block = slot % CACHE_BLOCK_SIZE
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + token * stride_k_t + offs_h[:, None] * stride_k_h + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    k_dst = key_cache_ptr + block * stride_kc_b + in_block * stride_kc_s
    v_dst = value_cache_ptr + block * stride_vc_b + in_block * stride_vc_s
    k_dst = k_dst + offs_h[:, None] * stride_kc_h + offs_d[None, :]
    v_dst = v_dst + offs_h[:, None] * stride_vc_h + offs_d[None, :]
    tl.store(k_dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    value_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int32/int64
) -> None:
    """In place: key_cache.view(-1, Hkv, D)[slot_mapping[t]] = key[t] (same for value); slot < 0 skipped."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key/value must both be [T, Hkv, D], got {tuple(key.shape)} and {tuple(value.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            f"key_cache/value_cache must both be [NB, BS, Hkv, D], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.shape[2:] != key.shape[1:]:
        raise ValueError(f"key rows {tuple(key.shape[1:])} do not match cache rows {tuple(key_cache.shape[2:])}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [T={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping dtype {slot_mapping.dtype} must be int32 or int64")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key_cache/value_cache must be contiguous in the head dim")
    for name, t in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache),
                    ("slot_mapping", slot_mapping)):  # fmt: skip
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device}, key on {key.device}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    slot_mapping = slot_mapping.contiguous()
    with launching(_reshape_and_cache_kernel, key.device):
        _reshape_and_cache_kernel[(num_tokens,)](
            key, value, key_cache, value_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
            CACHE_BLOCK_SIZE=key_cache.shape[1],
            num_warps=4,
        )  # fmt: skip
