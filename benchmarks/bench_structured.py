"""What structured outputs cost: throughput with half the requests under a JSON schema vs none, same run.

    python -m benchmarks.bench_structured [--backend jax|torch] [--requests 16] [--output-len 64]
                                          [--no-async-scheduling] [--json PATH]

Offline `LLM` on the embedded model. Both workloads generate exactly the same number of tokens: every
request runs to --output-len (ignore_eos; the schema's one string field has a minimum length longer than
that, so the grammar never ends first). The constrained half pays for the host-side matcher and bitmask,
the bitmask's copy and unpacking on the device, and the synchronous steps (a constrained request's mask
needs its previous token, so those steps do not overlap scheduling with the device). Each workload is run
once untimed first (compiles the sampler variants), then --repeats times, interleaved; the best run counts. Prints
tokens/s of each and their ratio, and how much CPU other processes took meanwhile. With
--no-async-scheduling both workloads run synchronously: what is left of the ratio is the grammar work
itself (matchers, masks, the masked sampler), without the lost overlap.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.bench_backends import timed

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer"],
          "properties": {"answer": {"type": "string", "minLength": 4000}}}


def run(llm, prompts, params) -> dict:
    return timed(lambda: sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="jax", choices=("jax", "torch"))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--async-scheduling", default=True, action=argparse.BooleanOptionalAction)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    from enginecore import LLM, SamplingParams
    from enginecore.sampling_params import StructuredOutputsParams

    llm = LLM(None, backend=args.backend, platform="cpu", max_model_len=512, max_num_seqs=args.requests,
              max_num_batched_tokens=max(512, args.requests), seed=0, async_scheduling=args.async_scheduling)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Tell me about the number {i} in JSON."}],
                                       tokenize=False, add_generation_prompt=True) for i in range(args.requests)]
    base = dict(temperature=0.8, max_tokens=args.output_len, ignore_eos=True)
    plain = [SamplingParams(seed=i, **base) for i in range(args.requests)]
    mixed = [SamplingParams(seed=i, **base, structured_outputs=StructuredOutputsParams(json=SCHEMA))
             if i % 2 == 0 else SamplingParams(seed=i, **base) for i in range(args.requests)]
    res: dict = {"backend": args.backend, "requests": args.requests, "output_len": args.output_len,
                 "async_scheduling": args.async_scheduling}
    workloads = (("plain", plain), ("half_json_schema", mixed))
    for _, params in workloads:
        run(llm, prompts, params)  # untimed: compiles, fills the grammar cache
    runs: dict[str, list[dict]] = {name: [] for name, _ in workloads}
    for _ in range(args.repeats):  # interleaved, so a burst of load elsewhere hits both alike
        for name, params in workloads:
            runs[name].append(run(llm, prompts, params))
    for name, rs in runs.items():
        res[name] = max(rs, key=lambda r: r["output_tok_s"])
    res["ratio"] = res["half_json_schema"]["output_tok_s"] / res["plain"]["output_tok_s"]
    print(f"{'workload':<18} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'other cpu':>9}")
    for name in ("plain", "half_json_schema"):
        r = res[name]
        print(f"{name:<18} {r['output_tokens']:>7} {r['seconds']:>8.2f} {r['output_tok_s']:>8.1f} "
              f"{r['other_cpu']:>8.0%}")
    print(f"ratio (half under a JSON schema / plain): {res['ratio']:.3f}  "
          f"(backend {args.backend}, {args.requests} requests x {args.output_len} tokens, "
          f"{'async' if args.async_scheduling else 'synchronous'} scheduling)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    llm.llm_engine.core.shutdown()
    return res


if __name__ == "__main__":
    main()
