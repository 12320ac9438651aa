"""In-process benchmarks: `bench latency`, `bench throughput`, and the trace driver `bench compare` uses.

`run_trace` drives an `LLMEngine` step by step, adding each request when its
send time comes and stamping every step that produced tokens, so in-process
runs get the same TTFT / TPOT / ITL records as the HTTP client.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Sequence

from frontend.bench.common import format_table, param_counts, params_line, run_info, special_token_ids, write_json
from frontend.bench.datasets import SampleRequest, load_jsonl_requests, random_token_requests
from frontend.bench.engine_flags import add_engine_args, engine_kwargs
from frontend.bench.metrics import DEFAULT_PERCENTILES, RequestRecord, summarize


def build_llm(kwargs: dict):
    from enginecore.llm import LLM

    return LLM(**kwargs)


def model_vocab(llm) -> tuple[int, list[int]]:
    eng = llm.llm_engine
    return eng.model.config.vocab_size, special_token_ids(eng.tokenizer)


def model_arch(llm):
    """The served model's ArchConfig."""
    return llm.llm_engine.model.config


# ---- the in-process trace driver ----------------------------------------------------


@dataclass
class TraceResult:
    """One request run in-process: its timings and what it generated."""

    request_id: str
    record: RequestRecord
    token_ids: list[int]
    top_logprobs: list[dict[int, float]] | None  # per generated position: token id -> logprob
    text: str
    finish_reason: str | None


def run_trace(
    engine,
    requests: Sequence[SampleRequest],
    params: Sequence,
    offsets: Sequence[float] | None = None,
    timeout_s: float = 3600.0,
    desc: str = "requests",
    use_tqdm: bool = True,
    clock=time.perf_counter,
) -> tuple[list[TraceResult], float]:
    """Run requests through an LLMEngine, each added at start + offsets[i]. Returns results and the duration.

    Bounded: after timeout_s the unfinished requests are aborted and marked failed.
    """
    from enginecore.sampling_params import RequestOutputKind

    n = len(requests)
    if len(params) != n:
        raise ValueError(f"{n} requests but {len(params)} sampling params")
    offsets = list(offsets) if offsets is not None else [0.0] * n
    bar = None
    if use_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=n, desc=desc, dynamic_ncols=True, leave=False)
    rid_base = f"bench-{int(time.time() * 1000)}-"
    results: list[TraceResult] = []
    by_id: dict[str, TraceResult] = {}
    for i, req in enumerate(requests):
        tr = TraceResult(rid_base + str(i), RequestRecord(req.prompt_len, math.nan), [],
                         [] if params[i].logprobs is not None else None, "", None)
        results.append(tr)
        by_id[tr.request_id] = tr
    nxt = 0
    start = clock()
    deadline = start + timeout_s
    done = 0
    while done < n:
        now = clock()
        if now > deadline:
            live = [r.request_id for r in results if r.finish_reason is None and not math.isnan(r.record.start_time)]
            engine.abort_request(live)
            for r in results:
                if r.finish_reason is None:
                    r.record.error = f"not finished within {timeout_s:.0f} s"
            break
        while nxt < n and start + offsets[nxt] <= now:
            sp = params[nxt].clone()
            sp.output_kind = RequestOutputKind.DELTA
            tr = results[nxt]
            tr.record.start_time = clock()
            engine.add_request(tr.request_id, requests[nxt].prompt, sp)
            nxt += 1
        if not engine.has_unfinished_requests():
            if nxt < n:
                time.sleep(max(0.0, min(start + offsets[nxt] - clock(), 0.05)))
            continue
        outs = engine.step()
        t = clock()
        for out in outs:
            tr = by_id.get(out.request_id)
            if tr is None:
                continue
            co = out.outputs[0]
            if co.token_ids:
                tr.record.chunk_times.append(t)
                tr.token_ids.extend(co.token_ids)
                if tr.top_logprobs is not None and co.logprobs:
                    tr.top_logprobs.extend({tid: lp.logprob for tid, lp in d.items()} for d in co.logprobs)
            tr.text += co.text
            if out.finished:
                tr.finish_reason = co.finish_reason or "stop"
                tr.record.end_time = t
                tr.record.output_tokens = len(tr.token_ids)
                tr.record.generated_text = tr.text
                tr.record.success = tr.finish_reason != "abort"
                done += 1
                if bar:
                    bar.update(1)
    duration = clock() - start
    if bar:
        bar.close()
    return results, duration


# ---- bench latency -------------------------------------------------------------------


def add_latency_parser(sub) -> None:
    p = sub.add_parser("latency", help="latency of one batch, in-process (vllm bench latency)",
                       description="Time one batch of fixed-length requests end to end, in-process.")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--n", type=int, default=1, help="sequences per prompt")
    p.add_argument("--num-iters-warmup", type=int, default=3)
    p.add_argument("--num-iters", type=int, default=10)
    p.add_argument("--output-json", default=None, help="write the results here")
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=latency_main)


def measure_latency(llm, prompts: list[list[int]], sampling_params, warmup: int, iters: int,
                    use_tqdm: bool = True) -> list[float]:
    if iters < 1 or warmup < 0:
        raise ValueError(f"--num-iters must be >= 1 and --num-iters-warmup >= 0, got {iters} and {warmup}")
    rng = range(warmup + iters)
    if use_tqdm:
        from tqdm import tqdm

        rng = tqdm(rng, desc="iterations", dynamic_ncols=True)
    lat = []
    for i in rng:
        # the same prompts every iteration: without this, iterations after the first hit the prefix cache
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        llm.generate(prompts, sampling_params, use_tqdm=False)
        if i >= warmup:
            lat.append(time.perf_counter() - t0)
    return lat


def latency_main(args: argparse.Namespace) -> int:
    from enginecore.sampling_params import SamplingParams

    llm = build_llm(engine_kwargs(args))
    vocab, special = model_vocab(llm)
    reqs = random_token_requests(args.batch_size, args.input_len, args.output_len, vocab,
                                 seed=getattr(args, "seed", 0), exclude_ids=special)
    sp = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=args.output_len)
    lat = measure_latency(llm, [r.prompt for r in reqs], sp, args.num_iters_warmup, args.num_iters,
                          not args.disable_tqdm)
    s = summarize(lat, DEFAULT_PERCENTILES)
    print(params_line(model_arch(llm)))
    print(f"Avg latency: {s.mean:.4f} seconds")
    for q, v in s.percentiles.items():
        print(f"{q:g}% percentile latency: {v:.4f} seconds")
    tokens = args.batch_size * args.n * args.output_len
    print(f"Output tokens/s at the median: {tokens / s.median:.1f} (batch {args.batch_size}, "
          f"{args.input_len} in / {args.output_len} out)")
    if args.output_json:
        write_json(args.output_json, {
            "avg_latency": s.mean, "latencies": lat, "percentiles": {f"{q:g}": v for q, v in s.percentiles.items()},
            "batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
            **param_counts(model_arch(llm)), "engine_args": engine_kwargs(args), "info": run_info(),
        })
    return 0


# ---- bench throughput --------------------------------------------------------------


def add_throughput_parser(sub) -> None:
    p = sub.add_parser("throughput", help="offline throughput, in-process (vllm bench throughput)",
                       description="Offline throughput of the in-process engine on a dataset.")
    p.add_argument("--dataset-name", choices=("random", "jsonl"), default=None,
                   help="random token ids, or a JSONL file (implied by --dataset-path)")
    p.add_argument("--dataset-path", default=None, help='JSONL: {"prompt": ..., "output_len": ...} per line')
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=None, help="default 128 (random); JSONL lines may set their own")
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=0)
    p.add_argument("--output-json", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=throughput_main)


def measure_throughput(llm, reqs: Sequence[SampleRequest], use_tqdm: bool = True) -> dict:
    from enginecore.sampling_params import SamplingParams

    params = [SamplingParams(n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.expected_output_len)
              for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - t0
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "elapsed_time": elapsed, "num_requests": len(reqs), "total_prompt_tokens": n_in,
        "total_output_tokens": n_out, "total_num_tokens": n_in + n_out,
        "requests_per_second": len(reqs) / elapsed, "tokens_per_second": (n_in + n_out) / elapsed,
        "output_tokens_per_second": n_out / elapsed,
    }


def throughput_main(args: argparse.Namespace) -> int:
    name = args.dataset_name or ("jsonl" if args.dataset_path else "random")
    if name == "jsonl" and not args.dataset_path:
        raise SystemExit("--dataset-name jsonl needs --dataset-path")
    llm = build_llm(engine_kwargs(args))
    if name == "random":
        vocab, special = model_vocab(llm)
        reqs = random_token_requests(args.num_prompts, args.input_len, args.output_len or 128, vocab,
                                     args.random_range_ratio, args.prefix_len, getattr(args, "seed", 0), special)
    else:
        tok = llm.llm_engine.tokenizer
        reqs = load_jsonl_requests(args.dataset_path, args.output_len,
                                   lambda s: len(tok.encode(s)), args.num_prompts)
    r = measure_throughput(llm, reqs, not args.disable_tqdm)
    print(params_line(model_arch(llm)))
    print(f"Throughput: {r['requests_per_second']:.2f} requests/s, {r['tokens_per_second']:.2f} total tokens/s, "
          f"{r['output_tokens_per_second']:.2f} output tokens/s")
    print(format_table(["requests", "prompt tokens", "output tokens", "elapsed s"],
                       [[r["num_requests"], r["total_prompt_tokens"], r["total_output_tokens"], r["elapsed_time"]]]))
    if args.output_json:
        write_json(args.output_json, {**r, "dataset": name, **param_counts(model_arch(llm)),
                                      "engine_args": engine_kwargs(args), "info": run_info()})
    return 0
