"""Prometheus metrics with vLLM's names, and the periodic one-line stats log.

Counters carry Prometheus's `_total` suffix on the wire, as vLLM's do
(`vllm:prompt_tokens_total`). Gauges come from the engine's `SchedulerStats`
(pushed after every engine step that changed them); counters and histograms
from the per-request events the engine client reports, token latencies (TTFT,
inter-token) by the times the engine sent its steps' outputs, as vLLM's go by
its engine timestamps. xlaserve adds `xlaserve:kv_cache_*_blocks` gauges so
`free + used == total` can be checked from outside, and
`xlaserve:num_requests_rejected` (HTTP requests refused before they were queued:
`overloaded` beyond --max-waiting-requests, `shutting_down` after SIGTERM), which
vLLM has no name for. Requests that failed on their own (an exception while
processing their output) count as `vllm:request_success{finished_reason="error"}`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from enginecore.scheduler import SchedulerStats

logger = logging.getLogger("xlaserve.stats")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


def _token_buckets(max_model_len: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_model_len:
                return out
            out.append(v)
        exp += 1


class EngineMetrics:
    """One engine core's series (vLLM's `engine` label under data parallelism); the engine client's observer of
    that core: its stats and the events of the requests it ran."""

    def __init__(self, fam: dict, labels: dict):
        def child(name):
            return fam[name].labels(**labels)

        self.running = child("running")
        self.waiting = child("waiting")
        self.kv_usage = child("kv_usage")
        self.free_blocks = child("free_blocks")
        self.used_blocks = child("used_blocks")
        self.total_blocks = child("total_blocks")
        self.prefix_queries = child("prefix_queries")
        self.prefix_hits = child("prefix_hits")
        self.preemptions = child("preemptions")
        self.structured_requests = child("structured_requests")
        self.grammar_compiles = child("grammar_compiles")
        self.grammar_compile_seconds = child("grammar_compile_seconds")
        self.prompt_tokens = child("prompt_tokens")
        self.generation_tokens = child("generation_tokens")
        self._success_family, self._labels = fam["success"], labels
        self.success = {reason: fam["success"].labels(**labels, finished_reason=reason)
                        for reason in ServerMetrics.FINISH_REASONS}
        self.ttft = child("ttft")
        self.itl = child("itl")
        self.e2e = child("e2e")
        self.req_prompt = child("req_prompt")
        self.req_generation = child("req_generation")
        # plain running totals for the stats logger
        self.total_prompt_tokens = 0
        self.total_generation_tokens = 0
        self.stats = SchedulerStats()
        self._last_engine = SchedulerStats()

    # ---- StatsObserver -----------------------------------------------------------------

    def on_engine_stats(self, s: SchedulerStats) -> None:
        self.running.set(s.num_running_reqs)
        self.waiting.set(s.num_waiting_reqs)
        self.kv_usage.set(s.kv_cache_usage)
        self.free_blocks.set(s.num_free_blocks)
        self.used_blocks.set(s.num_used_blocks)
        self.total_blocks.set(s.num_total_blocks)
        last = self._last_engine
        for counter, new, old in (
            (self.prefix_queries, s.prefix_cache_queries, last.prefix_cache_queries),
            (self.prefix_hits, s.prefix_cache_hits, last.prefix_cache_hits),
            (self.preemptions, s.num_preemptions, last.num_preemptions),
            (self.structured_requests, s.num_structured_requests, last.num_structured_requests),
            (self.grammar_compiles, s.num_grammar_compiles, last.num_grammar_compiles),
            (self.grammar_compile_seconds, s.grammar_compile_seconds, last.grammar_compile_seconds),
        ):
            if new > old:
                counter.inc(new - old)
        self._last_engine = s
        self.stats = s

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.total_prompt_tokens += num_prompt_tokens

    def on_inter_token(self, latency_s: float) -> None:
        self.itl.observe(latency_s)

    def on_generation_tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)
        self.total_generation_tokens += n

    def on_finished(self, reason: str, e2e_s: float, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        c = self.success.get(reason)
        if c is None:
            c = self.success[reason] = self._success_family.labels(**self._labels, finished_reason=reason)
        c.inc()
        self.e2e.observe(e2e_s)
        self.req_prompt.observe(num_prompt_tokens)
        self.req_generation.observe(num_generation_tokens)


class ServerMetrics:
    """Owns a private registry (no global state). `engines`: the data-parallel ranks of the cores this server
    drives; with more than one every engine series carries vLLM's `engine` label ("0", "1", ...) and
    `engine(i)` is the i-th core's observer; one core keeps the unlabelled series, and the server's own
    methods and attributes are that core's (it is the engine client's observer)."""

    FINISH_REASONS = ("stop", "length", "abort", "error")
    REJECT_REASONS = ("overloaded", "shutting_down")

    def __init__(self, model_name: str, max_model_len: int, num_blocks: int = 0, block_size: int = 16,
                 engines: list[int] | None = None):
        self.registry = CollectorRegistry()
        ranks = list(engines) if engines and len(engines) > 1 else [None]
        labels = ["model_name"] + (["engine"] if ranks[0] is not None else [])
        r = self.registry

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r)

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        tb = _token_buckets(max_model_len)
        fam = dict(
            running=gauge("vllm:num_requests_running", "Requests in the running batch."),
            waiting=gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled."),
            kv_usage=gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent."),
            free_blocks=gauge("xlaserve:kv_cache_free_blocks", "Free KV-cache blocks (excluding the null block)."),
            used_blocks=gauge("xlaserve:kv_cache_used_blocks", "KV-cache blocks held by requests."),
            total_blocks=gauge("xlaserve:kv_cache_total_blocks", "Usable KV-cache blocks: free + used."),
            prefix_queries=counter("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens."),
            prefix_hits=counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens."),
            preemptions=counter("vllm:num_preemptions", "Cumulative preemptions."),
            structured_requests=counter("xlaserve:structured_output_requests",
                                        "Requests (sequences) with a structured-output constraint."),
            grammar_compiles=counter("xlaserve:grammar_compiles", "Grammars compiled (cache misses)."),
            grammar_compile_seconds=counter("xlaserve:grammar_compile_seconds",
                                            "Time spent compiling structured-output grammars."),
            prompt_tokens=counter("vllm:prompt_tokens", "Prompt tokens of requests that started generating."),
            generation_tokens=counter("vllm:generation_tokens", "Generated tokens."),
            success=Counter("vllm:request_success", "Finished requests, by finish reason.",
                            labels + ["finished_reason"], registry=r),
            ttft=hist("vllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS),
            itl=hist("vllm:inter_token_latency_seconds", "Time between consecutive tokens.", _ITL_BUCKETS),
            e2e=hist("vllm:e2e_request_latency_seconds", "Arrival to finish.", _E2E_BUCKETS),
            req_prompt=hist("vllm:request_prompt_tokens", "Prompt length of finished requests.", tb),
            req_generation=hist("vllm:request_generation_tokens", "Generated tokens of finished requests.", tb),
        )
        self.engines = [EngineMetrics(fam, {"model_name": model_name} if rank is None else
                                      {"model_name": model_name, "engine": str(rank)}) for rank in ranks]
        rejected = Counter("xlaserve:num_requests_rejected", "HTTP requests refused before they were queued, by "
                           "reason (overloaded: --max-waiting-requests reached; shutting_down).",
                           ["model_name", "reason"], registry=r)
        self.rejected = {reason: rejected.labels(model_name=model_name, reason=reason)
                         for reason in self.REJECT_REASONS}
        info = Gauge("vllm:cache_config_info", "KV-cache configuration.", ["block_size", "num_gpu_blocks"],
                     registry=r)
        self._cache_info = info
        self.set_cache_info(num_blocks, block_size)

    def __getattr__(self, name):  # one core: its series and observer methods are the server's
        return getattr(self.__dict__["engines"][0], name)

    def engine(self, index: int) -> EngineMetrics:
        return self.engines[index]

    @property
    def stats(self) -> SchedulerStats:
        """Every core's stats summed (the stats log, /load)."""
        from frontend.dp_router import sum_stats

        return sum_stats([e.stats for e in self.engines])

    @property
    def total_prompt_tokens(self) -> int:
        return sum(e.total_prompt_tokens for e in self.engines)

    @property
    def total_generation_tokens(self) -> int:
        return sum(e.total_generation_tokens for e in self.engines)

    def set_cache_info(self, num_blocks: int, block_size: int) -> None:
        self._cache_info.clear()
        self._cache_info.labels(block_size=str(block_size), num_gpu_blocks=str(num_blocks)).set(1)

    def on_rejected(self, reason: str) -> None:
        self.rejected[reason].inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatsLogger:
    """Logs one line every `interval` seconds while there is activity (vLLM's LoggingStatLogger)."""

    def __init__(self, metrics: ServerMetrics, interval: float = 10.0):
        self.metrics = metrics
        self.interval = interval
        self._last_t = time.monotonic()
        self._last_prompt = 0
        self._last_gen = 0
        self._last_queries = 0
        self._last_hits = 0
        self._was_idle = True

    def log_once(self) -> str | None:
        m, now = self.metrics, time.monotonic()
        dt = max(now - self._last_t, 1e-9)
        s = m.stats
        prompt_tp = (m.total_prompt_tokens - self._last_prompt) / dt
        gen_tp = (m.total_generation_tokens - self._last_gen) / dt
        dq = s.prefix_cache_queries - self._last_queries
        dh = s.prefix_cache_hits - self._last_hits
        idle = prompt_tp == 0 and gen_tp == 0 and s.num_running_reqs == 0 and s.num_waiting_reqs == 0
        line = None
        if not (idle and self._was_idle):
            line = (f"Avg prompt throughput: {prompt_tp:.1f} tokens/s, Avg generation throughput: {gen_tp:.1f} "
                    f"tokens/s, Running: {s.num_running_reqs} reqs, Waiting: {s.num_waiting_reqs} reqs, "
                    f"KV cache usage: {100 * s.kv_cache_usage:.1f}% ({s.num_used_blocks}/{s.num_total_blocks} "
                    f"blocks), Prefix cache hit rate: {100 * dh / dq if dq > 0 else 0.0:.1f}%")
            logger.info("%s", line)
        self._was_idle = idle
        self._last_t, self._last_prompt, self._last_gen = now, m.total_prompt_tokens, m.total_generation_tokens
        self._last_queries, self._last_hits = s.prefix_cache_queries, s.prefix_cache_hits
        return line

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.log_once()
