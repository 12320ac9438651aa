"""The engine: `EngineCore` (scheduler + runner step loop) and `LLMEngine` (in-process, with I/O processing).

`EngineCore` is what runs in the engine process; it sees token ids only.
`LLMEngine` adds tokenization, detokenization and stop strings around it and
is used by the offline `LLM` API and by the server with
`--disable-frontend-multiprocessing`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from typing import Callable

from enginecore.config import ConfigError, EngineArgs, EngineConfig
from enginecore.faults import FaultInjector
from enginecore.model_loader import ModelSource, resolve_model
from enginecore.outputs import EngineCoreOutput, RequestOutput, SchedulerOutput
from enginecore.processor import InputProcessor, OutputProcessor, RequestFailedError
from enginecore.request import Request, RequestStatus
from enginecore.runner import create_runner
from enginecore.sampling_params import SamplingParams
from enginecore.scheduler import RequestRejectedError, Scheduler, SchedulerStats
from enginecore.structured_outputs import GrammarCompiler, build_ll_tokenizer
from enginecore.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("xlaserve.engine")


class EngineCore:
    """Scheduler + runner: `step()` schedules, runs and applies one step.

    With asynchronous scheduling (the default) a step is launched before the
    previous one's results are applied: `step()` schedules step N+1 and hands
    it to the runner, then waits for step N and applies it, so the scheduling,
    batch building and output handling of one step overlap the device's work
    on the other. Outputs are the same as with `--no-async-scheduling`
    (tested); a request that stops by EOS has one wasted step in flight.

    A step that samples for a structured-output request runs synchronously
    (the step in flight is applied first): its token bitmask needs every token
    before it. Plain batches keep the overlap.

    An exception out of `step()` (the model step, scheduling) is an engine
    death; one inside a single request's update fails that request alone
    (see `Scheduler.update_from_output`).
    """

    def __init__(self, config: EngineConfig, model: ModelSource, runner=None,
                 tokenizer: Tokenizer | concurrent.futures.Future | None = None):
        self.config = config
        self.model = model
        t0 = time.perf_counter()
        if config.parallel_config.data_parallel_size != 1:  # the server's client splits DP into DP-size-1 cores
            raise ConfigError(f"--data-parallel-size {config.parallel_config.data_parallel_size}: one engine core is "
                              "one data-parallel rank; `xlaserve serve` runs the N cores behind its API server")
        if runner is None:
            runner = create_runner(config, model)
            runner.load_model()
        self.runner = runner
        override = config.cache_config.num_gpu_blocks_override
        self.num_blocks = override if override is not None else runner.determine_num_blocks()
        runner.init_kv_cache(self.num_blocks)
        self.warmup_stats = runner.warmup() or {}
        self._faults = FaultInjector.from_env()  # test-only; None unless XLASERVE_FAULT_INJECTION is set
        self.grammar_compiler = _grammar_compiler(config, model, tokenizer, getattr(runner, "vocab_size", None))
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, self.num_blocks, self._faults,
                                   self.grammar_compiler)
        self.async_scheduling = config.scheduler_config.async_scheduling
        cache_tokens = self.scheduler.kv.pool.num_usable_blocks * config.cache_config.block_size
        if cache_tokens < config.scheduler_config.max_model_len - 1:
            logger.warning("the KV cache holds %d tokens, fewer than --max-model-len %d: requests whose prompt plus "
                           "max_tokens need more are refused (HTTP 400)", cache_tokens,
                           config.scheduler_config.max_model_len)
        self._in_flight: tuple[SchedulerOutput, object] | None = None  # (step, runner handle)
        logger.info(
            "engine ready: backend=%s platform=%s blocks=%d (block size %d)%s in %.1fs",
            config.device_config.backend, config.device_config.platform, self.num_blocks,
            config.cache_config.block_size, ", async scheduling" if self.async_scheduling else "",
            time.perf_counter() - t0,
        )

    def add_request(self, req: Request) -> None:
        self.scheduler.add_request(req)

    def abort_requests(self, req_ids) -> list[str]:
        return self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_work(self) -> bool:
        """Something to step: requests, a step in flight, or finished requests the runner must drop."""
        return self.has_unfinished_requests() or self._in_flight is not None or bool(self.scheduler.finished_req_ids)

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler
        launched = None
        outputs: list[EngineCoreOutput] = []
        synchronous = not self.async_scheduling or sched.needs_synchronous_step()
        if synchronous and self._in_flight is not None:  # a constrained request needs its tokens first
            so, handle = self._in_flight
            self._in_flight = None
            outputs = sched.update_from_output(so, handle.result())
        if sched.has_unfinished_requests() or sched.finished_req_ids:
            so = sched.schedule()
            if so.has_work:
                if self._faults is not None:
                    for rid in so.num_scheduled_tokens:
                        self._faults.check("step", rid)
                launched = (so, self.runner.execute(so))
            elif self._in_flight is None and not outputs:
                sched.wait_for_grammars(0.02)  # only compiling requests: do not spin
        outputs += sched.take_deferred_outputs()
        if not synchronous:
            done, self._in_flight = self._in_flight, launched  # apply the previous step; this one runs meanwhile
        else:
            done = launched
        if done is None:
            return outputs
        so, handle = done
        return outputs + sched.update_from_output(so, handle.result())

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.grammar_compiler.shutdown()
        self.runner.shutdown()


def _grammar_compiler(config: EngineConfig, model: ModelSource,
                      tokenizer: Tokenizer | concurrent.futures.Future | None, vocab_size: int | None) -> GrammarCompiler:
    """The structured-output grammar compiler; its llguidance tokenizer is built on first use (the engine
    process loads the tokenizer then; in-process engines share the frontend's, which may still be loading)."""
    soc = config.structured_outputs_config
    V = vocab_size or max(model.config.vocab_size, 0)

    def factory():
        if isinstance(tokenizer, concurrent.futures.Future):
            tok = tokenizer.result()
        else:
            tok = tokenizer or load_engine_tokenizer(config, model)
        return build_ll_tokenizer(tok.hf, V, tok.eos_token_ids)

    return GrammarCompiler(factory, soc.disable_any_whitespace, soc.disable_additional_properties)


def load_in_thread(fn: Callable, *args) -> concurrent.futures.Future:
    """fn(*args) on a daemon thread (a start-up that fails or is interrupted meanwhile does not wait for it):
    the tokenizer loads so while the engine loads its weights (transformers' import alone is ~7 s on 2 cores)."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
            fut.set_exception(e)

    threading.Thread(target=run, name=f"load-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return fut


def build_engine_config(args: EngineArgs) -> tuple[EngineConfig, ModelSource]:
    """Resolve the model and freeze the config: all an engine core needs to start (its tokenizer comes later)."""
    model = resolve_model(args.model)
    return args.create_engine_config(model_max_len=model.config.max_position_embeddings), model


def build_engine_parts(args: EngineArgs) -> tuple[EngineConfig, ModelSource, Tokenizer]:
    """Resolve the model and tokenizer and freeze the config (shared by every entry point)."""
    config, model = build_engine_config(args)
    return config, model, load_engine_tokenizer(config, model)


def load_engine_tokenizer(config: EngineConfig, model: ModelSource) -> Tokenizer:
    """The tokenizer `config` names for `model` (--tokenizer, --generation-config)."""
    return load_tokenizer(model, config.model_config.tokenizer,
                          use_generation_config=config.model_config.generation_config == "auto")


def served_model_names(config: EngineConfig, model: ModelSource) -> list[str]:
    names = config.model_config.served_model_name
    if names:
        return list(names)
    return [config.model_config.model or model.name]


class LLMEngine:
    """In-process engine with tokenization and detokenization (the offline `LLM`, run-batch)."""

    def __init__(self, config: EngineConfig, model: ModelSource, tokenizer: Tokenizer, core: EngineCore | None = None):
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.core = core or EngineCore(config, model, tokenizer=tokenizer)
        self.input_processor = InputProcessor(config, tokenizer, max(model.config.vocab_size, 0))
        self.output_processor = OutputProcessor(tokenizer)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        config, model = build_engine_config(args)
        tokenizer = load_in_thread(load_engine_tokenizer, config, model)  # beside the engine's load
        core = EngineCore(config, model, tokenizer=tokenizer)
        return cls(config, model, tokenizer.result(), core=core)

    def add_request(self, request_id: str, prompt, params: SamplingParams, priority: int = 0) -> list[str]:
        """Validate and submit; returns the engine ids of its children. Raises as the server's client does."""
        if self.output_processor.has(request_id):
            raise RequestRejectedError(f"request id {request_id!r} is already in use")
        text, ids, reqs = self.input_processor.process(request_id, prompt, params, priority)
        self.output_processor.add_request(request_id, text, ids, params, [r.request_id for r in reqs],
                                          arrival_time=reqs[0].arrival_time)
        added = []
        try:
            for r in reqs:
                self.core.add_request(r)
                added.append(r.request_id)
        except Exception:
            self.core.abort_requests(added)
            self.output_processor.abort(request_id)
            raise
        return [r.request_id for r in reqs]

    def abort_request(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            self.core.abort_requests(self.output_processor.unfinished_child_ids(rid))
            self.output_processor.abort(rid)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outs = self.core.step()
        results, to_abort = self.output_processor.process_outputs(outs)
        if to_abort:
            self.core.abort_requests(to_abort)
        return [self.output_processor.failed_output(st, ro) if isinstance(ro, RequestFailedError) else ro
                for st, ro in results]
