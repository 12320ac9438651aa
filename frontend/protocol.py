"""OpenAI API request / response models (pydantic), with vLLM's extra sampling parameters.

Requests accept unknown fields (logged and ignored, as vLLM does); types and
ranges that pydantic can check are checked here (HTTP 400 via the
RequestValidationError handler); everything that needs the model or the
engine's limits is checked by `SamplingParams` / `InputProcessor`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from enginecore.sampling_params import RequestOutputKind, SamplingParams


def random_id() -> str:
    return uuid.uuid4().hex


def _optional(default=None):
    """A response field that is left out of the JSON while None (vLLM extensions, delta fields)."""
    return Field(default, exclude_if=lambda v: v is None)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


# ---- shared pieces -------------------------------------------------------------------


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = _optional()


class SamplingFields(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's and vLLM's extras)."""

    # NaN / Infinity are valid in Python's JSON: a NaN temperature or logit bias is a 400, not silent garbage
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: int = 0
    request_id: str = Field(default_factory=random_id)
    return_token_ids: bool | None = None
    # structured outputs (frontend/structured_outputs.py): OpenAI's response_format, vLLM's object, and its
    # deprecated guided_* fields
    response_format: dict | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    @field_validator("stream_options", mode="before")
    @classmethod
    def _stream_options_need_stream(cls, v, info: ValidationInfo):
        # vLLM's rule (a non-empty stream_options without stream is a 400): silently ignoring it would hide a
        # client bug, e.g. a usage chunk that never comes
        if v and not info.data.get("stream"):
            raise ValueError("stream_options can only be set when stream is true")
        return v

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any], prompt_logprobs: int | None
    ) -> SamplingParams:
        """Request -> SamplingParams. `defaults`: the model's generation-config defaults."""

        from frontend.structured_outputs import request_constraint

        def pick(name: str, fallback):
            v = getattr(self, name)
            return v if v is not None else defaults.get(name, fallback)

        return SamplingParams(
            n=self.n,
            best_of=self.best_of,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick("repetition_penalty", 1.0),
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=request_constraint(self),
        )


# ---- /v1/completions ---------------------------------------------------------------------


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, dict] | None] | None = _optional()
    token_ids: list[int] | None = _optional()
    prompt_token_ids: list[int] | None = _optional()


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _optional()
    prompt_token_ids: list[int] | None = _optional()


class CompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions ------------------------------------------------------------------


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | {"type": "function", ...}
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True  # vLLM: false drops the reasoning (--reasoning-parser) from the answer
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_flags(self) -> "ChatCompletionRequest":
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        return self


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str
    content: str | None = None
    # --reasoning-parser: `reasoning` is current vLLM's field, `reasoning_content` its earlier name (DeepSeek's)
    reasoning: str | None = _optional()
    reasoning_content: str | None = _optional()
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _optional()


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, dict] | None] | None = _optional()
    prompt_token_ids: list[int] | None = _optional()
    system_fingerprint: str | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = _optional()
    content: str | None = _optional()
    reasoning: str | None = _optional()
    reasoning_content: str | None = _optional()
    tool_calls: list[dict[str, Any]] | None = _optional()  # OpenAI's incremental shape (index, id, function)


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _optional()


class ChatCompletionStreamResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenizer endpoints ------------------------------------------------------------


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "xlaserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    # xlaserve's additions (OpenAI clients keep unknown fields): every parameter, and those one token reads (a
    # Mixture-of-Experts model's top-k experts; the same for a dense model)
    num_params: int | None = None
    num_active_params: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # as in chat requests: the template sees them
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_of(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
