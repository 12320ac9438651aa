"""Both backends' samplers on a CPU: their own ops against the shared C row kernels, in one run.

    python -m benchmarks.bench_sampler [--vocab 49152] [--rows 1,8,32] [--reps 15]

The jitted `jaxengine.sampler.sample` with XLA's ops ("topk" method) and with
`cpu_kernels=True`, and `torchengine.sampler.sample` on torch's ops and on
`cpu_kernels/csrc` (log_softmax / softmax, the top-p cut, the draw,
the top-N logprobs), on the same float32 logits. Cases: "temp" (temperature
0.8), "top_k+top_p" (0.8, top_k 50, top_p 0.9), "top_p" (1.0, top_p 0.95),
"greedy+lp5" (greedy, 5 logprobs); logits "peaked" (a few tokens hold most of
the mass) or "flat" (Gaussian: top_p needs thousands of tokens). Median
milliseconds per call, and own-ops / kernels ratios (> 1: the kernels are
faster). The kernels' tokens and logprobs are also checked to be the same on
both backends (the point of sharing them); a mismatch is printed.
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np

CASES = {
    "temp": (0.8, 0, 1.0, False),
    "top_k+top_p": (0.8, 50, 0.9, False),
    "top_p": (1.0, 0, 0.95, False),
    "greedy+lp5": (0.0, 0, 1.0, True),
}


def median_ms(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[reps // 2] * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import torch

    from enginecore.sampling_batch import SamplingBatch
    from cpu_kernels import jax_ops as jax_kernels
    from jaxengine import sampler as jax_sampler
    from cpu_kernels import torch_ops as torch_kernels
    from torchengine import sampler as torch_sampler

    why = jax_kernels.available() or ("" if torch_kernels.lib() is not None else torch_kernels.load()[1])
    if why:
        print(f"the CPU kernels do not run here: {why}")
        return 1
    rng = np.random.default_rng(0)
    V = args.vocab
    print(f"vocab {V}, float32, {torch.get_num_threads()} torch threads; median ms per call")
    print(f"{'rows':>4} {'logits':>6} {'case':>12} {'jax xla':>8} {'jax C':>7} {'ratio':>6} {'torch ops':>10} "
          f"{'torch C':>8} {'ratio':>6}")
    own_kernels = torch_sampler._row_kernels
    for R in (int(r) for r in args.rows.split(",")):
        for kind in ("peaked", "flat"):
            x = (rng.standard_normal((R, V)) * 3).astype(np.float32)
            if kind == "peaked":
                x[:, :20] += 12.0
            xj, xt = jnp.asarray(x), torch.from_numpy(x)
            for name, (t, k, p, lp) in CASES.items():
                temp, top_k = np.full(R, t, np.float32), np.full(R, k, np.int32)
                top_p, min_p = np.full(R, p, np.float32), np.zeros(R, np.float32)
                u = rng.random(R).astype(np.float32)
                flags = (np.bool_(t == 0), np.bool_(k > 0 or p < 1), np.bool_(lp))
                outs, ms = {}, []
                for ck in (False, True):
                    run = jax.jit(functools.partial(jax_sampler.sample, mode="full" if lp else "sample",
                                                    num_logprobs=5, method="topk", cpu_kernels=ck))
                    call = functools.partial(run, xj, temp, top_k, top_p, min_p, u, *flags)
                    ms.append(median_ms(lambda: jax.block_until_ready(call()), args.reps))  # noqa: B023
                    outs[("jax", ck)] = call()
                sb = SamplingBatch(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p, uniform=u,
                                   all_greedy=t == 0, needs_filtering=k > 0 or p < 1, num_logprobs=5 if lp else -1)
                st = torch_sampler.SamplingTensors.from_batch(sb, torch.device("cpu"))
                for ck in (False, True):
                    torch_sampler._row_kernels = own_kernels if ck else (lambda x: None)
                    try:
                        ms.append(median_ms(lambda: torch_sampler.sample(xt, st), args.reps))  # noqa: B023
                        outs[("torch", ck)] = torch_sampler.sample(xt, st)
                    finally:
                        torch_sampler._row_kernels = own_kernels
                j, tt = outs[("jax", True)], outs[("torch", True)]
                same = np.array_equal(np.asarray(j[0]), tt.sampled.numpy())
                if lp:
                    same &= np.array_equal(np.asarray(j[1][2]).view(np.int32),
                                           tt.sampled_logprobs.numpy().view(np.int32))
                print(f"{R:>4} {kind:>6} {name:>12} {ms[0]:8.2f} {ms[1]:7.2f} {ms[0] / ms[1]:6.2f} {ms[2]:10.2f} "
                      f"{ms[3]:8.2f} {ms[2] / ms[3]:6.2f}" + ("" if same else "  MISMATCH jax vs torch kernels"),
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
