"""Ragged paged attention on TPU: the Pallas kernel against the pure-JAX reference.

    python -m benchmarks.bench_pallas [--decode-seqs 128 --kv-len 2048 ...]

Decode is judged by achieved HBM bandwidth (KV bytes read / time) next to the
chip's peak, prefill by achieved TFLOP/s (causal QK^T and PV) next to the bf16
peak. Without a TPU it says so and exits 0: interpret mode on CPU measures the
interpreter, not the kernel, so nothing is timed.
"""

from __future__ import annotations

import argparse
import sys
import time

# (HBM bytes/s, bf16 FLOP/s) per chip, used when pltpu.get_tpu_info() is unavailable.
_PEAKS = {
    "TPU v4": (1.2e12, 275e12),
    "TPU v5 lite": (819e9, 197e12),
    "TPU v5e": (819e9, 197e12),
    "TPU v5p": (2.765e12, 459e12),
    "TPU v5": (2.765e12, 459e12),
    "TPU v6 lite": (1.64e12, 918e12),
    "TPU v6e": (1.64e12, 918e12),
}


def _tpu():
    import jax

    try:
        devices = jax.devices("tpu")
    except RuntimeError:
        return None
    return devices[0] if devices else None


def _peaks(device):
    from jax.experimental.pallas import tpu as pltpu

    try:
        info = pltpu.get_tpu_info()
        cores = max(1, getattr(device, "num_cores", 1) or 1)
        return info.mem_bw_bytes_per_second * cores, info.bf16_ops_per_second * cores
    except Exception:  # noqa: BLE001 -- older jax or unknown chip: use the table
        return _PEAKS.get(device.device_kind, (float("nan"), float("nan")))


def _batch(q_lens, kv_lens, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    import jax
    import jax.numpy as jnp
    import numpy as np

    num_reqs = len(q_lens)
    blocks_per_seq = -(-max(kv_lens) // block_size)
    num_blocks = 1 + num_reqs * blocks_per_seq
    num_tokens = sum(q_lens)
    key = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(key[0], (num_tokens, num_q_heads, head_dim), dtype)
    k = jax.random.normal(key[1], (num_tokens, num_kv_heads, head_dim), dtype)
    v = jax.random.normal(key[2], (num_tokens, num_kv_heads, head_dim), dtype)
    cache = jax.random.normal(key[3], (num_blocks, block_size, 2 * num_kv_heads, head_dim), dtype)
    blocks = 1 + np.random.default_rng(seed).permutation(num_reqs * blocks_per_seq).astype(np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    decode = sum(1 for n in q_lens if n == 1)
    dist = np.array([decode, num_reqs, num_reqs], np.int32)
    meta = (np.asarray(kv_lens, np.int32), blocks, cu, dist)
    return (q, k, v, cache) + tuple(jnp.asarray(x) for x in meta)


def _time(fn, args, iters):
    """Median seconds per call; the cache (args[3]) is donated, so feed the new one back."""
    import jax

    args = list(args)
    out, args[3] = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        out, args[3] = fn(*args)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode-seqs", type=int, default=128)
    p.add_argument("--kv-len", type=int, default=2048)
    p.add_argument("--prefill-seqs", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=1024)
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks-per-chunk", type=int, default=16)
    p.add_argument("--num-queries-per-block", type=int, default=32)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)

    device = _tpu()
    if device is None:
        print("bench_pallas: no TPU present; the kernel only runs in interpret mode here, "
              "which times the interpreter, so nothing is measured.")
        return 0

    import functools

    import jax
    import jax.numpy as jnp

    from pallas_kernels import ragged_paged_attention, ref_ragged_paged_attention

    hbm_peak, flops_peak = _peaks(device)
    heads = dict(num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                 block_size=args.block_size, dtype=jnp.bfloat16)
    sm_scale = args.head_dim ** -0.5
    kernel = functools.partial(
        ragged_paged_attention, sm_scale=sm_scale,
        num_kv_blocks_per_chunk=args.num_kv_blocks_per_chunk, num_queries_per_block=args.num_queries_per_block)
    reference = jax.jit(functools.partial(ref_ragged_paged_attention, sm_scale=sm_scale), donate_argnums=3)
    print(f"device: {device.device_kind}; peaks: {hbm_peak / 1e9:.0f} GB/s HBM, {flops_peak / 1e12:.0f} TFLOP/s bf16")

    n = args.decode_seqs
    decode = _batch([1] * n, [args.kv_len] * n, **heads)
    kv_bytes = 2 * n * args.kv_len * args.num_kv_heads * args.head_dim * 2
    print(f"decode: {n} seqs x kv_len {args.kv_len}, KV read {kv_bytes / 2**20:.0f} MiB per call")
    for name, fn in (("kernel", kernel), ("reference", reference)):
        t = _time(fn, decode, args.iters)
        print(f"  {name:9s} {t * 1e6:9.1f} us  {kv_bytes / t / 1e9:7.1f} GB/s  "
              f"({100 * kv_bytes / t / hbm_peak:.0f}% of peak)")

    n, L = args.prefill_seqs, args.prefill_len
    prefill = _batch([L] * n, [L] * n, **heads)
    flops = 4 * n * args.num_q_heads * args.head_dim * (L * (L + 1) // 2)  # causal QK^T + PV
    print(f"prefill: {n} seqs x {L} tokens, {flops / 1e12:.2f} TFLOP per call (causal)")
    for name, fn in (("kernel", kernel), ("reference", reference)):
        t = _time(fn, prefill, args.iters)
        print(f"  {name:9s} {t * 1e6:9.1f} us  {flops / t / 1e12:7.1f} TFLOP/s  "
              f"({100 * flops / t / flops_peak:.0f}% of peak)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
