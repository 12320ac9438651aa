"""Paged attention for the torch backend: metadata, the per-step attention function, backends.

The KV cache is one pair of tensors per layer, `key_cache, value_cache:
[num_blocks, block_size, Hkv, D]` (block 0 is the null block). A backend
writes this step's k/v into their slots and attends over the ragged batch:

- `TorchAttention` ("torch"): plain torch, the CPU serving path. Requests are
  split into groups, decodes (one new token) by kv length and the rest by
  query length; each group is padded to [n requests, L queries] and attends
  with one masked SDPA over its requests' blocks, gathered only up to the
  group's longest kv length (never max_model_len). With the AVX2 kernels
  (`cpu_kernels.torch_ops`), float32 queries and a float32, float16 or
  bfloat16 cache (`--kv-cache-dtype`), all decodes are one `DecodeGroup`
  attended in place over the paged cache (no gather, no mask), the prefills
  one `PrefillGroup`, and the cache writes are one call too. The plan (index
  tensors and masks) is built once per step on the host from the numpy batch
  and shared by every layer. Not capturable in a CUDA graph (its shapes depend on the lengths).
- `TritonAttention` ("triton"): `triton_kernels.reshape_and_cache` +
  `unified_attention`; reads lengths on the device only, so decode steps can
  be captured in CUDA graphs. The default on CUDA.
- `ReferenceAttention` ("reference"): `triton_kernels.reference` (slow, for
  debugging a kernel against its definition).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import abc

import numpy as np
import torch
import torch.nn.functional as F

from enginecore.step_batch import StepBatch
from enginecore.config import ConfigError
from cpu_kernels import torch_ops


@dataclass(frozen=True)
class RequestGroup:
    """Requests attended together, padded to [n, L] query rows over S = P * block_size cache slots."""

    token_index: torch.Tensor  # [n, L] i64 flat token of each query row (padding rows repeat a real one)
    blocks: torch.Tensor  # [n * P] i64 block ids, request by request
    mask: torch.Tensor  # [n, 1, G*L, S] additive (0 or -inf) in the query's dtype: row (g, l) may see slot s
    out_rows: torch.Tensor  # [m] i64 rows of the [n*L] padded queries that are real
    out_tokens: torch.Tensor  # [m] i64 their flat token index
    whole_batch: bool = False  # the [n, L] rows are exactly tokens 0..T-1 in order (no gather or scatter needed)


@dataclass(frozen=True)
class DecodeGroup:
    """Requests of one new token each, attended by `cpu_kernels.decode_attention` straight from the cache."""

    tokens: torch.Tensor  # [n] i64 flat token (query row) of each request
    kv_lens: torch.Tensor  # [n] i32
    block_tables: torch.Tensor  # [n, P] i32, P blocks cover the longest


@dataclass(frozen=True)
class PrefillGroup:
    """Requests of several new tokens (prefill, chunked prefill, recompute), attended by
    `cpu_kernels.prefill_attention` straight from the cache, each query with decode_attention's arithmetic."""

    q_start: torch.Tensor  # [n] i32 first query row of each request
    q_lens: torch.Tensor  # [n] i32
    kv_lens: torch.Tensor  # [n] i32
    block_tables: torch.Tensor  # [n, P] i32, P blocks cover the longest


@dataclass
class AttentionMetadata:
    """One step's ragged batch on the device (shapes padded to the batch's buckets)."""

    slot_mapping: torch.Tensor  # [Tp] i64 cache slot of each token, -1 for padding
    cu_q_lens: torch.Tensor  # [Rp+1] i32
    kv_lens: torch.Tensor  # [Rp] i32 cache length after this step
    block_tables: torch.Tensor  # [Rp, Bp] i32
    num_reqs: int  # requests the kernels look at (real ones eagerly, Rp in a CUDA graph)
    num_tokens: int  # real tokens (the first num_tokens rows of the batch)
    groups: tuple[RequestGroup | DecodeGroup | PrefillGroup, ...] = field(default_factory=tuple)  # TorchAttention's plan


class AttentionBackend(abc.ABC):
    """Writes k/v into the paged cache and attends. Subclasses state whether CUDA graphs may capture them."""

    name = "base"
    supports_cuda_graphs = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding_window = sliding_window
        self.sm_scale = head_dim**-0.5

    def plan(self, batch: StepBatch, device: torch.device, block_size: int,
             dtype: torch.dtype = torch.float32) -> tuple[RequestGroup | DecodeGroup | PrefillGroup, ...]:
        """Host-side per-step precomputation shared by all layers (none by default); `dtype`: the queries'."""
        return ()

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        key_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        value_cache: torch.Tensor,  # [NB, BS, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, Hq, D]
        """Write this step's k/v into the caches, then attend q over them."""


class PagedAttention:
    """The model's `AttentionFn` for one step: binds a backend, the per-layer caches and the metadata."""

    def __init__(self, backend: AttentionBackend, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 meta: AttentionMetadata):
        self.backend, self.kv_caches, self.meta = backend, kv_caches, meta

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        key_cache, value_cache = self.kv_caches[layer_idx]
        return self.backend.forward(q, k, v, key_cache, value_cache, self.meta)


# ---------------------------------------------------------------------------------
# plain torch (CPU)


class TorchAttention(AttentionBackend):
    name = "torch"
    supports_cuda_graphs = False

    # a request joins a group when its padded size (queries for prefills, kv length for decodes) is at least
    # 1/GROUP_SPREAD of the group's largest: bounded padding waste, few SDPA calls per layer
    GROUP_SPREAD = 4

    def __init__(self, *args, cpu_lib=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.lib = cpu_lib  # cpu_kernels.torch_ops' library (float32 queries, a KV_TYPES cache), or None

    def plan(self, batch: StepBatch, device: torch.device, block_size: int,
             dtype: torch.dtype = torch.float32) -> tuple[RequestGroup | DecodeGroup | PrefillGroup, ...]:
        R = batch.num_reqs
        cu = batch.cu_q_lens[: R + 1].astype(np.int64)
        q_lens = np.diff(cu)
        kv = batch.kv_lens[:R].astype(np.int64)
        decode = q_lens == 1
        decodes, prefills = np.nonzero(decode)[0], np.nonzero(~decode)[0]
        head: tuple = ()
        if self.lib is not None and dtype == torch.float32:
            # the C kernels straight from the cache; each prefill query as decode_attention would attend it, so a
            # token's attention is the same decoded, prefilled or recomputed (and the jax backend's on a CPU)
            i32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32)).to(device)  # noqa: E731
            tables = lambda idx: i32(batch.block_tables[idx, : -(-kv[idx].max() // block_size)])  # noqa: E731
            if len(decodes):
                head += (DecodeGroup(tokens=torch.from_numpy(cu[decodes]).to(device), kv_lens=i32(kv[decodes]),
                                     block_tables=tables(decodes)),)
            if len(prefills):
                head += (PrefillGroup(q_start=i32(cu[prefills]), q_lens=i32(q_lens[prefills]),
                                      kv_lens=i32(kv[prefills]), block_tables=tables(prefills)),)
            decodes, prefills = decodes[:0], prefills[:0]
        groups = self._split(decodes, kv) + self._split(prefills, q_lens)
        return head + tuple(self._group(batch, idx, cu[idx], q_lens[idx], kv[idx], block_size, device, dtype)
                            for idx in groups)

    def _split(self, reqs: np.ndarray, size: np.ndarray) -> list[np.ndarray]:
        """`reqs` cut into groups of similar `size` (largest first)."""
        order = reqs[np.argsort(-size[reqs], kind="stable")]
        groups, start = [], 0
        for i in range(1, len(order) + 1):
            if i == len(order) or size[order[i]] * self.GROUP_SPREAD < size[order[start]]:
                groups.append(np.sort(order[start:i]))  # batch order inside a group
                start = i
        return groups

    def _group(self, batch, reqs, starts, q_lens, kv, block_size, device, dtype) -> RequestGroup:
        group = self.num_heads // self.num_kv_heads
        L = int(q_lens.max())
        P = int(-(-kv.max() // block_size))
        S = P * block_size
        l_idx = np.arange(L)[None, :]  # [1, L]
        valid = l_idx < q_lens[:, None]  # [n, L]
        token_index = starts[:, None] + np.minimum(l_idx, q_lens[:, None] - 1)  # [n, L]
        q_pos = (kv - q_lens)[:, None] + l_idx  # [n, L]
        s = np.arange(S)[None, None, :]
        visible = s <= q_pos[:, :, None]  # [n, L, S]
        if self.sliding_window is not None:
            visible &= q_pos[:, :, None] - s < self.sliding_window
        visible |= ~valid[:, :, None] & (s == 0)  # padding rows see one slot: no NaN from an empty softmax
        # [n, 1, G*L, S] rows ordered (g, l); additive, so SDPA does not convert a boolean mask in every layer
        mask = np.where(np.tile(visible, (1, group, 1))[:, None], np.float32(0), np.float32(-np.inf))
        flat_valid = valid.reshape(-1)
        flat_tokens = token_index.reshape(-1)
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
        whole = bool(flat_valid.all()) and len(flat_tokens) == batch.num_tokens and bool(
            np.array_equal(flat_tokens, np.arange(len(flat_tokens))))
        return RequestGroup(
            token_index=to(token_index.astype(np.int64)),
            blocks=to(batch.block_tables[reqs, :P].astype(np.int64).reshape(-1)),
            mask=to(mask).to(dtype),
            out_rows=to(np.nonzero(flat_valid)[0].astype(np.int64)),
            out_tokens=to(flat_tokens[flat_valid].astype(np.int64)),
            whole_batch=whole,
        )

    def forward(self, q, k, v, key_cache, value_cache, meta):
        T = meta.num_tokens
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        G = Hq // Hkv
        slots = meta.slot_mapping[:T]
        if k.shape[0] != T:
            k, v = k[:T], v[:T]
        lib = self.lib if q.dtype == k.dtype == torch.float32 else None
        if lib is not None and k.stride(2) == 1 and k.stride(1) == D and v.stride(2) == 1 and v.stride(1) == D:
            torch_ops.kv_write(lib, k, v, slots, key_cache, value_cache)  # (converts to a 16-bit cache's dtype)
        else:
            if k.dtype != key_cache.dtype:  # (a no-op .to still costs a dispatch, 30 layers x every step)
                k, v = k.to(key_cache.dtype), v.to(value_cache.dtype)
            key_cache.view(-1, Hkv, D).index_copy_(0, slots, k)
            value_cache.view(-1, Hkv, D).index_copy_(0, slots, v)
        cast = key_cache.dtype != q.dtype
        out = None
        for g in meta.groups:
            if isinstance(g, DecodeGroup):
                if out is None:  # every row written when the decodes are the whole step
                    out = (torch.empty if len(meta.groups) == 1 and g.tokens.shape[0] == q.shape[0]
                           else torch.zeros)(q.shape, dtype=q.dtype)
                if q.stride(2) != 1 or q.stride(1) != D:
                    q = q.contiguous()
                torch_ops.decode_attention(lib, q, g.tokens, g.kv_lens, g.block_tables, key_cache, value_cache,
                                             self.sm_scale, self.sliding_window, out)
                continue
            if isinstance(g, PrefillGroup):
                if out is None:
                    out = torch.zeros(q.shape, dtype=q.dtype)
                if q.stride(2) != 1 or q.stride(1) != D:
                    q = q.contiguous()
                torch_ops.prefill_attention(lib, q, g.q_start, g.q_lens, g.kv_lens, g.block_tables, key_cache,
                                              value_cache, self.sm_scale, self.sliding_window, out)
                continue
            n, L = g.token_index.shape
            qg = q[:T] if g.whole_batch else q[g.token_index]
            qg = qg.view(n, L, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(n, Hkv, G * L, D)
            # index_select, not key_cache[blocks]: on a CPU 2-3x faster for the same copy
            kg = key_cache.index_select(0, g.blocks).view(n, -1, Hkv, D).transpose(1, 2)  # [n, Hkv, S, D]
            vg = value_cache.index_select(0, g.blocks).view(n, -1, Hkv, D).transpose(1, 2)
            if cast:
                kg, vg = kg.to(q.dtype), vg.to(q.dtype)
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=self.sm_scale)
            o = o.view(n, Hkv, G, L, D).permute(0, 3, 1, 2, 4).reshape(n * L, Hq, D)
            if g.whole_batch and q.shape[0] == T:
                return o
            if out is None:
                out = torch.zeros_like(q)
            out[g.out_tokens] = o[g.out_rows]
        return torch.zeros_like(q) if out is None else out


# ---------------------------------------------------------------------------------
# Triton (CUDA) and the reference


class TritonAttention(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import triton_kernels  # lazily: CPU runs never need triton

        if not triton_kernels.HAS_TRITON:
            raise ImportError("--attention-backend triton needs the triton package")
        self._write = triton_kernels.reshape_and_cache
        self._attend = triton_kernels.unified_attention

    def forward(self, q, k, v, key_cache, value_cache, meta):
        self._write(k, v, key_cache, value_cache, meta.slot_mapping)
        return self._attend(
            q, key_cache, value_cache, meta.cu_q_lens, meta.kv_lens, meta.block_tables,
            sm_scale=self.sm_scale, sliding_window=self.sliding_window, num_reqs=meta.num_reqs,
        )


class ReferenceAttention(AttentionBackend):
    name = "reference"
    supports_cuda_graphs = False

    def forward(self, q, k, v, key_cache, value_cache, meta):
        from triton_kernels.reference import ref_reshape_and_cache, ref_unified_attention

        ref_reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        return ref_unified_attention(
            q, key_cache, value_cache, meta.cu_q_lens, meta.kv_lens, meta.block_tables,
            sm_scale=self.sm_scale, sliding_window=self.sliding_window, num_reqs=meta.num_reqs,
        )


_BACKENDS = {"torch": TorchAttention, "triton": TritonAttention, "reference": ReferenceAttention}


def make_attention_backend(name: str, device: torch.device, kv_dtype: torch.dtype = torch.float32,
                           **kwargs) -> AttentionBackend:
    """`--attention-backend`: auto is triton on CUDA, torch elsewhere (with the AVX2 kernels for a float32,
    float16 or bfloat16 cache on a CPU that runs them; they serve float32 queries)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch" and device.type == "cpu" and kv_dtype in torch_ops.KV_TYPES:
        kwargs["cpu_lib"] = torch_ops.lib()
    if name not in _BACKENDS:
        raise ConfigError(f"--attention-backend {name!r} is not available on the torch backend "
                         f"(choose from auto, {', '.join(_BACKENDS)})")
    if name == "triton" and device.type != "cuda":
        import triton_kernels

        # the interpreter runs the same kernels on CPU tensors (slowly): the CPU tests of the CUDA path use it
        if not triton_kernels.interpreted():
            raise ConfigError("--attention-backend triton needs --platform cuda (on CPU use torch; "
                              "TRITON_INTERPRET=1 runs the kernels in triton's interpreter, for testing)")
    return _BACKENDS[name](**kwargs)
