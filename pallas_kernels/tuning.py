"""Per-chip chunk and q-block sizes of ragged paged attention: the one table the engine reads.

Why these numbers (a cost model, not measurements: no TPU has run them)
----------------------------------------------------------------------
* **kv chunk** (``num_kv_blocks_per_chunk``): each pipeline iteration pays a
  fixed cost (one DMA issue per cache block, a semaphore wait, loop control;
  assumed well under 1 us) that the previous chunk's transfer must hide. The
  table asks for ~2 us of HBM time per chunk: ``kv_chunk_bytes`` = bandwidth x
  2 us (v5e 819 GB/s -> 1.5 MiB, v6e 1640 GB/s -> 3 MiB, v5p 2765 GB/s ->
  5 MiB). A chunk's token count follows from the bytes one token occupies on
  one device (``2 * Hkv * D * itemsize``): tensor parallelism leaves fewer kv
  heads per chip, so it takes *longer* chunks to move the same bytes. Capped at
  ``MAX_CHUNK_TOKENS``: the compute of a chunk covers all its slots, masked,
  which a short request would waste, and the kernel unrolls one DMA issue per
  cache block of a chunk (Mosaic took 16-32 s to compile 128 of them, 2-3 s 16).
* **q block** (``num_queries_per_block``): the q block's matmul has ``bq * G``
  rows; the table asks for one MXU width of rows (128 on v5e/v5p, 256 on v6e),
  so prefill keeps the MXU full, rounded to a multiple of 8 tokens.
* **VMEM**: Mosaic refuses a kernel whose buffers exceed its scoped-VMEM limit
  (default 16 MiB on v5e, 32 MiB on v6e). The table grants 32 MiB (a quarter of
  v5e's and v6e's 128 MiB of VMEM, half of v5p's 64 MiB), and the chunk (then
  the q block) is halved until `estimate_vmem_bytes` fits 3/4 of it.

Compiling the engine for ``v5e:2x2`` / ``v6e:2x4`` (``xlaserve warmup
--topology``, ``tests/test_tpu_aot.py``) is the check that Mosaic accepts
these sizes for every shape the engine uses; the speed they give is unmeasured.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from pallas_kernels.validation import estimate_vmem_bytes

MAX_CHUNK_TOKENS = 1024


@dataclass(frozen=True)
class KernelTuning:
    """One chip generation's targets (see the module docstring for the model behind them)."""

    kv_chunk_bytes: int  # HBM bytes one kv chunk should move on one device
    q_rows: int  # rows of the q block's matmul (bq * G): one MXU width
    vmem_limit_bytes: int  # scoped VMEM granted to the kernel


TUNING: dict[str, KernelTuning] = {
    "v5e": KernelTuning(kv_chunk_bytes=3 << 19, q_rows=128, vmem_limit_bytes=32 << 20),
    "v6e": KernelTuning(kv_chunk_bytes=3 << 20, q_rows=256, vmem_limit_bytes=32 << 20),
    "v5p": KernelTuning(kv_chunk_bytes=5 << 20, q_rows=128, vmem_limit_bytes=32 << 20),
}

# jax's device_kind strings (as TPU VMs and libtpu's topology descriptions report them) -> chip.
DEVICE_KINDS = {
    "TPU v5 lite": "v5e",
    "TPU v5e": "v5e",
    "TPU v6 lite": "v6e",
    "TPU v6e": "v6e",
    "TPU v5": "v5p",
    "TPU v5p": "v5p",
}


def chip_of(device_kind: str) -> str | None:
    """'TPU v5 lite' -> 'v5e'; None for a device this table does not know (the kernel defaults apply)."""
    return DEVICE_KINDS.get(device_kind)


def _pow2_floor(n: int) -> int:
    return 1 << max(int(n), 1).bit_length() - 1


def kernel_block_sizes(device_kind: str, *, block_size: int, num_kv_heads: int, group: int, head_dim: int,
                       dtype) -> dict:
    """Keyword arguments of `ragged_paged_attention` for this chip and per-device shape.

    ``num_kv_heads`` is the count on one device (after tensor parallelism). An
    unknown device kind gets ``{}``: the kernel's chip-independent defaults.
    """
    chip = chip_of(device_kind)
    if chip is None:
        return {}
    t = TUNING[chip]
    token_bytes = 2 * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
    chunk_tokens = min(MAX_CHUNK_TOKENS, max(block_size, t.kv_chunk_bytes // token_bytes))
    blocks = _pow2_floor(max(1, chunk_tokens // block_size))
    bq = max(8, min(128, t.q_rows // group // 8 * 8))
    budget = t.vmem_limit_bytes * 3 // 4

    def need(b, q):
        return estimate_vmem_bytes(num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=block_size,
                                   dtype=dtype, num_kv_blocks_per_chunk=b, num_queries_per_block=q)

    while blocks > 1 and need(blocks, bq) > budget:
        blocks //= 2
    while bq > 8 and need(blocks, bq) > budget:
        bq = max(8, bq // 2 // 8 * 8)
    if need(blocks, bq) > budget:
        raise ValueError(
            f"ragged paged attention on {chip}: even 1 block per chunk and 8 queries per block need "
            f"{need(blocks, bq)} bytes of VMEM, over {budget} (3/4 of vmem_limit_bytes={t.vmem_limit_bytes}) "
            f"for num_kv_heads={num_kv_heads}, group={group}, head_dim={head_dim}, block_size={block_size}; "
            "use more tensor parallelism or a smaller --block-size")
    return {"num_kv_blocks_per_chunk": blocks, "num_queries_per_block": bq,
            "vmem_limit_bytes": t.vmem_limit_bytes}
