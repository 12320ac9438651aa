"""`xlaserve bench serve`: a streaming client against any OpenAI-compatible server (vllm bench serve).

Works against xlaserve, vLLM and llama.cpp's servers: it only needs
/v1/models and /v1/completions (or /v1/chat/completions) with SSE streaming.
Prompts are random words fitted to an exact token count with the server's
tokenize endpoint when it has one (vLLM's /tokenize, llama.cpp's /tokenize,
llama-cpp-python's /extras/tokenize), else with a local tokenizer, else
estimated at one token a word. Every wait is bounded: the readiness check,
each request (--request-timeout) and therefore the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import httpx

from frontend.bench.arrivals import arrival_offsets, paced
from frontend.bench.common import format_table, parse_int_list, run_info, write_json
from frontend.bench.datasets import SampleRequest, TextPromptBuilder, load_jsonl_requests, word_pool
from frontend.bench.metrics import RequestRecord, ServeMetrics, compute_serve_metrics, format_serve_metrics


@dataclass
class ServeConfig:
    """Everything one `bench serve` run needs (the CLI flags, as a value peers scripts can build)."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first of /v1/models
    num_prompts: int = 100
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float | None = None
    extra_body: dict = field(default_factory=dict)
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    seed: int = 0
    tokenizer: str | None = None  # local tokenizer: HF folder, .gguf, or "embedded"
    request_timeout: float = 600.0
    ready_timeout: float = 60.0
    percentiles: tuple[float, ...] = (99.0,)
    disable_tqdm: bool = False
    skip_test_run: bool = False

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + path


@dataclass
class ServeResult:
    metrics: ServeMetrics
    records: list[RequestRecord]
    model: str
    max_concurrency: int | None
    tokenize_source: str

    def to_dict(self, cfg: ServeConfig) -> dict:
        return {
            **self.metrics.to_dict(),
            "model_id": self.model, "base_url": cfg.base_url, "endpoint": cfg.endpoint,
            "num_prompts": len(self.records), "request_rate": cfg.request_rate, "burstiness": cfg.burstiness,
            "max_concurrency": self.max_concurrency, "tokenize_source": self.tokenize_source,
            "input_lens": [r.prompt_len for r in self.records],
            "output_lens": [r.output_tokens for r in self.records],
            "server_prompt_lens": [r.server_prompt_tokens for r in self.records],
            "ttfts": [r.ttft for r in self.records],
            "itls": [r.itl for r in self.records],
            "generated_texts": [r.generated_text for r in self.records],
            "errors": [r.error for r in self.records],
            "info": run_info(),
        }


# ---- server discovery ---------------------------------------------------------------


def wait_ready(cfg: ServeConfig, client: httpx.Client) -> list[str]:
    """Poll /v1/models until it answers (at most cfg.ready_timeout s); returns the model ids."""
    deadline = time.monotonic() + cfg.ready_timeout
    last = ""
    while True:
        try:
            r = client.get(cfg.url("/v1/models"), timeout=5.0)
            if r.status_code == 200:
                return [m["id"] for m in r.json().get("data", [])]
            last = f"HTTP {r.status_code}"
        except (httpx.HTTPError, ValueError, KeyError) as e:
            last = type(e).__name__ + (f": {e}" if str(e) else "")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{cfg.url('/v1/models')} not ready after {cfg.ready_timeout:.0f} s ({last})")
        time.sleep(0.5)


def probe_tokenizer_endpoint(cfg: ServeConfig, client: httpx.Client, model: str) -> tuple[str, Callable[[str], int]] | None:
    """Find the server's tokenize endpoint; returns (description, count_fn) or None."""
    shapes = [
        ("/tokenize", lambda s: {"model": model, "prompt": s}),  # vLLM, xlaserve
        ("/tokenize", lambda s: {"content": s}),  # llama.cpp server
        ("/extras/tokenize", lambda s: {"model": model, "input": s}),  # llama-cpp-python
    ]
    for path, body in shapes:
        def count(s: str, path=path, body=body) -> int:
            r = client.post(cfg.url(path), json=body(s), timeout=30.0)
            r.raise_for_status()
            j = r.json()
            return int(j["count"]) if "count" in j else len(j["tokens"])
        try:
            if count("hello world") > 0:
                return f"server {path}", count
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            continue
    return None


def load_local_tokenizer(spec: str | None, model: str | None):
    """A transformers tokenizer for `spec` (folder, .gguf or 'embedded'); the embedded one when the served
    model is SmolLM2-135M-Instruct; else None."""
    from enginecore.model_loader import DEFAULT_MODEL_NAME

    if spec is None and model not in (DEFAULT_MODEL_NAME, os.path.basename(DEFAULT_MODEL_NAME)):
        return None
    from enginecore.model_loader import resolve_model
    from enginecore.tokenizer import load_tokenizer

    src = resolve_model(None if spec in (None, "embedded") else spec)
    return load_tokenizer(src).hf


def build_requests(cfg: ServeConfig, client: httpx.Client, model: str, tokenizer,
                   dataset_path: str | None = None) -> tuple[list[SampleRequest], str]:
    """The benchmark's prompts and how their lengths were measured."""
    server = probe_tokenizer_endpoint(cfg, client, model)
    if server is not None:
        source, count = server
    elif tokenizer is not None:
        source, count = "local tokenizer", (lambda s: len(tokenizer.encode(s, add_special_tokens=False)))
    else:
        source, count = "estimate (1 token per word)", None
    if dataset_path:
        return load_jsonl_requests(dataset_path, cfg.random_output_len, count, cfg.num_prompts), source
    builder = TextPromptBuilder(word_pool(tokenizer), count, seed=cfg.seed)
    bar = None
    if not cfg.disable_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=cfg.num_prompts, desc=f"prompts ({source})", dynamic_ncols=True, leave=False)
    try:
        reqs = builder.build(cfg.num_prompts, cfg.random_input_len, cfg.random_output_len, cfg.random_range_ratio,
                             cfg.random_prefix_len, bar)
    finally:
        if bar:
            bar.close()
    return reqs, source


# ---- one request ----------------------------------------------------------------------


def request_body(cfg: ServeConfig, model: str, req: SampleRequest) -> dict:
    body: dict = {"model": model, "max_tokens": req.expected_output_len, "stream": True,
                  "stream_options": {"include_usage": True}}
    if cfg.endpoint.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.temperature is not None:
        body["temperature"] = cfg.temperature
    body.update(cfg.extra_body)
    return body


def _chunk_output(choice: dict) -> tuple[bool, str]:
    """(does this chunk carry a generated token, its text).

    Completions: any chunk but a bare finish chunk (a token whose text is held back
    still counts). Chat: only deltas with content (the first, role-only delta is not output).
    """
    if "text" in choice:
        text = choice.get("text") or ""
        return bool(text) or choice.get("finish_reason") is None, text
    text = (choice.get("delta") or {}).get("content") or ""
    return bool(text), text


async def send_request(client: httpx.AsyncClient, cfg: ServeConfig, model: str, req: SampleRequest,
                       count_tokens: Callable[[str], int] | None) -> RequestRecord:
    """Stream one request, stamping every chunk that carries output (see _chunk_output)."""
    rec = RequestRecord(prompt_len=req.prompt_len, start_time=time.perf_counter())
    usage_tokens = None
    try:
        async with client.stream("POST", cfg.url(cfg.endpoint), json=request_body(cfg, model, req)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {body[:300]}"
                return rec
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    rec.error = f"stream error: {str(obj['error'])[:300]}"
                    return rec
                now = time.perf_counter()
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                    rec.server_prompt_tokens = obj["usage"].get("prompt_tokens")
                for ch in obj.get("choices") or []:
                    is_output, text = _chunk_output(ch)
                    if is_output:
                        rec.chunk_times.append(now)
                        rec.generated_text += text
                        break
        rec.end_time = time.perf_counter()
    except (httpx.HTTPError, json.JSONDecodeError, asyncio.TimeoutError) as e:
        detail = str(e) or "the connection was closed or reset (server overloaded or its backlog full?)"
        rec.error = f"{type(e).__name__}: {detail}"[:300]
        return rec
    if not rec.chunk_times:
        rec.error = "the stream ended without output"
        return rec
    if usage_tokens:
        rec.output_tokens = int(usage_tokens)
    elif count_tokens is not None:
        rec.output_tokens = count_tokens(rec.generated_text)
    else:
        rec.output_tokens = len(rec.chunk_times)
    rec.success = True
    return rec


async def _bounded(coro, timeout: float, rec_factory: Callable[[], RequestRecord]) -> RequestRecord:
    try:
        return await asyncio.wait_for(coro, timeout)
    except asyncio.TimeoutError:
        rec = rec_factory()
        rec.error = f"no complete response within --request-timeout {timeout:.0f} s"
        return rec


async def run_requests(cfg: ServeConfig, model: str, reqs: Sequence[SampleRequest], max_concurrency: int | None,
                       count_tokens: Callable[[str], int] | None, desc: str = "requests") -> tuple[list[RequestRecord], float]:
    """Send reqs on cfg's schedule with at most max_concurrency in flight; returns records and duration."""
    offsets = arrival_offsets(len(reqs), cfg.request_rate, cfg.burstiness, cfg.seed)
    conns = max_concurrency or len(reqs)
    timeout = httpx.Timeout(cfg.request_timeout, connect=10.0)
    limits = httpx.Limits(max_connections=conns + 1, max_keepalive_connections=conns + 1)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = None
    if not cfg.disable_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=len(reqs), desc=desc, dynamic_ncols=True, leave=False)

    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        async def one(req: SampleRequest) -> RequestRecord:
            async def go() -> RequestRecord:
                return await _bounded(send_request(client, cfg, model, req, count_tokens), cfg.request_timeout,
                                      lambda: RequestRecord(req.prompt_len, time.perf_counter()))
            if sem is None:
                rec = await go()
            else:
                async with sem:
                    rec = await go()
            if bar:
                bar.update(1)
            return rec

        start = time.perf_counter()
        tasks = []
        async for _, req in paced(list(reqs), offsets):
            tasks.append(asyncio.create_task(one(req)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    if bar:
        bar.close()
    return records, duration


# ---- whole runs ------------------------------------------------------------------------


def prepare(cfg: ServeConfig, dataset_path: str | None = None) -> tuple[str, list[SampleRequest], str, Callable | None]:
    """Wait for the server, pick the model, build prompts. Returns (model, requests, tokenize source, counter)."""
    with httpx.Client() as client:
        models = wait_ready(cfg, client)
        model = cfg.model or (models[0] if models else None)
        if model is None:
            raise RuntimeError(f"{cfg.url('/v1/models')} lists no model; pass --model")
        tok = load_local_tokenizer(cfg.tokenizer, model)
        reqs, source = build_requests(cfg, client, model, tok, dataset_path)
    counter = (lambda s: len(tok.encode(s, add_special_tokens=False))) if tok is not None else None
    return model, reqs, source, counter


def run_serve(cfg: ServeConfig, model: str, reqs: Sequence[SampleRequest], source: str,
              counter: Callable | None, max_concurrency: int | None,
              probe: SampleRequest | None = None) -> ServeResult:
    """One benchmark run. Unless cfg.skip_test_run, one test request goes first (`probe`, default reqs[0];
    pass a prompt of its own to keep it out of the server's prefix cache)."""
    if not cfg.skip_test_run:
        probe = probe or reqs[0]
        probe = SampleRequest(probe.prompt, probe.prompt_len, min(probe.expected_output_len, 8))
        rec, _ = asyncio.run(run_requests(
            dataclasses.replace(cfg, request_rate=math.inf, disable_tqdm=True),
            model, [probe], 1, counter))
        if not rec[0].success:
            raise RuntimeError(f"the test request failed: {rec[0].error}")
    desc = f"concurrency {max_concurrency}" if max_concurrency else "requests"
    records, duration = asyncio.run(run_requests(cfg, model, reqs, max_concurrency, counter, desc))
    metrics = compute_serve_metrics(records, duration, cfg.percentiles)
    return ServeResult(metrics, records, model, max_concurrency, source)


def plot_sweep(results: Sequence[ServeResult], path: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [r.max_concurrency for r in results]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    ax.plot(xs, [r.metrics.output_throughput for r in results], "o-", label="output tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("max concurrency")
    ax.set_ylabel("output tokens/s")
    ax.grid(True, alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(xs, [r.metrics.ttft_ms.median for r in results], "s--", color="tab:red", label="median TTFT (ms)")
    ax2.set_ylabel("median TTFT (ms)", color="tab:red")
    ax.set_title(title, fontsize=9)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def sweep_table(results: Sequence[ServeResult]) -> str:
    rows = [[r.max_concurrency, r.metrics.completed, r.metrics.failed, r.metrics.request_throughput,
             r.metrics.output_throughput, r.metrics.ttft_ms.median, r.metrics.tpot_ms.median,
             r.metrics.itl_ms.median, r.metrics.e2el_ms.median] for r in results]
    return format_table(["concurrency", "ok", "failed", "req/s", "out tok/s", "TTFT med ms", "TPOT med ms",
                         "ITL med ms", "E2EL med ms"], rows)


# ---- CLI ---------------------------------------------------------------------------------


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="benchmark a running OpenAI-compatible server (vllm bench serve)",
                       description="Stream requests to an OpenAI-compatible server and report TTFT/TPOT/ITL/E2EL.")
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (default: --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions", choices=("/v1/completions", "/v1/chat/completions"))
    p.add_argument("--model", default=None, help="default: the first model of /v1/models")
    p.add_argument("--tokenizer", default=None, help="local tokenizer (HF folder, .gguf, or 'embedded')")
    p.add_argument("--dataset-name", default="random", choices=("random", "jsonl"))
    p.add_argument("--dataset-path", default=None, help='JSONL: {"prompt": ..., "output_len": ...} per line')
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s; inf sends all at once")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--sweep-concurrency", default=None, metavar="1,4,16,64",
                   help="run once per max concurrency and plot output throughput against it")
    p.add_argument("--plot-path", default=None, help="PNG of the sweep (default: in --result-dir)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metric-percentiles", dest="percentiles", default="99",
                   help="comma-separated percentiles to report (default 99)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds for one request, stream included")
    p.add_argument("--ready-check-timeout-sec", dest="ready_timeout", type=float, default=60.0)
    p.add_argument("--skip-test-run", action="store_true")
    p.add_argument("--save-result", action="store_true", help="save the JSON result in --result-dir")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--output-json", default=None, help="write the JSON result to this path")
    p.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=serve_main)


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    if args.dataset_name == "jsonl" and not args.dataset_path:
        raise SystemExit("--dataset-name jsonl needs --dataset-path")
    return ServeConfig(
        base_url=args.base_url or f"http://{args.host}:{args.port}", endpoint=args.endpoint, model=args.model,
        num_prompts=args.num_prompts, request_rate=args.request_rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos, temperature=args.temperature,
        extra_body=args.extra_body or {}, random_input_len=args.random_input_len,
        random_output_len=args.random_output_len, random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len, seed=args.seed, tokenizer=args.tokenizer,
        request_timeout=args.request_timeout, ready_timeout=args.ready_timeout,
        percentiles=tuple(float(x) for x in str(args.percentiles).split(",") if x),
        disable_tqdm=args.disable_tqdm, skip_test_run=args.skip_test_run,
    )


def serve_main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    levels = parse_int_list(args.sweep_concurrency) if args.sweep_concurrency else [args.max_concurrency]
    jsonl = args.dataset_path if args.dataset_name == "jsonl" else None
    # random prompts: fresh ones for every sweep level and for the test request, so no run is helped by
    # the server's prefix cache holding another run's prompts (a JSONL dataset is reused as it is)
    n = cfg.num_prompts
    model, pool, source, counter = prepare(dataclasses.replace(cfg, num_prompts=n if jsonl else n * len(levels) + 1),
                                           jsonl)
    probe = None if jsonl else pool[-1]
    lens = [r.prompt_len for r in pool]
    print(f"model {model} at {cfg.base_url}{cfg.endpoint}; {n} prompts per run, input tokens "
          f"{min(lens)}..{max(lens)} (measured by {source}); request rate {cfg.request_rate}, "
          f"burstiness {cfg.burstiness}")
    results = []
    for i, c in enumerate(levels):
        reqs = pool if jsonl else pool[i * n : (i + 1) * n]
        if c and c > len(reqs):
            print(f"note: concurrency {c} exceeds --num-prompts {len(reqs)}; it is never reached")
        res = run_serve(cfg, model, reqs, source, counter, c, probe)
        results.append(res)
        print(format_serve_metrics(res.metrics, extra={"Maximum request concurrency": c or "unlimited"},
                                   title="Serving Benchmark Result"))
        failed = [r.error for r in res.records if not r.success]
        if failed:
            print(f"first error of {len(failed)}: {failed[0]}")
    out = {"runs": [r.to_dict(cfg) for r in results]} if len(results) > 1 else results[0].to_dict(cfg)
    if len(results) > 1:
        print(sweep_table(results))
        stamp = time.strftime("%Y%m%d-%H%M%S")
        plot = args.plot_path or os.path.join(args.result_dir, f"bench-serve-sweep-{stamp}.png")
        plot_sweep(results, plot, f"{model} @ {cfg.base_url}: {cfg.random_input_len} in / "
                                  f"{cfg.random_output_len} out, {len(reqs)} prompts")
        out["plot"] = plot
        print(f"plot: {plot}")
    if args.save_result:
        name = args.result_filename or f"bench-serve-{os.path.basename(model)}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        print(f"saved {write_json(os.path.join(args.result_dir, name), out)}")
    if args.output_json:
        print(f"saved {write_json(args.output_json, out)}")
    return 0 if all(r.metrics.completed for r in results) else 1
