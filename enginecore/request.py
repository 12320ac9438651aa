"""A request's lifecycle inside the engine core (vLLM's `Request`)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from enginecore.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    # an exception while processing this request alone (vLLM's FINISHED_ERROR); the others go on
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


@dataclass
class Request:
    """One sequence being generated. `n > 1` requests are split into n of these."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    # Seeded draws are keyed by (seed, sample_index, position): see sampling_ref.
    seed: int = 0
    sample_index: int = 0
    max_tokens: int = 16  # resolved (max_model_len - prompt when max_tokens is None)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit of the first schedule, -1 before
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # sampled tokens of steps still in flight (asynchronous scheduling): scheduled, values not back yet
    num_output_placeholders: int = 0
    # block hashes of full blocks of all_token_ids, extended lazily
    block_hashes: list = field(default_factory=list)
    # engine side: the structured-output state (enginecore.structured_outputs.RequestGrammar) of a
    # constrained request; never sent over the wire
    grammar: object = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def sort_key(self) -> tuple:
        return (self.priority, self.arrival_time)
