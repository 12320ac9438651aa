"""The scheduler: one token budget per step, no prefill/decode phases.

Each step: running requests first (each gets min(remaining, threshold, budget
left) tokens), then waiting ones while `len(running) < max_num_seqs`. Chunked
prefill falls out of this. When the pool runs dry a running request is
preempted by recompute (blocks freed, `num_computed_tokens = 0`, back to the
front of `waiting`): the last running one (fcfs) or the lowest priority one.

Applying a step's result is per-request code: an exception there fails that
request alone (`FINISHED_ERROR`, its blocks freed, an output with finish reason
"error"), the others go on. Admission refuses a request that could never fit
the whole KV cache, which would otherwise preempt itself forever.

Structured outputs: a constrained request waits (skipped, others go ahead)
until its grammar has compiled in the compiler's thread pool; each step that
samples for it carries its row of the token bitmask (`grammar_bitmask`),
filled from its matcher, and each token it generates is fed to the matcher;
the request stops when the grammar is complete. Its bitmask needs the previous
token, so `EngineCore` runs steps holding constrained requests synchronously.
A preempted request keeps its output tokens and so its matcher state.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections import deque
from dataclasses import dataclass

import numpy as np

from enginecore.config import CacheConfig, SchedulerConfig
from enginecore.faults import FaultInjector
from enginecore.kv_cache import KVCacheManager
from enginecore.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from enginecore.request import Request, RequestStatus
from enginecore.structured_outputs import GrammarCompiler, RequestGrammar, bitmask_width

logger = logging.getLogger("xlaserve.scheduler")


class SchedulerOverloadedError(RuntimeError):
    """The bounded waiting queue is full (HTTP 503)."""


class RequestRejectedError(ValueError):
    """A request that can never run (HTTP 400)."""


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens, cumulative
    prefix_cache_hits: int = 0  # tokens, cumulative
    num_preemptions: int = 0  # cumulative
    num_scheduled_tokens: int = 0  # last step
    num_structured_requests: int = 0  # requests with a structured-output constraint, cumulative
    grammar_compile_seconds: float = 0.0  # time spent compiling grammars, cumulative
    num_grammar_compiles: int = 0  # grammars compiled (cache misses), cumulative


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 faults: FaultInjector | None = None, grammar_compiler: GrammarCompiler | None = None):
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.max_model_len = scheduler_config.max_model_len
        self.kv = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            hash_algo=cache_config.prefix_caching_hash_algo,
        )
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self._last_num_scheduled = 0
        self._faults = faults  # test-only (enginecore.faults); None in normal operation
        self.grammar_compiler = grammar_compiler
        self.num_structured_requests = 0
        self._num_constrained = 0  # live constrained requests (waiting or running)
        self._deferred_outputs: list[EngineCoreOutput] = []  # failures found while scheduling

    # -- requests in and out -------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Capacity checks only (requests were validated by `InputProcessor.validate`): a request that can
        never fit the context or the KV cache gets RequestRejectedError (HTTP 400), a full waiting queue
        SchedulerOverloadedError (HTTP 503)."""
        if req.request_id in self.requests:
            raise RequestRejectedError(f"request id {req.request_id!r} is already in use")
        if not 0 < req.num_prompt_tokens < self.max_model_len:
            raise RequestRejectedError(
                f"a prompt of {req.num_prompt_tokens} tokens does not fit --max-model-len {self.max_model_len} "
                "with room for output")
        usable = self.kv.pool.num_usable_blocks
        need = -(-(req.num_prompt_tokens + 1) // self.block_size)
        if need > usable:
            raise RequestRejectedError(
                f"the prompt needs {need} KV-cache blocks but the cache only has {usable} "
                f"({usable * self.block_size} tokens)")
        # Alone it must be able to reach its last token, or it would preempt itself forever (a hang). The
        # last sampled token is never written to the cache, hence the - 1.
        longest = min(req.num_prompt_tokens + req.max_tokens, self.max_model_len) - 1
        if -(-longest // self.block_size) > usable:
            raise RequestRejectedError(
                f"the prompt ({req.num_prompt_tokens} tokens) plus max_tokens ({req.max_tokens}) needs "
                f"{longest} tokens of KV cache but the whole cache holds {usable * self.block_size} "
                f"({usable} blocks of {self.block_size}): lower max_tokens or give the KV cache more blocks")
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise SchedulerOverloadedError(
                f"the server is overloaded: {len(self.waiting)} requests are waiting "
                f"(limit set by --max-waiting-requests={self.config.max_waiting_requests})"
            )
        so = req.sampling_params.structured_outputs
        if so is not None:
            if self.grammar_compiler is None:
                raise RequestRejectedError("structured outputs are not available in this engine")
            req.grammar = RequestGrammar(self.grammar_compiler.submit(so), so.start_after_token_ids)
            self.num_structured_requests += 1
            self._num_constrained += 1
        self.requests[req.request_id] = req
        self._enqueue_waiting(req)

    def _enqueue_waiting(self, req: Request, front: bool = False) -> None:
        if self.config.scheduling_policy == "priority":
            # keep waiting sorted by (priority, arrival): lower value runs first
            items = list(self.waiting)
            items.append(req)
            items.sort(key=Request.sort_key)
            self.waiting = deque(items)
        elif front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def finish_requests(self, req_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[str]:
        """Abort (or otherwise finish) requests at any time; frees their blocks. Returns those found."""
        if isinstance(req_ids, str):
            req_ids = [req_ids]
        done = []
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                try:
                    self.waiting.remove(req)
                except ValueError:
                    pass
            req.status = status
            self._free_request(req)
            done.append(rid)
        return done

    def _free_request(self, req: Request) -> None:
        if req.grammar is not None:
            req.grammar = None  # the matcher goes with it
            self._num_constrained -= 1
        self.kv.free(req)
        self.finished_req_ids.add(req.request_id)
        del self.requests[req.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- the step ----------------------------------------------------------------------

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_output_placeholders = 0  # tokens of steps in flight are dropped; recompute samples them again
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue_waiting(victim, front=True)

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=Request.sort_key)
        return self.running[-1]

    def _num_new_tokens(self, req: Request, step: "_Step") -> tuple[int, int]:
        """(tokens to compute for `req` this step (0: nothing to do now), tokens it has left to compute)."""
        pending = req.num_output_placeholders
        if pending and (req.num_output_tokens + pending >= req.max_tokens
                        or req.num_tokens + pending >= self.max_model_len):
            return 0, 0  # the steps in flight already produce its last token
        todo = n = req.num_tokens + pending - req.num_computed_tokens
        if self.config.long_prefill_token_threshold:
            n = min(n, self.config.long_prefill_token_threshold)
        return min(step.room(n, todo), self.max_model_len - req.num_computed_tokens), todo

    def schedule(self) -> SchedulerOutput:
        """One step: running requests first, then waiting ones (vLLM's V1 order, one token budget; while more
        than one request could share the step, at most max_shared_prefill_tokens of it prompt tokens)."""
        cfg = self.config
        admissible = min(len(self.waiting), max(cfg.max_num_seqs - len(self.running), 0))
        shared = cfg.max_shared_prefill_tokens and len(self.running) + admissible > 1
        step = _Step(cfg.max_num_batched_tokens, cfg.max_shared_prefill_tokens if shared else cfg.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:  # when memory just ran out, admitting more would only thrash
            self._schedule_waiting(step)
        return self._make_output(step)

    def _schedule_running(self, step: "_Step") -> None:
        i = 0
        while i < len(self.running) and step.budget > 0:
            req = self.running[i]
            n, todo = self._num_new_tokens(req, step)
            if n <= 0:
                i += 1
                continue
            blocks = self.kv.allocate_slots(req, n)
            while blocks is None:  # out of blocks: preempt from the back until it fits (or req itself goes)
                victim = self._pick_victim()
                vi = self.running.index(victim)
                step.unschedule(victim)
                self._preempt(victim)
                step.preempted.add(victim.request_id)
                if victim is req:
                    break
                if vi < i:
                    i -= 1
                blocks = self.kv.allocate_slots(req, n)
            if blocks is None:
                continue  # req was preempted; self.running[i] is now the next one
            step.add(req, n, blocks, todo)
            i += 1

    def _schedule_waiting(self, step: "_Step") -> None:
        skipped: list[Request] = []  # constrained requests whose grammar is still compiling
        try:
            self._schedule_waiting_in_order(step, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _schedule_waiting_in_order(self, step: "_Step", skipped: list[Request]) -> None:
        cfg = self.config
        threshold = cfg.long_prefill_token_threshold
        partial_prefills = sum(1 for r in self.running if r.request_id in step.num_scheduled
                               and r.num_computed_tokens + step.num_scheduled[r.request_id] < r.num_prompt_tokens)
        while self.waiting and step.budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            if req.grammar is not None and not req.grammar.ready():
                skipped.append(self.waiting.popleft())
                continue
            if req.grammar is not None and req.grammar.error is not None:
                self.waiting.popleft()
                self._deferred_outputs.append(self._fail_request(req, ValueError(req.grammar.error)))
                continue
            hit_blocks, num_hit = self.kv.get_computed_blocks(req)
            todo = n = req.num_tokens - num_hit
            if threshold:
                n = min(n, threshold)
            if not cfg.enable_chunked_prefill and n > step.budget:
                break
            n = step.room(n, todo)
            if n == 0:
                break
            partial = num_hit + n < req.num_tokens
            if partial and partial_prefills >= cfg.max_num_partial_prefills:
                break
            blocks = self.kv.allocate_slots(req, n, hit_blocks)
            if blocks is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            partial_prefills += partial
            step.add(req, n, None, todo)
            step.new_reqs.append(NewRequestData(
                req_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                sampling_params=req.sampling_params, block_ids=self.kv.get_block_ids(req.request_id),
                num_computed_tokens=num_hit, output_token_ids=list(req.output_token_ids), seed=req.seed,
                sample_index=req.sample_index,
            ))

    def _make_output(self, step: "_Step") -> SchedulerOutput:
        cached = CachedRequestData()
        bs = self.block_size
        caching = self.kv.enable_caching
        computed_after: dict[str, int] = {}
        constrained: list[Request] = []
        for req, n, blocks in step.scheduled:
            before = req.num_computed_tokens
            if blocks is not None:
                cached.req_ids.append(req.request_id)
                cached.new_block_ids.append(blocks)
                cached.num_computed_tokens.append(before)
            after = before + n
            req.num_computed_tokens = after  # the next schedule() sees these tokens as computed
            if after == req.num_tokens + req.num_output_placeholders:
                if req.grammar is not None and req.grammar.active:
                    # its mask needs every earlier token: EngineCore runs such steps synchronously
                    assert req.num_output_placeholders == 0, "a constrained request with a token in flight"
                    constrained.append(req)
                req.num_output_placeholders += 1  # this step samples its next token
            if caching and after // bs > before // bs:
                computed_after[req.request_id] = after
        total = sum(step.num_scheduled.values())
        assert total <= self.config.max_num_batched_tokens
        assert len(self.running) <= self.config.max_num_seqs
        out = SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=step.preempted,
            computed_after=computed_after,
        )
        if constrained:
            out.structured_output_request_ids = [r.request_id for r in constrained]
            out.grammar_bitmask = self._grammar_bitmask(constrained)
        self.finished_req_ids = set()
        self._last_num_scheduled = total
        return out

    def _grammar_bitmask(self, reqs: list[Request]) -> np.ndarray:
        """[len(reqs), W] int32: each constrained request's allowed next tokens."""
        W = bitmask_width(self.grammar_compiler.tokenizer().vocab_size)
        bm = np.full((len(reqs), W), -1, np.int32)
        for i, req in enumerate(reqs):
            req.grammar.fill_bitmask(bm, i)
        return bm

    def needs_synchronous_step(self) -> bool:
        """Whether the next step may sample for a constrained request (its mask needs the previous token)."""
        if not self._num_constrained:
            return False
        return any(r.grammar is not None for r in self.running) or any(
            r.grammar is not None and r.grammar.ready() for r in self.waiting)

    def wait_for_grammars(self, timeout: float) -> None:
        """Block up to `timeout` s until a waiting request's grammar is ready (nothing else to do)."""
        pending = [r.grammar.future for r in self.waiting if r.grammar is not None and not r.grammar.ready()]
        if pending:
            concurrent.futures.wait(pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def take_deferred_outputs(self) -> list[EngineCoreOutput]:
        out, self._deferred_outputs = self._deferred_outputs, []
        return out

    # -- applying the runner's output -------------------------------------------------

    def _check_stop(self, req: Request) -> bool:
        sp = req.sampling_params
        if req.num_tokens >= self.max_model_len or req.num_output_tokens >= req.max_tokens:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if req.num_output_tokens < sp.min_tokens:
            return False
        last = req.output_token_ids[-1]
        if not sp.ignore_eos and last in req.eos_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in sp.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = last
            return True
        return False

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply a finished step. With asynchronous scheduling, later steps may already be scheduled:
        requests that finished, were aborted or were preempted since are skipped. An exception while
        applying it to one request fails that request alone (`_fail_request`)."""
        requests = self.requests
        running = RequestStatus.RUNNING
        outputs: list[EngineCoreOutput] = []
        # the step ran: blocks it filled may now serve prefix-cache hits
        for rid, upto in scheduler_output.computed_after.items():
            req = requests.get(rid)
            if req is not None and req.status == running:
                try:
                    self.kv.cache_computed_blocks(req, upto)
                except Exception as e:
                    outputs.append(self._fail_request(req, e))
        lps_all = runner_output.logprobs
        plps = runner_output.prompt_logprobs
        for idx, (rid, toks) in enumerate(zip(runner_output.req_ids, runner_output.sampled_token_ids)):
            if not toks and not plps:
                continue
            req = requests.get(rid)
            if req is None or req.status != running:
                continue  # aborted, finished or preempted after this step was scheduled
            plp = plps.get(rid) if plps else None
            if not toks and plp is None:
                continue
            try:
                outputs.append(self._update_request(req, toks, lps_all[idx] if lps_all is not None else None, plp))
            except Exception as e:
                outputs.append(self._fail_request(req, e))
        return outputs

    def _update_request(self, req: Request, toks: list[int], lp, plp) -> EngineCoreOutput:
        if self._faults is not None:
            self._faults.check("update", req.request_id)
        stopped = False
        if toks:
            req.num_output_placeholders -= len(toks)
            grammar = req.grammar
            for t in toks:
                req.output_token_ids.append(t)
                if grammar is not None:
                    grammar.accept(t)
                if self._check_stop(req):
                    stopped = True
                    break
                if grammar is not None and grammar.is_terminated():
                    req.status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
                    stopped = True
                    break
        want_lps = req.sampling_params.logprobs is not None and lp is not None
        out = EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=toks,
            new_logprobs=[lp] if want_lps and toks else None,
            prompt_logprobs=plp,
            num_cached_tokens=max(req.num_cached_tokens, 0),
        )
        if stopped:
            out.finish_reason = req.status.finish_reason
            out.stop_reason = req.stop_reason
            self.running.remove(req)
            self._free_request(req)
        return out

    def _fail_request(self, req: Request, exc: Exception) -> EngineCoreOutput:
        """End `req` alone after an exception in its own processing: blocks freed, the runner told to drop
        it; the output's stop_reason carries the error for the API side (HTTP 500)."""
        logger.error("request %s failed (its step result, or its grammar); it alone is ended", req.request_id,
                     exc_info=exc)
        if req in self.running:
            self.running.remove(req)
        req.status = RequestStatus.FINISHED_ERROR
        self._free_request(req)
        return EngineCoreOutput(request_id=req.request_id, new_token_ids=[], finish_reason="error",
                                stop_reason=f"{type(exc).__name__}: {exc}",
                                num_cached_tokens=max(req.num_cached_tokens, 0))

    # -- stats ---------------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        pool = self.kv.pool
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=pool.usage(),
            num_free_blocks=pool.num_free_blocks,
            num_used_blocks=pool.num_used_blocks,
            num_total_blocks=pool.num_usable_blocks,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self.num_preemptions,
            num_scheduled_tokens=self._last_num_scheduled,
            num_structured_requests=self.num_structured_requests,
            grammar_compile_seconds=self.grammar_compiler.compile_seconds if self.grammar_compiler else 0.0,
            num_grammar_compiles=self.grammar_compiler.num_compiled if self.grammar_compiler else 0,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def check_invariants(self) -> None:
        live = {r.request_id for r in self.running}
        self.kv.check_invariants(live)
        for r in self.waiting:
            assert r.request_id not in self.kv.req_blocks, f"waiting request {r.request_id} holds blocks"


class _Step:
    """What one schedule() call has decided so far."""

    def __init__(self, budget: int, prefill_budget: int):
        self.budget = budget
        self.prefill_budget = prefill_budget  # of tokens of requests with more than one to compute
        self.num_scheduled: dict[str, int] = {}
        self.prefill: set[str] = set()  # the requests scheduled against prefill_budget
        self.scheduled: list[tuple[Request, int, list[int] | None]] = []  # (req, tokens, new block ids | None: new)
        self.new_reqs: list[NewRequestData] = []
        self.preempted: set[str] = set()

    def room(self, n: int, todo: int) -> int:
        """Of the `n` tokens a request with `todo` to compute asks for, those it gets this step (0: none)."""
        return min(n, self.budget, self.prefill_budget if todo > 1 else n)

    def add(self, req: Request, n: int, new_block_ids: list[int] | None, todo: int) -> None:
        """`n` of `req`'s `todo` tokens left to compute (`room`'s) into this step."""
        self.num_scheduled[req.request_id] = n
        self.scheduled.append((req, n, new_block_ids))
        self.budget -= n
        if todo > 1:
            self.prefill.add(req.request_id)
            self.prefill_budget -= n

    def unschedule(self, req: Request) -> None:
        n = self.num_scheduled.pop(req.request_id, None)
        if n is not None:
            self.budget += n
            if req.request_id in self.prefill:
                self.prefill.discard(req.request_id)
                self.prefill_budget += n
            self.scheduled = [s for s in self.scheduled if s[0] is not req]
