"""Our own per-step cost: a decode step of a tiny model, where the model costs next to nothing.

    python -m benchmarks.bench_step [--batches 1,64,256] [--backends jax,torch] [--steps 64] [--profile]

The model has 2 layers, hidden size 64 and SmolLM2's vocabulary (49152), random
weights: at batch 1 its forward pass is a fraction of a millisecond, so a
decode step's time is almost all the engine's own work (scheduling, batch
building, dispatch, sampling, output handling, detokenization). Each backend
runs in its own subprocess through the offline API (`LLM.generate`, greedy,
ignore_eos, exactly --steps new tokens per request, 16-token prompts, prefix
caching off). The decode step time is (time for --steps tokens - time for 1
token) / (--steps - 1), the prefill excluded. A warm-up run of each shape comes
first, so no compilation is timed. The same run also times a decode step's
device work alone at each batch (`device ms`: the compiled programs for jax,
the forward and sampler on a prepared batch for torch, 24-token contexts), so
`host ms` = step - device is about the engine's own per-step cost (with
asynchronous scheduling the host work overlaps the device's, so it can be
small or even negative).

--profile adds, per backend and batch, the functions where a step's time goes
(cProfile, own time, top 12).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from benchmarks._server import run_json_worker

TINY_DIR = os.path.join(os.path.expanduser("~"), ".cache", "xlaserve", "tiny-llama-h64")


def tiny_model_dir() -> str:
    """A 2-layer, hidden-64 Llama with SmolLM2's vocabulary and tokenizer (written once, then reused)."""
    if os.path.isfile(os.path.join(TINY_DIR, "model.safetensors")):
        return TINY_DIR
    import shutil

    import torch
    import transformers as tf

    from enginecore.hf_folder import save_hf_folder
    from enginecore.model_loader import resolve_model

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    model = tf.LlamaForCausalLM(cfg)
    tmp = TINY_DIR + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    with tempfile.TemporaryDirectory() as d:
        save_hf_folder(resolve_model(None), d)
        for fn in os.listdir(d):
            if fn.startswith("tokenizer") or fn.endswith(".jinja") or fn == "special_tokens_map.json":
                shutil.copy(os.path.join(d, fn), tmp)
    os.replace(tmp, TINY_DIR)
    return TINY_DIR


# ---- the worker (one backend, in its own process) ----------------------------------------------


def _decode_batch(runner, batch: int, context: int):
    """A decode step of `batch` requests with `context` tokens each (greedy), on a scratch InputBatch."""
    from enginecore.input_batch import InputBatch
    from enginecore.outputs import CachedRequestData, NewRequestData, SchedulerOutput
    from enginecore.sampling_params import SamplingParams
    from enginecore.step_batch import prepare_step

    ib = InputBatch(runner.input_batch.max_num_seqs, runner.input_batch.max_model_len, runner.block_size,
                    runner.arch.vocab_size)
    nb = -(-(context + 1) // runner.block_size)
    sp = SamplingParams(temperature=0.0)
    news = [NewRequestData(f"d{i}", [7] * context, sp, list(range(1, nb + 1)), context - 1, [], 0, 0)
            for i in range(batch)]
    so = SchedulerOutput(news, CachedRequestData(), {n.req_id: 1 for n in news}, batch, set(), set())
    ib.update(so)
    return prepare_step(ib, so, runner.buckets)


def _device_time(llm, batch: int, reps: int = 20) -> float:
    """Seconds of one decode step's device work at this batch: the compiled programs (jax) or the forward
    and sampler on a prepared batch (torch), without scheduling, batch building or output handling."""
    runner = llm.llm_engine.core.runner
    b = _decode_batch(runner, batch, 24)
    if hasattr(runner, "_programs"):  # jax
        import jax

        from jaxengine.programs import ProgramKey, SampleLayout

        model = runner._program(ProgramKey("model", b.padded_num_tokens))
        samp = runner._program(ProgramKey("sample", b.padded_num_reqs, "greedy"))
        m_in = runner._model_layout(b.padded_num_tokens).pack(b)
        s_in = SampleLayout(b.padded_num_reqs).pack(b.sampling, b.sample_rows)  # every row samples: the head runs

        def once():
            _, rows, runner.kv_cache = model(runner.params, runner.kv_cache, runner.last_tokens, runner.rope, m_in)
            out, runner.last_tokens = samp(runner.params, rows, runner.last_tokens, s_in)
            jax.block_until_ready(out)
    else:
        def once():
            runner._run(b).result()
    once()
    t0 = time.perf_counter()
    for _ in range(reps):
        once()
    return (time.perf_counter() - t0) / reps


def worker(backend: str, batches: list[int], steps: int, profile: bool) -> dict:
    from benchmarks._sysload import OtherCpu
    from enginecore import LLM, SamplingParams

    model = tiny_model_dir()
    max_b = max(batches)
    llm = LLM(model, backend=backend, max_num_seqs=max(max_b, 8), max_model_len=256,
              max_num_batched_tokens=max(2048, 16 * max_b), enable_prefix_caching=False, seed=0)
    rng = np.random.default_rng(0)
    out = {}
    for b in batches:
        prompts = [[int(t) for t in rng.integers(100, 40000, 16)] for _ in range(b)]

        with OtherCpu() as noise:
            step = decode_step_seconds(llm, prompts, steps)
            dev = _device_time(llm, b)
        row = {"step_ms": 1e3 * step, "device_ms": 1e3 * dev, "prefill_ms": 1e3 * t1, "tok_s": b / step,
               "other_cpu": noise.share}
        if profile:
            import cProfile
            import io
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            gen(steps)
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
            row["profile"] = s.getvalue()
        out[str(b)] = row
        print(f"  {backend} batch {b}: {row['step_ms']:.2f} ms/step", file=sys.stderr, flush=True)
    return out


# ---- the driver ------------------------------------------------------------------------------------


def decode_step_seconds(llm, prompts, steps: int) -> float:
    """Seconds a greedy decode step of `prompts` takes: (best time for `steps` tokens - best for 1) / (steps - 1),
    after a warm-up that compiles every bucket the shape meets."""
    from enginecore import SamplingParams

    def gen(n):
        sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)
        t0 = time.perf_counter()
        res = llm.generate(prompts, sp, use_tqdm=False)
        assert all(len(r.outputs[0].token_ids) == n for r in res)
        return time.perf_counter() - t0

    gen(steps)
    gen(1)
    t1 = min(gen(1) for _ in range(3))
    tn = min(gen(steps) for _ in range(2))
    return (tn - t1) / (steps - 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--backends", default="jax,torch")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    if args.worker:
        res = worker(args.worker, batches, args.steps, args.profile)
        with open(args.out, "w") as f:
            json.dump(res, f)
        return 0

    from frontend.bench.common import format_table

    tiny_model_dir()
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    results = {}
    for be in backends:
        print(f"running {be} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "benchmarks.bench_step", "--worker", be,
               "--batches", args.batches, "--steps", str(args.steps)] + (["--profile"] if args.profile else [])
        results[be] = run_json_worker(cmd, {"JAX_PLATFORMS": "cpu"})
    headers = ["batch"]
    for be in backends:
        headers += [f"{be} step ms", f"{be} device ms", f"{be} host ms", f"{be} tok/s"]
    headers.append("other CPU % (max)")
    rows = []
    for b in batches:
        row = [b]
        for be in backends:
            r = results[be].get(str(b)) if "error" not in results[be] else None
            if r is None:
                row += [None] * 4
                continue
            row += [r["step_ms"], r["device_ms"], r["step_ms"] - r["device_ms"], r["tok_s"]]
        row.append(max((100 * results[be][str(b)]["other_cpu"] for be in backends if str(b) in results[be]),
                       default=None))
        rows.append(row)
    cores = len(os.sched_getaffinity(0))
    print(f"\ntiny Llama (2 layers, hidden 64, vocab 49152), 16-token prompts, {args.steps} greedy steps, "
          f"{cores} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    for be in backends:
        if "error" in results[be]:
            print(f"  {be}: {results[be]['error']}")
    print(format_table(headers, rows, digits=2))
    if args.profile:
        for be in backends:
            for b in batches:
                r = results[be].get(str(b)) if "error" not in results[be] else None
                if r and r.get("profile"):
                    print(f"\n---- {be}, batch {b}: where {args.steps} steps went (cProfile, own time) ----")
                    print("\n".join(r["profile"].splitlines()[:30]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "batches": batches, "steps": args.steps}, f, indent=1)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
