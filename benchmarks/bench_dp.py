"""Data parallelism on this host, same run: `--data-parallel-size 2` (each core 1 thread, pinned to its CPU)
against one core with 2 threads, at each concurrency: output tok/s and TTFT of streamed completions through a
real server; and the API process's added cost a request of DP routing (`DPRouter.choose`: the prompt's block
hashes, the least-loaded pick, the bounded map) with as many requests in flight, goal <= 1 ms. Ratios DP2 / DP1.

    python -m benchmarks.bench_dp [--model none] [--concurrency 16,64] [--output-len 32]

`--model none` (default): the embedded SmolLM2-135M.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

from benchmarks._server import ServerProcess, sse_events
from benchmarks._sysload import OtherCpu


async def stream_one(port: int, body: bytes) -> tuple[float, int]:
    """One streamed completion over a raw connection: (seconds to its first token event, completion tokens)."""
    t0 = time.perf_counter()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(f"POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\nContent-Length: "
            f"{len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
    await w.drain()
    ttft, buf = None, b""
    while chunk := await r.read(65536):
        if ttft is None and b'"text"' in chunk:
            ttft = time.perf_counter() - t0
        buf += chunk
    w.close()
    events = sse_events(buf.decode())
    if errors := [ev["error"] for ev in events if ev.get("error")]:
        raise RuntimeError(f"the server answered an error: {errors[0]}")
    return ttft or 0.0, sum(ev["usage"]["completion_tokens"] for ev in events if ev.get("usage"))


def prompt(i: int) -> str:
    return f"Request {i}: write a short story about a lighthouse keeper and the sea, in the voice of a sailor"


async def run_level(port: int, concurrency: int, n: int, output_len: int) -> tuple[float, list[float], int]:
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int):
        body = {"prompt": prompt(i), "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        async with sem:
            return await stream_one(port, json.dumps(body).encode())

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t0, [t for t, _ in got], sum(k for _, k in got)


def measure(name: str, args, levels: list[int], server_args: list[str], threads: int, logdir: str) -> dict:
    model = [] if args.model in (None, "none") else ["--model", args.model]
    srv = ServerProcess([*model, "--max-model-len", "512", "--max-num-seqs", str(max(levels)),
                         "--max-num-batched-tokens", "512", "--disable-log-stats", "--disable-uvicorn-access-log",
                         *server_args, *args.server_args.split()],
                        os.path.join(logdir, f"{name}.log"), env={"OMP_NUM_THREADS": str(threads)})
    out = {}
    try:
        srv.wait_ready()
        asyncio.run(run_level(srv.port, max(levels), max(levels), 4))  # warm-up: every batch shape seen
        for c in levels:
            n = c * args.requests_per_level
            with OtherCpu([srv.proc.pid]) as other:
                dt, ttfts, tokens = asyncio.run(run_level(srv.port, c, n, args.output_len))
            if tokens != n * args.output_len:
                raise RuntimeError(f"{tokens} tokens streamed, expected {n * args.output_len}")
            out[c] = {"tok_s": tokens / dt, "ttft_ms_median": 1e3 * statistics.median(ttfts),
                      "ttft_ms_p90": 1e3 * sorted(ttfts)[int(0.9 * (len(ttfts) - 1))], "other_cpu": other.share}
            print(f"  {name}, concurrency {c}: {out[c]['tok_s']:.0f} tok/s, TTFT median "
                  f"{out[c]['ttft_ms_median']:.0f} ms, p90 {out[c]['ttft_ms_p90']:.0f} ms, other CPU {other.note()}",
                  flush=True)
    finally:
        srv.stop()
    return out


def routing_cost_ms(concurrency: int, prompt_tokens: int = 200, rounds: int = 2000) -> float:
    """ms a request of the router's work in the API process: DP 2, prefix caching on, `concurrency` requests
    in flight (stats arriving as each core's steps would send them), prompts of `prompt_tokens` tokens."""
    from enginecore.scheduler import SchedulerStats
    from frontend.dp_router import DPRouter

    router = DPRouter(2, block_size=16, prefix_caching=True)
    prompts = [[(i * 7919 + t * 31) % 49000 for t in range(prompt_tokens)] for i in range(rounds)]
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        router.choose(p)
        if i % 4 == 3:  # a core's stats with `concurrency / 2` requests each
            router.on_stats(i % 2, SchedulerStats(num_running_reqs=concurrency // 2))
    return 1e3 * (time.perf_counter() - t0) / rounds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_dp", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default none: the embedded SmolLM2-135M")
    p.add_argument("--concurrency", default="16,64")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--requests-per-level", type=int, default=2, help="requests = this x concurrency")
    p.add_argument("--server-args", default="", help="more `xlaserve serve` flags, e.g. '--backend torch'")
    p.add_argument("--json", default=None)
    p.add_argument("--log-dir", default=None)
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    logdir = args.log_dir or tempfile.mkdtemp(prefix="bench_dp_")
    os.makedirs(logdir, exist_ok=True)
    print(f"model {args.model or 'SmolLM2-135M (embedded)'}, {args.output_len} tokens a request, "
          f"{os.cpu_count()} cores; server logs in {logdir}", flush=True)
    # the DP 2 server splits OMP_NUM_THREADS=2 into 1 a core (enginecore.engine_proc.core_placement)
    dp2 = measure("dp2x1", args, levels, ["--data-parallel-size", "2"], 2, logdir)
    dp1 = measure("dp1x2", args, levels, [], 2, logdir)
    route = {c: routing_cost_ms(c) for c in levels}
    print(f"\n{'conc':>5} {'DP2x1 tok/s':>12} {'DP1x2 tok/s':>12} {'ratio':>6} {'DP2x1 TTFT':>11} {'DP1x2 TTFT':>11} "
          f"{'ratio':>6} {'routing ms/req':>15}")
    for c in levels:
        a, b = dp2[c], dp1[c]
        print(f"{c:>5} {a['tok_s']:>12.0f} {b['tok_s']:>12.0f} {a['tok_s'] / b['tok_s']:>5.2f}x "
              f"{a['ttft_ms_median']:>9.0f}ms {b['ttft_ms_median']:>9.0f}ms "
              f"{a['ttft_ms_median'] / b['ttft_ms_median']:>5.2f}x {route[c]:>15.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dp2x1": dp2, "dp1x2": dp1, "routing_ms": route}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
