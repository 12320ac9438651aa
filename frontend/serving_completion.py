"""POST /v1/completions: prompts as text, token ids or lists of either; echo; logprobs; n; best_of; SSE."""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from enginecore.outputs import Logprob, RequestOutput
from frontend.engine_client import RequestStream
from frontend.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)
from frontend.serving_common import APIError, OpenAIServing, clamp_logprob, merge_streams, \
    plain_prompt_logprobs, SSEResponse, sse, sse_error, unless_disconnected


def normalize_prompts(prompt) -> list:
    """The four OpenAI prompt shapes -> a list of prompts (strings or token-id lists)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        for p in prompt:
            if not p:
                raise APIError("a token-id prompt must not be empty", param="prompt")
        return [list(p) for p in prompt]
    raise APIError("prompt must be a string, a list of strings, a list of token ids or a list of those",
                   param="prompt")


class ServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: HTTPRequest | None):
        model_name = self.check_model(req.model)
        self.warn_ignored_fields(req)
        if req.suffix:
            raise APIError("suffix is not supported", param="suffix")
        prompts = normalize_prompts(req.prompt)
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
        params = req.sampling_params(req.max_tokens, req.logprobs, self.options.sampling_defaults, prompt_logprobs)
        best_of = params.best_of
        if best_of > params.n:
            if req.stream:
                raise APIError("best_of > n is not supported with stream", param="best_of")
            # generate best_of samples, keep the n with the highest cumulative logprob
            params.n = best_of
            if params.logprobs is None:
                params.logprobs = 0
        limit = self.client.config.scheduler_config.max_waiting_requests
        if len(prompts) * params.n > limit:
            raise APIError(f"this request has {len(prompts)} prompt(s) x {params.n} sequence(s); the waiting queue "
                           f"holds at most {limit} (--max-waiting-requests): it could never be admitted",
                           param="prompt")
        public_id = f"cmpl-{self.base_request_id(raw, req.request_id)}"
        streams = await self._add_all(req, public_id, prompts, params)
        if req.stream:
            return SSEResponse(self._stream(req, public_id, model_name, streams))
        try:
            finals = await unless_disconnected(raw, self._collect(streams))
        finally:
            for s in streams:
                s.abort()
        return JSONResponse(self._response(req, public_id, model_name, finals, best_of).model_dump())

    async def _add_all(self, req: CompletionRequest, public_id: str, prompts: list, params) -> list[RequestStream]:
        """Submit every prompt at once (one engine round trip, not one per prompt); all or nothing."""
        inputs = []
        for p in prompts:
            if isinstance(p, str) and not req.add_special_tokens:
                p = {"prompt": p, "prompt_token_ids": self.tokenizer.encode(p, add_special_tokens=False)}
            inputs.append(p)
        ids = [self.engine_request_id(public_id, i) for i in range(len(inputs))]
        for rid, p in zip(ids, inputs):
            self.log_request(rid, p, params)
        adds = [asyncio.ensure_future(self.client.add_request(rid, p, params.clone(), req.priority))
                for rid, p in zip(ids, inputs)]
        try:
            await asyncio.wait(adds)
        except BaseException:  # cancelled (client gone): abort whatever got in
            for a in adds:
                a.cancel()
            await asyncio.gather(*adds, return_exceptions=True)
            for a in adds:
                if not a.cancelled() and a.exception() is None:
                    a.result().abort()
            raise
        failed = next((a.exception() for a in adds if a.exception() is not None), None)
        if failed is not None:
            for a in adds:
                if a.exception() is None:
                    a.result().abort()
            raise failed
        return [a.result() for a in adds]

    @staticmethod
    async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in merge_streams(streams):
            finals[i] = out
        return finals

    # ---- non-streaming ----------------------------------------------------------------

    def _response(self, req: CompletionRequest, public_id: str, model_name: str, finals: list[RequestOutput],
                  best_of: int) -> CompletionResponse:
        choices, n_prompt, n_gen, n_cached = [], 0, 0, 0
        for pi, final in enumerate(finals):
            outs = list(final.outputs)
            if best_of > req.n:
                outs = sorted(outs, key=lambda o: o.cumulative_logprob or 0.0, reverse=True)[: req.n]
            prompt_text = self._prompt_text(final)
            for j, o in enumerate(outs):
                text = (prompt_text + o.text) if req.echo else o.text
                logprobs = None
                if req.logprobs is not None:
                    logprobs, offset = CompletionLogProbs(), 0
                    if req.echo:
                        offset = self._append_logprobs(logprobs, final.prompt_token_ids, final.prompt_logprobs,
                                                       req.logprobs)
                    self._append_logprobs(logprobs, o.token_ids, o.logprobs, req.logprobs, offset)
                choices.append(CompletionResponseChoice(
                    index=pi * req.n + j,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=o.finish_reason,
                    stop_reason=o.stop_reason,
                    prompt_logprobs=plain_prompt_logprobs(final.prompt_logprobs) if req.prompt_logprobs else None,
                    token_ids=list(o.token_ids) if req.return_token_ids else None,
                    prompt_token_ids=list(final.prompt_token_ids) if req.return_token_ids else None,
                ))
            n_prompt += len(final.prompt_token_ids)
            n_gen += sum(len(o.token_ids) for o in final.outputs)
            n_cached += final.num_cached_tokens
        return CompletionResponse(id=public_id, model=model_name, choices=choices,
                                  usage=self.usage(n_prompt, n_gen, n_cached))

    def _prompt_text(self, final: RequestOutput) -> str:
        if final.prompt is not None:
            return final.prompt
        return self.tokenizer.decode(final.prompt_token_ids, skip_special_tokens=False)

    def _append_logprobs(self, out: CompletionLogProbs, token_ids: list[int],
                         steps: list[dict[int, Logprob] | None] | None, num: int, offset: int = 0) -> int:
        """OpenAI's legacy logprobs shape, extended in place; returns the text offset after the tokens."""
        steps = steps or []
        for i, tid in enumerate(token_ids):
            step = steps[i] if i < len(steps) else None
            if step is None or tid not in step:  # the first prompt token has no logprob
                token = self.token_str(tid, None)
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                token = self.token_str(tid, step[tid])
                out.token_logprobs.append(clamp_logprob(step[tid].logprob))
                # the sampled token first, then the top `num` (vLLM's shape)
                out.top_logprobs.append({self.token_str(t, lp): clamp_logprob(lp.logprob)
                                         for k, (t, lp) in enumerate(step.items()) if k <= num})
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
        return offset

    # ---- streaming --------------------------------------------------------------------

    async def _stream(self, req: CompletionRequest, public_id: str, model_name: str, streams: list[RequestStream]):
        created = int(time.time())
        so = req.stream_options
        include_usage = self.options.enable_force_include_usage or bool(so and so.include_usage)
        continuous = include_usage and bool(so and so.continuous_usage_stats)
        prompt_tokens = [0] * len(streams)
        cached = [0] * len(streams)
        gen_tokens: dict[int, int] = {}
        offsets: dict[int, int] = {}  # choice -> text offset of its next token
        try:
            async for pi, out in merge_streams(streams):
                prompt_tokens[pi] = len(out.prompt_token_ids)
                cached[pi] = out.num_cached_tokens
                for o in out.outputs:
                    idx = pi * req.n + o.index
                    first = idx not in gen_tokens
                    gen_tokens[idx] = gen_tokens.get(idx, 0) + len(o.token_ids)
                    text = o.text
                    logprobs = CompletionLogProbs() if req.logprobs is not None else None
                    if first and req.echo:
                        text = self._prompt_text(out) + text
                        if logprobs is not None:
                            offsets[idx] = self._append_logprobs(logprobs, out.prompt_token_ids, out.prompt_logprobs,
                                                                 req.logprobs)
                    if logprobs is not None:
                        offsets[idx] = self._append_logprobs(logprobs, o.token_ids, o.logprobs, req.logprobs,
                                                             offsets.get(idx, 0))
                    if not text and not o.token_ids and o.finish_reason is None:
                        continue
                    chunk = CompletionStreamResponse(
                        id=public_id, created=created, model=model_name,
                        choices=[CompletionResponseStreamChoice(
                            index=idx, text=text, logprobs=logprobs, finish_reason=o.finish_reason,
                            stop_reason=o.stop_reason,
                            token_ids=list(o.token_ids) if req.return_token_ids else None,
                            prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids and first else None,
                        )],
                    )
                    if continuous:
                        chunk.usage = self.usage(sum(prompt_tokens), sum(gen_tokens.values()), sum(cached))
                    yield sse(chunk.model_dump_json())
            if include_usage:
                final = CompletionStreamResponse(id=public_id, created=created, model=model_name, choices=[],
                                                 usage=self.usage(sum(prompt_tokens), sum(gen_tokens.values()),
                                                                  sum(cached)))
                yield sse(final.model_dump_json())
        except Exception as e:
            yield sse_error(e)
        finally:
            for s in streams:
                s.abort()
        yield "data: [DONE]\n\n"

