"""Llama-3.1-8B on TPU v5e-4 / v6e-4 / v6e-8, compiled on this CPU host: per bucket, an estimate on paper.

    python -m benchmarks.bench_tpu_aot [--targets v5e:2x2/4,v6e:2x2/4,v6e:2x4/8,v6e:1x1/1]
                                       [--no-compile] [--context 1260] [--max-model-len 8192] [--json PATH]

For each target (topology / tensor-parallel size) it compiles every program
the TPU server would run (`jaxengine.aot.run_aot_warmup`: libtpu's
compile-only devices, no weights, no TPU) and prints ONE table per target, one
row per token bucket: compile seconds, XLA's HBM temporaries, and the roofline
estimate (`jaxengine.step_cost`: max(FLOPs / peak, bytes / bandwidth), per
chip) of a decode step of that many requests at ``--context`` cached tokens
each (TPOT, output tokens/s per chip) and of a prefill chunk of that many
tokens (prompt tokens/s per chip). Then the peers' published, *measured*
numbers for the same model next to our estimate of the same workload.

Every xlaserve number here is an ESTIMATE ON PAPER, an upper bound from peak
FLOP/s and HBM bandwidth: no TPU ran anything. Collectives, kernel overheads
and scheduling are not in it; a peer's measurement is not comparable to it as
a result, only as a sense of scale. ``--no-compile`` skips compilation (the
estimates need none; then nothing about the programs is verified either).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

# Llama-3.1-8B's public architecture (config.json as published); nothing is downloaded.
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}
# The Mixture-of-Experts models' public config.json (as published; nothing is downloaded). Qwen3-30B-A3B: 48 sparse
# layers of top-8 of 128 experts (3.3B of 30.5B params a token); Mixtral-8x7B: 32 of top-2 of 8 (12.9B of 46.7B).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960,
    "max_window_layers": 48, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
    "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 151643,
    "eos_token_id": 151645, "output_router_logits": False, "router_aux_loss_coef": 0.001,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0, "sliding_window": None, "hidden_act": "silu", "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "output_router_logits": False,
    "router_aux_loss_coef": 0.02,
}
# Published by the peers for Llama-3.1-8B (measured on TPUs, by them).
PEERS = [
    {"engine": "tpu-inference", "chips": "v6e-1", "output_tok_s": 1415, "workload": "~1,199 in / ~123 out",
     "tpot_ms": None, "concurrency": None},
    {"engine": "sglang-jax", "chips": "v6e-4", "output_tok_s": 1449, "workload": "concurrency 16",
     "tpot_ms": 9.9, "concurrency": 16},
]
DEFAULT_TARGETS = "v5e:2x2/4,v6e:2x2/4,v6e:2x4/8,v6e:1x1/1"
PEER_INPUT, PEER_OUTPUT = 1199, 123


def _target_list(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        topo, _, tp = item.strip().partition("/")
        out.append((topo, int(tp or 1)))
    return out


def plan_target(model_dir: str, topology: str, tp: int, max_model_len: int):
    """The engine's own view of the target without compiling: (runner, memory plan, cost shape, chip)."""
    import jax.numpy as jnp

    from enginecore.config import EngineArgs
    from jaxengine.aot import _engine_config
    from jaxengine.hbm import check_fit
    from jaxengine.model import jnp_dtype
    from jaxengine.runner import JaxModelRunner
    from jaxengine.step_cost import ShardedShape
    from jaxengine.tpu_target import parse_topology, topology_devices

    topo = parse_topology(topology)
    args = EngineArgs(model=model_dir, tensor_parallel_size=tp, max_model_len=max_model_len,
                      compilation_cache_dir="none")
    config, source = _engine_config(args, topo)
    runner = JaxModelRunner(config, source, devices=topology_devices(topo))
    plan = check_fit(config, runner.arch, runner.mesh, runner.rules, runner.kv_bytes_per_block(),
                     topo.chip.hbm_bytes, topology)
    item = jnp.dtype(jnp_dtype(runner.dtype)).itemsize
    shape = ShardedShape.of(runner.arch, tp, runner.rules.shard_heads, item, item)
    return runner, plan, shape, topo.chip


def estimates(arch, shape, chip, buckets, max_reqs: int, context: int, chips: int) -> list[dict]:
    """Per token bucket: decode TPOT and output tokens/s per chip at `context`, prefill tokens/s per chip."""
    from jaxengine.step_cost import model_step_cost, sample_step_cost

    peak, bw = chip.peak_bf16_flops, chip.hbm_bandwidth
    rows = []
    for T in buckets.tokens:
        row = {"tokens": T}
        if T <= max_reqs:
            step = (model_step_cost(arch, shape, tokens=T, reqs=T, context=context)
                    + sample_step_cost(arch, shape, reqs=T))
            s = step.seconds(peak, bw)
            row.update(tpot_ms=s * 1e3, decode_tok_s_chip=T / s / chips, decode_bound=step.bound(peak, bw))
        pre = model_step_cost(arch, shape, tokens=T, reqs=1, context=0) + sample_step_cost(arch, shape, reqs=1)
        row.update(prefill_tok_s_chip=T / pre.seconds(peak, bw) / chips, prefill_bound=pre.bound(peak, bw))
        rows.append(row)
    return rows


def workload_estimate(arch, shape, chip, concurrency: int, max_tokens: int) -> dict:
    """Output tokens/s of `concurrency` requests of PEER_INPUT in / PEER_OUTPUT out, all chips together:
    per decode step (every request one token, at its mean context) plus its share of prefill
    (PEER_INPUT / PEER_OUTPUT prompt tokens per output token, in chunks of `max_tokens`)."""
    from jaxengine.step_cost import model_step_cost, sample_step_cost

    peak, bw = chip.peak_bf16_flops, chip.hbm_bandwidth
    ctx = PEER_INPUT + PEER_OUTPUT // 2
    decode = (model_step_cost(arch, shape, tokens=concurrency, reqs=concurrency, context=ctx)
              + sample_step_cost(arch, shape, reqs=concurrency)).seconds(peak, bw)
    chunk = model_step_cost(arch, shape, tokens=max_tokens, reqs=max(1, max_tokens // PEER_INPUT), context=0)
    prefill_per_token = chunk.seconds(peak, bw) / max_tokens
    step = decode + concurrency * PEER_INPUT / PEER_OUTPUT * prefill_per_token
    return {"concurrency": concurrency, "tpot_ms": decode * 1e3, "output_tok_s": concurrency / step}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--targets", default=DEFAULT_TARGETS, help="topology/tp, comma-separated (default: %(default)s)")
    p.add_argument("--no-compile", action="store_true", help="estimates only: compile nothing (verifies nothing)")
    p.add_argument("--context", type=int, default=PEER_INPUT + PEER_OUTPUT // 2,
                   help="cached tokens per request of a decode step (default: %(default)s, the peers' mean)")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    from jaxengine.tpu_target import libtpu_missing_reason

    reason = libtpu_missing_reason()
    if reason:
        print(f"bench_tpu_aot: {reason}")
        return 2
    from enginecore.config import EngineArgs
    from jaxengine.aot import run_aot_warmup

    model_dir = tempfile.mkdtemp(prefix="llama-3.1-8b-config-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(LLAMA_31_8B, f)
    results = []
    print("Llama-3.1-8B, bf16, --max-model-len %d, decode context %d tokens. ESTIMATES ON PAPER (roofline: "
          "max(FLOPs / peak, bytes / HBM bandwidth) per chip), not measurements: no TPU ran anything."
          % (args.max_model_len, args.context))
    for topology, tp in _target_list(args.targets):
        runner, plan, shape, chip = plan_target(model_dir, topology, tp, args.max_model_len)
        sc = runner.config.scheduler_config
        rows = estimates(runner.arch, shape, chip, runner.buckets, sc.max_num_seqs, args.context, tp)
        compiled = {}
        if not args.no_compile:
            t0 = time.perf_counter()
            report = run_aot_warmup(EngineArgs(model=model_dir, tensor_parallel_size=tp,
                                               max_model_len=args.max_model_len, compilation_cache_dir="none"),
                                    topology, "all")
            compiled = {r["key"].size: r for r in report.rows if r["key"].kind == "model"}
            total = time.perf_counter() - t0
        print(f"\n{topology} ({chip.device_kind} x {tp}, tensor-parallel {tp}): {plan.describe()}"
              + ("" if args.no_compile else f"; {len(report.rows)} programs compiled in {total:.0f} s, "
                 f"peak HBM {report.fit['peak_bytes'] / 2**30:.2f} GiB per chip, "
                 f"KV-cache layout {sorted({r['kv_layout'] for r in report.rows if r['kv_layout']})}"))
        head = ("tokens", "compile_s", "temp_GiB", "TPOT_ms", "decode tok/s/chip", "prefill tok/s/chip", "bound")
        print("  ".join(f"{h:>18}" if i > 0 else f"{h:>7}" for i, h in enumerate(head)))
        for r in rows:
            c = compiled.get(r["tokens"], {})
            cells = [f"{r['tokens']:>7}", f"{c['compile_s']:>18.1f}" if c else f"{'-':>18}",
                     f"{c['temp_bytes'] / 2**30:>18.2f}" if c else f"{'-':>18}",
                     f"{r['tpot_ms']:>18.2f}" if "tpot_ms" in r else f"{'-':>18}",
                     f"{r['decode_tok_s_chip']:>18,.0f}" if "decode_tok_s_chip" in r else f"{'-':>18}",
                     f"{r['prefill_tok_s_chip']:>18,.0f}",
                     f"{r.get('decode_bound', '-')}/{r['prefill_bound']}".rjust(18)]
            print("  ".join(cells))
        kv_tokens = plan.num_blocks * runner.block_size
        fits = min(sc.max_num_seqs, kv_tokens // (PEER_INPUT + PEER_OUTPUT))
        work = [workload_estimate(runner.arch, shape, chip, n, sc.max_num_batched_tokens) for n in (16, fits)]
        results.append({"topology": topology, "tp": tp, "device_kind": chip.device_kind, "plan": plan.describe(),
                        "buckets": [dict(r, **{k: compiled[r["tokens"]][k] for k in ("compile_s", "temp_bytes")})
                                    if r["tokens"] in compiled else r for r in rows],
                        "workload": work, "kv_tokens": kv_tokens})
        runner.shutdown()

    print(f"\nPeers (published, MEASURED by them) vs xlaserve (ESTIMATE ON PAPER), Llama-3.1-8B, "
          f"~{PEER_INPUT:,} in / ~{PEER_OUTPUT} out:")
    print(f"{'engine':>14}  {'chips':>7}  {'what':>22}  {'concurrency':>11}  {'TPOT_ms':>8}  {'output tok/s':>12}")
    for peer in PEERS:
        print(f"{peer['engine']:>14}  {peer['chips']:>7}  {'measured':>22}  {peer['concurrency'] or '?':>11}  "
              f"{peer['tpot_ms'] or '?':>8}  {peer['output_tok_s']:>12,}")
    names = {"v6e:1x1": "v6e-1", "v6e:2x2": "v6e-4", "v6e:2x4": "v6e-8", "v5e:2x2": "v5e-4"}
    for res in results:
        for w in res["workload"]:
            print(f"{'xlaserve':>14}  {names.get(res['topology'], res['topology']):>7}  {'estimate (roofline)':>22}  "
                  f"{w['concurrency']:>11}  {w['tpot_ms']:>8.2f}  {w['output_tok_s']:>12,.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"targets": results, "peers": PEERS, "context": args.context,
                       "max_model_len": args.max_model_len}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
