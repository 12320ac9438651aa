"""This machine's limits and the embedded model's cost per token, so throughput can be put as a fraction of them.

    python -m benchmarks.bench_roofline [--quick] [--json PATH]

Measures the matmul peak (f32 and bf16; numpy, torch and jax, best taken)
and the memory copy bandwidth, reads the model's shape from its ArchConfig,
and prints ONE table: the measured peaks and, per batch size, the
decode-step limit in tokens/s (the slower of compute and memory).

Other scripts import `get_roofline()` and `ModelCost.from_arch(...)`, and
call `Roofline.generate_limit(...)` to print their numbers as a fraction of
what this machine could possibly do.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, dataclass

import numpy as np

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "xlaserve", "roofline.json")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# ---- the model's cost ------------------------------------------------------------------


@dataclass(frozen=True)
class ModelCost:
    """FLOPs and bytes of a Llama-family decoder, per token; a Mixture-of-Experts model's tokens each go through
    top_k of its experts, and a step of N tokens reads the distinct experts they reach
    (`jaxengine.step_cost.expected_distinct_experts`, uniform routing)."""

    name: str
    linear_params: int  # parameters in matmuls a token goes through (incl. the LM head; its top_k experts only)
    embedding_params: int  # the embedding table (a lookup, no FLOPs)
    attn_flops_per_ctx_token: int  # QK^T and PV FLOPs per token per context position
    kv_elems_per_token: int  # K and V elements cached per token (all layers)
    expert_params: int = 0  # one expert's gate/up/down, summed over the sparse layers
    num_experts: int = 0  # 0: dense
    top_k: int = 0

    @classmethod
    def from_arch(cls, cfg, name: str = "") -> "ModelCost":
        H, L, I, V = cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        attn = H * q + 2 * H * kv + q * H
        moe = getattr(cfg, "moe", None)
        sparse = moe.num_sparse_layers if moe is not None else 0
        linear = L * attn + (L - sparse) * 3 * H * I + H * V
        experts = dict(expert_params=0, num_experts=0, top_k=0)
        if sparse:
            linear += sparse * cfg.moe_mlp_params(active=True)
            experts = dict(expert_params=sparse * 3 * H * moe.intermediate_size, num_experts=moe.num_experts,
                           top_k=moe.top_k)
        return cls(
            name=name or cfg.model_type,
            linear_params=linear,
            embedding_params=V * H,
            attn_flops_per_ctx_token=L * 2 * 2 * q,
            kv_elems_per_token=L * 2 * kv,
            **experts,
        )

    def flops_per_token(self, context: int) -> float:
        return 2.0 * self.linear_params + self.attn_flops_per_ctx_token * context

    def weight_bytes(self, dtype: str, tokens: float = 1) -> float:
        """Bytes read per forward step of `tokens` tokens: every matmul weight once, of the experts those
        reached (the embedding rows are negligible)."""
        params = self.linear_params
        if self.num_experts:
            from jaxengine.step_cost import expected_distinct_experts

            reached = expected_distinct_experts(self.num_experts, self.top_k, tokens)
            params += (reached - self.top_k) * self.expert_params
        return params * DTYPE_BYTES[dtype]

    def kv_bytes(self, context: int, dtype: str) -> float:
        return self.kv_elems_per_token * context * DTYPE_BYTES[dtype]


# ---- the machine's limits ---------------------------------------------------------------


@dataclass
class Roofline:
    """Measured peaks: FLOP/s per dtype (best backend) and memory copy bandwidth in bytes/s."""

    peak_flops: dict  # dtype -> FLOP/s
    peak_by_lib: dict  # "lib/dtype" -> FLOP/s
    mem_bw: float  # bytes/s
    cpus: int
    measured_at: str

    def decode_step_time(self, cost: ModelCost, batch: int, context: float, dtype: str) -> float:
        """Lower bound of one decode step of `batch` sequences at `context` tokens: compute vs memory."""
        compute = batch * cost.flops_per_token(context) / self.peak_flops[dtype]
        memory = (cost.weight_bytes(dtype, batch) + batch * cost.kv_bytes(context, dtype)) / self.mem_bw
        return max(compute, memory)

    def prefill_time(self, cost: ModelCost, tokens: int, context: float, dtype: str) -> float:
        compute = tokens * cost.flops_per_token(context) / self.peak_flops[dtype]
        memory = cost.weight_bytes(dtype, tokens) / self.mem_bw
        return max(compute, memory)

    def generate_limit(self, cost: ModelCost, batch: int, input_len: int, output_len: int, dtype: str) -> float:
        """Upper bound of output tokens/s for `batch` requests of input_len in / output_len out, run together."""
        # the prefill yields the first token; each later token is one decode step
        t = self.prefill_time(cost, batch * input_len, input_len / 2, dtype)
        t += sum(self.decode_step_time(cost, batch, input_len + i, dtype) for i in range(1, output_len))
        return batch * output_len / t


def _time_best(fn, min_time: float, repeats: int) -> float:
    fn()  # warm-up / compile
    best = float("inf")
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_time:
                break
        best = min(best, dt / n)
    return best


def _matmul_fns() -> dict:
    """lib/dtype -> make(n) -> a zero-argument function doing one n x n matmul to completion."""
    fns = {}

    def np_make(n):
        a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
        b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
        return lambda: a @ b

    fns["numpy/float32"] = np_make
    try:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        for dt in ("float32", "bfloat16"):
            def t_make(n, dt=dt):
                a = torch.randn(n, n).to(getattr(torch, dt))
                b = torch.randn(n, n).to(getattr(torch, dt))
                return lambda: torch.matmul(a, b)
            fns[f"torch/{dt}"] = t_make
    except ImportError as e:
        print(f"torch matmul skipped: {e}")
    try:
        import jax
        import jax.numpy as jnp

        f = jax.jit(lambda x, y: x @ y)
        for dt in ("float32", "bfloat16"):
            def j_make(n, dt=dt):
                a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dtype=dt)
                b = jnp.asarray(np.random.default_rng(1).standard_normal((n, n)), dtype=dt)
                return lambda: f(a, b).block_until_ready()
            fns[f"jax/{dt}"] = j_make
    except ImportError as e:
        print(f"jax matmul skipped: {e}")
    return fns


def measure_matmul(n: int, min_time: float, repeats: int) -> dict:
    """FLOP/s of a square matmul per library and dtype, up to n x n.

    A slow path (bf16 without hardware support runs at well under 1 GFLOP/s)
    gets a smaller matrix, sized from a 512 x 512 probe, so no single call
    takes more than about a second.
    """
    out: dict[str, float] = {}
    for key, make in _matmul_fns().items():
        probe = 512
        rate = 2.0 * probe**3 / _time_best(make(probe), 0.05, 3)
        size = n
        while size > probe and 2.0 * size**3 / rate > 1.0:
            size //= 2
        out[key] = 2.0 * size**3 / _time_best(make(size), min_time, repeats)
    return out


def measure_copy_bandwidth(mib: int, repeats: int) -> float:
    """Bytes/s of a large numpy copy, counting the read and the write."""
    src = np.ones(mib * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    t = _time_best(lambda: np.copyto(dst, src), 0.2, repeats)
    return 2.0 * src.nbytes / t


def measure(quick: bool = False) -> Roofline:
    n = 1024 if quick else 2048
    by_lib = measure_matmul(n, 0.2 if quick else 0.5, 2 if quick else 3)
    peak = {}
    for key, v in by_lib.items():
        dt = key.split("/")[1]
        peak[dt] = max(peak.get(dt, 0.0), v)
    peak.setdefault("bfloat16", peak["float32"])
    peak.setdefault("float16", peak["bfloat16"])
    bw = measure_copy_bandwidth(128 if quick else 512, 3 if quick else 5)
    return Roofline(peak, by_lib, bw, os.cpu_count() or 1, time.strftime("%Y-%m-%dT%H:%M:%S"))


def get_roofline(fresh: bool = False, quick: bool = False, max_age_s: float = 24 * 3600) -> Roofline:
    """The machine's roofline, measured once a day and cached in ~/.cache/xlaserve/roofline.json."""
    key = f"{platform.node()}-{os.cpu_count()}"
    if not fresh and os.path.isfile(CACHE):
        try:
            with open(CACHE) as f:
                d = json.load(f)
            if d.get("key") == key and time.time() - d.get("time", 0) < max_age_s:
                return Roofline(**d["roofline"])
        except (OSError, ValueError, TypeError, KeyError):
            pass
    r = measure(quick)
    os.makedirs(os.path.dirname(CACHE), exist_ok=True)
    with open(CACHE, "w") as f:
        json.dump({"key": key, "time": time.time(), "roofline": asdict(r)}, f, indent=2)
    return r


def embedded_model_cost() -> ModelCost:
    from enginecore.model_loader import resolve_model

    src = resolve_model(None)
    return ModelCost.from_arch(src.config, src.name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_roofline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller matmuls and copies (less stable)")
    ap.add_argument("--context", type=int, default=192, help="context length for the per-token costs")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args(argv)

    from benchmarks._sysload import OtherCpu

    cost = embedded_model_cost()
    with OtherCpu() as noise:
        r = get_roofline(fresh=True, quick=args.quick)
    G = 1e9
    ctx = args.context
    print(f"machine: {r.cpus} CPUs ({platform.machine()}); model: {cost.name} "
          f"({cost.linear_params / 1e6:.1f}M matmul params + {cost.embedding_params / 1e6:.1f}M embedding)")
    print(f"other processes used {noise.note()} of the machine while measuring "
          f"(load average {os.getloadavg()[0]:.1f}); peaks measured under load are low, and fractions of them high")
    print("matmul by library (GFLOP/s): " + ", ".join(f"{k} {v / G:.1f}" for k, v in sorted(r.peak_by_lib.items())))
    rows = [
        ("matmul peak, GFLOP/s (best library)", r.peak_flops["float32"] / G, r.peak_flops["bfloat16"] / G),
        ("memory copy bandwidth, GB/s", r.mem_bw / G, r.mem_bw / G),
        ("machine balance, FLOP/byte", r.peak_flops["float32"] / r.mem_bw, r.peak_flops["bfloat16"] / r.mem_bw),
        (f"model GFLOP/token (context {ctx})", cost.flops_per_token(ctx) / G, cost.flops_per_token(ctx) / G),
        ("model weight MB read per step", cost.weight_bytes("float32") / 1e6, cost.weight_bytes("bfloat16") / 1e6),
        ("model KV kB per token", cost.kv_bytes(1, "float32") / 1e3, cost.kv_bytes(1, "bfloat16") / 1e3),
        ("prefill limit, tokens/s (compute)", r.peak_flops["float32"] / cost.flops_per_token(ctx / 2),
         r.peak_flops["bfloat16"] / cost.flops_per_token(ctx / 2)),
    ]
    for b in (1, 8, 32, 128):
        rows.append((f"decode limit, tokens/s, batch {b}", b / r.decode_step_time(cost, b, ctx, "float32"),
                     b / r.decode_step_time(cost, b, ctx, "bfloat16")))
    w = max(len(x[0]) for x in rows)
    print(f"{'':<{w}}  {'float32':>10}  {'bfloat16':>10}  {'bf16/f32':>8}")
    for name, a, b in rows:
        print(f"{name:<{w}}  {a:>10.2f}  {b:>10.2f}  {b / a:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"roofline": asdict(r), "model": asdict(cost)}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
