"""Packed weights on 4 KiB pages against 2 MiB (transparent huge) pages, in one process.

    python -m benchmarks.bench_huge_pages [--rows 1,32] [--rounds 12]

The float32 linears of a decode step of the embedded model's shape (30 layers of fused q/k/v, o, fused
gate/up and down, random weights packed in panels, ~425 MB: streamed from memory as in a real step), once
from ordinary allocations and once from `cpu_kernels.torch_ops.huge_page_buffer` (what
`torchengine.cpu_transform.apply_cpu_kernels` packs into), timed back to back in every round. Prints each round's
ratio (> 1: huge pages faster) and their median, and how much of the process is on huge pages (0 where the
OS gives none: transparent huge pages "never").
"""

from __future__ import annotations

import argparse
import time

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, o, gate_up, down
LAYERS = 30


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,32")
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args(argv)

    import torch

    from cpu_kernels import torch_ops as ck

    lib = ck.lib()
    if lib is None:
        print(f"the CPU kernels do not run here: {ck.load()[1]}")
        return 1
    g = torch.Generator().manual_seed(0)
    plain = [[ck.pack_panels(torch.randn(n, k, generator=g)) for n, k in SHAPES] for _ in range(LAYERS)]
    arena = ck.huge_page_buffer(sum(p.numel() for layer in plain for p in layer))
    huge, o = [], 0
    for layer in plain:
        row = []
        for p in layer:
            row.append(arena[o : o + p.numel()].view(p.shape).copy_(p))
            o += p.numel()
        huge.append(row)
    anon = next((ln.split()[1] for ln in open("/proc/self/smaps_rollup") if ln.startswith("AnonHugePages")), "?")
    print(f"weights {o * 4 / 1e6:.0f} MB; this process's anonymous huge pages: {anon} kB")

    def step(weights, xs):
        for layer in weights:
            for (n, k), p in zip(SHAPES, layer):
                ck.panel_gemm(lib, xs[k], p, n)

    def ms(weights, xs, reps=5):
        step(weights, xs)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            step(weights, xs)
            ts.append(time.perf_counter() - t)
        return sorted(ts)[reps // 2] * 1e3

    for M in (int(r) for r in args.rows.split(",")):
        xs = {576: torch.randn(M, 576, generator=g), 1536: torch.randn(M, 1536, generator=g)}
        ratios = []
        for _ in range(args.rounds):
            a, b = ms(plain, xs), ms(huge, xs)
            ratios.append(a / b)
            print(f"rows {M:3d}: 4 KiB pages {a:6.1f} ms, 2 MiB pages {b:6.1f} ms, {a / b:.2f}x", flush=True)
        print(f"rows {M:3d}: median {sorted(ratios)[len(ratios) // 2]:.2f}x over {len(ratios)} rounds "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
