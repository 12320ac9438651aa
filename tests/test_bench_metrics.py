"""The metric math of `xlaserve bench`: TTFT/TPOT/ITL/E2EL from known timestamps, percentiles, aggregation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from frontend.bench.metrics import (
    RequestRecord,
    compute_serve_metrics,
    format_serve_metrics,
    peak_output_rate,
    percentile,
    summarize,
)


def stream(start, ttft, gaps, tokens=None, prompt_len=10):
    """A request sent at `start`, first chunk after `ttft`, then chunks `gaps` apart, ending at the last chunk."""
    times = [start + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(prompt_len=prompt_len, start_time=start, chunk_times=times,
                         output_tokens=tokens if tokens is not None else len(times), end_time=times[-1], success=True)


def test_single_request_ttft_itl_tpot_e2el():
    r = stream(100.0, 0.5, [0.1, 0.2, 0.3])
    assert r.ttft == pytest.approx(0.5)
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2el == pytest.approx(1.1)
    # (E2EL - TTFT) / (tokens - 1) = 0.6 / 3
    assert r.tpot == pytest.approx(0.2)


def test_tpot_counts_tokens_not_chunks():
    # 2 chunks but 5 tokens (a server that batches tokens per chunk): TPOT divides by tokens - 1
    r = stream(0.0, 1.0, [0.8], tokens=5)
    assert r.itl == pytest.approx([0.8])
    assert r.tpot == pytest.approx(0.8 / 4)


def test_one_token_has_no_tpot_and_no_itl():
    r = stream(0.0, 0.3, [])
    assert r.tpot is None and r.itl == [] and r.ttft == pytest.approx(0.3)


def test_percentile_is_linear_interpolation():
    v = [1.0, 2.0, 3.0, 4.0]
    assert percentile(v, 50) == pytest.approx(2.5)
    assert percentile(v, 0) == 1.0 and percentile(v, 100) == 4.0
    assert percentile(v, 99) == pytest.approx(np.percentile(v, 99))
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="101"):
        percentile(v, 101)


def test_summarize_drops_none_and_handles_empty():
    s = summarize([1.0, None, 3.0], (50, 99))
    assert s.count == 2 and s.mean == 2.0 and s.median == 2.0 and s.p(50) == 2.0
    e = summarize([], (99,))
    assert e.count == 0 and math.isnan(e.mean) and math.isnan(e.p(99))


def test_aggregate_metrics_from_synthetic_streams():
    recs = [
        stream(0.0, 0.1, [0.05] * 9, prompt_len=100),  # 10 tokens, e2el 0.55
        stream(0.0, 0.3, [0.10] * 4, prompt_len=50),  # 5 tokens, e2el 0.7
        RequestRecord(prompt_len=7, start_time=0.0, error="HTTP 500"),  # failed: not counted
    ]
    m = compute_serve_metrics(recs, duration_s=2.0, percentiles=(50, 99))
    assert (m.completed, m.failed) == (2, 1)
    assert m.total_input_tokens == 150 and m.total_output_tokens == 15
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(7.5)
    assert m.total_token_throughput == pytest.approx(82.5)
    assert m.ttft_ms.mean == pytest.approx(200.0) and m.ttft_ms.median == pytest.approx(200.0)
    # TPOT per request: 0.45/9 = 50 ms and 0.4/4 = 100 ms
    assert m.tpot_ms.mean == pytest.approx(75.0)
    # ITL: all 13 gaps pooled (9 x 50 ms, 4 x 100 ms)
    assert m.itl_ms.count == 13
    assert m.itl_ms.mean == pytest.approx((9 * 50 + 4 * 100) / 13)
    assert m.itl_ms.median == pytest.approx(50.0)
    assert m.e2el_ms.p(99) == pytest.approx(np.percentile([550.0, 700.0], 99))
    d = m.to_dict()
    assert d["median_ttft_ms"] == pytest.approx(200.0) and "p99_itl_ms" in d and d["completed"] == 2
    text = format_serve_metrics(m)
    assert "Successful requests:" in text and "Median TPOT (ms):" in text and "P99 ITL (ms):" in text


def test_peak_output_rate_counts_busiest_second():
    recs = [stream(0.0, 0.05, [0.1] * 9), stream(0.5, 0.05, [0.1] * 9), stream(3.0, 0.05, [0.1])]
    peak, conc = peak_output_rate(recs)
    # second [0, 1): all 10 chunks of request 0 (0.05..0.95) and 5 of request 1 (0.55..0.95)
    assert peak == pytest.approx(10 + 5)
    assert conc == 2


def test_duration_must_be_positive():
    with pytest.raises(ValueError, match="duration"):
        compute_serve_metrics([], 0.0)
