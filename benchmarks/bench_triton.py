"""Triton paged attention against its reference, torch SDPA and the hardware limit.

    python -m benchmarks.bench_triton               # on a CUDA GPU
    python -m benchmarks.bench_triton --splits      # also sweep the kv-split count
    python -m benchmarks.bench_triton --cpu-smoke   # GPU tables, tiny shapes, CPU interpreter

On a GPU: decode batches (32/128 requests, kv 1k-4k, Hq=32, Hkv=8, D=128,
bf16, block 16) and a prefill batch, each timed for
- `triton`: `unified_attention` (one launch, blocks read in place),
- `sdpa`: gather each request's blocks into a dense tensor, then torch SDPA
  (what a backend without a paged kernel would do), and `sdpa-only` without
  the gather,
- `ref`: the float32 per-request reference (a correctness oracle, not a rival).
Decode is bandwidth-bound, so it is scored as K/V bytes read per second and as
a fraction of the GPU's device-to-device copy bandwidth (read + write bytes of
a large copy_). Prefill is scored in TFLOP/s of causal attention.

Without a GPU it says so and exits 0. `--cpu-smoke` instead runs the GPU
tables with tiny shapes through the Triton interpreter, to check this script
itself; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Callable

import torch

BLOCK_SIZE = 16


def make_paged_batch(q_lens, kv_lens, num_q_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    """Random cache + a ragged batch whose requests own shuffled blocks (block 0 stays the null block)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks = [-(-kv // BLOCK_SIZE) for kv in kv_lens]
    max_blocks = max(blocks)
    num_blocks = 1 + sum(blocks)
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, device=device, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
    block_tables = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks):
        block_tables[r, :n] = order[start : start + n]
        start += n
    cu = torch.tensor([0] + list(q_lens)).cumsum(0).to(torch.int32)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, device=device, dtype=dtype)
    return dict(
        q=q,
        key_cache=key_cache,
        value_cache=value_cache,
        cu_q_lens=cu.to(device),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
    )


def sdpa_on_gathered_blocks(batch, q_lens, kv_lens, sm_scale, pre_gathered=None):
    """Dense torch path: gather blocks per request (padded to the longest), then one SDPA call.

    Equal lengths only (the tables below use equal lengths), so no mask is needed:
    decode is q_len 1 over the full kv; prefill is q_len == kv_len with is_causal.
    """
    assert len(set(q_lens)) == 1 and len(set(kv_lens)) == 1
    q_len, kv_len = q_lens[0], kv_lens[0]
    if pre_gathered is None:
        pre_gathered = gather_blocks(batch, kv_len)
    k, v = pre_gathered
    num_reqs = len(q_lens)
    q = batch["q"].view(num_reqs, q_len, *batch["q"].shape[1:]).transpose(1, 2)  # [B, Hq, L, D]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=q_len > 1, scale=sm_scale, enable_gqa=True
    )  # [B, Hq, L, D]
    return out.transpose(1, 2).reshape(-1, *batch["q"].shape[1:])


def gather_blocks(batch, kv_len):
    num_blocks_read = -(-kv_len // BLOCK_SIZE)
    blocks = batch["block_tables"][:, :num_blocks_read].long()

    def dense(cache):  # [B, Hkv, S, D]
        return cache[blocks].flatten(1, 2)[:, :kv_len].transpose(1, 2)

    return dense(batch["key_cache"]), dense(batch["value_cache"])


class Timer:
    """Milliseconds per call: triton's do_bench median on CUDA (L2 flushed between calls), best wall clock on CPU."""

    def __init__(self, device: torch.device, reps_ms: int):
        self.device, self.reps_ms = device, reps_ms

    def __call__(self, fn: Callable[[], object], slow: bool = False) -> float:
        if self.device.type == "cuda":
            import triton.testing

            rep = max(20, self.reps_ms // 10) if slow else self.reps_ms
            return float(triton.testing.do_bench(fn, warmup=5 if slow else 25, rep=rep, return_mode="median"))
        fn()
        best = math.inf
        for _ in range(1 if slow else 5):  # best of: the CPU may be shared
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best * 1e3


def copy_bandwidth_gbs(device: torch.device, timer: Timer, num_bytes: int) -> float:
    """Device-to-device copy_: (read + write bytes) / time."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def run_gpu_tables(args, device: torch.device) -> None:
    import triton_kernels as tk

    timer = Timer(device, args.rep_ms)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter cannot multiply bf16
    hq, hkv, d = args.heads
    sm_scale = 1.0 / math.sqrt(d)
    copy_gbs = copy_bandwidth_gbs(device, timer, args.copy_mib << 20)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter smoke run)"
    print(f"device: {name}")
    print(f"copy bandwidth (read+write of a {args.copy_mib} MiB copy_): {copy_gbs:,.0f} GB/s\n")

    print(f"decode: Hq={hq} Hkv={hkv} D={d} {str(dtype).removeprefix('torch.')}, block {BLOCK_SIZE}")
    print(f"{'batch':>5} {'kv':>5} {'triton ms':>9} {'GB/s':>7} {'of copy':>7} {'splits':>6} "
          f"{'sdpa ms':>8} {'sdpa-only':>9} {'ref ms':>8} {'err':>8}")  # fmt: skip
    for batch_size in args.decode_batches:
        for kv_len in args.decode_kv:
            q_lens, kv_lens = [1] * batch_size, [kv_len] * batch_size
            batch = make_paged_batch(q_lens, kv_lens, hq, hkv, d, dtype, device)
            out = torch.empty_like(batch["q"])
            cfg = tk_config(batch, q_lens)

            def triton_call(splits=None, out=out):
                return tk.unified_attention(**batch, sm_scale=sm_scale, out=out, num_kv_splits=splits)

            t_triton = timer(triton_call)
            kv_bytes = 2 * batch_size * kv_len * hkv * d * batch["key_cache"].element_size()
            gbs = kv_bytes / (t_triton * 1e-3) / 1e9
            t_sdpa = timer(lambda: sdpa_on_gathered_blocks(batch, q_lens, kv_lens, sm_scale))
            gathered = gather_blocks(batch, kv_len)
            t_sdpa_only = timer(lambda: sdpa_on_gathered_blocks(batch, q_lens, kv_lens, sm_scale, gathered))
            del gathered
            ref_ms, err = "-", "-"
            if batch_size * kv_len <= args.ref_limit:
                ref = tk.ref_unified_attention(**batch, sm_scale=sm_scale)
                ref_ms = f"{timer(lambda: tk.ref_unified_attention(**batch, sm_scale=sm_scale), slow=True):8.2f}"
                err = f"{max_abs_err(triton_call(), ref):8.1e}"
            print(f"{batch_size:>5} {kv_len:>5} {t_triton:9.3f} {gbs:7.0f} {gbs / copy_gbs:7.1%} {cfg.num_splits:>6} "
                  f"{t_sdpa:8.3f} {t_sdpa_only:9.3f} {ref_ms:>8} {err:>8}")  # fmt: skip
            if args.splits:
                sweep = []
                for splits in (1, 2, 4, 8, 16):
                    ms = timer(lambda: triton_call(splits))
                    sweep.append(f"{splits}:{ms:.3f}ms/{kv_bytes / (ms * 1e-3) / 1e9 / copy_gbs:.0%}")
                print(f"{'':>11} split sweep  " + "  ".join(sweep))
            del batch, out

    num_reqs, q_len = args.prefill
    print(f"\nprefill: {num_reqs} x {q_len} new tokens (no cached prefix), Hq={hq} Hkv={hkv} D={d}")
    print(f"{'':>11} {'triton ms':>9} {'TFLOP/s':>7} {'sdpa ms':>8} {'sdpa-only':>9} {'ref ms':>8} {'err':>8}")
    q_lens = kv_lens = [q_len] * num_reqs
    batch = make_paged_batch(q_lens, kv_lens, hq, hkv, d, dtype, device)
    t_triton = timer(lambda: tk.unified_attention(**batch, sm_scale=sm_scale))
    flops = num_reqs * 4 * hq * d * q_len * (q_len + 1) / 2  # QK^T and PV over the causal half
    t_sdpa = timer(lambda: sdpa_on_gathered_blocks(batch, q_lens, kv_lens, sm_scale))
    gathered = gather_blocks(batch, q_len)
    t_sdpa_only = timer(lambda: sdpa_on_gathered_blocks(batch, q_lens, kv_lens, sm_scale, gathered))
    ref = tk.ref_unified_attention(**batch, sm_scale=sm_scale)
    t_ref = timer(lambda: tk.ref_unified_attention(**batch, sm_scale=sm_scale), slow=True)
    err = max_abs_err(tk.unified_attention(**batch, sm_scale=sm_scale), ref)
    sdpa_err = max_abs_err(sdpa_on_gathered_blocks(batch, q_lens, kv_lens, sm_scale, gathered), ref)
    tflops = flops / (t_triton * 1e-3) / 1e12
    print(f"{'':>11} {t_triton:9.3f} {tflops:7.1f} {t_sdpa:8.3f} {t_sdpa_only:9.3f} {t_ref:8.2f} {err:8.1e}")
    print(f"(sdpa max abs err vs ref: {sdpa_err:.1e})")


def tk_config(batch, q_lens):
    from triton_kernels.unified_attention import pick_config

    q = batch["q"]
    return pick_config(q.shape[0], len(q_lens), q.shape[1], batch["key_cache"].shape[2], q.shape[2], q.dtype, q.device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--splits", action="store_true", help="also sweep num_kv_splits for each decode shape")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="run the GPU tables on CPU with tiny shapes (interpreter)"
    )
    parser.add_argument("--rep-ms", type=int, default=200, help="measuring time per timing on CUDA")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        if "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET"):
            raise SystemExit("--cpu-smoke needs TRITON_INTERPRET=1 before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
        args.heads, args.decode_batches, args.decode_kv = (8, 2, 64), [2], [40, 100]
        args.prefill, args.copy_mib, args.ref_limit = (2, 24), 8, 10**9
        run_gpu_tables(args, torch.device("cpu"))
        return 0
    if not torch.cuda.is_available():
        print("no CUDA GPU present: Triton kernel timings skipped (--cpu-smoke runs the tables in the interpreter)")
        return 0
    args.heads, args.decode_batches, args.decode_kv = (32, 8, 128), [32, 128], [1024, 2048, 4096]
    args.prefill, args.copy_mib, args.ref_limit = (4, 2048), 2048, 32 * 4096
    run_gpu_tables(args, torch.device("cuda"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
