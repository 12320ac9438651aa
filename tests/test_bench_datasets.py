"""Benchmark datasets and the arrival schedule: lengths, range ratio, determinism, bounds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from frontend.bench.arrivals import arrival_offsets
from frontend.bench.datasets import (
    TextPromptBuilder,
    length_range,
    load_jsonl_requests,
    random_token_requests,
    word_pool,
)


def test_random_fixed_lengths_and_vocab():
    reqs = random_token_requests(20, 128, 64, vocab_size=1000, seed=3, exclude_ids=[0, 1, 2])
    assert len(reqs) == 20
    for r in reqs:
        assert len(r.prompt) == r.prompt_len == 128 and r.expected_output_len == 64
        assert all(3 <= t < 1000 for t in r.prompt)


def test_random_range_ratio_bounds_and_spread():
    lo, hi = length_range(100, 0.25)
    assert (lo, hi) == (75, 125)
    reqs = random_token_requests(400, 100, 40, vocab_size=500, range_ratio=0.25, seed=0)
    ins = [r.prompt_len for r in reqs]
    outs = [r.expected_output_len for r in reqs]
    assert min(ins) >= 75 and max(ins) <= 125 and min(outs) >= 30 and max(outs) <= 50
    assert len(set(ins)) > 20  # actually spread over the range
    assert abs(np.mean(ins) - 100) < 3
    with pytest.raises(ValueError, match="range-ratio"):
        length_range(100, 1.0)


def test_random_prefix_is_shared_and_counted():
    reqs = random_token_requests(5, 10, 4, vocab_size=300, prefix_len=16, seed=1)
    first = reqs[0].prompt[:16]
    assert all(r.prompt[:16] == first and r.prompt_len == 26 for r in reqs)
    assert len({tuple(r.prompt[16:]) for r in reqs}) == 5


def test_random_is_deterministic_per_seed():
    a = random_token_requests(4, 32, 8, 1000, 0.5, 4, seed=7)
    b = random_token_requests(4, 32, 8, 1000, 0.5, 4, seed=7)
    c = random_token_requests(4, 32, 8, 1000, 0.5, 4, seed=8)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]


def test_jsonl_dataset(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join([
        json.dumps({"prompt": "one two three", "output_len": 5}),
        "",
        json.dumps({"prompt": [5, 6, 7, 8]}),
    ]))
    reqs = load_jsonl_requests(str(p), default_output_len=9, count_tokens=lambda s: len(s.split()))
    assert [(r.prompt_len, r.expected_output_len) for r in reqs] == [(3, 5), (4, 9)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_jsonl_requests(str(bad), 4)
    with pytest.raises(ValueError, match="output_len"):
        load_jsonl_requests(str(p), None)


def test_text_prompt_builder_hits_exact_count():
    # a counter where some words are 2 tokens: the builder must still land on the target
    def count(text: str) -> int:
        return sum(2 if len(w) > 6 else 1 for w in text.split()) + 1  # +1: a BOS the server adds

    b = TextPromptBuilder(word_pool(None), count, seed=0)
    reqs = b.build(10, 126, 64)
    assert all(r.prompt_len == 126 and count(r.prompt) == 126 for r in reqs)
    # without a counter: one token per word
    reqs = TextPromptBuilder(word_pool(None), None, seed=0).build(3, 50, 8, range_ratio=0.2)
    assert all(40 <= r.prompt_len <= 60 and len(r.prompt.split()) == r.prompt_len for r in reqs)


# ---- arrival schedule ---------------------------------------------------------------


def test_arrivals_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    assert arrival_offsets(0, 3.0) == []


def test_arrivals_poisson_bounded_seeded_and_monotone():
    a = arrival_offsets(200, request_rate=4.0, burstiness=1.0, seed=11)
    assert a == arrival_offsets(200, 4.0, 1.0, seed=11)
    assert a != arrival_offsets(200, 4.0, 1.0, seed=12)
    assert all(x <= y for x, y in zip(a, a[1:])) and a[0] > 0
    assert a[-1] == pytest.approx(200 / 4.0)  # rescaled: the schedule ends at n / rate


def test_arrivals_burstiness_changes_regularity():
    def cv(b):
        gaps = np.diff([0.0] + arrival_offsets(4000, 10.0, b, seed=0))
        return gaps.std() / gaps.mean()

    assert cv(1.0) == pytest.approx(1.0, abs=0.1)  # Poisson: exponential gaps
    assert cv(0.25) == pytest.approx(2.0, abs=0.25)  # gamma shape k: cv = 1/sqrt(k)
    assert cv(16.0) == pytest.approx(0.25, abs=0.05)
    assert np.allclose(np.diff(arrival_offsets(10, 2.0, math.inf)), 0.5)


def test_arrivals_reject_bad_values():
    with pytest.raises(ValueError, match="request-rate"):
        arrival_offsets(3, 0.0)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(3, 1.0, burstiness=0.0)
