"""The metric math of `xlaserve bench`, with no I/O: per-request timings -> the numbers people compare.

Definitions follow `vllm bench serve` so results line up with theirs:

- TTFT: first chunk that carried output minus the time the request was sent.
- ITL: gaps between consecutive output-carrying chunks (a chunk may hold
  several tokens; the gap is still one ITL sample, as in vLLM).
- TPOT: (E2EL - TTFT) / (output_tokens - 1), for requests with more than one
  output token.
- E2EL: end of the response minus the time the request was sent.

All times are seconds on one monotonic clock; reports convert to ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

DEFAULT_PERCENTILES = (10.0, 25.0, 50.0, 75.0, 90.0, 99.0)


@dataclass
class RequestRecord:
    """What one request looked like from the client (or the in-process driver)."""

    prompt_len: int
    start_time: float  # when the request was sent / added
    chunk_times: list[float] = field(default_factory=list)  # arrival of each output-carrying chunk
    output_tokens: int = 0  # tokens generated (server usage, or counted)
    end_time: float | None = None  # end of the response
    success: bool = False
    error: str = ""
    generated_text: str = ""
    server_prompt_tokens: int | None = None  # usage.prompt_tokens, when the server reports it

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start_time if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2el(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.start_time

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1 or self.ttft is None or self.e2el is None:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Summary:
    """mean / median / std / chosen percentiles of one metric (same unit as the input)."""

    count: int
    mean: float
    median: float
    std: float
    percentiles: dict[float, float]

    def p(self, q: float) -> float:
        return self.percentiles[float(q)]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default, as vLLM uses); nan for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if len(values) == 0:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize(values: Iterable[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> Summary:
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    if v.size == 0:
        return Summary(0, math.nan, math.nan, math.nan, {float(q): math.nan for q in percentiles})
    return Summary(
        count=int(v.size),
        mean=float(v.mean()),
        median=float(np.median(v)),
        std=float(v.std()),
        percentiles={float(q): float(np.percentile(v, q)) for q in percentiles},
    )


@dataclass(frozen=True)
class ServeMetrics:
    """What `vllm bench serve` reports, computed from request records."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # generated tokens / s
    total_token_throughput: float  # (input + generated) tokens / s
    ttft_ms: Summary
    tpot_ms: Summary
    itl_ms: Summary
    e2el_ms: Summary
    max_output_tokens_per_s: float  # best one-second bucket
    max_concurrent_requests: int  # requests in flight in that busiest second

    def to_dict(self) -> dict:
        """Flat keys named as in vLLM's --save-result JSON."""
        d = {
            "completed": self.completed,
            "failed": self.failed,
            "duration": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "max_output_tokens_per_s": self.max_output_tokens_per_s,
            "max_concurrent_requests": self.max_concurrent_requests,
        }
        for name, s in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms), ("itl", self.itl_ms), ("e2el", self.e2el_ms)):
            d[f"mean_{name}_ms"] = s.mean
            d[f"median_{name}_ms"] = s.median
            d[f"std_{name}_ms"] = s.std
            for q, v in s.percentiles.items():
                d[f"p{q:g}_{name}_ms"] = v
        return d


def _ms(values: Iterable[float | None]) -> list[float]:
    return [v * 1000.0 for v in values if v is not None]


def peak_output_rate(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """Busiest one-second bucket of output chunks and the requests in flight then (vLLM's 'peak')."""
    ok = [r for r in records if r.success and r.end_time is not None]
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    n = int(math.ceil(max(r.end_time for r in ok) - t0)) + 1
    tokens = np.zeros(n)
    inflight = np.zeros(n)
    for r in ok:
        # spread a request's tokens evenly over its chunks (a chunk may hold several)
        per_chunk = r.output_tokens / len(r.chunk_times) if r.chunk_times else 0.0
        for t in r.chunk_times:
            b = int(t - t0)
            if 0 <= b < n:
                tokens[b] += per_chunk
        inflight[int(r.start_time - t0) : int(r.end_time - t0) + 1] += 1
    i = int(np.argmax(tokens))
    return float(tokens[i]), int(inflight[i])


def compute_serve_metrics(
    records: Sequence[RequestRecord], duration_s: float, percentiles: Sequence[float] = (99.0,)
) -> ServeMetrics:
    if duration_s <= 0:
        raise ValueError(f"benchmark duration must be positive, got {duration_s}")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    itls: list[float] = []
    for r in ok:
        itls.extend(r.itl)
    peak, peak_conc = peak_output_rate(ok)
    return ServeMetrics(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft_ms=summarize(_ms(r.ttft for r in ok), percentiles),
        tpot_ms=summarize(_ms(r.tpot for r in ok), percentiles),
        itl_ms=summarize(_ms(itls), percentiles),
        e2el_ms=summarize(_ms(r.e2el for r in ok), percentiles),
        max_output_tokens_per_s=peak,
        max_concurrent_requests=peak_conc,
    )


def format_serve_metrics(m: ServeMetrics, title: str = "Serving Benchmark Result", extra: dict | None = None) -> str:
    """The block `vllm bench serve` prints, same labels."""
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(label: str, value) -> None:
        v = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{label:<40}{v:<10}")

    for k, v in (extra or {}).items():
        row(k + ":", v)
    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", m.duration_s)
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s)
    row("Peak concurrent requests:", m.max_concurrent_requests)
    row("Total Token throughput (tok/s):", m.total_token_throughput)
    for name, header, s in (
        ("TTFT", "Time to First Token", m.ttft_ms),
        ("TPOT", "Time per Output Token (excl. 1st token)", m.tpot_ms),
        ("ITL", "Inter-token Latency", m.itl_ms),
        ("E2EL", "End-to-end Latency", m.e2el_ms),
    ):
        lines.append(f"{header:-^{w}}")
        row(f"Mean {name} (ms):", s.mean)
        row(f"Median {name} (ms):", s.median)
        for q, v in s.percentiles.items():
            row(f"P{q:g} {name} (ms):", v)
    lines.append("=" * w)
    return "\n".join(lines)
