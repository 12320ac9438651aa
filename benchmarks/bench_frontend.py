"""The API process's own cost a streamed token: many concurrent streams of a tiny model, whose engine steps cost
little, so the API process (HTTP, SSE, detokenization, output processing) is what a fast accelerator's server
would wait on. For each `--stream-interval` (one server each) and concurrency: output tok/s, SSE events, the CPU
time of the API process and of the engine process a token, the other processes' CPU share meanwhile (as every
benchmark here), and the ratios against the first interval measured in the same run.

    python -m benchmarks.bench_frontend --concurrency 64,256 --stream-interval 1,8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import psutil

from benchmarks._server import ServerProcess, sse_events
from benchmarks._sysload import OtherCpu


def cpu_seconds(p: psutil.Process | None) -> float:
    """user + system CPU seconds of a process (all its threads)."""
    if p is None:
        return 0.0
    t = p.cpu_times()
    return t.user + t.system


async def stream_one(port: int, body: bytes, path: str) -> tuple[int, int]:
    """One streamed request over a raw connection (a light client: on a small machine it shares the cores):
    (SSE events with tokens, completion tokens from the final usage event)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(f"POST {path} HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            f"\r\nConnection: close\r\n\r\n".encode() + body)
    await w.drain()
    events = sse_events((await r.read()).decode())  # (each event is a chunk of its own: no line is split)
    w.close()
    if errors := [ev["error"] for ev in events if ev.get("error")]:
        raise RuntimeError(f"the server answered an error: {errors[0]}")
    tokens = sum(ev["usage"]["completion_tokens"] for ev in events if ev.get("usage"))  # (the last event's)
    return sum(1 for ev in events if ev.get("choices")), tokens


async def run_level(port: int, concurrency: int, n: int, output_len: int, chat: bool) -> tuple[float, int, int]:
    """n requests, `concurrency` at a time: (seconds, events, tokens)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int):
        common = {"max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                  "stream_options": {"include_usage": True}}
        text = f"Request {i}: tell me a story about the sea"
        if chat:
            body, path = {"messages": [{"role": "user", "content": text}], **common}, "/v1/chat/completions"
        else:
            body, path = {"prompt": text, **common}, "/v1/completions"
        async with sem:
            return await stream_one(port, json.dumps(body).encode(), path)

    t0 = time.perf_counter()
    got = await asyncio.gather(*(one(i) for i in range(n)))
    return time.perf_counter() - t0, sum(e for e, _ in got), sum(t for _, t in got)


def measure(args, interval: int, levels: list[int], model: str, logdir: str) -> dict[int, dict]:
    srv = ServerProcess(["--model", model, "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs",
                         str(max(levels)), "--max-num-batched-tokens", str(max(512, max(levels))),
                         "--stream-interval", str(interval), "--disable-log-stats",
                         "--disable-uvicorn-access-log", *args.server_args.split()],
                        os.path.join(logdir, f"server_si{interval}.log"))
    results = {}
    try:
        srv.wait_ready()
        api = psutil.Process(srv.proc.pid)
        asyncio.run(run_level(srv.port, max(levels), max(levels), 8, args.chat))  # warm-up
        engine = max(api.children(), key=cpu_seconds, default=None)  # (the busiest child: the engine core)
        for c in levels:
            n = c * args.requests_per_level
            a0, e0 = cpu_seconds(api), cpu_seconds(engine)
            with OtherCpu([srv.proc.pid]) as other:
                dt, events, tokens = asyncio.run(run_level(srv.port, c, n, args.output_len, args.chat))
            a1, e1 = cpu_seconds(api), cpu_seconds(engine)
            if tokens != n * args.output_len:
                raise RuntimeError(f"{tokens} tokens streamed, expected {n * args.output_len}")
            results[c] = {"tok_s": tokens / dt, "events": events, "tokens": tokens, "other_cpu": other.share,
                          "api_ms_tok": 1e3 * (a1 - a0) / tokens, "engine_ms_tok": 1e3 * (e1 - e0) / tokens}
            r = results[c]
            print(f"  --stream-interval {interval}, concurrency {c}: {r['tok_s']:.0f} tok/s, "
                  f"{events / tokens:.2f} events a token, API process {r['api_ms_tok']:.3f} ms CPU a token, "
                  f"engine {r['engine_ms_tok']:.3f}, other CPU {other.note()}", flush=True)
    finally:
        srv.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_frontend", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--stream-interval", default="1,8", help="one server each; ratios against the first")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--requests-per-level", type=int, default=4, help="requests = this x concurrency")
    p.add_argument("--chat", action="store_true", help="/v1/chat/completions instead of /v1/completions")
    p.add_argument("--model", default=None, help="default: the tiny Llama of bench_step (SmolLM2's vocabulary)")
    p.add_argument("--server-args", default="", help="more `xlaserve serve` flags, e.g. '--backend jax'")
    p.add_argument("--json", default=None)
    p.add_argument("--log-dir", default=None, help="the servers' logs (default: a new folder in the temp dir)")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    intervals = [int(x) for x in args.stream_interval.split(",")]
    if args.model is None:
        from benchmarks.bench_step import tiny_model_dir

        args.model = tiny_model_dir()
    logdir = args.log_dir or tempfile.mkdtemp(prefix="bench_frontend_")
    os.makedirs(logdir, exist_ok=True)
    print(f"model {args.model}, {args.output_len} tokens a request, {'chat' if args.chat else 'completions'}, "
          f"{os.cpu_count()} cores; server logs in {logdir}", flush=True)
    res = {si: measure(args, si, levels, args.model, logdir) for si in intervals}
    base = intervals[0]
    print(f"\n{'interval':>8} {'conc':>5} {'tok/s':>8} {'events/tok':>10} {'API ms/tok':>10} {'engine ms/tok':>13} "
          f"{'tok/s vs ' + str(base):>12} {'API CPU vs ' + str(base):>14} {'other CPU %':>11}")
    for si in intervals:
        for c in levels:
            r, b = res[si][c], res[base][c]
            print(f"{si:>8} {c:>5} {r['tok_s']:>8.0f} {r['events'] / r['tokens']:>10.2f} {r['api_ms_tok']:>10.3f} "
                  f"{r['engine_ms_tok']:>13.3f} {r['tok_s'] / b['tok_s']:>11.2f}x "
                  f"{r['api_ms_tok'] / b['api_ms_tok']:>13.2f}x {100 * r['other_cpu']:>11.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(si): {str(c): v for c, v in r.items()} for si, r in res.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
