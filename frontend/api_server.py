"""The FastAPI app: routes, OpenAI-shaped errors, and the ASGI middlewares (auth, 413, request ids, load).

Middlewares are plain ASGI (not BaseHTTPMiddleware) so that streaming
responses and client-disconnect detection pass through untouched.
"""

from __future__ import annotations

import hmac
import json
import logging
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from enginecore import __version__
from enginecore.processor import PromptError, RequestFailedError
from enginecore.sampling_params import SamplingParamsError
from enginecore.scheduler import RequestRejectedError, SchedulerOverloadedError
from enginecore.tokenizer import TextEncodingError
from frontend.engine_client import AsyncEngineClient, EngineDeadError
from frontend.metrics import ServerMetrics
from frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from frontend.serving_chat import ServingChat
from frontend.serving_common import APIError, ClientDisconnected, FrontendOptions, error_body, error_status
from frontend.serving_completion import ServingCompletion

logger = logging.getLogger("xlaserve.api")


@dataclass
class HTTPOptions:
    """Flags that shape the app itself (not the serving of one request)."""

    api_keys: list[str] = field(default_factory=list)
    root_path: str = ""
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    disable_fastapi_docs: bool = False
    enable_request_id_headers: bool = False
    enable_server_load_tracking: bool = False
    max_request_body_bytes: int = 16 * 2**20
    dev_mode: bool = False


class ServerState:
    def __init__(self, client: AsyncEngineClient, metrics: ServerMetrics, served_model_names: list[str],
                 options: FrontendOptions):
        self.client = client
        self.metrics = metrics
        self.served_model_names = served_model_names
        self.completion = ServingCompletion(client, served_model_names, options)
        self.chat = ServingChat(client, served_model_names, options)
        self.server_load = 0
        # set on SIGTERM (serve.py): new generation requests get 503 while those in flight finish
        self.draining = False


# Seconds an overloaded server asks clients to wait (HTTP Retry-After): about one decode step of a full batch
# on a slow host; clients with backoff (the openai client honours the header) spread their retries from there.
OVERLOAD_RETRY_AFTER_S = 1
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
SHUTTING_DOWN = "the server is shutting down: it finishes the requests in flight but accepts no new ones"


def _json_error(message: str, status: int, param: str | None = None,
                headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status, headers=headers)


async def _send_json_error(send, message: str, status: int) -> None:
    body = json.dumps(error_body(message, status)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _app_path(scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class APIKeyMiddleware:
    """401 on /v1/* without `Authorization: Bearer <one of the keys>`."""

    def __init__(self, app, keys: list[str]):
        self.app = app
        self.keys = [k.encode() for k in keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not _app_path(scope).startswith("/v1"):
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        token = auth[7:] if auth[:7].lower() == b"bearer " else b""
        if not any(hmac.compare_digest(token, k) for k in self.keys):
            return await _send_json_error(send, "Unauthorized: a valid API key is required "
                                                "(Authorization: Bearer <key>)", 401)
        return await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """413 for bodies over --max-request-body-bytes (declared or streamed)."""

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    def _too_large(self, size: int | str) -> str:
        return (f"request body too large: {size} bytes; the limit is {self.limit} bytes "
                "(set by --max-request-body-bytes)")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                return await _send_json_error(send, "invalid Content-Length header", 400)
            if size > self.limit:
                return await _send_json_error(send, self._too_large(size), 413)
            return await self.app(scope, receive, send)
        # no Content-Length (chunked): buffer up to the limit, then replay
        chunks, total = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            total += len(msg.get("body", b""))
            if total > self.limit:
                return await _send_json_error(send, self._too_large(f"more than {self.limit}"), 413)
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


class RequestIdHeaderMiddleware:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = dict(scope.get("headers") or []).get(b"x-request-id") or uuid.uuid4().hex.encode()

        async def send_with_id(msg):
            if msg["type"] == "http.response.start":
                msg = dict(msg)
                msg["headers"] = list(msg.get("headers") or []) + [(b"x-request-id", rid)]
            await send(msg)

        return await self.app(scope, receive, send_with_id)


class LoadTrackingMiddleware:
    """Counts generation requests in flight (until their last byte is sent), for GET /load."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or _app_path(scope) not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        self.state.server_load += 1
        try:
            return await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1


class DrainingMiddleware:
    """After SIGTERM the port stays open for the grace period: a new generation request gets a clear 503
    (a load balancer retries it elsewhere) instead of a refused connection; everything else still answers."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.state.draining and _app_path(scope) in GENERATION_PATHS:
            self.state.metrics.on_rejected("shutting_down")
            return await _send_json_error(send, SHUTTING_DOWN, 503)
        return await self.app(scope, receive, send)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON ({err.get('ctx', {}).get('error', 'parse error')})")
            continue
        where = ".".join(loc)
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request", param


def build_app(state: ServerState, opts: HTTPOptions) -> FastAPI:
    docs = {} if not opts.disable_fastapi_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="xlaserve", version=__version__, root_path=opts.root_path, **docs)
    app.state.xla = state
    client = state.client

    # ---- errors ------------------------------------------------------------------------

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _json_error(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req, exc: StarletteHTTPException):
        return _json_error(str(exc.detail), exc.status_code)

    async def _engine_error(_req, exc: Exception):
        status, message = error_status(exc)
        headers = None
        if isinstance(exc, SchedulerOverloadedError):
            state.metrics.on_rejected("overloaded")
            headers = {"Retry-After": str(OVERLOAD_RETRY_AFTER_S)}
        return _json_error(message, status, getattr(exc, "param", None), headers)

    for cls in (APIError, PromptError, SamplingParamsError, RequestRejectedError, SchedulerOverloadedError,
                EngineDeadError, RequestFailedError, TextEncodingError):
        app.add_exception_handler(cls, _engine_error)

    @app.exception_handler(Exception)
    async def _internal(_req, exc: Exception):
        logger.error("internal error: %s: %s", type(exc).__name__, exc)
        return _json_error(f"internal error: {type(exc).__name__}: {exc}", 500)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_req, _exc):
        return Response(status_code=499)

    # ---- health and info -------------------------------------------------------------------

    # 503 once the engine is dead or the server drains for shutdown: take this instance out of rotation
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if client.is_dead or state.draining else 200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return Response(status_code=503 if client.is_dead or state.draining else 200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/load")
    async def load():
        return {"server_load": state.server_load}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        cfg = client.config
        root = cfg.model_config.model or client.model.path
        arch = client.model.config
        counts = {"num_params": arch.num_params(), "num_active_params": arch.num_params(active=True)}
        cards = [ModelCard(id=name, root=root, max_model_len=cfg.scheduler_config.max_model_len, **counts)
                 for name in state.served_model_names]
        return ModelList(data=cards)

    # ---- generation ----------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request):
        return await state.completion.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request):
        return await state.chat.create(request, raw_request)

    # ---- tokenizer -------------------------------------------------------------------------------

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        serving = state.chat
        serving.check_model(request.model)
        tok = serving.tokenizer
        if request.messages is not None:
            text = serving.render_prompt(
                request.messages, add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message, chat_template=request.chat_template,
                chat_template_kwargs=request.chat_template_kwargs, tools=request.tools)
            ids = tok.encode(text, add_special_tokens=bool(request.add_special_tokens))
        else:
            add = True if request.add_special_tokens is None else request.add_special_tokens
            ids = tok.encode(request.prompt, add_special_tokens=add)
        strs = tok.hf.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        serving = state.chat
        serving.check_model(request.model)
        vocab = client.input_processor.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is out of vocabulary (vocab size is {vocab})", param="tokens")
        return DetokenizeResponse(prompt=serving.tokenizer.decode(request.tokens, skip_special_tokens=False))

    # ---- development -------------------------------------------------------------------------------

    if opts.dev_mode:
        logger.warning("VLLM_SERVER_DEV_MODE is set: development endpoints are on (/reset_prefix_cache, "
                       "/server_info); do not expose this server")

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():
            ok = await client.call("reset_prefix_cache")
            return {"success": bool(ok)}

        @app.get("/server_info")
        async def server_info():
            cfg = client.config
            return {"version": __version__, "backend": cfg.device_config.backend,
                    "platform": cfg.device_config.platform, "num_blocks": client.num_blocks,
                    "block_size": cfg.cache_config.block_size, "multiprocess": client.multiprocess,
                    "engine_pid": client.engine_pid, "engine_pids": client.engine_pids,
                    "max_model_len": cfg.scheduler_config.max_model_len}

    # ---- middlewares (the last added runs first) -----------------------------------------------------

    app.add_middleware(DrainingMiddleware, state=state)
    if opts.enable_server_load_tracking:
        app.add_middleware(LoadTrackingMiddleware, state=state)
    app.add_middleware(BodySizeLimitMiddleware, limit=opts.max_request_body_bytes)
    if opts.api_keys:
        app.add_middleware(APIKeyMiddleware, keys=opts.api_keys)
    if opts.enable_request_id_headers:
        app.add_middleware(RequestIdHeaderMiddleware)
    app.add_middleware(CORSMiddleware, allow_origins=opts.allowed_origins, allow_credentials=opts.allow_credentials,
                       allow_methods=opts.allowed_methods, allow_headers=opts.allowed_headers)
    return app
