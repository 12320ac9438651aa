"""A linear layer of a few rows on this CPU, both orientations, both backends, and 4-bit.

    python -m benchmarks.bench_dense [--rows 1,2,4,8,16,32,64,256] [--layers 8]

`h [M, K] . w [N, K]^T` (what every linear and the LM head compute) in the
usual orientation and weights first (`w . h^T`, then transposed:
`jaxengine.model.dense`, `torchengine.model.Model.compute_logits`), at the
embedded model's shapes. Each timing cycles through --layers distinct weight
matrices, so the weights come from memory as in a real step, not from cache.
Prints ms per matmul and the speedup of weights first; the engines use it for
2 to 32 rows on a CPU (`weights_first_rows`). `avx2 f32` is the torch backend's
float32 kernel on [out, in] weights (`cpu_kernels.f32_gemm`) and `panels` the one
on weights packed in panels of 16 rows (`cpu_kernels.panel_gemm`, what all its
float32 linears and its LM head use on a CPU, any row count), each as a speedup
over torch's usual linear. The last columns are the 4-bit
kernels of `--quantization gguf` (`torchengine.quant`) on the same weights
quantized in groups of 32: torch's int4 kernel, and our AVX2 kernel
(`cpu_kernels/csrc`, up to 32 rows; `-` where it cannot run), each as a
speedup over torch's usual float32 linear.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

SHAPES = (("qkv", 576, 960), ("gate_up", 576, 3072), ("down", 1536, 576), ("lm_head", 576, 49152))


def best_ms(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)

    import jax
    import jax.numpy as jnp
    import torch

    from enginecore.model_loader import Int4Groups
    from jaxengine.model import dense
    from cpu_kernels import torch_ops
    from torchengine.quant import Int4Linear

    torch.set_num_threads(threads)
    jstd = jax.jit(lambda h, w: dense(h, w, 0))
    jwf = jax.jit(lambda h, w: dense(h, w, 1 << 30))  # one row: the same dot either way
    rng = np.random.default_rng(0)
    print(f"ms per matmul, {threads} threads; weights first / usual = speedup (>1: weights first is faster)")
    print(f"{'shape':>8} {'rows':>4} | {'jax usual':>9} {'jax wfirst':>10} {'x':>5} | "
          f"{'torch usual':>11} {'torch wfirst':>12} {'x':>5} | {'avx2 f32':>8} {'x':>5} | {'panels':>8} {'x':>5} | {'torch int4':>10} {'x':>5} | "
          f"{'avx2 q4':>7} {'x':>5}")
    lib = torch_ops.lib()
    have_q4 = lib is not None
    for name, K, N in SHAPES:
        n_layers = max(1, min(args.layers, (1 << 30) // (N * K * 4)))
        ws = [rng.standard_normal((N, K), np.float32) for _ in range(n_layers)]
        jws = [jnp.asarray(w) for w in ws]
        tws = [torch.from_numpy(w) for w in ws]
        pws = [torch_ops.pack_panels(w) for w in tws] if lib is not None else []
        q4s, avx = [], []
        for w in ws:
            g = w.reshape(N, K // 32, 32)
            lo, hi = g.min(-1), g.max(-1)
            scale = (hi - lo) / 15
            q = np.clip(np.rint((g - lo[..., None]) / scale[..., None]), 0, 15).astype(np.uint8).reshape(N, K)
            lin = torch.nn.Linear(K, N, bias=False)
            q4s.append(Int4Linear(lin, Int4Groups(q, scale, lo), max_rows=1 << 30, kernel="torch"))
            if have_q4:
                avx.append(Int4Linear(lin, Int4Groups(q, scale, lo)))
        for M in rows:
            h = rng.standard_normal((M, K), np.float32)
            jh, th = jnp.asarray(h), torch.from_numpy(h)

            def run_j(f):
                return lambda: jax.block_until_ready([f(jh, w) for w in jws])

            with torch.inference_mode():
                t_usual = best_ms(lambda: [torch.nn.functional.linear(th, w) for w in tws]) / n_layers
                t_wf = best_ms(lambda: [torch.mm(w, th.t()).t().contiguous() for w in tws]) / n_layers
                t_f32 = best_ms(lambda: [torch_ops.f32_gemm(lib, th, w) for w in tws]) / n_layers \
                    if lib is not None else 0
                t_pan = best_ms(lambda: [torch_ops.panel_gemm(lib, th, p, N) for p in pws]) / n_layers \
                    if lib is not None else 0
                t_q4 = best_ms(lambda: [lin(th) for lin in q4s]) / n_layers
                t_avx = best_ms(lambda: [lin(th) for lin in avx]) / n_layers if avx and M <= torch_ops.MAX_ROWS else 0
            j_usual = best_ms(run_j(jstd)) / n_layers
            j_wf = best_ms(run_j(jwf)) / n_layers
            print(f"{name:>8} {M:>4} | {j_usual:>9.3f} {j_wf:>10.3f} {j_usual / j_wf:>5.2f} | "
                  f"{t_usual:>11.3f} {t_wf:>12.3f} {t_usual / t_wf:>5.2f} | "
                  + (f"{t_f32:>8.3f} {t_usual / t_f32:>5.2f}" if t_f32 else f"{'-':>8} {'-':>5}")
                  + " | " + (f"{t_pan:>8.3f} {t_usual / t_pan:>5.2f}" if t_pan else f"{'-':>8} {'-':>5}")
                  + f" | {t_q4:>10.3f} {t_usual / t_q4:>5.2f} | "
                  + (f"{t_avx:>7.3f} {t_usual / t_avx:>5.2f}" if t_avx else f"{'-':>7} {'-':>5}"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
