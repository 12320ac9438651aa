"""`bench compare`'s report on fake token streams, and the in-process trace driver on a fake engine."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from frontend.bench.compare import TokenStream, compare_streams, first_divergence, format_agreement
from frontend.bench.datasets import SampleRequest
from frontend.bench.offline import run_trace


def lp(**kw) -> dict[int, float]:
    return {int(k[1:]): v for k, v in kw.items()}


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one stopped early
    assert first_divergence([], []) is None


def test_report_counts_and_divergence_at_known_position():
    same = [5, 6, 7, 8]
    a = [
        TokenStream("g0", "greedy", same, [lp(t5=-0.1)] * 4),
        # diverges at position 2: a picks 7 (-0.50) over 9 (-0.51): a near-tie in both
        TokenStream("g1", "greedy", [5, 6, 7, 1], [{}, {}, lp(t7=-0.50, t9=-0.51, t3=-2.0), {}]),
        TokenStream("s0", "seeded", [1, 2, 3], None),
        TokenStream("s1", "seeded", [1, 2, 3], [lp(t1=-1.0, t4=-3.0)] + [{}] * 2),
    ]
    b = [
        TokenStream("g0", "greedy", same, [lp(t5=-0.1)] * 4),
        TokenStream("g1", "greedy", [5, 6, 9, 2], [{}, {}, lp(t9=-0.49, t7=-0.52, t3=-2.0), {}]),
        TokenStream("s0", "seeded", [1, 2, 3], None),
        # diverges at position 0 with a large gap: a real disagreement
        TokenStream("s1", "seeded", [4, 2, 3], [lp(t4=-0.2, t1=-2.5)] + [{}] * 2),
    ]
    rep = compare_streams(a, b)
    modes = {m.mode: m for m in rep.by_mode}
    assert (modes["greedy"].identical, modes["greedy"].total) == (1, 2)
    assert (modes["seeded"].identical, modes["seeded"].total) == (1, 2)
    assert rep.identical == 2 and rep.total == 4
    assert modes["greedy"].mean_common_prefix == pytest.approx((1.0 + 2 / 4) / 2)
    d = {x.request_id: x for x in rep.divergences}
    g1 = d["g1"]
    assert (g1.position, g1.token_a, g1.token_b) == (2, 7, 9)
    assert g1.gap_a == pytest.approx(0.01) and g1.gap_b == pytest.approx(0.03)
    assert g1.near_tie
    assert g1.top_a[0] == (7, -0.50) and g1.top_b[0] == (9, -0.49)
    s1 = d["s1"]
    assert s1.position == 0 and s1.gap_a == pytest.approx(2.0) and not s1.near_tie
    text = format_agreement(rep, ("jax", "torch"), decode=lambda t: f"w{t}")
    assert "1/2" in text and "near-tie" in text and "REAL" in text and "7:'w7'=-0.500" in text


def test_report_when_one_stream_stops_early_and_mismatched_traces():
    rep = compare_streams([TokenStream("r", "greedy", [1, 2])], [TokenStream("r", "greedy", [1, 2, 3])])
    (d,) = rep.divergences
    assert d.position == 2 and d.token_a is None and d.token_b == 3 and d.gap_a is None
    assert "<end>" in format_agreement(rep, ("a", "b"))
    with pytest.raises(ValueError, match="same trace"):
        compare_streams([TokenStream("x", "greedy", [1])], [TokenStream("y", "greedy", [1])])


# ---- the in-process trace driver, on a fake engine --------------------------------------


@dataclass
class _Out:  # the parts of RequestOutput run_trace reads
    request_id: str
    outputs: list
    finished: bool


@dataclass
class _Comp:
    token_ids: list
    text: str
    logprobs: list | None
    finish_reason: str | None


@dataclass
class _Lp:
    logprob: float


class FakeEngine:
    """Emits one token per step per request (token = step count), with logprobs when asked."""

    def __init__(self):
        self.live: dict[str, list] = {}

    def add_request(self, rid, prompt, sp):
        assert sp.output_kind.name == "DELTA"
        self.live[rid] = [sp.max_tokens, 0, sp.logprobs]

    def has_unfinished_requests(self):
        return bool(self.live)

    def abort_request(self, ids):
        for i in ids:
            self.live.pop(i, None)

    def step(self):
        outs = []
        for rid, st in list(self.live.items()):
            st[1] += 1
            done = st[1] >= st[0]
            lps = [{st[1]: _Lp(-0.1), 0: _Lp(-3.0)}] if st[2] is not None else None
            outs.append(_Out(rid, [_Comp([st[1]], f" t{st[1]}", lps, "length" if done else None)], done))
            if done:
                del self.live[rid]
        return outs


def test_run_trace_records_tokens_timings_and_logprobs():
    from enginecore.sampling_params import SamplingParams

    reqs = [SampleRequest([1, 2, 3], 3, 4), SampleRequest([4, 5], 2, 2)]
    params = [SamplingParams(max_tokens=4, logprobs=2), SamplingParams(max_tokens=2)]
    ticks = iter(range(1000))
    res, dur = run_trace(FakeEngine(), reqs, params, offsets=[0.0, 0.0], use_tqdm=False,
                         clock=lambda: float(next(ticks)))
    a, b = res
    assert a.token_ids == [1, 2, 3, 4] and a.finish_reason == "length" and a.text == " t1 t2 t3 t4"
    assert a.top_logprobs == [{1: -0.1, 0: -3.0}, {2: -0.1, 0: -3.0}, {3: -0.1, 0: -3.0}, {4: -0.1, 0: -3.0}]
    assert b.top_logprobs is None and b.token_ids == [1, 2]
    for r in res:
        assert r.record.success and r.record.output_tokens == len(r.token_ids)
        assert len(r.record.chunk_times) == len(r.token_ids) and r.record.ttft > 0 and dur > 0
