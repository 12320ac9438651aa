"""A Mixture-of-Experts layer's experts on this CPU (`torchengine.moe.fused_moe_sorted`) against dense MLPs.

    python -m benchmarks.bench_torch_moe [--rows 1,8,64] [--experts 64] [--top-k 4] [--hidden 1024] [--inter 512]

The sorted path (torch's matmuls) and the CPU kernels' one (`torchengine.cpu_transform.CpuExperts`: each expert's
weights in `panel_gemm`'s panels, as a loaded float32 model on this CPU runs them) read only the experts the step's
tokens are routed to. They are compared with two dense SwiGLU
MLPs (`torchengine.model.MLP`'s arithmetic, one fused gate/up matmul then down): one of the active parameters
(intermediate top_k * I: what one token reads) and one of all of them (E * I: what a step reads once every
expert has tokens). Routing is uniform at random, so at 64 rows nearly every expert has some. Each timing
cycles through --layers distinct layers, so the weights come from memory as in a real step. float32, ms per
layer (best of 5).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.bench_dense import best_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--layers", type=int, default=3)
    a = ap.parse_args()
    from cpu_kernels import torch_ops
    from torchengine.cpu_transform import CpuExperts
    from torchengine.moe import fused_moe_sorted, select_experts

    E, K, H, I = a.experts, a.top_k, a.hidden, a.inter
    g = torch.Generator().manual_seed(0)
    moe = [(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)) for _ in range(a.layers)]
    lib = torch_ops.lib()
    packed = [CpuExperts([torch_ops.pack_panels(w[0][e]) for e in range(E)],
                         [torch_ops.pack_panels(w[1][e]) for e in range(E)], 2 * I, H, lib) for w in moe] if lib else []
    dense = {name: [(torch.randn(2 * n, H, generator=g), torch.randn(H, n, generator=g)) for _ in range(a.layers)]
             for name, n in (("active", K * I), ("all", E * I))}

    def mlp(x, w):
        gate, up = F.linear(x, w[0]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w[1])

    print(f"E={E} top_k={K} H={H} I={I}, {torch.get_num_threads()} threads; ms per layer")
    print(f"{'rows':>5} {'experts hit':>11} {'moe sorted':>10} {'moe panels':>10} {'dense active':>12} {'dense all':>9}")
    with torch.inference_mode():
        for rows in map(int, a.rows.split(",")):
            x = torch.randn(rows, H, generator=g)
            weights, ids = select_experts(torch.randn(rows, E, generator=g), K, renormalize=True)
            hit = len(torch.unique(ids))
            i = [0]

            def cycle(fn, ws):
                def run():
                    fn(ws[i[0] % len(ws)])
                    i[0] += 1
                return run

            t_moe = best_ms(cycle(lambda w: fused_moe_sorted(x, w[0], w[1], weights, ids), moe))
            t_pan = best_ms(cycle(lambda ex: ex(x, weights, ids), packed)) if packed else float("nan")
            t_act = best_ms(cycle(lambda w: mlp(x, w), dense["active"]))
            t_all = best_ms(cycle(lambda w: mlp(x, w), dense["all"]))
            print(f"{rows:>5} {hit:>11} {t_moe:>10.3f} {t_pan:>10.3f} {t_act:>12.3f} {t_all:>9.3f}")


if __name__ == "__main__":
    main()
