"""The Mixture-of-Experts speed goal, measured in one run: a MoE decode step against dense models of its active
and of all its parameters, and offline throughput against `transformers` on the MoE model.

    python -m benchmarks.bench_moe [--family mixtral|qwen3_moe] [--backends jax,torch] [--only-dense] [--json PATH]

Three random models, built with `transformers` and saved to a temporary folder (SmolLM2's tokenizer copied in):

- moe: --experts experts (16), top --top-k (2), hidden --hidden (1024), --layers layers (8), expert width
  --moe-intermediate (1024), vocabulary --vocab (32000); Mixtral (default) or Qwen3-MoE (norm_topk_prob);
- dense-active: the same decoder with a dense MLP of top_k x moe_intermediate (the parameters one token reads);
- dense-all: a dense MLP of experts x moe_intermediate (every expert's parameters).

For each backend (each model in its own subprocess, CPU), a decode step's time at batch 1 and at batch
--big-batch (64), as benchmarks/bench_step.py times it: (time for --steps greedy tokens - time for 1) /
(--steps - 1) through the offline API, 16-token prompts, prefix caching off, every shape warmed up first. The
goals: moe / dense-active <= 1.5 at batch 1 (a step reads only the routed experts), moe / dense-all <= 1.0 at
the big batch (the experts' FLOPs are a top_k / experts share of dense-all's). Then offline throughput: the
engine's `LLM.generate` of --num-prompts prompts (--input-len in, --output-len out, greedy, exact lengths) against
`transformers`' `generate` of the same batch on the same MoE model; the goal: engine / transformers >= 1.

A backend that cannot run the MoE model yet (or `--only-dense`) still gets its dense rows, and the throughput
comparison then runs on dense-active, so the script runs end to end either way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from benchmarks._server import run_json_worker
from benchmarks.bench_backends import thread_env

MODELS = ("moe", "dense-active", "dense-all")


# ---- the models ------------------------------------------------------------------------------------------


def build_models(args, root: str) -> dict[str, str]:
    """{model: its Hugging Face folder} under `root`: the MoE and its two dense counterparts, float32 random."""
    import torch
    import transformers as tf

    from enginecore.hf_folder import save_hf_folder
    from enginecore.model_loader import resolve_model

    common = dict(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    E, k, Ie = args.experts, args.top_k, args.moe_intermediate
    if args.family == "mixtral":
        configs = {"moe": (tf.MixtralForCausalLM, tf.MixtralConfig(**common, intermediate_size=Ie,
                                                                   num_local_experts=E, num_experts_per_tok=k)),
                   "dense-active": (tf.LlamaForCausalLM, tf.LlamaConfig(**common, intermediate_size=k * Ie)),
                   "dense-all": (tf.LlamaForCausalLM, tf.LlamaConfig(**common, intermediate_size=E * Ie))}
    else:
        hd = args.hidden // args.heads
        configs = {"moe": (tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
                       **common, head_dim=hd, intermediate_size=k * Ie, moe_intermediate_size=Ie, num_experts=E,
                       num_experts_per_tok=k, norm_topk_prob=True)),
                   "dense-active": (tf.Qwen3ForCausalLM, tf.Qwen3Config(**common, head_dim=hd,
                                                                         intermediate_size=k * Ie)),
                   "dense-all": (tf.Qwen3ForCausalLM, tf.Qwen3Config(**common, head_dim=hd,
                                                                      intermediate_size=E * Ie))}
    tok = os.path.join(root, "tokenizer")
    save_hf_folder(resolve_model(None), tok)  # SmolLM2's tokenizer (its ids past --vocab are never prompted)
    out = {}
    for i, (name, (cls, cfg)) in enumerate(configs.items()):
        if name == "moe" and args.only_dense:
            continue
        torch.manual_seed(i)
        print(f"building {name} ...", file=sys.stderr, flush=True)
        model = cls(cfg).float()
        out[name] = os.path.join(root, name)
        model.save_pretrained(out[name], safe_serialization=True)
        del model
        for fn in os.listdir(tok):
            if fn.startswith("tokenizer") or fn.endswith(".jinja") or fn == "special_tokens_map.json":
                shutil.copy(os.path.join(tok, fn), out[name])
    return out


def model_params(folder: str) -> dict:
    from enginecore.model_loader import resolve_model
    from frontend.bench.common import param_counts

    return param_counts(resolve_model(folder).config)


# ---- workers (one backend and one model, or transformers, in a subprocess each) ---------------------------


def worker_engine(backend: str, folder: str, spec: dict) -> dict:
    from benchmarks._sysload import OtherCpu
    from benchmarks.bench_step import decode_step_seconds
    from enginecore import LLM

    steps = spec["steps"]
    max_b = max(spec["batches"] + [spec["num_prompts"]])
    need = max(16 + steps, spec["input_len"] + spec["output_len"]) + 1
    llm = LLM(folder, backend=backend, dtype=spec["dtype"], max_num_seqs=max_b, max_model_len=-(-need // 64) * 64,
              max_num_batched_tokens=max(2048, 16 * max_b), enable_prefix_caching=False, seed=0)
    rng = np.random.default_rng(0)
    out = {"step_ms": {}, "other_cpu": {}}
    for b in spec["batches"]:
        prompts = [[int(t) for t in rng.integers(100, spec["vocab"], 16)] for _ in range(b)]
        with OtherCpu() as noise:
            out["step_ms"][str(b)] = 1e3 * decode_step_seconds(llm, prompts, steps)
        out["other_cpu"][str(b)] = noise.share
        print(f"  {backend} batch {b}: {out['step_ms'][str(b)]:.2f} ms/step", file=sys.stderr, flush=True)
    if spec["throughput"]:
        out["throughput"] = _engine_throughput(llm, spec)
    return out


def _engine_throughput(llm, spec: dict) -> dict:
    from benchmarks.bench_backends import timed
    from enginecore import SamplingParams

    prompts = spec["prompts"]
    llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4), use_tqdm=False)
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=spec["output_len"])
    return timed(lambda: sum(len(r.outputs[0].token_ids) for r in llm.generate(prompts, sp, use_tqdm=False)))


def worker_transformers(folder: str, spec: dict) -> dict:
    import torch
    import transformers

    from benchmarks.bench_backends import timed

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, spec["dtype"])).eval()
    ids = torch.tensor(spec["prompts"], dtype=torch.long)

    def gen(n):
        with torch.inference_mode():
            o = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=0)
        return int((o.shape[1] - ids.shape[1]) * ids.shape[0])

    gen(4)
    return {"throughput": timed(lambda: gen(spec["output_len"]))}


def worker_main(name: str, folder: str, spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    res = worker_transformers(folder, spec) if name == "transformers" else worker_engine(name, folder, spec)
    with open(out_path, "w") as f:
        json.dump(res, f)
    return 0


# ---- the driver ----------------------------------------------------------------------------------------


def _ratio(a, b):
    return a / b if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_moe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=("mixtral", "qwen3_moe"), default="mixtral")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--backends", default="jax,torch")
    ap.add_argument("--big-batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32, help="greedy tokens per timed decode run")
    ap.add_argument("--num-prompts", type=int, default=64, help="offline throughput: prompts in one generate")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--only-dense", action="store_true", help="leave the MoE model out (throughput on dense-active)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for every worker")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.folder, args.spec, args.out)

    from frontend.bench.common import format_count, format_table, run_info, write_json

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    batches = [1, args.big_batch]
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(100, args.vocab, args.input_len)] for _ in range(args.num_prompts)]
    spec = {"batches": batches, "steps": args.steps, "dtype": args.dtype, "vocab": args.vocab,
            "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
            "prompts": prompts}
    env = thread_env(args.threads)
    results: dict[str, dict[str, dict]] = {be: {} for be in backends}
    with tempfile.TemporaryDirectory(prefix="bench_moe_") as root:
        folders = build_models(args, root)
        params = {m: model_params(f) for m, f in folders.items()}

        def run(name: str, model: str, throughput: bool) -> dict:
            path = os.path.join(root, f"spec-{int(throughput)}.json")
            with open(path, "w") as f:
                json.dump({**spec, "throughput": throughput}, f)
            print(f"running {name} on {model} ...", file=sys.stderr, flush=True)
            return run_json_worker([sys.executable, "-m", "benchmarks.bench_moe", "--worker", name, "--folder",
                                    folders[model], "--spec", path], env, args.timeout)

        for be in backends:
            for m in folders:  # moe first: where it cannot run, dense-active's worker measures the throughput
                tp = m == "moe" or m == "dense-active" and "error" in results[be].get("moe", {"error": "left out"})
                results[be][m] = run(be, m, throughput=tp)
        tp_model = "moe" if "moe" in folders and any("error" not in results[be].get("moe", {"error": 1})
                                                     for be in backends) else "dense-active"
        hf = run("transformers", tp_model, throughput=True)

    def step(be, m, b):
        r = results[be].get(m, {})
        return r.get("step_ms", {}).get(str(b)) if "error" not in r else None

    print(f"\n{args.family}: {args.experts} experts, top {args.top_k}, hidden {args.hidden}, {args.layers} layers, "
          f"expert width {args.moe_intermediate}, vocab {args.vocab}, {args.dtype}, {args.threads} thread(s)")
    for m, c in params.items():
        print(f"  {m}: {format_count(c['num_params'])} params, {format_count(c['num_active_params'])} active")
    for be in backends:
        for m, r in results[be].items():
            if "error" in r:
                print(f"  {be} {m}: {r['error']}")
    headers = ["backend", "batch", "moe ms", "dense-active ms", "dense-all ms", "moe/active", "moe/all", "goal",
               "other CPU % (max)"]
    rows = []
    for be in backends:
        for b in batches:
            moe, act, full = (step(be, m, b) for m in MODELS)
            goal = "moe/active <= 1.5" if b == 1 else "moe/all <= 1.0"
            noise = [r["other_cpu"][str(b)] for r in results[be].values() if "error" not in r]
            rows.append([be, b, moe, act, full, _ratio(moe, act), _ratio(moe, full), goal,
                         100 * max(noise) if noise else None])
    print(format_table(headers, rows, digits=2))

    def tok_s(r):
        return r.get("throughput", {}).get("output_tok_s") if "error" not in r else None

    hf_tok_s = tok_s(hf)
    tp_rows = [[be, tok_s(results[be].get(tp_model, {})), hf_tok_s,
                _ratio(tok_s(results[be].get(tp_model, {})), hf_tok_s)] for be in backends]
    print(f"\noffline throughput on {tp_model}: {args.num_prompts} prompts, {args.input_len} in / "
          f"{args.output_len} out, greedy (goal: engine / transformers >= 1)"
          + (f"; transformers: {hf['error']}" if "error" in hf else ""))
    print(format_table(["backend", "engine tok/s", "transformers tok/s", "engine/HF"], tp_rows, digits=2))
    if args.json:
        write_json(args.json, {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "folder", "spec",
                                                                                        "out")},
                               "params": params, "results": results, "transformers": hf, "throughput_model": tp_model,
                               "steps": {"headers": headers, "rows": rows}, "info": run_info()})
    errors = [r for be in backends for r in results[be].values() if "error" in r] + ([hf] if "error" in hf else [])
    return 0 if not errors else 1


if __name__ == "__main__":
    raise SystemExit(main())
