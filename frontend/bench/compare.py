"""`xlaserve bench compare`: one request trace through two backends, speed and token agreement side by side.

The report logic is a pure function over token streams (`compare_streams`),
so it is tested without a model. For each request pair it finds the first
position where the generated tokens differ and shows both backends' top
logprobs there; the logprob gap between the two chosen tokens tells a
near-tie (numerics: reductions in another order, another dtype) from a real
disagreement (a bug).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from frontend.bench.arrivals import arrival_offsets
from frontend.bench.common import format_table, run_info, write_json
from frontend.bench.datasets import random_token_requests
from frontend.bench.engine_flags import add_engine_args, engine_kwargs
from frontend.bench.metrics import compute_serve_metrics


@dataclass
class TokenStream:
    """What one backend generated for one request."""

    request_id: str
    mode: str  # "greedy" or "seeded"
    token_ids: list[int]
    top_logprobs: list[dict[int, float]] | None = None  # per position: token id -> logprob (top-k + chosen)


@dataclass
class Divergence:
    request_id: str
    mode: str
    position: int  # first generated position where the two differ
    token_a: int | None  # None: stream a ended here
    token_b: int | None
    top_a: list[tuple[int, float]]  # a's top logprobs at that position, best first
    top_b: list[tuple[int, float]]
    gap_a: float | None  # in a's distribution: logprob(token_a) - logprob(token_b); None if b's token not in a's top
    gap_b: float | None  # in b's distribution: logprob(token_b) - logprob(token_a)

    @property
    def near_tie(self) -> bool:
        return self.gap_a is not None and self.gap_b is not None and max(self.gap_a, self.gap_b) < _NEAR_TIE


_NEAR_TIE = 0.05  # nats: both backends rank the two tokens within this of each other


@dataclass
class ModeAgreement:
    mode: str
    total: int
    identical: int
    mean_common_prefix: float  # fraction of the shorter stream that matched before the first difference

    @property
    def fraction(self) -> float:
        return self.identical / self.total if self.total else math.nan


@dataclass
class CompareReport:
    by_mode: list[ModeAgreement]
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(m.total for m in self.by_mode)

    @property
    def identical(self) -> int:
        return sum(m.identical for m in self.by_mode)


def _top(d: dict[int, float] | None) -> list[tuple[int, float]]:
    return sorted((d or {}).items(), key=lambda kv: -kv[1])


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, len(shorter) if one is a strict prefix, None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _at(lps: list[dict[int, float]] | None, i: int) -> dict[int, float] | None:
    return lps[i] if lps is not None and i < len(lps) else None


def compare_streams(a: Sequence[TokenStream], b: Sequence[TokenStream]) -> CompareReport:
    """Pair streams by request id and report agreement per mode and every first divergence."""
    b_by_id = {s.request_id: s for s in b}
    missing = [s.request_id for s in a if s.request_id not in b_by_id]
    if missing or len(a) != len(b):
        raise ValueError(f"the two runs hold different requests (e.g. {missing[:3]}); compare needs the same trace")
    modes: dict[str, list] = {}
    divs: list[Divergence] = []
    for sa in a:
        sb = b_by_id[sa.request_id]
        pos = first_divergence(sa.token_ids, sb.token_ids)
        shorter = min(len(sa.token_ids), len(sb.token_ids)) or 1
        modes.setdefault(sa.mode, []).append((pos is None, (shorter if pos is None else pos) / shorter))
        if pos is None:
            continue
        ta = sa.token_ids[pos] if pos < len(sa.token_ids) else None
        tb = sb.token_ids[pos] if pos < len(sb.token_ids) else None
        la, lb = _at(sa.top_logprobs, pos), _at(sb.top_logprobs, pos)
        gap_a = la[ta] - la[tb] if la and ta in la and tb in la else None
        gap_b = lb[tb] - lb[ta] if lb and ta in lb and tb in lb else None
        divs.append(Divergence(sa.request_id, sa.mode, pos, ta, tb, _top(la), _top(lb), gap_a, gap_b))
    by_mode = [
        ModeAgreement(m, len(v), sum(1 for same, _ in v if same), sum(f for _, f in v) / len(v))
        for m, v in modes.items()
    ]
    divs.sort(key=lambda d: (d.mode, d.position, d.request_id))
    return CompareReport(by_mode, divs)


def format_agreement(report: CompareReport, names: tuple[str, str],
                     decode: Callable[[int], str] | None = None, max_rows: int = 20) -> str:
    """Counts per mode, then the divergence table (near-ties marked)."""
    def tok(t: int | None) -> str:
        if t is None:
            return "<end>"
        return f"{t}:{decode(t)!r}" if decode else str(t)

    def tops(lst: list[tuple[int, float]]) -> str:
        return " ".join(f"{tok(t)}={v:.3f}" for t, v in lst[:5]) or "-"

    lines = ["Token agreement (identical outputs, per sampling mode)"]
    rows = [[m.mode, f"{m.identical}/{m.total}", f"{100 * m.fraction:.1f}%", m.total - m.identical,
             f"{100 * m.mean_common_prefix:.1f}%"] for m in report.by_mode]
    rows.append(["all", f"{report.identical}/{report.total}",
                 f"{100 * report.identical / report.total:.1f}%" if report.total else "-",
                 report.total - report.identical, ""])
    lines.append(format_table(["mode", "identical", "%", "diverged", "mean matched prefix"], rows))
    if not report.divergences:
        lines.append("No divergences.")
        return "\n".join(lines)
    ties = sum(d.near_tie for d in report.divergences)
    lines.append("")
    lines.append(f"First divergence per differing request ({ties} of {len(report.divergences)} are near-ties: "
                 f"both backends put the two tokens within {_NEAR_TIE} nats)")
    a, b = names
    drows = []
    for d in report.divergences[:max_rows]:
        gap = lambda g: "n/a" if g is None else f"{g:.3f}"  # noqa: E731
        drows.append([d.request_id, d.mode, d.position, tok(d.token_a), tok(d.token_b), gap(d.gap_a), gap(d.gap_b),
                      "near-tie" if d.near_tie else "REAL"])
    lines.append(format_table(["request", "mode", "pos", f"{a} token", f"{b} token", f"{a} gap", f"{b} gap", "kind"],
                              drows))
    lines.append("")
    lines.append(f"Top logprobs at the divergence ({a} | {b}):")
    for d in report.divergences[:max_rows]:
        lines.append(f"  {d.request_id} pos {d.position}: {a}: {tops(d.top_a)}")
        lines.append(f"  {' ' * len(d.request_id)} {' ' * len(str(d.position))}      {b}: {tops(d.top_b)}")
    if len(report.divergences) > max_rows:
        lines.append(f"  ... {len(report.divergences) - max_rows} more in --output-json")
    return "\n".join(lines)


# ---- running it ------------------------------------------------------------------------


def add_compare_parser(sub) -> None:
    p = sub.add_parser("compare", help="the same trace through two backends: speed and token agreement",
                       description="Run one request trace through each backend in-process, one after the other, "
                                   "and compare throughput, TTFT, TPOT and the generated tokens.")
    p.add_argument("--backends", default="jax,torch", help="two backends, comma-separated")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts; each runs once per mode")
    p.add_argument("--modes", default="greedy,seeded", help="greedy and/or seeded (sampling with a per-request seed)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--temperature", type=float, default=0.8, help="for seeded mode")
    p.add_argument("--top-p", type=float, default=0.95, help="for seeded mode")
    p.add_argument("--logprobs", type=int, default=5)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly --output-len tokens (default on)")
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per backend before giving up")
    p.add_argument("--warmup-tokens", type=int, default=4,
                   help="run the trace once with this many output tokens first, untimed (0: no warm-up)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    add_engine_args(p, skip=("backend",), defaults={"dtype": "float32"})
    p.set_defaults(func=compare_main)


def build_trace(args, vocab: int, special: list[int]):
    from enginecore.sampling_params import SamplingParams

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in ("greedy", "seeded")]
    if bad or not modes:
        raise SystemExit(f"--modes must list greedy and/or seeded, got {args.modes!r}")
    seed = getattr(args, "seed", 0)
    prompts = random_token_requests(args.num_prompts, args.input_len, args.output_len, vocab,
                                    args.random_range_ratio, 0, seed, special)
    reqs, params, labels = [], [], []
    for i, r in enumerate(prompts):
        for m in modes:
            common = dict(max_tokens=r.expected_output_len, logprobs=args.logprobs, ignore_eos=args.ignore_eos)
            sp = (SamplingParams(temperature=0.0, **common) if m == "greedy" else
                  SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=seed * 100003 + i, **common))
            reqs.append(r)
            params.append(sp)
            labels.append((f"{m[0]}{i}", m))
    return reqs, params, labels


def _with_max_tokens(sp, n: int):
    sp = sp.clone()
    sp.max_tokens = n
    sp.min_tokens = min(sp.min_tokens, n)
    return sp


def run_backend(backend: str, kwargs: dict, args, trace=None):
    """Build an engine for one backend and run the trace; returns (trace, results, duration, engine info)."""
    from enginecore.config import EngineArgs
    from enginecore.engine import LLMEngine

    from frontend.bench.common import special_token_ids
    from frontend.bench.offline import run_trace

    t0 = time.perf_counter()
    engine = LLMEngine.from_engine_args(EngineArgs.from_kwargs(**{**kwargs, "backend": backend}))
    load_s = time.perf_counter() - t0
    if trace is None:
        trace = build_trace(args, engine.model.config.vocab_size, special_token_ids(engine.tokenizer))
    reqs, params, _ = trace
    if args.warmup_tokens > 0:
        # the same shapes once, untimed, so programs compiled lazily are not in the timings; then
        # forget the prompts so the timed run does not hit the prefix cache
        warm = [dataclasses.replace(r, expected_output_len=args.warmup_tokens) for r in reqs]
        warm_params = [_with_max_tokens(p, args.warmup_tokens) for p in params]
        t0 = time.perf_counter()
        run_trace(engine, warm, warm_params, None, args.timeout, desc=f"{backend} warm-up",
                  use_tqdm=not args.disable_tqdm)
        load_s += time.perf_counter() - t0
        engine.core.reset_prefix_cache()
    offsets = arrival_offsets(len(reqs), args.request_rate, args.burstiness, getattr(args, "seed", 0))
    results, duration = run_trace(engine, reqs, params, offsets, args.timeout, desc=backend,
                                  use_tqdm=not args.disable_tqdm)
    info = {"backend": backend, "load_and_warmup_s": load_s, "dtype": engine.config.model_config.canonical_dtype,
            "platform": engine.config.device_config.platform, "model": engine.model.name,
            "num_blocks": getattr(engine.core, "num_blocks", None)}
    tok = engine.tokenizer
    decode = lambda t: tok.decode([t], skip_special_tokens=False)  # noqa: E731
    shutdown = getattr(engine.core, "shutdown", None)
    if shutdown:
        shutdown()
    del engine  # free this backend's weights and KV cache before the next one loads
    return trace, results, duration, info, decode


def compare_main(args: argparse.Namespace) -> int:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if len(backends) != 2:
        raise SystemExit(f"--backends needs exactly two backends, got {args.backends!r}")
    kwargs = engine_kwargs(args)
    trace = None
    runs = []
    for be in backends:
        trace, results, duration, info, decode = run_backend(be, kwargs, args, trace)
        runs.append((results, duration, info))
    _, _, labels = trace
    streams = [
        [TokenStream(labels[i][0], labels[i][1], r.token_ids, r.top_logprobs) for i, r in enumerate(results)]
        for results, _, _ in runs
    ]
    report = compare_streams(streams[0], streams[1])
    metrics = [compute_serve_metrics([r.record for r in results], dur, (99.0,)) for results, dur, _ in runs]
    a, b = backends if backends[0] != backends[1] else (f"{backends[0]}#1", f"{backends[1]}#2")
    dtypes = {info["dtype"] for _, _, info in runs}
    platform = runs[0][2]["platform"]
    print(f"=== xlaserve bench compare: {a} vs {b} ===")
    print(f"model {runs[0][2]['model']}, dtype {'/'.join(sorted(dtypes))}, platform {platform}; "
          f"{args.num_prompts} prompts x {args.modes} = {len(labels)} requests, {args.input_len} in / "
          f"{args.output_len} out, request rate {args.request_rate}")
    if platform == "cpu" and dtypes != {"float32"}:
        print("warning: not float32 on CPU; expect more near-tie divergences (float32 is recommended)")
    rows = []
    for label, get in (
        ("requests ok", lambda m: m.completed), ("duration s", lambda m: m.duration_s),
        ("requests/s", lambda m: m.request_throughput), ("output tok/s", lambda m: m.output_throughput),
        ("TTFT median ms", lambda m: m.ttft_ms.median), ("TTFT p99 ms", lambda m: m.ttft_ms.p(99)),
        ("TPOT median ms", lambda m: m.tpot_ms.median), ("TPOT p99 ms", lambda m: m.tpot_ms.p(99)),
        ("ITL median ms", lambda m: m.itl_ms.median),
    ):
        va, vb = get(metrics[0]), get(metrics[1])
        ratio = vb / va if isinstance(va, (int, float)) and va else math.nan
        rows.append([label, va, vb, ratio])
    rows.append(["load+warm-up s", runs[0][2]["load_and_warmup_s"], runs[1][2]["load_and_warmup_s"], math.nan])
    print(format_table(["", a, b, f"{b}/{a}"], rows))
    print()
    print(format_agreement(report, (a, b), decode=decode))
    if args.output_json:
        write_json(args.output_json, {
            "backends": backends, "engine_args": kwargs, "runs": [info for _, _, info in runs],
            "metrics": {be: m.to_dict() for be, m in zip((a, b), metrics)},
            "agreement": [vars(m) | {"fraction": m.fraction} for m in report.by_mode],
            "divergences": [vars(d) | {"near_tie": d.near_tie} for d in report.divergences],
            "tokens": {be: {s.request_id: s.token_ids for s in st} for be, st in zip((a, b), streams)},
            "info": run_info(),
        })
    return 0
