"""One step's sampling inputs, per request row, padded to the request bucket.

Plain rows need only per-row scalars and the seeded draw (`uniform`, see
`sampling_ref.seeded_uniform`), gathered from the InputBatch's arrays in a few
vectorized numpy operations. Rows that use penalties or token masks add dense
[Rp, V] arrays, built from their incrementally kept `TokenState`; those arrays
exist only in steps that have such rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from enginecore.sampling_ref import GREEDY_EPS, seeded_uniform
from enginecore.structured_outputs import bitmask_width


@dataclass
class SamplingBatch:
    """Per request row (padded rows are greedy and their results ignored)."""

    temperature: np.ndarray  # [Rp] f32; rows < GREEDY_EPS are greedy
    top_k: np.ndarray  # [Rp] i32; 0 = off
    top_p: np.ndarray  # [Rp] f32
    min_p: np.ndarray  # [Rp] f32
    uniform: np.ndarray  # [Rp] f32 the seeded draw for this step
    all_greedy: bool
    needs_filtering: bool  # some non-greedy row uses top-k, top-p or min-p
    num_logprobs: int  # top-N logprobs to return; -1: no row asked for logprobs
    # None unless some row uses them:
    bias: np.ndarray | None = None  # [Rp, V] f32 additive token masks
    output_counts: np.ndarray | None = None  # [Rp, V] f32
    prompt_mask: np.ndarray | None = None  # [Rp, V] bool
    presence: np.ndarray | None = None  # [Rp] f32
    frequency: np.ndarray | None = None  # [Rp] f32
    repetition: np.ndarray | None = None  # [Rp] f32
    # structured outputs: packed allowed tokens, -1 (all allowed) on unconstrained rows
    token_bitmask: np.ndarray | None = None  # [Rp, ceil(V / 32)] i32

    @property
    def masked(self) -> bool:
        """Some row is constrained by a grammar this step."""
        return self.token_bitmask is not None

    @property
    def processed(self) -> bool:
        """Some row needs the [Rp, V] bias / penalty inputs."""
        return self.bias is not None or self.output_counts is not None

    @property
    def plain_greedy(self) -> bool:
        """Every row takes the argmax of its raw logits: no token masks, penalties, biases or logprobs."""
        return self.all_greedy and self.num_logprobs < 0 and not self.masked and not self.processed


def filled(n: int, value, dtype) -> np.ndarray:
    """np.full(n, value, dtype) at about half its cost (np.full is Python around np.empty and np.copyto; a step's
    batch is built of such small arrays, every step)."""
    out = np.empty(n, dtype)
    out.fill(value)
    return out


def _pad(a: np.ndarray, n: int, fill, dtype) -> np.ndarray:
    out = filled(n, fill, dtype)
    out[: len(a)] = a
    return out


def make_sampling_batch(ib, rows: np.ndarray, kv: np.ndarray, Rp: int, req_ids: list[str] | None = None,
                        so=None) -> SamplingBatch:
    """`ib`: the InputBatch; `rows` [R]: the batch's rows; `kv` [R]: the position of the token each would sample;
    `req_ids` [R] and the SchedulerOutput `so`: where the grammar bitmask rows go."""
    R = len(rows)
    temp = _pad(ib.temperature.take(rows), Rp, 0.0, np.float32)
    greedy = temp[:R] < GREEDY_EPS
    all_greedy = bool(greedy.all())
    top_k = _pad(ib.top_k.take(rows), Rp, 0, np.int32)
    top_p = _pad(ib.top_p.take(rows), Rp, 1.0, np.float32)
    min_p = _pad(ib.min_p.take(rows), Rp, 0.0, np.float32)
    if all_greedy:
        uniform = filled(Rp, 0.5, np.float32)
        needs_filtering = False
    else:
        uniform = _pad(seeded_uniform(ib.seed.take(rows), ib.sample_index.take(rows), kv), Rp, 0.5, np.float32)
        needs_filtering = bool(np.any(~greedy & ((top_k[:R] > 0) | (top_p[:R] < 1.0) | (min_p[:R] > 0.0))))
    num_logprobs = -1
    if ib.wants_logprobs.take(rows).any():
        num_logprobs = max(ib.params[r].logprobs for r in rows.tolist() if ib.wants_logprobs[r])
    sb = SamplingBatch(temp, top_k, top_p, min_p, uniform, all_greedy, needs_filtering, num_logprobs)
    if ib.token_state:
        _add_processed(sb, ib, rows, kv, Rp)
    if so is not None and so.grammar_bitmask is not None:
        sb.token_bitmask = scatter_bitmask(so.grammar_bitmask, so.structured_output_request_ids, req_ids, Rp,
                                           ib.vocab_size)
    return sb


def scatter_bitmask(bitmask: np.ndarray, bitmask_req_ids: list[str], req_ids: list[str], Rp: int,
                    vocab_size: int) -> np.ndarray | None:
    """The scheduler's [n, W'] bitmask rows into the batch's padded rows [Rp, ceil(V / 32)] (-1 elsewhere).

    W' may differ from the model's width (the grammar's vocabulary is the tokenizer's, at least V):
    extra words are cut, missing ones allow nothing."""
    W = bitmask_width(vocab_size)
    where = {rid: j for j, rid in enumerate(bitmask_req_ids)}
    out = np.full((Rp, W), -1, np.int32)
    hit = False
    w = min(W, bitmask.shape[1])
    for i, rid in enumerate(req_ids):
        j = where.get(rid)
        if j is not None:
            out[i, :w] = bitmask[j, :w]
            out[i, w:] = 0
            hit = True
    return out if hit else None


def _add_processed(sb: SamplingBatch, ib, rows: np.ndarray, kv: np.ndarray, Rp: int) -> None:
    states = [(i, row, ib.token_state[row]) for i, row in enumerate(rows.tolist()) if row in ib.token_state]
    if not states:
        return
    V = ib.vocab_size
    if any(st.has_bias for _, _, st in states):
        sb.bias = np.zeros((Rp, V), np.float32)
        for i, row, st in states:
            if st.has_bias:
                P = int(ib.num_prompt[row])
                st.bias(sb.bias[i], ib.token_ids[row, P : int(kv[i])])
    if any(st.counts is not None for _, _, st in states):
        sb.output_counts = np.zeros((Rp, V), np.float32)
        sb.prompt_mask = np.zeros((Rp, V), bool)
        sb.presence = np.zeros(Rp, np.float32)
        sb.frequency = np.zeros(Rp, np.float32)
        sb.repetition = np.ones(Rp, np.float32)
        for i, row, st in states:
            if st.counts is None:
                continue
            p = st.params
            sb.output_counts[i] = st.counts
            sb.prompt_mask[i] = st.prompt_mask
            sb.presence[i], sb.frequency[i], sb.repetition[i] = p.presence_penalty, p.frequency_penalty, \
                p.repetition_penalty
