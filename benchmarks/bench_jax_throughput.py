"""Offline throughput of the JAX backend next to `transformers` generate, on the embedded SmolLM2-135M.

    python -m benchmarks.bench_jax_throughput            # 1000 tokens in / 128 out, batch 1, 8, 32
    python -m benchmarks.bench_jax_throughput --quick    # 200 in / 32 out: a couple of minutes on 2 cores

Both sides get the same random prompts (token ids), greedy, no early stop, fp32
on CPU. Reported per batch: output tokens/s, total (prompt + output) tokens/s,
and model FLOPs utilization against a matmul peak measured in the same run
(a 2048^3 float32 jnp.matmul). Also reported: start-up time of the engine from
the GGUF (dequantization) vs from an orbax checkpoint of the converted params.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def matmul_peak_flops(n: int = 2048, reps: int = 5) -> float:
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def model_flops(cfg, batch: int, input_len: int, output_len: int) -> float:
    """Matmul + attention FLOPs of the whole run (lm_head only where logits are computed)."""
    H, I, D, L = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, cfg.num_layers
    per_tok = 2 * L * (H * D * (2 * cfg.num_q_heads + 2 * cfg.num_kv_heads) + 3 * H * I)
    lm_head = 2 * cfg.vocab_size * H
    attn = lambda ctx: 4 * L * cfg.num_q_heads * D * ctx  # noqa: E731  QK and PV for one query
    prompt = input_len * per_tok + sum(attn(p + 1) for p in range(input_len))
    decode = sum(per_tok + attn(input_len + j + 1) for j in range(output_len - 1))
    return batch * (prompt + decode + output_len * lm_head)


def bench_jax(batches, input_len, output_len, prompts):
    from enginecore import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(None, backend="jax", platform="cpu", dtype="float32", max_num_seqs=max(max(batches), 8),
              max_num_batched_tokens=2048, max_model_len=input_len + output_len + 16,
              enable_prefix_caching=False, seed=0)
    startup = time.perf_counter() - t0
    runner = llm.llm_engine.core.runner
    res = {}
    for b in batches:
        ps = [{"prompt_token_ids": p} for p in prompts[:b]]
        # same shapes untimed first: every bucket the timed run touches gets compiled here
        llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=min(4, output_len), ignore_eos=True),
                     use_tqdm=False)
        compiled_before = len(runner.guard.lazy_compiles)
        t = time.perf_counter()
        outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True),
                            use_tqdm=False)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
        res[b] = (dt, len(runner.guard.lazy_compiles) - compiled_before)
    cfg = runner.cfg
    llm.llm_engine.core.shutdown()
    return res, startup, cfg


def bench_hf(batches, input_len, output_len, prompts, hf_dir, threads):
    import torch
    import transformers as tf

    torch.set_num_threads(threads)
    model = tf.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    res = {}
    for b in batches:
        ids = torch.tensor(prompts[:b])
        gc = tf.GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                 pad_token_id=0)
        with torch.no_grad():
            model.generate(ids[:, :16], attention_mask=torch.ones_like(ids[:, :16]),
                           generation_config=tf.GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=0))
            t = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
            res[b] = time.perf_counter() - t
        assert out.shape[1] == input_len + output_len
    return res


def bench_startup(hf_dir: str, work: str) -> dict:
    """Seconds from LLM(...) to ready: GGUF (embedded) vs orbax checkpoint of the same converted params."""
    from enginecore import LLM
    from enginecore.model_loader import resolve_model
    from jaxengine.checkpoint import convert_to_orbax

    ckpt = os.path.join(work, "orbax_ckpt")
    t = time.perf_counter()
    convert_to_orbax(resolve_model(None), ckpt, dtype="float32")
    convert_s = time.perf_counter() - t
    out = {"convert_s": convert_s}
    for name, model, fmt in (("gguf", None, "auto"), ("safetensors", hf_dir, "safetensors"), ("orbax", ckpt, "orbax")):
        t = time.perf_counter()
        llm = LLM(model, backend="jax", platform="cpu", max_model_len=256, max_num_seqs=8, load_format=fmt)
        out[f"{name}_startup_s"] = time.perf_counter() - t
        out[f"{name}_load_s"] = llm.llm_engine.core.runner.load_seconds
        llm.llm_engine.core.shutdown()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="200 in / 32 out instead of 1000 / 128")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-startup", action="store_true")
    args = ap.parse_args(argv)
    input_len = args.input_len or (200 if args.quick else 1000)
    output_len = args.output_len or (32 if args.quick else 128)
    batches = [int(b) for b in args.batches.split(",")]
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 2))

    import numpy as np

    from enginecore.hf_folder import save_hf_folder
    from enginecore.model_loader import resolve_model

    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(100, 40000, input_len - 1).tolist() for _ in range(max(batches))]
    work = tempfile.mkdtemp(prefix="bench_jax_")
    hf_dir = save_hf_folder(resolve_model(None), os.path.join(work, "hf"))

    peak = matmul_peak_flops()
    print(f"# {input_len} in / {output_len} out, fp32 CPU, {threads} threads; matmul peak {peak / 1e9:.1f} GFLOP/s",
          flush=True)
    jres, startup, cfg = bench_jax(batches, input_len, output_len, prompts)
    hres = {} if args.skip_hf else bench_hf(batches, input_len, output_len, prompts, hf_dir, threads)
    print(f"{'batch':>5} {'jax out tok/s':>14} {'jax tot tok/s':>14} {'jax MFU':>8} {'hf out tok/s':>13} "
          f"{'hf MFU':>7} {'speedup':>8}  note")
    for b in batches:
        dt, lazy = jres[b]
        fl = model_flops(cfg, b, input_len, output_len)
        out_tps = b * output_len / dt
        row = f"{b:>5} {out_tps:>14.1f} {b * (input_len + output_len) / dt:>14.1f} {fl / dt / peak:>8.1%}"
        if b in hres:
            ht = hres[b]
            row += f" {b * output_len / ht:>13.1f} {fl / ht / peak:>7.1%} {ht / dt:>7.2f}x"
        else:
            row += f" {'-':>13} {'-':>7} {'-':>8}"
        row += f"  {lazy} lazy compiles during the timed run" if lazy else ""
        print(row, flush=True)
    print(f"jax engine start-up (GGUF, lazy compile): {startup:.1f}s")
    if not args.skip_startup:
        st = bench_startup(hf_dir, work)
        print("start-up: " + ", ".join(f"{k}={v:.2f}" for k, v in st.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
