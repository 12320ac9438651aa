"""What flows between scheduler, runner and frontends (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from enginecore.sampling_params import SamplingParams


# ---- scheduler -> runner -------------------------------------------------------
#
# The runner keeps its own copy of every running request (token ids, block table,
# sampling parameters) and appends the tokens it samples itself. The scheduler
# sends a request whole once (new, or resumed after preemption), and afterwards
# only what it decides: new blocks, the number of computed tokens, and the end of
# the request (finished, aborted or preempted: the runner drops its row).


@dataclass
class NewRequestData:
    """A request the runner has not seen (or one resumed after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int]  # non-empty when resumed after preemption
    seed: int
    sample_index: int


@dataclass
class CachedRequestData:
    """Requests the runner already holds, as parallel lists (one entry per scheduled request)."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)  # blocks allocated this step (often [])
    num_computed_tokens: list[int] = field(default_factory=list)  # tokens in the cache before this step


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens this step (new and cached requests)
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished or aborted since the last step: drop them
    preempted_req_ids: set[str]  # preempted this step: drop them (they come back as new)
    # req_id -> num_computed_tokens after this step, for the requests whose step fills blocks
    # that may be published to the prefix cache once it has run
    computed_after: dict[str, int] = field(default_factory=dict)
    # structured outputs: the constrained requests that sample this step and their allowed next tokens
    structured_output_request_ids: list[str] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None  # [len(structured_output_request_ids), ceil(V / 32)] i32

    @property
    def has_work(self) -> bool:
        """Anything for the runner: tokens to compute or rows to drop."""
        return bool(self.total_num_scheduled_tokens or self.finished_req_ids or self.preempted_req_ids)


# ---- runner -> scheduler --------------------------------------------------------


@dataclass
class LogprobsLists:
    """Per sampled token: ids [k+1] (sampled first), logprobs [k+1], rank of the sampled one."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # one list per request: [] while a prompt is still being prefilled in chunks
    sampled_token_ids: list[list[int]]
    logprobs: list[LogprobsLists | None] | None = None
    # req_id -> per prompt position (the first has none): LogprobsLists of the prompt token
    prompt_logprobs: dict[str, list[LogprobsLists | None]] = field(default_factory=dict)


# ---- engine core -> frontends --------------------------------------------------


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsLists] | None = None
    prompt_logprobs: list[LogprobsLists | None] | None = None
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # time.monotonic() in the engine when its step's message was sent (the process mode's wire sets it; None: when
    # the output processor takes it). Token latencies are measured from it, as vLLM's from its engine timestamps:
    # the API process may read several steps' messages at once.
    timestamp: float | None = None


# ---- user-facing (LLM.generate, the frontend) ----------------------------------


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # per generated token: {token_id: Logprob}
    logprobs: list[dict[int, "Logprob"]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict | None = None
