"""Llama-3.1-8B, Qwen3-30B-A3B and Mixtral-8x7B on TPU slices, compiled on this CPU host: per bucket, an estimate
on paper.

    python -m benchmarks.bench_tpu_aot [--model llama-3.1-8b|qwen3-30b-a3b|mixtral-8x7b]
                                       [--targets v5e:2x2/4,v6e:2x2/4/ep,...] [--no-compile] [--context 1260]
                                       [--max-model-len 8192] [--json PATH]
    python -m benchmarks.bench_tpu_aot --moe-block [--model qwen3-30b-a3b] [--targets v6e:2x2/4/ep]

A target is topology/tensor-parallel size, with "/ep" for --enable-expert-parallel. A Mixture-of-Experts
model's roofline counts the experts a step's tokens reach (`jaxengine.step_cost`), not all of them.
`--moe-block` compiles one sparse layer's routed experts alone, per method (megablox's gmm, what the runner
uses on a TPU; ragged_dot over the [out, in] experts as stored) and prints XLA's view of each: temporaries,
copies of expert weights, kernels.

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
# Published by sglang-jax for Qwen3-30B-A3B (measured by them; their input / output lengths are not in this record,
# our estimate assumes the same ~1,199 in / ~123 out). v7x is not a target libtpu's table here holds.
QWEN3_PEERS = [
    {"engine": "sglang-jax", "chips": "v7x-4", "output_tok_s": 6179, "workload": "concurrency 128", "tpot_ms": None,
     "concurrency": 128},
    {"engine": "sglang-jax", "chips": "v6e-16", "output_tok_s": 1476, "workload": "concurrency 16", "tpot_ms": None,
     "concurrency": 16},
]
# name -> (config.json, default targets, the peers' published numbers)
MODELS = {
    "llama-3.1-8b": ("Llama-3.1-8B", LLAMA_31_8B, "v5e:2x2/4,v6e:2x2/4,v6e:2x4/8,v6e:1x1/1", PEERS),
    "qwen3-30b-a3b": ("Qwen3-30B-A3B", QWEN3_30B_A3B, "v6e:2x2/4/ep,v6e:4x4/16/ep", QWEN3_PEERS),
    "mixtral-8x7b": ("Mixtral-8x7B", MIXTRAL_8X7B, "v5e:2x4/8", []),
}
DEFAULT_TARGETS = MODELS["llama-3.1-8b"][2]
PEER_INPUT, PEER_OUTPUT = 1199, 123


def _target_list(text: str) -> list[tuple[str, int, bool]]:
    """'v6e:2x2/4/ep,v5e:2x4/8' -> [(topology, tp, expert parallel)]."""
    out = []
    for item in text.split(","):
        topo, *rest = item.strip().split("/")
        out.append((topo, int(rest[0]) if rest else 1, "ep" in rest[1:]))
    return out


def plan_target(model_dir: str, topology: str, tp: int, max_model_len: int, ep: bool = False):
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
                      compilation_cache_dir="none", enable_expert_parallel=ep)
    config, source = _engine_config(args, topo)
    runner = JaxModelRunner(config, source, devices=topology_devices(topo))
    plan = check_fit(config, runner.arch, runner.mesh, runner.rules, runner.kv_bytes_per_block(),
                     topo.chip.hbm_bytes, topology)
    item = jnp.dtype(jnp_dtype(runner.dtype)).itemsize
    shape = ShardedShape.of(runner.arch, tp, runner.rules.shard_heads, item, item, expert_parallel=ep)
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


def _moe_block(model: dict, topology: str, tp: int, ep: bool, tokens: list[int]) -> list[dict]:
    """One sparse layer's routed experts compiled alone for the target, per method and token count: XLA's
    temporaries and its count of the layer's expert weights copied, the kernels called, and the roofline's
    expert bytes a device reads (`step_cost`)."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from enginecore.arch import ArchConfig
    from jaxengine.moe import routed_experts
    from jaxengine.sharding import MESH_AXES, ShardingRules, shard_experts
    from jaxengine.step_cost import ShardedShape, expected_distinct_experts, expert_params
    from jaxengine.tpu_moe import tpu_experts
    from jaxengine.tpu_target import parse_topology, topology_devices

    arch = ArchConfig.from_hf_dict(model)
    m, H = arch.moe, arch.hidden_size
    E, Ie, k = m.num_experts, m.intermediate_size, m.top_k
    devices = topology_devices(parse_topology(topology))[:tp]
    mesh = Mesh(np.array(devices, dtype=object).reshape(1, tp), MESH_AXES)
    rules = ShardingRules.for_model(arch, mesh, expert_parallel=ep)
    shape = ShardedShape.of(arch, tp, rules.shard_heads, 2, 2, expert_parallel=ep)
    gate_spec = rules.spec((E, Ie, H), ("experts", "expert_mlp", "embed"), mesh)
    down_spec = rules.spec((E, Ie, H), ("experts", "expert_mlp", "embed"), mesh)  # [in, out] (jaxengine.moe)
    methods = {"gmm (megablox)": tpu_experts(),
               "ragged_dot": functools.partial(routed_experts, method="ragged", platform="tpu")}
    local_e = E // shape.experts_ep
    rows = []
    for T in tokens:
        sd = lambda sh, spec, d=jnp.bfloat16: jax.ShapeDtypeStruct(sh, d, sharding=NamedSharding(mesh, spec))  # noqa: E731
        args = (sd((T, H), P()), sd((T, k), P(), jnp.int32), sd((T, k), P()), sd((E, Ie, H), gate_spec),
                sd((E, Ie, H), gate_spec), sd((E, Ie, H), down_spec))
        read = expected_distinct_experts(E, k, T) / shape.experts_ep * expert_params(arch, shape) * 2
        for name, fn in methods.items():
            t0 = time.perf_counter()
            compiled = jax.jit(shard_experts(fn, mesh, rules, arch)).lower(*args).compile()
            text, mem = compiled.as_text(), compiled.memory_analysis()
            copies = sum(1 for line in text.splitlines() if " copy(" in line
                         and f"[{local_e}," in (out := line.split(" copy(")[0]) and str(H) in out)
            rows.append({"method": name, "tokens": T, "compile_s": time.perf_counter() - t0,
                         "temp_mib": mem.temp_size_in_bytes / 2**20, "weight_copies": copies,
                         "ragged_dot_kernels": text.count("ragged-dot-none"),
                         "mosaic_calls": text.count('custom_call_target="tpu_custom_call"'),
                         "roofline_expert_mb": read / 1e6})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    p.add_argument("--targets", default=None,
                   help="topology/tp[/ep], comma-separated (default: the model's, llama-3.1-8b's %s)" % DEFAULT_TARGETS)
    p.add_argument("--no-compile", action="store_true", help="estimates only: compile nothing (verifies nothing)")
    p.add_argument("--moe-block", action="store_true",
                   help="compile one sparse layer's routed experts per method instead of the whole server")
    p.add_argument("--tokens", default="1,16,128,512", help="--moe-block's token counts (default: %(default)s)")
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

    title, model, default_targets, peers = MODELS[args.model]
    targets = _target_list(args.targets or default_targets)
    if args.moe_block:
        from enginecore.arch import ArchConfig

        if ArchConfig.from_hf_dict(model).moe is None:
            print(f"bench_tpu_aot: --moe-block needs a Mixture-of-Experts --model, not {args.model}")
            return 2
        out = []
        print(f"{title}: one sparse layer's routed experts compiled alone (bf16), per device. temp: XLA's "
              "temporaries; copies: expert-weight tensors XLA copies (relayouts) each step; roofline: the expert "
              "bytes a device must read (the reached experts, uniform routing).")
        for topology, tp, ep in targets:
            rows = _moe_block(model, topology, tp, ep, [int(t) for t in args.tokens.split(",")])
            print(f"\n{topology}, {tp} chips, {'expert parallel' if ep else 'expert columns split'}")
            print(f"{'method':>16}  {'tokens':>6}  {'compile_s':>9}  {'temp_MiB':>9}  {'copies':>6}  "
                  f"{'ragged-dot':>10}  {'mosaic':>6}  {'roofline_MB':>11}")
            for r in rows:
                print(f"{r['method']:>16}  {r['tokens']:>6}  {r['compile_s']:>9.1f}  {r['temp_mib']:>9.1f}  "
                      f"{r['weight_copies']:>6}  {r['ragged_dot_kernels']:>10}  {r['mosaic_calls']:>6}  "
                      f"{r['roofline_expert_mb']:>11.1f}")
            out.append({"topology": topology, "tp": tp, "ep": ep, "rows": rows})
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": args.model, "moe_block": out}, f, indent=2)
        return 0

    model_dir = tempfile.mkdtemp(prefix=f"{args.model}-config-")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(model, f)
    results = []
    print("%s, bf16, --max-model-len %d, decode context %d tokens. ESTIMATES ON PAPER (roofline: "
          "max(FLOPs / peak, bytes / HBM bandwidth) per chip), not measurements: no TPU ran anything."
          % (title, args.max_model_len, args.context))
    for topology, tp, ep in targets:
        runner, plan, shape, chip = plan_target(model_dir, topology, tp, args.max_model_len, ep)
        sc = runner.config.scheduler_config
        rows = estimates(runner.arch, shape, chip, runner.buckets, sc.max_num_seqs, args.context, tp)
        compiled = {}
        if not args.no_compile:
            t0 = time.perf_counter()
            report = run_aot_warmup(EngineArgs(model=model_dir, tensor_parallel_size=tp, enable_expert_parallel=ep,
                                               max_model_len=args.max_model_len, compilation_cache_dir="none"),
                                    topology, "all")
            compiled = {r["key"].size: r for r in report.rows if r["key"].kind == "model"}
            total = time.perf_counter() - t0
        print(f"\n{topology} ({chip.device_kind} x {tp}, tensor-parallel {tp}{', expert parallel' if ep else ''}): "
              f"{plan.describe()}"
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
        levels = sorted({16, fits, *(peer["concurrency"] for peer in peers if peer["concurrency"])})
        work = [workload_estimate(runner.arch, shape, chip, n, sc.max_num_batched_tokens) for n in levels
                if n <= fits]
        results.append({"topology": topology, "tp": tp, "ep": ep, "device_kind": chip.device_kind,
                        "plan": plan.describe(),
                        "buckets": [dict(r, **{k: compiled[r["tokens"]][k] for k in ("compile_s", "temp_bytes")})
                                    if r["tokens"] in compiled else r for r in rows],
                        "workload": work, "kv_tokens": kv_tokens})
        runner.shutdown()

    print(f"\nPeers (published, MEASURED by them) vs xlaserve (ESTIMATE ON PAPER), {title}, "
          f"~{PEER_INPUT:,} in / ~{PEER_OUTPUT} out:")
    print(f"{'engine':>14}  {'chips':>7}  {'what':>22}  {'concurrency':>11}  {'TPOT_ms':>8}  {'output tok/s':>12}")
    for peer in peers:
        print(f"{peer['engine']:>14}  {peer['chips']:>7}  {'measured':>22}  {peer['concurrency'] or '?':>11}  "
              f"{peer['tpot_ms'] or '?':>8}  {peer['output_tok_s']:>12,}")
    names = {"v6e:1x1": "v6e-1", "v6e:2x2": "v6e-4", "v6e:2x4": "v6e-8", "v5e:2x2": "v5e-4", "v6e:4x4": "v6e-16",
             "v5e:2x4": "v5e-8"}
    for res in results:
        for w in res["workload"]:
            print(f"{'xlaserve':>14}  {names.get(res['topology'], res['topology']):>7}  {'estimate (roofline)':>22}  "
                  f"{w['concurrency']:>11}  {w['tpot_ms']:>8.2f}  {w['output_tok_s']:>12,.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "targets": results, "peers": peers, "context": args.context,
                       "max_model_len": args.max_model_len}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
