"""msgpack encoding of what crosses the API <-> engine-core socket.

API -> engine messages (tuples):
    ("add", parent_id, [request, ...])   the n children of one API request
    ("abort", [child_id, ...])
    ("call", call_id, method, args)      utility calls (reset_prefix_cache, ...)
    ("shutdown",)
Engine -> API messages (dicts, every key optional but e):
    e: int                            the sending core's data-parallel rank (0 without data parallelism); a
                                      message of `e` alone: an idle core is alive (every 2 s)
    hello: pid                        once, as soon as the core connected (before it loads the model)
    ready: {num_blocks}               once, after the runner is warm
    startup_error: str                instead of ready
    outputs: [engine core output, ...]
    acks: [(parent_id, None | (error kind, message)), ...]
    results: [(call_id, ok, value), ...]
    stats: {SchedulerStats fields}    when they changed since the last message
    dead: str                         the step loop failed; the engine is gone
"""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np

from enginecore.outputs import EngineCoreOutput, LogprobsLists
from enginecore.request import Request
from enginecore.sampling_params import RequestOutputKind, SamplingParams
from enginecore.scheduler import SchedulerStats

_SP_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_"))
_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerStats))


def _default(obj):
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


def pack(obj) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)


def encode_sampling_params(sp: SamplingParams) -> dict:
    d = {name: getattr(sp, name) for name in _SP_FIELDS}
    d["output_kind"] = int(sp.output_kind)
    if sp.structured_outputs is not None:
        d["structured_outputs"] = dataclasses.asdict(sp.structured_outputs)
    d["_bad_words_token_ids"] = [list(x) for x in sp._bad_words_token_ids]
    d["_all_stop_token_ids"] = sorted(sp._all_stop_token_ids)
    return d


def decode_sampling_params(d: dict) -> SamplingParams:
    d = dict(d)
    bad = d.pop("_bad_words_token_ids", [])
    stops = d.pop("_all_stop_token_ids", [])
    d["output_kind"] = RequestOutputKind(d.get("output_kind", 0))
    sp = SamplingParams(**d)
    sp._bad_words_token_ids = bad
    sp._all_stop_token_ids = set(stops)
    return sp


def encode_request(r: Request) -> tuple:
    return (r.request_id, r.prompt_token_ids, encode_sampling_params(r.sampling_params), list(r.eos_token_ids),
            r.arrival_time, r.priority, r.seed, r.sample_index, r.max_tokens)


def decode_request(t) -> Request:
    rid, ids, sp, eos, arrival, priority, seed, sample_index, max_tokens = t
    return Request(request_id=rid, prompt_token_ids=list(ids), sampling_params=decode_sampling_params(sp),
                   eos_token_ids=tuple(eos), arrival_time=arrival, priority=priority, seed=seed,
                   sample_index=sample_index, max_tokens=max_tokens)


def _enc_lp(lp: LogprobsLists | None):
    return None if lp is None else (lp.token_ids, lp.logprobs, lp.rank)


def _dec_lp(t) -> LogprobsLists | None:
    return None if t is None else LogprobsLists(list(t[0]), list(t[1]), int(t[2]))


def encode_output(o: EngineCoreOutput) -> tuple:
    return (
        o.request_id,
        o.new_token_ids,
        None if o.new_logprobs is None else [_enc_lp(lp) for lp in o.new_logprobs],
        None if o.prompt_logprobs is None else [_enc_lp(lp) for lp in o.prompt_logprobs],
        o.finish_reason,
        o.stop_reason,
        o.num_cached_tokens,
    )


def decode_output(t, timestamp: float | None = None) -> EngineCoreOutput:
    rid, toks, lps, plps, finish, stop, cached = t
    return EngineCoreOutput(
        request_id=rid,
        new_token_ids=list(toks),
        new_logprobs=None if lps is None else [_dec_lp(x) for x in lps],
        prompt_logprobs=None if plps is None else [_dec_lp(x) for x in plps],
        finish_reason=finish,
        stop_reason=stop,
        num_cached_tokens=cached,
        timestamp=timestamp,
    )


def encode_stats(s: SchedulerStats) -> dict:
    return {name: getattr(s, name) for name in _STATS_FIELDS}


def decode_stats(d: dict) -> SchedulerStats:
    return SchedulerStats(**{k: v for k, v in d.items() if k in _STATS_FIELDS})
