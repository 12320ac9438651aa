"""A finished step's numpy results -> `ModelRunnerOutput`, and the sampled tokens into the runner's rows.

Both runners end a step here: they copy the device results to the host (one
copy where they can) and call `finish_step`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from enginecore.input_batch import InputBatch
from enginecore.outputs import LogprobsLists, ModelRunnerOutput
from enginecore.step_batch import StepBatch

_NO_TOKENS: list[int] = []  # shared by every request that samples nothing this step (never mutated)


@dataclass
class SampledLogprobs:
    """Logprobs of the raw distribution for each request row (numpy, >= R rows)."""

    topk_ids: np.ndarray  # [Rp, N] i32
    topk_logprobs: np.ndarray  # [Rp, N] f32
    sampled_logprobs: np.ndarray  # [Rp] f32
    sampled_ranks: np.ndarray  # [Rp] i32 (1 = most likely)


@dataclass
class PromptLogprobs:
    """One request's prompt logprobs for the positions of its `PromptLogprobsSlice` (numpy)."""

    target_logprobs: np.ndarray  # [n] f32 logprob of each next prompt token
    target_ranks: np.ndarray  # [n] i32
    topk_ids: np.ndarray  # [n, k] i32
    topk_logprobs: np.ndarray  # [n, k] f32


def finish_step(
    ib: InputBatch,
    batch: StepBatch,
    sampled: np.ndarray,  # [>= R] i32 sampled token per request row (rows that sample nothing: ignored)
    logprobs: SampledLogprobs | None = None,
    prompt_logprobs: dict[str, PromptLogprobs] | None = None,
) -> ModelRunnerOutput:
    idx = batch.sample_index
    toks = sampled[idx].astype(np.int32, copy=False)
    ib.record_sampled(batch.rows[idx], batch.sample_generations, batch.sample_positions, toks)
    R = batch.num_reqs
    sampled_lists: list[list[int]] = [_NO_TOKENS] * R
    idx_l = idx.tolist()
    for i, t in zip(idx_l, toks.tolist()):
        sampled_lists[i] = [t]
    lps = None
    if logprobs is not None and batch.sampling.num_logprobs >= 0:
        n = batch.sampling.num_logprobs
        lps = [None] * R
        ids, vals = logprobs.topk_ids[:, :n].tolist(), logprobs.topk_logprobs[:, :n].tolist()
        tok_lp, ranks = logprobs.sampled_logprobs.tolist(), logprobs.sampled_ranks.tolist()
        for i, t in zip(idx_l, toks.tolist()):
            lps[i] = LogprobsLists([t] + ids[i], [tok_lp[i]] + vals[i], int(ranks[i]))
    plp_out: dict[str, list[LogprobsLists | None]] = {}
    for sl in batch.prompt_logprobs:
        p = prompt_logprobs[sl.req_id]
        k = sl.num_logprobs
        tgt, tl, rk = sl.target_ids.tolist(), p.target_logprobs.tolist(), p.target_ranks.tolist()
        ids, vals = p.topk_ids[:, :k].tolist(), p.topk_logprobs[:, :k].tolist()
        plp_out[sl.req_id] = [LogprobsLists([tgt[j]] + ids[j], [tl[j]] + vals[j], int(rk[j]))
                              for j in range(sl.num_tokens)]
    return ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=sampled_lists, logprobs=lps,
                             prompt_logprobs=plp_out)


def empty_output() -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])


class PendingStep:
    """A launched step: `device` holds its results still on the way; `result()` finishes it once.

    `finish(step) -> ModelRunnerOutput` waits for the device arrays, copies them to the host and
    calls `finish_step`; the engine asks results in launch order.
    """

    def __init__(self, finish, batch: StepBatch, **device):
        self._finish = finish
        self.batch = batch
        self.device = device
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._finish(self)
            self.device = {}
        return self._output


class DoneStep:
    """A step whose output is already on the host (the synchronous path, or nothing to compute)."""

    def __init__(self, output: ModelRunnerOutput):
        self._output = output

    def result(self) -> ModelRunnerOutput:
        return self._output
