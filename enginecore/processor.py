"""The API side of a request, around the engine core: validation in, detokenization out.

`InputProcessor.process` is the one validation of a request, used by the
server and by the offline `LLM` alike: prompt -> token ids, every check that
needs the model or the engine's limits, the seed, and the split of an `n > 1`
request into n child `Request`s. The scheduler keeps only capacity checks
(KV blocks, the waiting queue).

`RequestState` is everything the API side keeps about one request (its
children's detokenizers, tokens, logprobs, timings, and for the server its
output queue); `OutputProcessor` owns them and turns `EngineCoreOutput`s into
`RequestOutput`s: incremental detokenization, stop strings, logprobs,
aggregation of children, and the per-request events of the metrics. That is
per-request code: an exception while processing one request's output (or an
engine output with finish reason "error") fails that request alone with a
`RequestFailedError` (HTTP 500) and aborts its children in the engine, which
frees their KV blocks; the other requests go on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from enginecore.config import EngineConfig
from enginecore.detokenizer import IncrementalDetokenizer
from enginecore.faults import FaultInjector
from enginecore.outputs import CompletionOutput, EngineCoreOutput, Logprob, LogprobsLists, RequestOutput
from enginecore.request import Request
from enginecore.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError, StructuredOutputsParams
from enginecore.scheduler import RequestRejectedError
from enginecore.tokenizer import TextEncodingError, Tokenizer

logger = logging.getLogger("xlaserve.processor")


class PromptError(ValueError):
    """An invalid prompt (HTTP 400); `param` names the field."""

    def __init__(self, message: str, param: str | None = "prompt"):
        super().__init__(message)
        self.param = param


class RequestFailedError(RuntimeError):
    """One request failed on its own (an exception while processing it); the others go on (HTTP 500)."""


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, vocab_size: int):
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = config.scheduler_config.max_model_len
        self._rng = np.random.default_rng(config.model_config.seed)
        self._valid_constraints: dict[str, bool] = {}  # structured-output specs that passed validation

    def tokenize_prompt(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            try:
                return prompt, self.tokenizer.encode(prompt)
            except TextEncodingError as e:
                raise PromptError(f"prompt: {e}") from None
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, (int, np.integer)) for t in prompt):
            return None, [int(t) for t in prompt]
        raise PromptError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def validate(self, ids: list[int], params: SamplingParams, priority: int) -> int:
        """Every check a request must pass before it reaches the engine; returns its resolved max_tokens.

        Raises PromptError or SamplingParamsError (HTTP 400), naming the field and the limit.
        """
        sc = self.config.scheduler_config
        if not ids:
            raise PromptError("the prompt is empty: it must contain at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError(f"token id {bad[0]} is out of vocabulary (vocab size is {self.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise PromptError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
                f"{len(ids)} input tokens, which leaves no room for output. Please reduce the length of the input."
            )
        params.verify_for_model(self.vocab_size, self.config.model_config.max_logprobs)
        room = self.max_model_len - len(ids)
        if params.max_tokens is not None and params.max_tokens > room:
            raise SamplingParamsError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{params.max_tokens + len(ids)} tokens ({len(ids)} in the input, {params.max_tokens} in the "
                "completion). Please reduce the length of the input or the completion.",
                "max_tokens",
            )
        if priority != 0 and sc.scheduling_policy != "priority":
            raise SamplingParamsError(
                f"got priority {priority}, but priority scheduling is off: start the server with "
                "--scheduling-policy priority", "priority")
        if params.n > sc.max_waiting_requests:  # its n sequences wait together: it could never be admitted
            raise SamplingParamsError(
                f"this request needs {params.n} sequences (n or best_of) but the waiting queue holds at most "
                f"{sc.max_waiting_requests} (--max-waiting-requests): it could never be admitted", "n")
        if params.structured_outputs is not None:
            self.validate_structured_outputs(params.structured_outputs)
        return params.max_tokens if params.max_tokens is not None else room

    def validate_structured_outputs(self, so: StructuredOutputsParams) -> None:
        """An invalid schema / regex / grammar is a 400 naming the client's field (`so.param`) here, not a
        failure in the engine (about 1 ms, remembered for the last few hundred valid constraints)."""
        from enginecore import structured_outputs

        soc = self.config.structured_outputs_config
        key = repr((so.kind, getattr(so, so.kind), so.whitespace_pattern, so.disable_any_whitespace,
                    so.disable_additional_properties))
        if key in self._valid_constraints:
            return
        try:
            structured_outputs.validate(so, so.param, soc.disable_any_whitespace, soc.disable_additional_properties)
        except ImportError:
            raise SamplingParamsError("structured outputs need the llguidance package", so.param)
        self._valid_constraints[key] = True
        if len(self._valid_constraints) > 512:
            self._valid_constraints.pop(next(iter(self._valid_constraints)))

    def process(
        self,
        request_id: str,
        prompt,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> tuple[str | None, list[int], list[Request]]:
        """Validate and build the engine requests: (prompt text or None, prompt ids, one Request per child)."""
        text, ids = self.tokenize_prompt(prompt)
        max_tokens = self.validate(ids, params, priority)
        eos = tuple(self.tokenizer.eos_token_ids)
        if params.bad_words:
            params._bad_words_token_ids = self._bad_words_ids(params.bad_words)
        params._all_stop_token_ids = set(params.stop_token_ids or []) | (set() if params.ignore_eos else set(eos))
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63 - 1))
        arrival = arrival_time or time.monotonic()
        reqs = [
            Request(
                request_id=child_request_id(request_id, i, params.n),
                prompt_token_ids=ids,
                sampling_params=params,
                eos_token_ids=eos,
                arrival_time=arrival,
                priority=priority,
                seed=seed,
                sample_index=i,
                max_tokens=max_tokens,
            )
            for i in range(params.n)
        ]
        return text, ids, reqs

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        out = []
        for w in words:
            for variant in (w, " " + w.lstrip()):
                ids = self.tokenizer.encode(variant, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out


class OutputObserver(Protocol):
    """Per-request events (the server's metrics implement it)."""

    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None: ...

    def on_inter_token(self, latency_s: float) -> None: ...

    def on_generation_tokens(self, n: int) -> None: ...

    def on_finished(self, reason: str, e2e_s: float, num_prompt_tokens: int, num_generation_tokens: int) -> None: ...


@dataclass
class ChildState:
    """One of the n sequences of a request (the engine's `Request` of that id)."""

    index: int
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # what DELTA outputs have handed out
    sent_tokens: int = 0
    sent_logprobs: int = 0


@dataclass
class RequestState:
    """Everything the API side keeps about one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, ChildState]  # engine request id -> child
    arrival_time: float
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    queue: Any = None  # the server's asyncio.Queue of RequestOutputs (None offline)
    first_token_time: float | None = None  # when its first child's first token came

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, observer: OutputObserver | None = None, stream_interval: int = 1):
        self.tokenizer = tokenizer
        self.observer = observer
        self.stream_interval = stream_interval  # --stream-interval: tokens a DELTA output gathers (_make_output)
        self.states: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, str] = {}
        self._faults = FaultInjector.from_env()  # test-only; None unless XLASERVE_FAULT_INJECTION is set

    def add_request(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                    child_ids: list[str], arrival_time: float | None = None, queue=None) -> RequestState:
        if request_id in self.states:
            raise RequestRejectedError(f"request id {request_id!r} is already in use")
        children = {}
        for i, cid in enumerate(child_ids):
            detok = (IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens, params.stop,
                                            params.include_stop_str_in_output) if params.detokenize else None)
            children[cid] = ChildState(i, detok, logprobs=[] if params.logprobs is not None else None,
                                       cumulative_logprob=0.0 if params.logprobs is not None else None)
            self.child_to_parent[cid] = request_id
        st = RequestState(request_id, prompt, prompt_ids, params, children, arrival_time or time.monotonic(),
                          prompt_logprobs=[None] if params.prompt_logprobs is not None else None, queue=queue)
        self.states[request_id] = st
        return st

    def has(self, request_id: str) -> bool:
        return request_id in self.states

    def unfinished_child_ids(self, request_id: str) -> list[str]:
        st = self.states.get(request_id)
        return [cid for cid, c in st.children.items() if c.finish_reason is None] if st else []

    def abort(self, request_id: str, now: float | None = None, reason: str = "abort") -> RequestState | None:
        """Forget a request; its unfinished children finish with `reason` ("abort", or "error" when it failed).
        Returns its state (None if unknown)."""
        st = self.states.pop(request_id, None)
        if st is None:
            return None
        now = now or time.monotonic()
        for cid, ch in st.children.items():
            self.child_to_parent.pop(cid, None)
            if ch.finish_reason is None:
                ch.finish_reason = reason
                self._finished(st, ch, now)
        return st

    def _finished(self, st: RequestState, ch: ChildState, now: float) -> None:
        if self.observer is not None:
            self.observer.on_finished(ch.finish_reason, now - st.arrival_time, len(st.prompt_token_ids),
                                      len(ch.token_ids))

    def _decode_one(self, t: int) -> str:
        return self.tokenizer.decode([t], skip_special_tokens=False)

    def _to_logprob_dict(self, lp: LogprobsLists, k: int) -> dict[int, Logprob]:
        d: dict[int, Logprob] = {}
        for j, (t, v) in enumerate(zip(lp.token_ids[1 : k + 1], lp.logprobs[1 : k + 1])):
            d[t] = Logprob(v, j + 1, self._decode_one(t))
        if lp.token_ids[0] not in d:
            d[lp.token_ids[0]] = Logprob(lp.logprobs[0], lp.rank, self._decode_one(lp.token_ids[0]))
        # the chosen token first, like vLLM
        first = lp.token_ids[0]
        return {first: d[first], **{t: v for t, v in d.items() if t != first}}

    def process_outputs(
        self, outputs: list[EngineCoreOutput], now: float | None = None
    ) -> tuple[list[tuple[RequestState, RequestOutput | RequestFailedError]], list[str]]:
        """-> ([(state, output or error to deliver)], engine child ids to abort).

        The ids to abort are children whose stop string matched here and children of failed requests.
        `outputs` may hold several of a child's (the engine client passes all the messages of one read): they
        become one output. Token latencies go by each output's engine `timestamp` where it has one (else `now`).
        """
        now = now or time.monotonic()
        new_tokens = 0
        updated: dict[str, set[str]] = {}
        failed: dict[str, RequestFailedError] = {}
        to_abort: list[str] = []
        for o in outputs:
            pid = self.child_to_parent.get(o.request_id)
            if pid is None or pid in failed:
                continue
            st = self.states[pid]
            ch = st.children[o.request_id]
            if ch.finish_reason is not None:
                continue
            if o.finish_reason == "error":  # the engine failed it (Scheduler._fail_request)
                failed[pid] = RequestFailedError(f"request {pid} failed in the engine: {o.stop_reason}")
                continue
            try:
                if self._faults is not None:
                    self._faults.check("output", o.request_id)
                self._apply_output(st, ch, o, now, to_abort)
            except Exception as e:
                failed[pid] = self._failure(pid, e)
                continue
            new_tokens += len(o.new_token_ids)
            updated.setdefault(pid, set()).add(o.request_id)
        results: list[tuple[RequestState, RequestOutput | RequestFailedError]] = []
        for pid, cids in updated.items():
            if pid in failed:
                continue
            st = self.states[pid]
            try:
                ro = self._make_output(st, cids)
            except Exception as e:
                failed[pid] = self._failure(pid, e)
                continue
            if ro is not None:
                results.append((st, ro))
            if ro is not None and ro.finished:  # (a finished request always has an output: its last child's end)
                self.states.pop(pid, None)
                for cid in st.children:
                    self.child_to_parent.pop(cid, None)
        for pid, err in failed.items():
            to_abort.extend(self.unfinished_child_ids(pid))
            st = self.abort(pid, now, reason="error")
            results.append((st, err))
        if new_tokens and self.observer is not None:
            self.observer.on_generation_tokens(new_tokens)
        return results, to_abort

    @staticmethod
    def failed_output(st: RequestState, err: RequestFailedError) -> RequestOutput:
        """A failed request as a finished output (finish reason "error", the error as stop_reason): what the
        offline LLM returns for it, where there is no HTTP status to carry the error."""
        outs = [CompletionOutput(ch.index, "", list(ch.token_ids), None, None, "error", str(err))
                for ch in sorted(st.children.values(), key=lambda c: c.index)]
        return RequestOutput(request_id=st.request_id, prompt=st.prompt, prompt_token_ids=st.prompt_token_ids,
                             prompt_logprobs=None, outputs=outs, finished=True)

    @staticmethod
    def _failure(pid: str, exc: Exception) -> RequestFailedError:
        logger.error("processing the output of request %s failed; it alone is ended", pid, exc_info=exc)
        return RequestFailedError(f"request {pid} failed while its output was processed: "
                                  f"{type(exc).__name__}: {exc}")

    def _apply_output(self, st: RequestState, ch: ChildState, o: EngineCoreOutput, now: float,
                      to_abort: list[str]) -> None:
        """One engine output into its child's state: tokens, logprobs, text, stop strings, finish."""
        obs = self.observer
        st.num_cached_tokens = max(st.num_cached_tokens, o.num_cached_tokens)
        if o.prompt_logprobs is not None and st.prompt_logprobs is not None and ch.index == 0:
            k = st.params.prompt_logprobs
            st.prompt_logprobs.extend(self._to_logprob_dict(lp, k) if lp else None for lp in o.prompt_logprobs)
        n = len(o.new_token_ids)
        if n:
            t = now if o.timestamp is None else o.timestamp
            if obs is not None:
                if ch.first_token_time is None:
                    obs.on_first_token(t - st.arrival_time, len(st.prompt_token_ids))
                else:
                    obs.on_inter_token(t - ch.last_token_time)
            if ch.first_token_time is None:
                ch.first_token_time = t
                if st.first_token_time is None:
                    st.first_token_time = t
            ch.last_token_time = t
            ch.token_ids.extend(o.new_token_ids)
        if ch.logprobs is not None and o.new_logprobs:
            for lp in o.new_logprobs:
                ch.logprobs.append(self._to_logprob_dict(lp, st.params.logprobs))
                ch.cumulative_logprob += lp.logprobs[0]
        text_ids = o.new_token_ids
        if (n and o.finish_reason == "stop" and not st.params.include_stop_str_in_output
                and text_ids[-1] in st.params._all_stop_token_ids):
            # the EOS / stop token that ended the request is not part of the text (vLLM): it shows with
            # skip_special_tokens=false (tool-call parsers need special tokens) or for a plain stop token
            text_ids = text_ids[:-1]
        stop_hit = ch.detok.add_tokens(text_ids) if ch.detok is not None and text_ids else None
        if stop_hit is not None:
            ch.finish_reason, ch.stop_reason = "stop", stop_hit
            if o.finish_reason is None:
                to_abort.append(o.request_id)
            self._finished(st, ch, now)
        elif o.finish_reason is not None:
            ch.finish_reason, ch.stop_reason = o.finish_reason, o.stop_reason
            if ch.detok is not None and o.finish_reason != "abort":
                ch.detok.flush_text()
            self._finished(st, ch, now)

    def _make_output(self, st: RequestState, updated: set[str]) -> RequestOutput | None:
        kind = st.params.output_kind
        finished = st.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        outs = []
        for cid, ch in st.children.items():
            if kind == RequestOutputKind.DELTA and cid not in updated:
                continue
            done = ch.finish_reason is not None
            if kind == RequestOutputKind.DELTA:
                if not done and ch.sent_tokens and len(ch.token_ids) - ch.sent_tokens < self.stream_interval:
                    continue  # --stream-interval: not enough new tokens yet (the first goes out at once)
                text = ch.detok.get_delta(done) if ch.detok else ""
                toks = ch.token_ids[ch.sent_tokens :]
                lps = ch.logprobs[ch.sent_logprobs :] if ch.logprobs is not None else None
                ch.sent_tokens = len(ch.token_ids)
                ch.sent_logprobs = len(ch.logprobs) if ch.logprobs is not None else 0
            else:
                text = ch.detok.visible_text(done) if ch.detok else ""
                toks, lps = list(ch.token_ids), (list(ch.logprobs) if ch.logprobs is not None else None)
            outs.append(
                CompletionOutput(ch.index, text, toks, ch.cumulative_logprob, lps, ch.finish_reason, ch.stop_reason)
            )
        if kind == RequestOutputKind.DELTA and not outs:
            return None
        outs.sort(key=lambda c: c.index)
        metrics = {
            "arrival_time": st.arrival_time,
            "first_token_time": st.first_token_time,
            "num_generation_tokens": sum(len(c.token_ids) for c in st.children.values()),
        }
        return RequestOutput(
            request_id=st.request_id,
            prompt=st.prompt,
            prompt_token_ids=st.prompt_token_ids,
            prompt_logprobs=st.prompt_logprobs,
            outputs=outs,
            finished=finished,
            num_cached_tokens=st.num_cached_tokens,
            metrics=metrics,
        )
