"""POST /v1/chat/completions (and the chat half of /tokenize): chat templates, roles, logprobs, SSE."""

from __future__ import annotations

import time

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from enginecore.outputs import Logprob, RequestOutput
from enginecore.tokenizer import TextEncodingError
from frontend.engine_client import RequestStream
from frontend.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbs,
    ChatLogProbsContent,
    ChatMessage,
    ChatResponseMessage,
    DeltaMessage,
)
from frontend.serving_common import APIError, OpenAIServing, clamp_logprob, detect_content_format, \
    plain_prompt_logprobs, SSEResponse, sse, sse_error, unless_disconnected

_TEXT_PARTS = ("text", "input_text", "output_text")


class ServingChat(OpenAIServing):
    # ---- the prompt ---------------------------------------------------------------------

    def _template(self, request_template: str | None) -> str | None:
        if request_template is not None:
            if not self.options.trust_request_chat_template:
                raise APIError("chat_template in a request is refused: start the server with "
                               "--trust-request-chat-template to allow it", param="chat_template")
            return request_template
        return self.options.chat_template or self.tokenizer.chat_template

    def _messages(self, messages: list[ChatMessage], template: str | None) -> list[dict]:
        fmt = self.options.chat_template_content_format
        if fmt == "auto":
            fmt = detect_content_format(template)
        out = []
        for i, m in enumerate(messages):
            d = m.model_dump(exclude_none=True)
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    kind = part.get("type")
                    if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
                        texts.append(part["text"])
                    elif kind == "refusal" and isinstance(part.get("refusal"), str):
                        texts.append(part["refusal"])
                    else:
                        raise APIError(f"messages[{i}].content: part type {kind!r} is not supported (xlaserve serves "
                                       "text-only models; parts need 'type': 'text' and a 'text' string)",
                                       param="messages")
                d["content"] = "\n".join(texts) if fmt == "string" else [{"type": "text", "text": t} for t in texts]
            elif content is None:
                d["content"] = "" if fmt == "string" else []
            elif fmt == "openai":
                d["content"] = [{"type": "text", "text": content}]
            out.append(d)
        return out

    def render_prompt(self, messages: list[ChatMessage], *, add_generation_prompt: bool = True,
                      continue_final_message: bool = False, chat_template: str | None = None,
                      chat_template_kwargs: dict | None = None, tools=None, documents=None) -> str:
        template = self._template(chat_template)
        if template is None:
            raise APIError("this model has no chat template: start the server with --chat-template, or use "
                           "/v1/completions", param="messages")
        if continue_final_message and messages[-1].role != "assistant":
            raise APIError("continue_final_message needs the last message to be from the assistant",
                           param="continue_final_message")
        kwargs = dict(chat_template_kwargs or {})
        for reserved in ("chat_template", "tokenize", "messages", "conversation"):
            kwargs.pop(reserved, None)
        if tools is not None:
            kwargs["tools"] = tools
        if documents is not None:
            kwargs["documents"] = documents
        try:
            return self.tokenizer.apply_chat_template(
                self._messages(messages, template), template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **kwargs)
        except APIError:
            raise
        except Exception as e:  # jinja errors, raise_exception() in templates, bad kwargs
            raise APIError(f"cannot apply the chat template: {type(e).__name__}: {e}", param="messages") from None

    # ---- the endpoint ---------------------------------------------------------------------

    async def create(self, req: ChatCompletionRequest, raw: HTTPRequest | None):
        model_name = self.check_model(req.model)
        self.reject_unsupported(req)
        if req.tool_choice not in (None, "none"):
            raise APIError("tool_choice other than 'none' needs tool-call parsing, which xlaserve does not support",
                           param="tool_choice")
        text = self.render_prompt(req.messages, add_generation_prompt=req.add_generation_prompt,
                                  continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                                  chat_template_kwargs=req.chat_template_kwargs, tools=req.tools,
                                  documents=req.documents)
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        except TextEncodingError as e:
            raise APIError(f"messages: {e}", param="messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling_params(max_tokens, logprobs, self.options.sampling_defaults, req.prompt_logprobs)
        if params.best_of > params.n:
            raise APIError("best_of > n is not supported for chat completions", param="best_of")
        public_id = f"chatcmpl-{self.base_request_id(raw, req.request_id)}"
        rid = self.engine_request_id(public_id)
        self.log_request(rid, text, params)
        stream = await self.client.add_request(rid, {"prompt": text, "prompt_token_ids": ids}, params, req.priority)
        role = self.options.response_role if req.add_generation_prompt else req.messages[-1].role
        if req.stream:
            return SSEResponse(self._stream(req, public_id, model_name, role, stream))
        try:
            final = await unless_disconnected(raw, self._collect(stream))
        finally:
            stream.abort()
        return JSONResponse(self._response(req, public_id, model_name, role, final).model_dump())

    @staticmethod
    async def _collect(stream: RequestStream) -> RequestOutput:
        final = None
        async for out in stream:
            final = out
        return final

    def _echo_text(self, req: ChatCompletionRequest, role: str) -> str:
        last = req.messages[-1]
        if not req.echo or last.role != role:
            return ""
        if isinstance(last.content, str):
            return last.content
        return "\n".join(p.get("text", "") for p in last.content or [] if isinstance(p, dict))

    def _logprobs(self, token_ids: list[int], steps: list[dict[int, Logprob]] | None, k: int) -> ChatLogProbs:
        content = []
        for i, tid in enumerate(token_ids):
            step = (steps or [])[i] if i < len(steps or []) else None
            if not step or tid not in step:
                content.append(ChatLogProbsContent(token=self.token_str(tid, None)))
                continue
            tok = self.token_str(tid, step[tid])
            top = sorted(step.items(), key=lambda kv: kv[1].logprob, reverse=True)[:k]
            content.append(ChatLogProbsContent(
                token=tok, logprob=clamp_logprob(step[tid].logprob), bytes=list(tok.encode("utf-8", "replace")),
                top_logprobs=[ChatLogProb(token=(s := self.token_str(t, lp)), logprob=clamp_logprob(lp.logprob),
                                          bytes=list(s.encode("utf-8", "replace"))) for t, lp in top],
            ))
        return ChatLogProbs(content=content)

    def _response(self, req: ChatCompletionRequest, public_id: str, model_name: str, role: str,
                  final: RequestOutput) -> ChatCompletionResponse:
        echo = self._echo_text(req, role)
        choices = []
        for o in final.outputs:
            choices.append(ChatCompletionResponseChoice(
                index=o.index,
                message=ChatResponseMessage(role=role, content=echo + o.text),
                logprobs=self._logprobs(o.token_ids, o.logprobs, req.top_logprobs or 0) if req.logprobs else None,
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
                token_ids=list(o.token_ids) if req.return_token_ids else None,
            ))
        n_gen = sum(len(o.token_ids) for o in final.outputs)
        return ChatCompletionResponse(
            id=public_id, model=model_name, choices=choices,
            usage=self.usage(len(final.prompt_token_ids), n_gen, final.num_cached_tokens),
            prompt_logprobs=plain_prompt_logprobs(final.prompt_logprobs) if req.prompt_logprobs else None,
            prompt_token_ids=list(final.prompt_token_ids) if req.return_token_ids else None,
        )

    async def _stream(self, req: ChatCompletionRequest, public_id: str, model_name: str, role: str,
                      stream: RequestStream):
        created = int(time.time())
        so = req.stream_options
        include_usage = self.options.enable_force_include_usage or bool(so and so.include_usage)
        continuous = include_usage and bool(so and so.continuous_usage_stats)
        prompt_tokens, cached, gen = 0, 0, 0

        def chunk(choices, usage=None) -> str:
            return sse(ChatCompletionStreamResponse(id=public_id, created=created, model=model_name,
                                                    choices=choices, usage=usage).model_dump_json())

        try:
            # the role first, for every choice, before any token (clients render the speaker at once)
            echo = self._echo_text(req, role)
            for i in range(req.n):
                yield chunk([ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role=role,
                                                                                            content=echo))])
            async for out in stream:
                prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
                for o in out.outputs:
                    gen += len(o.token_ids)
                    if not o.text and not o.token_ids and o.finish_reason is None:
                        continue
                    choice = ChatCompletionResponseStreamChoice(
                        index=o.index,
                        delta=DeltaMessage(content=o.text) if (o.text or o.finish_reason is None) else DeltaMessage(),
                        logprobs=self._logprobs(o.token_ids, o.logprobs, req.top_logprobs or 0)
                        if req.logprobs and o.token_ids else None,
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                        token_ids=list(o.token_ids) if req.return_token_ids else None,
                    )
                    usage = self.usage(prompt_tokens, gen, cached) if continuous else None
                    yield chunk([choice], usage)
            if include_usage:
                yield chunk([], self.usage(prompt_tokens, gen, cached))
        except Exception as e:
            yield sse_error(e)
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"

