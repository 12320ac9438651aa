"""Top-k/top-p thresholds in the JAX sampler: sort vs bisect (sort-free) vs topk (candidates + bisect fallback).

    python -m benchmarks.bench_jax_sampler [--vocab 49152] [--rows 8,64]

Two kinds of rows: "peaked" (LLM-like: a few tokens hold most of the mass, the
top-p cut falls among the first 256 candidates) and "flat" (Gaussian logits:
top_p=0.9 needs thousands of tokens, the topk method falls back to bisect).
Every row uses top_k=50, top_p=0.9, temperature 0.8. Milliseconds per call
(best of 7) of the jitted `jaxengine.sampler.sample`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", default="8,64")
    ap.add_argument("--top-k", type=int, default=50)
    args = ap.parse_args(argv)

    import jax

    from jaxengine.sampler import sample

    rng = np.random.default_rng(0)
    V = args.vocab
    print(f"{'rows':>5} {'logits':>7} {'sort ms':>9} {'bisect ms':>10} {'topk ms':>9} {'no-filter ms':>13}")
    for R in (int(r) for r in args.rows.split(",")):
        for kind in ("peaked", "flat"):
            x = rng.standard_normal((R, V)).astype(np.float32)
            if kind == "peaked":
                x *= 4.0
                x[:, :20] += 12.0
            temp = np.full(R, 0.8, np.float32)
            top_k = np.full(R, args.top_k, np.int32)
            top_p = np.full(R, 0.9, np.float32)
            min_p = np.zeros(R, np.float32)
            u = rng.random(R).astype(np.float32)
            xs = jax.device_put(x)
            times = {}
            for method in ("sort", "bisect", "topk", None):
                def call():
                    return sample(xs, temp, top_k, top_p, min_p, u, all_greedy=False,
                                  needs_filtering=method is not None, method=method or "topk")["sampled"]

                ref = np.asarray(call())
                best = float("inf")
                for _ in range(7):
                    t = time.perf_counter()
                    call().block_until_ready()
                    best = min(best, time.perf_counter() - t)
                times[method] = best * 1e3
                if method == "sort":
                    want = ref
                elif method is not None:
                    assert (ref == want).all(), f"{method} picked other tokens than sort"
            print(f"{R:>5} {kind:>7} {times['sort']:>9.2f} {times['bisect']:>10.2f} {times['topk']:>9.2f} "
                  f"{times[None]:>13.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
