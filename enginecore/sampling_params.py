"""SamplingParams: vLLM's fields, defaults and validation ranges.

The exact sampling semantics (order of processors, the seeded draw) are
specified executable in `enginecore.sampling_ref`; both backends implement
them and are tested against it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from enginecore.sampling_ref import GREEDY_EPS

DEFAULT_MAX_LOGPROBS = 20


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class SamplingParamsError(ValueError):
    """An invalid sampling parameter; `param` names the field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's `StructuredOutputsParams` names): exactly one kind is set.

    Compiled to an llguidance grammar by `enginecore.structured_outputs`; the sampler masks
    the tokens the grammar does not allow.
    """

    json: dict | str | None = None  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance) or GBNF/EBNF grammar text
    json_object: bool = False  # any JSON object
    structural_tag: str | None = None
    whitespace_pattern: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    # Engine-internal: enforce only after the output contains this token sequence (the end of
    # the reasoning, set by the frontend's --reasoning-parser); None: from the first output token.
    start_after_token_ids: list[int] | None = None
    # Engine-internal: the request field the client gave the constraint in (set by the frontend), named
    # by a 400 when the constraint is invalid ("response_format", "guided_regex", "tools", ...).
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if isinstance(self.start_after_token_ids, tuple):
            self.start_after_token_ids = list(self.start_after_token_ids)
        if self.choice is not None:
            self.choice = list(self.choice)
        self._verify()

    def _set_kinds(self) -> list[str]:
        return [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) is not None and getattr(self, k) is not False]

    @property
    def kind(self) -> str:
        """The one constraint kind that is set ("json", "regex", ...)."""
        kinds = self._set_kinds()
        if not kinds:
            raise SamplingParamsError(f"{self.param} sets no constraint.", self.param)
        return kinds[0]

    def _verify(self) -> None:
        p = self.param
        set_kinds = self._set_kinds()
        if len(set_kinds) != 1:
            raise SamplingParamsError(
                f"{p} must set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}; got {set_kinds or 'none'}.", p)
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise SamplingParamsError(f"{p}.json must be a JSON schema object or string.", p)
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise SamplingParamsError(f"{p}.choice must be a non-empty list of strings.", p)
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise SamplingParamsError(f"{p}.{name} must be a string.", p)
        if self.start_after_token_ids is not None and not all(isinstance(t, int) for t in self.start_after_token_ids):
            raise SamplingParamsError(f"{p}.start_after_token_ids must be token ids.", p)


# set by the engine's callers, not a client's keys
ENGINE_INTERNAL_STRUCTURED_FIELDS = frozenset({"start_after_token_ids", "param"})


@dataclass
class SamplingParams:
    """Parameters for one generation request (vLLM's names and defaults)."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine: token ids of single-token bad words, all eos ids.
    _bad_words_token_ids: list[int] = field(default_factory=list, repr=False)
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise SamplingParamsError(f"logit_bias keys must be token ids: {e}", "logit_bias")
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise SamplingParamsError(f"structured_outputs: {e}", "structured_outputs")
        if self.best_of is None:
            self.best_of = self.n
        self._verify()
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(msg: str, param: str) -> None:
            raise SamplingParamsError(msg, param)

        if not isinstance(self.n, int) or self.n < 1:
            bad(f"n must be at least 1, got {self.n}.", "n")
        if self.best_of < self.n:
            bad(f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}.", "best_of")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.", "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.", "frequency_penalty")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.", "repetition_penalty")
        if self.temperature < 0.0:
            bad(f"temperature must be non-negative, got {self.temperature}.", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}.", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}.", "min_p")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**64):
            bad(f"seed must fit in 64 bits, got {self.seed}.", "seed")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens")
        if self.min_tokens < 0:
            bad(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.", "min_tokens")
        if self.logprobs is not None and self.logprobs < 0:
            bad(f"logprobs must be non-negative, got {self.logprobs}.", "logprobs")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.", "prompt_logprobs")
        if any(not s for s in self.stop):
            bad("stop cannot contain an empty string.", "stop")
        if self.stop and not self.detokenize:
            bad("stop strings are only supported when detokenize is True.", "stop")
        if self.logit_bias:
            for tok, b in self.logit_bias.items():
                if not -100.0 <= b <= 100.0:
                    bad(f"logit_bias values must be in [-100, 100], got {b} for token {tok}.", "logit_bias")
        if self.allowed_token_ids is not None and len(self.allowed_token_ids) == 0:
            bad("allowed_token_ids is not allowed to be empty.", "allowed_token_ids")

    # -- engine-side checks that need the model ------------------------------------

    def verify_for_model(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model's vocabulary and the engine's limits."""
        for name in ("logprobs", "prompt_logprobs"):
            val = getattr(self, name)
            if val is not None and max_logprobs >= 0 and val > max_logprobs:
                raise SamplingParamsError(
                    f"Requested {name} of {val}, which is greater than max allowed: {max_logprobs}", name
                )
        for name, ids in (
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("stop_token_ids", self.stop_token_ids or []),
            ("logit_bias", list((self.logit_bias or {}).keys())),
        ):
            for t in ids:
                if not 0 <= int(t) < vocab_size:
                    raise SamplingParamsError(
                        f"{name} contains out-of-vocab token id {t} (vocab size is {vocab_size}).", name
                    )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def uses_token_masks(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids or self._bad_words_token_ids or self.min_tokens)

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> "SamplingParams":
        """Build from kwargs, dropping None values so defaults apply."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None})
