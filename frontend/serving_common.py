"""What both OpenAI endpoints share: errors, model names, options, request logging, SSE helpers."""

from __future__ import annotations

import asyncio
import codecs
import itertools
import json
import logging
import os
import re
from dataclasses import dataclass, field
from http import HTTPStatus

from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse

from enginecore.config import ConfigError, EngineConfig
from enginecore.model_loader import ModelSource
from enginecore.outputs import Logprob
from frontend.engine_client import AsyncEngineClient
from frontend.protocol import SamplingFields, UsageInfo, PromptTokenUsageInfo

logger = logging.getLogger("xlaserve.api")

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error with an HTTP status, rendered in OpenAI's shape."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type or _ERROR_TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")


def error_body(message: str, status: int, param: str | None = None, type: str | None = None) -> dict:
    err = APIError(message, status, param, type)
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}}


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


@dataclass
class FrontendOptions:
    """The Frontend flags the serving code needs (a plain copy of the parsed namespace)."""

    response_role: str = "assistant"
    chat_template: str | None = None
    chat_template_content_format: str = "auto"
    trust_request_chat_template: bool = False
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    return_tokens_as_token_ids: bool = False
    log_requests: bool = False
    max_log_len: int | None = None
    sampling_defaults: dict = field(default_factory=dict)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str | None = None


def resolve_chat_template(value: str | None) -> str | None:
    """--chat-template: a file, or the template itself (with \\n escapes, as vLLM reads it)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{" not in value and ("/" in value or value.endswith((".jinja", ".j2", ".jinja2"))):
        raise ConfigError(f"--chat-template {value!r}: no such file (give a file or an inline Jinja template)")
    template = codecs.decode(value, "unicode_escape")
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # parsing runs nothing; templates are rendered by transformers, in the same sandbox
        ImmutableSandboxedEnvironment().parse(template)
    except Exception as e:
        raise ConfigError(f"--chat-template: not a valid Jinja template ({e})") from None
    return template


_OPENAI_FORMAT = re.compile(r"""\bfor\s+\w+\s+in\s+\w+(\[['"]content['"]\]|\.content\b)""")


def detect_content_format(template: str | None) -> str:
    """'openai' when the template iterates over a message's content parts, else 'string'."""
    return "openai" if template and _OPENAI_FORMAT.search(template) else "string"


def load_sampling_defaults(config: EngineConfig, model: ModelSource) -> dict:
    """--generation-config: the model's default sampling parameters (vLLM applies them too)."""
    choice = config.model_config.generation_config
    if choice == "vllm":
        return {}
    folder = choice if choice != "auto" else (model.path if model.kind == "hf" else None)
    if not folder:
        return {}
    path = os.path.join(folder, "generation_config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    out = {k: cfg[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty") if k in cfg}
    if out:
        logger.info("default sampling parameters from %s: %s (use --generation-config vllm to ignore them)",
                    path, out)
    return out


class OpenAIServing:
    """Base of the completion and chat handlers."""

    def __init__(self, client: AsyncEngineClient, served_model_names: list[str], options: FrontendOptions):
        self.client = client
        self.served_model_names = served_model_names
        self.options = options
        self.tokenizer = client.tokenizer
        self.max_model_len = client.config.scheduler_config.max_model_len
        self._ids = itertools.count()

    def check_model(self, name: str | None) -> str:
        if name is None or name in self.served_model_names:
            return self.served_model_names[0] if name is None else name
        raise APIError(f"The model `{name}` does not exist.", 404, param="model")

    def base_request_id(self, raw: HTTPRequest | None, body_id: str | None) -> str:
        if raw is not None and raw.headers.get("x-request-id"):
            return raw.headers["x-request-id"]
        return body_id or f"{next(self._ids)}"

    def engine_request_id(self, public_id: str, index: int = 0) -> str:
        # public ids may repeat (clients choose them); engine ids never do
        return f"{public_id}-{index}-{next(self._ids)}"

    def warn_ignored_fields(self, req: SamplingFields) -> None:
        ignored = req.ignored_fields()
        if ignored:
            logger.warning("request fields ignored (not supported): %s", ", ".join(ignored))

    def log_request(self, request_id: str, prompt, params) -> None:
        if not self.options.log_requests:
            return
        n = self.options.max_log_len
        shown = prompt if n is None else prompt[:n]
        logger.info("Received request %s: prompt: %r, params: %s", request_id, shown, params)

    def usage(self, prompt_tokens: int, completion_tokens: int, cached: int) -> UsageInfo:
        u = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                      total_tokens=prompt_tokens + completion_tokens)
        if self.options.enable_prompt_tokens_details:
            u.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached)
        return u

    def token_str(self, token_id: int, lp: Logprob | None) -> str:
        if self.options.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def clamp_logprob(v: float) -> float:
    return max(v, -9999.0) if v == v else -9999.0  # -inf / nan are not JSON


def plain_prompt_logprobs(plps) -> list | None:
    """vLLM's prompt_logprobs field: per position {token_id: {logprob, rank, decoded_token}} (first: null)."""
    if plps is None:
        return None
    return [None if step is None else
            {t: {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for t, lp in step.items()} for step in plps]


class SSEResponse(StreamingResponse):
    """text/event-stream whose generator is always closed when the response ends, disconnects included,
    so its `finally` (which aborts the engine requests) runs at once rather than at garbage collection."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(exc: BaseException) -> str:
    status, message = error_status(exc)
    return sse(json.dumps(error_body(message, status, getattr(exc, "param", None))))


def error_status(exc: BaseException) -> tuple[int, str]:
    """Maps the engine's exceptions to an HTTP status (shared by the handlers and the SSE streams)."""
    from enginecore.processor import PromptError, RequestFailedError
    from enginecore.sampling_params import SamplingParamsError
    from enginecore.scheduler import RequestRejectedError, SchedulerOverloadedError
    from enginecore.tokenizer import TextEncodingError
    from frontend.engine_client import EngineDeadError

    if isinstance(exc, APIError):
        return exc.status, exc.message
    if isinstance(exc, (PromptError, SamplingParamsError, RequestRejectedError, TextEncodingError)):
        return 400, str(exc)
    if isinstance(exc, (SchedulerOverloadedError, EngineDeadError)):
        return 503, str(exc)
    if isinstance(exc, RequestFailedError):
        return 500, str(exc)
    return 500, f"{type(exc).__name__}: {exc}"


async def wait_for_disconnect(raw: HTTPRequest) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(raw: HTTPRequest | None, coro):
    """Run `coro`; if the HTTP client disconnects first, cancel it (its `finally` aborts the requests)."""
    if raw is None:
        return await coro
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(wait_for_disconnect(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected()


async def merge_streams(streams):
    """Yield (index, RequestOutput) from several RequestStreams as they come; errors propagate."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, s):
        try:
            async for out in s:
                queue.put_nowait((i, out, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
        finally:
            queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()
