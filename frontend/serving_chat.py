"""POST /v1/chat/completions (and the chat half of /tokenize): chat templates, roles, logprobs, SSE."""

from __future__ import annotations

import json
import time

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from enginecore.outputs import Logprob, RequestOutput
from enginecore.sampling_params import SamplingParamsError, StructuredOutputsParams
from enginecore.tokenizer import TextEncodingError
from frontend.chat_output import ChatOutputParser, ParsedDelta
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
from frontend.reasoning_parsers import REASONING_PARSERS
from frontend.serving_common import APIError, OpenAIServing, clamp_logprob, detect_content_format, \
    plain_prompt_logprobs, SSEResponse, sse, sse_error, unless_disconnected
from frontend.tool_parsers import (TOOL_PARSERS, NamedToolParser, RequiredToolParser, ToolChoiceError,
                                   invalid_tool_schema, resolve_tool_choice, tool_choice_schema)

_TEXT_PARTS = ("text", "input_text", "output_text")


class ServingChat(OpenAIServing):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        name = self.options.reasoning_parser
        self.reasoning_parser = REASONING_PARSERS[name](self.tokenizer) if name else None
        parser = TOOL_PARSERS.get(self.options.tool_call_parser or "")
        # a parser whose marker is a special token (mistral's [TOOL_CALLS]) needs special tokens in the text
        self._tool_markers_special = bool(parser and set(parser.markers) & _special_tokens(self.tokenizer))

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
            _template_tool_calls(d)
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
        self.warn_ignored_fields(req)
        try:
            choice = resolve_tool_choice(req.tools, req.tool_choice, auto_enabled=bool(
                self.options.enable_auto_tool_choice and self.options.tool_call_parser))
            schema = tool_choice_schema(choice, req.parallel_tool_calls)
        except ToolChoiceError as e:
            raise APIError(str(e), param=e.param) from None
        # the template sees the tools whatever the choice (vLLM), unless --exclude-tools-when-tool-choice-none
        hide = req.tool_choice == "none" and self.options.exclude_tools_when_tool_choice_none
        text = self.render_prompt(req.messages, add_generation_prompt=req.add_generation_prompt,
                                  continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                                  chat_template_kwargs=req.chat_template_kwargs,
                                  tools=None if req.tools is None or hide else choice.tools, documents=req.documents)
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        except TextEncodingError as e:
            raise APIError(f"messages: {e}", param="messages") from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = req.sampling_params(max_tokens, logprobs, self.options.sampling_defaults, req.prompt_logprobs)
        if params.best_of > params.n:
            raise APIError("best_of > n is not supported for chat completions", param="best_of")
        parsing = self._output_parser(req, choice, schema, text, params)
        public_id = f"chatcmpl-{self.base_request_id(raw, req.request_id)}"
        rid = self.engine_request_id(public_id)
        self.log_request(rid, text, params)
        try:
            stream = await self.client.add_request(rid, {"prompt": text, "prompt_token_ids": ids}, params,
                                                   req.priority)
        except SamplingParamsError as e:
            if schema is None or e.param != "tools":
                raise
            raise APIError(str(invalid_tool_schema(choice, req.parallel_tool_calls, e)), param="tools") from None
        role = self.options.response_role if req.add_generation_prompt else req.messages[-1].role
        if req.stream:
            return SSEResponse(self._stream(req, public_id, model_name, role, stream, parsing))
        try:
            final = await unless_disconnected(raw, self._collect(stream))
        finally:
            stream.abort()
        return JSONResponse(self._response(req, public_id, model_name, role, final, parsing).model_dump())

    def _output_parser(self, req: ChatCompletionRequest, choice, schema: dict | None, prompt: str,
                       params) -> ChatOutputParser:
        """Tools and reasoning of one request: the grammar of an enforced tool choice, where constraints
        start (after the reasoning), and the parsers of its outputs."""
        if schema is not None:
            if params.structured_outputs is not None:
                raise APIError("tool_choice 'required' or a named function is enforced with a JSON schema and "
                               "cannot be combined with response_format / structured_outputs", param="tool_choice")
            # validated (and cached) with the request's other checks, a 400 naming "tools"
            params.structured_outputs = StructuredOutputsParams(json=schema, param="tools")
        reasoning = None
        if self.reasoning_parser is not None:
            reasoning = self.reasoning_parser.for_request(prompt, req.chat_template_kwargs)
            if params.structured_outputs is not None:
                params.structured_outputs.start_after_token_ids = reasoning.constraint_start_ids()
        tool_parser = None
        if choice.mode == "auto":
            tool_parser = TOOL_PARSERS[self.options.tool_call_parser](choice.tools)
            if self._tool_markers_special:
                params.skip_special_tokens = False
        elif choice.mode == "named":
            tool_parser = NamedToolParser(choice.name)
        elif choice.mode == "required":
            tool_parser = RequiredToolParser(choice.tools)
        return ChatOutputParser(reasoning, tool_parser, choice.mode, req.parallel_tool_calls, req.include_reasoning)

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
                  final: RequestOutput, parsing: ChatOutputParser) -> ChatCompletionResponse:
        echo = self._echo_text(req, role)
        choices = []
        for o in final.outputs:
            message, finish = ChatResponseMessage(role=role, content=echo + o.text), o.finish_reason
            if parsing.active:
                m = parsing.parse(o.text)
                message = ChatResponseMessage(
                    role=role, content=(echo + (m.content or "")) or None, reasoning=m.reasoning,
                    reasoning_content=m.reasoning, tool_calls=[c.to_openai() for c in m.tool_calls])
                finish = parsing.finish_reason(o.finish_reason, bool(m.tool_calls))
            choices.append(ChatCompletionResponseChoice(
                index=o.index,
                message=message,
                logprobs=self._logprobs(o.token_ids, o.logprobs, req.top_logprobs or 0) if req.logprobs else None,
                finish_reason=finish,
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
                      stream: RequestStream, parsing: ChatOutputParser):
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
            streamers = [parsing.streamer() for _ in range(req.n)] if parsing.active else None
            async for out in stream:
                prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
                for o in out.outputs:
                    gen += len(o.token_ids)
                    if not o.text and not o.token_ids and o.finish_reason is None:
                        continue
                    finish = o.finish_reason
                    if streamers is None:
                        deltas = [DeltaMessage(content=o.text) if (o.text or finish is None) else DeltaMessage()]
                    else:
                        s = streamers[o.index]
                        deltas = _delta_messages(s.feed(o.text, finish is not None))
                        finish = parsing.finish_reason(finish, s.called)
                        if not deltas:
                            if finish is None and not (req.logprobs and o.token_ids) and not req.return_token_ids:
                                continue  # text held back (a tag may be starting): nothing to say yet
                            deltas = [DeltaMessage()]
                    for k, delta in enumerate(deltas):
                        first, last = k == 0, k == len(deltas) - 1
                        choice = ChatCompletionResponseStreamChoice(
                            index=o.index,
                            delta=delta,
                            logprobs=self._logprobs(o.token_ids, o.logprobs, req.top_logprobs or 0)
                            if first and req.logprobs and o.token_ids else None,
                            finish_reason=finish if last else None,
                            stop_reason=o.stop_reason if last else None,
                            token_ids=list(o.token_ids) if first and req.return_token_ids else None,
                        )
                        usage = self.usage(prompt_tokens, gen, cached) if continuous and last else None
                        yield chunk([choice], usage)
            if include_usage:
                yield chunk([], self.usage(prompt_tokens, gen, cached))
        except Exception as e:
            yield sse_error(e)
        finally:
            stream.abort()
        yield "data: [DONE]\n\n"



def _delta_messages(parts: ParsedDelta) -> list[DeltaMessage]:
    """A parsed delta as DeltaMessages: a call's header (index, id, type, name, "" arguments) and its
    argument fragments go in separate chunks, as OpenAI streams them."""
    if not parts:
        return []
    groups: list[list[dict]] = [[]]
    for tc in parts.tool_calls:
        if any(g["index"] == tc["index"] for g in groups[-1]):
            groups.append([])
        groups[-1].append(tc)
    out = [DeltaMessage(reasoning=parts.reasoning or None, reasoning_content=parts.reasoning or None,
                        content=parts.content or None, tool_calls=groups[0] or None)]
    out.extend(DeltaMessage(tool_calls=g) for g in groups[1:])
    return out


def _special_tokens(tokenizer) -> set[str]:
    hf = getattr(tokenizer, "hf", None)
    added = getattr(hf, "added_tokens_decoder", None) or {}
    return {t.content for t in added.values() if getattr(t, "special", False)} | set(
        getattr(hf, "all_special_tokens", None) or [])


def _template_tool_calls(message: dict) -> None:
    """Assistant tool calls carry their arguments as JSON text (OpenAI); templates index into them
    (`tool_call.arguments.city`, `| tojson`): give them the object, as vLLM does. `reasoning` (vLLM's
    current name) reaches templates as `reasoning_content`, the name they read."""
    for tc in message.get("tool_calls") or []:
        fn = tc.get("function") if isinstance(tc, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass
    if message.get("reasoning") is not None and message.get("reasoning_content") is None:
        message["reasoning_content"] = message["reasoning"]
