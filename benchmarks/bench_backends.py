"""Offline throughput of jaxengine vs torchengine vs `transformers` generate, on the embedded model.

    python -m benchmarks.bench_backends [--quick] [--dtype float32] [--json PATH]

Same prompts (random token ids, same seed) and greedy decoding with exactly
--output-len new tokens for every engine (each batch shape is run once with
4 new tokens first, untimed, so lazily compiled programs are not timed), batches of 1, 8 and 32 requests of
128 tokens in / 128 out (--quick: 1 and 4, 64 in / 32 out). Each engine runs
in its own subprocess, one after the other, so their thread pools never
compete and one failing engine does not hide the others. Prints ONE table:
output tokens/s, the ratio to transformers, and the fraction of this
machine's roofline (benchmarks.bench_roofline), plus how much CPU other
processes took during each measurement. The roofline streams the weights in
--dtype: both engines' decode steps of up to 8 rows read the embedded
GGUF's 4- and 8-bit blocks instead (the same bits, `torchengine.quant.
attach_qx`, `jaxengine.loader.attach_cpu_qx`), so at batch 1 they run past
that roofline.

--rounds N runs the engines N times in turn (the order rotated each round) and reports each engine's median
tok/s, and each ratio as the median of the rounds' ratios with its range: on a shared VM whose speed drifts
by up to 2x between minutes, engines measured minutes apart can differ more than the engines themselves
(benchmarks/README.md, bench_backends).

An engine may name a KV-cache dtype, `--engines torch,torch:float16,transformers`: our engine with
`--kv-cache-dtype float16` (half the bytes a decode step's attention reads; not float32's bits); and
compilation-config options after `+`, `--engines jax,jax+cpu_layers=false`: the jax engine with
`compilation_config={"cpu_layers": False}` (values parsed as JSON), to time one option against the default in
the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks._server import run_json_worker

ENGINES = ("jax", "torch", "transformers")
HF_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "xlaserve", "smollm2-hf-{dtype}")


def hf_folder(dtype: str) -> str:
    """The embedded model as a Hugging Face folder (written once, then reused)."""
    from enginecore.hf_folder import save_hf_folder
    from enginecore.model_loader import resolve_model

    path = HF_CACHE.format(dtype=dtype)
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        save_hf_folder(resolve_model(None), path, dtype=dtype)
    return path


# ---- workers (run in a subprocess each) ---------------------------------------------------


def timed(fn) -> dict:
    """Run `fn` (it returns the output tokens it made) once, timed, with the CPU other processes took."""
    from benchmarks._sysload import OtherCpu

    with OtherCpu() as noise:
        t0 = time.perf_counter()
        n_out = fn()
        dt = time.perf_counter() - t0
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt, "other_cpu": noise.share}


def worker_engine(name: str, spec: dict) -> dict:
    from enginecore.llm import LLM
    from enginecore.sampling_params import SamplingParams

    engine, *opts = name.split("+")  # "jax+cpu_layers=false": compilation_config={"cpu_layers": False}
    backend, _, kv_dtype = engine.partition(":")  # "torch:float16": --kv-cache-dtype float16
    cc = {k: json.loads(v) for k, _, v in (o.partition("=") for o in opts)} or None
    t0 = time.perf_counter()
    max_b = max(len(p) for p in spec["prompts"].values())
    need = spec["input_len"] + spec["output_len"] + 1
    max_len = 128
    while max_len < need:
        max_len *= 2
    llm = LLM(backend=backend, dtype=spec["dtype"], max_model_len=max_len, max_num_seqs=max(max_b, 8),
              enable_prefix_caching=False, kv_cache_dtype=kv_dtype or "auto", compilation_config=cc)
    load = time.perf_counter() - t0
    sp_warm = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)
    out = {"load_s": load, "dtype": llm.llm_engine.config.model_config.canonical_dtype, "runs": {}}
    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=spec["output_len"])
    for b, prompts in spec["prompts"].items():
        # same shapes first, so buckets compiled lazily are not timed (prefix caching is off)
        llm.generate(prompts, sp_warm, use_tqdm=False)

        def run(prompts=prompts):
            res = llm.generate(prompts, sp, use_tqdm=False)
            return sum(len(r.outputs[0].token_ids) for r in res)
        out["runs"][b] = timed(run)
        print(f"  {name} batch {b}: {out['runs'][b]['output_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return out


def worker_transformers(spec: dict) -> dict:
    import torch
    import transformers

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    t0 = time.perf_counter()
    folder = hf_folder("float32")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, spec["dtype"]))
    model.eval()
    load = time.perf_counter() - t0

    def gen(prompts, n):
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            o = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=0)
        return int((o.shape[1] - ids.shape[1]) * ids.shape[0])

    out = {"load_s": load, "dtype": spec["dtype"], "runs": {}}
    for b, prompts in spec["prompts"].items():
        gen(prompts, 4)
        out["runs"][b] = timed(lambda prompts=prompts: gen(prompts, spec["output_len"]))
        print(f"  transformers batch {b}: {out['runs'][b]['output_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return out


def worker_main(name: str, spec_path: str, out_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    res = worker_transformers(spec) if name == "transformers" else worker_engine(name, spec)
    with open(out_path, "w") as f:
        json.dump(res, f)
    return 0


# ---- the driver -----------------------------------------------------------------------------


def make_spec(batches: list[int], input_len: int, output_len: int, dtype: str, seed: int = 0) -> dict:
    from enginecore.model_loader import resolve_model
    from enginecore.tokenizer import load_tokenizer

    from frontend.bench.common import special_token_ids
    from frontend.bench.datasets import random_token_requests

    src = resolve_model(None)
    special = special_token_ids(load_tokenizer(src))
    prompts = {
        str(b): [r.prompt for r in random_token_requests(b, input_len, output_len, src.config.vocab_size,
                                                          seed=seed + b, exclude_ids=special)]
        for b in batches
    }
    return {"prompts": prompts, "input_len": input_len, "output_len": output_len, "dtype": dtype}


def thread_env(threads: int) -> dict:
    """The same thread count for every engine: OpenMP/MKL (torch) and XLA's CPU pool (jax)."""
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
           "JAX_PLATFORMS": "cpu"}
    if threads == 1:
        flags = os.environ.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1").strip()
    return env


def run_worker(name: str, spec_path: str, timeout: float, threads: int) -> dict:
    return run_json_worker([sys.executable, "-m", "benchmarks.bench_backends", "--worker", name, "--spec", spec_path],
                           thread_env(threads), timeout, stdout=subprocess.PIPE, text=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_backends", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="batches 1 and 4, 64 in / 32 out")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8,32)")
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="CPU threads for every engine (default: all cores; on a busy shared machine 1 is "
                         "often faster, because OpenMP threads spin waiting for each other)")
    ap.add_argument("--rounds", type=int, default=1, help="run the engines this many times in turn (see above)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.spec, args.out)

    from benchmarks.bench_roofline import embedded_model_cost, get_roofline

    batches = [int(x) for x in (args.batches or ("1,4" if args.quick else "1,8,32")).split(",")]
    in_len = args.input_len or (64 if args.quick else 128)
    out_len = args.output_len or (32 if args.quick else 128)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    spec = make_spec(batches, in_len, out_len, args.dtype)
    from benchmarks._sysload import OtherCpu

    print("measuring the roofline ...", file=sys.stderr, flush=True)
    with OtherCpu() as roof_noise:
        roof = get_roofline(fresh=True)  # in this run, so every ratio below comes from one run
    cost = embedded_model_cost()
    rounds = []
    with tempfile.TemporaryDirectory() as d:
        spec_path = os.path.join(d, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        for r in range(max(1, args.rounds)):
            order = engines[r % len(engines):] + engines[: r % len(engines)]
            res = {}
            for e in order:
                print(f"running {e} (round {r + 1} of {max(1, args.rounds)}) ...", file=sys.stderr, flush=True)
                res[e] = run_worker(e, spec_path, args.timeout, args.threads)
            rounds.append(res)

    def round_tok_s(res, e, b):
        r = res.get(e, {})
        return r.get("runs", {}).get(str(b), {}).get("output_tok_s") if "error" not in r else None

    def median(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    def tok_s(e, b):
        return median([round_tok_s(res, e, b) for res in rounds])

    def ratios(e, base, b):
        return [round_tok_s(res, e, b) / round_tok_s(res, base, b) for res in rounds
                if round_tok_s(res, e, b) and round_tok_s(res, base, b)]

    headers = ["batch"] + [f"{e} tok/s" for e in engines]
    base = "transformers" if "transformers" in engines else None
    others = [e for e in engines if e != base]
    if base:
        headers += [f"{e}/HF" for e in others]
    headers += ["roofline tok/s"] + [f"{e} % roof" for e in engines] + ["other CPU % (max)"]
    rows, spread = [], []
    for b in batches:
        limit = roof.generate_limit(cost, b, in_len, out_len, args.dtype)
        row = [b] + [tok_s(e, b) for e in engines]
        if base:
            row += [median(ratios(e, base, b)) for e in others]
            spread += [f"  batch {b} {e}/HF by round: " + " ".join(f"{x:.2f}" for x in ratios(e, base, b))
                       for e in others if len(rounds) > 1]
        row += [limit] + [(100 * tok_s(e, b) / limit) if tok_s(e, b) else None for e in engines]
        noise = [res[e]["runs"][str(b)]["other_cpu"] for res in rounds for e in engines if round_tok_s(res, e, b)]
        row.append(100 * max(noise) if noise else None)
        rows.append(row)

    from frontend.bench.common import format_table

    print(f"\n{cost.name}, {args.dtype}, {in_len} tokens in / {out_len} out, greedy, exact output length, "
          f"{args.threads} thread(s) each; roofline {roof.peak_flops[args.dtype] / 1e9:.0f} GFLOP/s, "
          f"{roof.mem_bw / 1e9:.1f} GB/s (other CPU {roof_noise.note()} while measuring it)")
    for e in engines:
        r = rounds[0][e]
        print(f"  {e}: " + (r["error"] if "error" in r else f"load {r['load_s']:.1f} s, dtype {r['dtype']}"))
    if len(rounds) > 1:
        print(f"  tok/s: the median of {len(rounds)} rounds; X/HF: the median of the rounds' ratios")
    print(format_table(headers, rows, digits=1))
    for line in spread:
        print(line)
    if args.json:
        from frontend.bench.common import run_info, write_json

        # "results": the first round (what a one-round run always wrote), "rounds": every round
        write_json(args.json, {"results": rounds[0], "rounds": rounds, "batches": batches, "input_len": in_len,
                               "output_len": out_len,
                               "dtype": args.dtype, "table": {"headers": headers, "rows": rows}, "info": run_info()})
    return 0 if all("error" not in res[e] for res in rounds for e in engines) else 1


if __name__ == "__main__":
    raise SystemExit(main())
