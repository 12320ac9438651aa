"""The API process's handle on the engine core: ZeroMQ + msgpack to its process (or thread).

`AsyncEngineClient` validates and tokenizes (`InputProcessor`, the same
validation as the offline `LLM`), sends the requests over a PUSH socket, and
awaits the engine's messages on a PULL socket: one task reads them (woken by
the socket's file descriptor in the event loop, then draining every queued
message without blocking), detokenizes the outputs of one drain together
(`OutputProcessor`: a request's tokens that came together make one output),
and puts each `RequestOutput` on the queue of its request's `RequestState`.
Nothing polls.

Both modes speak the same protocol (`enginecore.wire`): the default runs
`enginecore.engine_proc` in a spawned process over `ipc://`; with
`--disable-frontend-multiprocessing` the same loop runs in a thread over
`inproc://`. A dead engine (process exit or a failed step) fails every
in-flight request with `EngineDeadError` (HTTP 503) and calls `on_dead`.

Data parallelism (`--data-parallel-size N`): N engine cores, each a plain
DP-size-1 engine in its own process (or Ray actor, or on another node's
`--headless` server), one input PUSH socket each and one shared output PULL
socket (every message names its core, `e`). `DPRouter` picks each request's
core (least loaded, prefix affinity); aborts go to the owning core, utility
calls to all of them, combined. Any core's death is the engine's death.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from typing import Callable, Protocol

import zmq

from enginecore.config import ConfigError, EngineConfig
from enginecore.engine import EngineCore
from enginecore.engine_proc import DPLayout, dp_layout, start_core_process
from enginecore.model_loader import ModelSource
from enginecore.outputs import EngineCoreOutput, RequestOutput
from enginecore.processor import InputProcessor, OutputObserver, OutputProcessor, RequestFailedError
from enginecore.sampling_params import SamplingParams
from enginecore.scheduler import RequestRejectedError, SchedulerOverloadedError, SchedulerStats
from enginecore.tokenizer import Tokenizer
from enginecore import wire
from frontend.dp_router import DPRouter, sum_stats

logger = logging.getLogger("xlaserve.engine_client")
# plain ints: pyzmq's flag enums cost microseconds an operation on the read loop's path
_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)

_EXIT_GRACE_S = 0.2
# Seconds the API server waits for data-parallel cores of other nodes (or Ray actors) to connect.
CORE_JOIN_TIMEOUT_S = 600.0
# A core over tcp that sends nothing this long (an idle one says it is alive every 2 s; a step sends its
# outputs) is gone with its node: the engine's death. Its local processes are watched by their exit instead.
CORE_SILENCE_TIMEOUT_S = 30.0


class EngineDeadError(RuntimeError):
    """The engine core is gone (HTTP 503)."""


class EngineStartupError(RuntimeError):
    """The engine core could not start; the message says why."""


class StatsObserver(OutputObserver, Protocol):
    """What the client reports: per-request events (OutputObserver) and each engine message's stats."""

    def on_engine_stats(self, stats: SchedulerStats) -> None: ...


class RequestStream:
    """Async iterator over one request's `RequestOutput`s. `abort()` is idempotent and safe in `finally`."""

    def __init__(self, client: "AsyncEngineClient", request_id: str, queue: asyncio.Queue):
        self._client = client
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            self._client._forget(self.request_id)
            raise item
        if item.finished:
            self.finished = True
            self._client._forget(self.request_id)
        return item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self._client._abort(self.request_id)


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, model: ModelSource, tokenizer: Tokenizer | concurrent.futures.Future,
                 observer: StatsObserver | None = None):
        """`tokenizer` may still be loading (a Future, `load_in_thread`): `start` launches the engine core first
        and has it by the time the engine is ready (a server's start-up: transformers' import alone took ~7 s
        of it on 2 cores, before the engine even began loading its weights)."""
        self.config = config
        self.model = model
        self.observer = observer
        self.tokenizer: Tokenizer | None = None
        self.input_processor: InputProcessor | None = None
        self.output_processor: OutputProcessor | None = None
        self.layout: DPLayout = dp_layout(config.parallel_config)
        ranks = self.layout.served
        self.engine_ranks = ranks
        self._pos = {r: i for i, r in enumerate(ranks)}  # core rank -> index in the lists below
        # per-core observers (ServerMetrics.engine: vLLM's engine label), the same one otherwise
        engine_view = getattr(observer, "engine", None)
        self._observers = [engine_view(i) if engine_view else observer for i in range(len(ranks))]
        self.engine_stats = [SchedulerStats() for _ in ranks]
        cc = config.cache_config
        self.router = DPRouter(len(ranks), cc.block_size, cc.enable_prefix_caching, cc.prefix_caching_hash_algo)
        self._owner: dict[str, int] = {}  # request id -> index of the core it went to
        self._unready: set[int] = set()
        self._joined: set[int] = set()  # cores that said hello
        self._last_heard = [0.0] * len(ranks)  # time.monotonic() of each core's latest message
        self._watch_task: asyncio.Task | None = None
        self._tokenizer_future = tokenizer if isinstance(tokenizer, concurrent.futures.Future) else None
        if self._tokenizer_future is None:
            self._set_tokenizer(tokenizer)
        self.stats = SchedulerStats()
        self.num_blocks = 0
        self.dead_reason: str | None = None
        self.on_dead: list[Callable[[str], None]] = []
        self._pending_adds: dict[str, asyncio.Future] = {}
        self._pending_calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._ready: asyncio.Future | None = None
        self._closing = False
        self._refusing: str | None = None  # set by stop_accepting(): why new requests are refused
        self._proc = None  # core 0's process (the only one without data parallelism)
        self._procs: dict[int, multiprocessing.process.BaseProcess] = {}  # rank -> local core process
        self._ray_cores = None
        self._thread: threading.Thread | None = None
        self._ipc_dir: str | None = None
        self._reader_task: asyncio.Task | None = None
        self._ctx: zmq.Context | None = None  # one for both sockets and the engine thread (inproc needs that)
        self._in: zmq.Socket | None = None  # PUSH, API -> engine (sync: sends never block, HWM 0); core 0's
        self._ins: list[zmq.Socket] = []  # one per core
        self._out: zmq.Socket | None = None  # PULL, engine -> API (read without blocking: _read_loop)

    def _set_tokenizer(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(self.config, tokenizer, max(self.model.config.vocab_size, 0))
        self.output_processor = OutputProcessor(tokenizer, self._observers[0],
                                                stream_interval=self.config.scheduler_config.stream_interval)

    # ---- lifecycle ------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def multiprocess(self) -> bool:
        return self._proc is not None or self.layout.remote or self._ray_cores is not None

    async def start(self, multiprocess: bool = True,
                    core_factory: Callable[[EngineConfig, ModelSource], EngineCore] | None = None) -> None:
        """Launch the engine core and wait until it is ready (the runner is loaded and warm).

        `core_factory(config, model)` builds the in-process core (a custom runner); default: EngineCore.
        """
        loop = asyncio.get_running_loop()
        layout, ranks = self.layout, self.engine_ranks
        if not multiprocess and len(ranks) > 1:
            raise ConfigError(f"--disable-frontend-multiprocessing runs one engine core in this process: it cannot "
                              f"run --data-parallel-size {len(ranks)}")
        self._ctx = zmq.Context()
        if layout.tcp:  # cores on other nodes or Ray actors connect to these
            out_addr, in_addrs = layout.output_address(bind=True), [layout.input_address(r, bind=True) for r in ranks]
        elif multiprocess:
            self._ipc_dir = tempfile.mkdtemp(prefix="xlaserve-")
            out_addr = f"ipc://{self._ipc_dir}/out"
            in_addrs = [f"ipc://{self._ipc_dir}/in{r}" for r in ranks]
        else:
            tag = f"{os.getpid()}-{id(self)}"
            in_addrs, out_addr = [f"inproc://xlaserve-in-{tag}"], f"inproc://xlaserve-out-{tag}"
        for addr in in_addrs:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(addr)
            self._ins.append(sock)
        self._in = self._ins[0]
        self._out = self._ctx.socket(zmq.PULL)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.bind(out_addr)
        self._ready = loop.create_future()
        self._unready = set(ranks)
        self._reader_task = asyncio.create_task(self._read_loop(), name="engine-output-reader")
        if multiprocess:
            if core_factory is not None:
                raise ValueError("core_factory is only for the in-process engine")
            connect_out = layout.output_address() if layout.tcp else out_addr
            connect_in = {r: layout.input_address(r) if layout.tcp else a for r, a in zip(ranks, in_addrs)}
            if self.config.parallel_config.data_parallel_backend == "ray" and len(ranks) > 1:
                from frontend.dp_ray import RayEngineCores

                self._ray_cores = RayEngineCores(self.config, layout, connect_in, connect_out, self._on_engine_exit)
                await self._ray_cores.start()
            else:
                for r in layout.local:
                    self._start_process(r, connect_in[r], connect_out)
            remote = [r for r in ranks if r not in layout.local and self._ray_cores is None]
            if remote:
                logger.info("waiting for data-parallel engine core(s) %s from other nodes (--headless, "
                            "--data-parallel-start-rank) at %s", ", ".join(map(str, remote)), connect_out)
            if layout.tcp:
                loop.call_later(CORE_JOIN_TIMEOUT_S, self._join_timeout, connect_out)
                self._watch_task = asyncio.create_task(self._watch_remote_cores(), name="engine-core-watch")
        else:
            self._start_thread(in_addrs[0], out_addr, core_factory)
        if self._tokenizer_future is not None:  # while the engine core loads
            self._set_tokenizer(await asyncio.wrap_future(self._tokenizer_future))
            self._tokenizer_future = None
        await self._ready

    def _start_process(self, rank: int, in_addr: str, out_addr: str) -> None:
        from enginecore.engine_proc import run_engine_process

        if self.config.parallel_config.data_parallel_size > 1:
            proc = start_core_process(self.config, rank, self.layout.local.index(rank), len(self.layout.local),
                                      in_addr, out_addr)
        else:
            proc = multiprocessing.get_context("spawn").Process(
                target=run_engine_process, name="EngineCore", daemon=False,
                args=(self.config, in_addr, out_addr, logging.getLogger("xlaserve").getEffectiveLevel(), os.getpid()))
            proc.start()
            logger.info("engine core process started (pid %d)", proc.pid)
        self._procs[rank] = proc
        if self._proc is None:
            self._proc = proc
        asyncio.get_running_loop().add_reader(proc.sentinel, self._on_process_exit, rank)

    def _start_thread(self, in_addr: str, out_addr: str, core_factory) -> None:
        from enginecore.engine_proc import serve_engine_core

        def factory() -> EngineCore:
            if core_factory is not None:
                return core_factory(self.config, self.model)
            # in-process: one tokenizer (still loading, maybe: the grammar compiler waits for it on first use)
            return EngineCore(self.config, self.model, tokenizer=self._tokenizer_future or self.tokenizer)

        loop = asyncio.get_running_loop()

        def main() -> None:
            code = 1
            try:
                code = serve_engine_core(factory, self._ctx, in_addr, out_addr)
            finally:
                if not loop.is_closed():
                    # as for the process: let the reason the loop sent on its way out arrive first
                    loop.call_soon_threadsafe(loop.call_later, _EXIT_GRACE_S, self._on_engine_exit,
                                              f"the engine core thread exited (code {code})")

        self._thread = threading.Thread(target=main, name="EngineCore", daemon=True)
        self._thread.start()

    def _on_process_exit(self, rank: int) -> None:
        loop = asyncio.get_running_loop()
        proc = self._procs[rank]
        loop.remove_reader(proc.sentinel)

        def exited() -> None:
            proc.join(0)  # by now the kernel has the exit status (at the sentinel it may not yet)
            code = proc.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            self._on_engine_exit(f"the engine core {self._core_name(rank)}process exited unexpectedly ({how})")

        # a failing engine sends its reason just before exiting: give that message a moment to arrive
        loop.call_later(_EXIT_GRACE_S, exited)

    async def _watch_remote_cores(self) -> None:
        try:
            await asyncio.shield(self._ready)
        except Exception:  # the start failed: reported there
            return
        remote = [self._pos[r] for r in self.engine_ranks if r not in self._procs]
        while not self._closing and not self.is_dead:
            await asyncio.sleep(CORE_SILENCE_TIMEOUT_S / 6)
            now = time.monotonic()
            for core in remote:
                if now - self._last_heard[core] > CORE_SILENCE_TIMEOUT_S and not self._closing:
                    self._mark_dead(f"engine core {self.engine_ranks[core]} sent nothing for "
                                    f"{CORE_SILENCE_TIMEOUT_S:.0f}s: its node or its process is gone")
                    return

    def _join_timeout(self, address: str) -> None:
        missing = sorted(set(self.engine_ranks) - self._joined)
        if missing and not self._closing:
            self._on_engine_exit(f"data-parallel engine core(s) {', '.join(map(str, missing))} did not connect to "
                                 f"{address} within {CORE_JOIN_TIMEOUT_S:.0f}s: start their node(s) with --headless "
                                 "--data-parallel-start-rank, and the head's --data-parallel-address / "
                                 "--data-parallel-rpc-port")

    def _core_name(self, rank: int) -> str:
        return f"{rank} " if len(self.engine_ranks) > 1 else ""

    def _on_engine_exit(self, reason: str) -> None:
        if self._closing:
            return
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineStartupError(reason))
        self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        if self.dead_reason is not None or self._closing:
            return
        self.dead_reason = reason
        logger.error("engine core is dead: %s", reason)
        err = EngineDeadError(f"the engine is dead: {reason}")
        for q in self._queues():
            q.put_nowait(err)
        for fut in list(self._pending_adds.values()) + list(self._pending_calls.values()):
            if not fut.done():
                fut.set_exception(err)
        for cb in list(self.on_dead):
            try:
                cb(reason)
            except Exception:
                logger.exception("on_dead callback failed")

    def stop_accepting(self, reason: str) -> None:
        """New requests get EngineDeadError(reason) (HTTP 503) from now on; those in flight go on."""
        self._refusing = reason

    def fail_all(self, reason: str) -> None:
        """End every in-flight request with EngineDeadError(reason) (HTTP 503); their streams abort them."""
        err = EngineDeadError(reason)
        for q in self._queues():
            q.put_nowait(err)
        for fut in self._pending_adds.values():
            if not fut.done():
                fut.set_exception(err)

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the engine core (politely, then by force) and release the sockets."""
        if self._closing:
            return
        self._closing = True
        for sock in self._ins:
            try:
                sock.send(wire.pack(("shutdown",)), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        loop = asyncio.get_running_loop()
        for proc in self._procs.values():
            try:
                loop.remove_reader(proc.sentinel)
            except Exception:
                pass
        await asyncio.gather(*(self._stop_process(p, timeout) for p in self._procs.values()))
        if self._ray_cores is not None:
            await self._ray_cores.shutdown(timeout)
        if self._thread is not None:
            await loop.run_in_executor(None, self._thread.join, timeout)
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self._reader_task is not None:
            self._reader_task.cancel()
            try:
                await self._reader_task
            except (asyncio.CancelledError, Exception):
                pass
        for q in self._queues():
            q.put_nowait(EngineDeadError("the server is shutting down"))
        for sock in [*self._ins, self._out]:
            if sock is not None:
                sock.close(0)
        engine_thread_gone = self._thread is None or not self._thread.is_alive()
        if self._ctx is not None and engine_thread_gone:
            self._ctx.term()
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    async def _stop_process(self, proc, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, proc.join, timeout)
        if proc.is_alive():
            logger.warning("engine core %s did not exit in %.0fs; terminating it", proc.name, timeout)
            proc.terminate()
            await loop.run_in_executor(None, proc.join, 2.0)
        if proc.is_alive():
            proc.kill()
            await loop.run_in_executor(None, proc.join, 2.0)

    # ---- requests -------------------------------------------------------------------

    def _send(self, msg, core: int = 0) -> None:
        self._ins[core].send(wire.pack(msg), zmq.NOBLOCK)

    def _queues(self):
        if self.output_processor is None:  # the tokenizer is still loading: no request yet
            return []
        return [st.queue for st in self.output_processor.states.values() if st.queue is not None]

    async def add_request(self, request_id: str, prompt, params: SamplingParams, priority: int = 0) -> RequestStream:
        """Validate, tokenize and submit; returns once the engine accepted it.

        Raises PromptError / SamplingParamsError (400), RequestRejectedError (400),
        SchedulerOverloadedError (503), EngineDeadError (503) or RequestFailedError (500).
        """
        if self.is_dead or self._closing:
            raise EngineDeadError(f"the engine is dead: {self.dead_reason or 'the server is shutting down'}")
        if self._refusing is not None:
            raise EngineDeadError(self._refusing)
        text, ids, reqs = self.input_processor.process(request_id, prompt, params, priority)
        queue: asyncio.Queue = asyncio.Queue()
        self.output_processor.add_request(request_id, text, ids, params, [r.request_id for r in reqs],
                                          arrival_time=reqs[0].arrival_time, queue=queue)
        core = self._owner[request_id] = self.router.choose(ids)  # (its n children with it: one prefix)
        fut = asyncio.get_running_loop().create_future()
        self._pending_adds[request_id] = fut
        try:
            self._send(("add", request_id, [wire.encode_request(r) for r in reqs]), core)
            err = await fut
        except BaseException:
            self._abort(request_id)
            raise
        finally:
            self._pending_adds.pop(request_id, None)
        if err is not None:
            self._forget(request_id)
            kind, message = err
            if kind == "failed":
                raise RequestFailedError(f"request {request_id} failed in the engine: {message}")
            raise (SchedulerOverloadedError if kind == "overloaded" else RequestRejectedError)(message)
        return RequestStream(self, request_id, queue)

    def _release(self, request_id: str) -> int:
        """Drop its state (its unfinished children finish as aborted, counted on its core); -> its core."""
        core = self._owner.pop(request_id, 0)
        self.output_processor.observer = self._observers[core]
        self.output_processor.abort(request_id)
        return core

    def _forget(self, request_id: str) -> None:
        """Its stream ended (the last output or an error): drop what is left of its state."""
        self._release(request_id)

    def _abort(self, request_id: str) -> None:
        child_ids = self.output_processor.unfinished_child_ids(request_id)
        core = self._release(request_id)
        if child_ids and not self.is_dead and not self._closing:
            try:
                self._send(("abort", child_ids), core)
            except zmq.ZMQError:
                pass

    async def call(self, method: str, *args, timeout: float = 60.0):
        """A utility call into every engine core (e.g. reset_prefix_cache), their answers combined: stats summed,
        booleans and-ed; otherwise one core's answer, or the list of them where they differ."""
        if self.is_dead:
            raise EngineDeadError(f"the engine is dead: {self.dead_reason}")
        values = await asyncio.gather(*(self._call_one(core, method, args, timeout)
                                        for core in range(len(self._ins))))
        if len(values) == 1:
            return values[0]
        if method == "get_stats":
            return wire.encode_stats(sum_stats([wire.decode_stats(v) for v in values]))
        if all(isinstance(v, bool) for v in values):
            return all(values)
        return values[0] if all(v == values[0] for v in values) else values

    async def _call_one(self, core: int, method: str, args, timeout: float):
        cid = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending_calls[cid] = fut
        try:
            self._send(("call", cid, method, list(args)), core)
            ok, value = await asyncio.wait_for(fut, timeout)
        finally:
            self._pending_calls.pop(cid, None)
        if not ok:
            raise RuntimeError(value)
        return value

    @property
    def engine_pid(self) -> int:
        return self._proc.pid if self._proc is not None else os.getpid()

    @property
    def engine_pids(self) -> dict[int, int]:
        """Local core processes by data-parallel rank."""
        return {r: p.pid for r, p in self._procs.items()}

    @property
    def num_in_flight(self) -> int:
        return 0 if self.output_processor is None else len(self.output_processor.states)

    # ---- the engine's messages ----------------------------------------------------------

    async def _read_loop(self) -> None:
        """Every message of the engine, in order. The socket's file descriptor wakes the loop when messages may
        have arrived (edge-triggered: ZeroMQ signals changes, not a level), so each wake drains the queue with
        non-blocking reads until it is empty, and ZMQ_EVENTS is asked once more before sleeping. zmq.asyncio's
        futures and poller callbacks cost more than that a message, and on a CPU host the API process's CPU is the
        engine's loss (the API process's CPU a streamed token: benchmarks/HISTORY.md, bench_peers)."""
        loop = asyncio.get_running_loop()
        sock = self._out
        fd = sock.getsockopt(zmq.FD)
        wake = asyncio.Event()
        loop.add_reader(fd, wake.set)
        outputs: dict[int, list[EngineCoreOutput]] = {}  # by core
        try:
            while True:
                while True:
                    try:
                        data = sock.recv(_NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(wire.unpack(data), outputs)
                if outputs:
                    for core, outs in outputs.items():
                        self._process_outputs(outs, core)
                    outputs = {}
                wake.clear()
                if sock.getsockopt(_EVENTS) & _POLLIN:
                    await asyncio.sleep(0)  # (more came meanwhile: the streams send this drain's outputs first)
                else:
                    await wake.wait()
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as e:
            if not self._closing:
                self._mark_dead(f"engine socket error: {e}")
        except Exception as e:
            logger.exception("failed to process engine output")
            self._mark_dead(f"output processing failed: {type(e).__name__}: {e}")
        finally:
            loop.remove_reader(fd)

    def _handle(self, msg: dict, outputs: dict[int, list[EngineCoreOutput]]) -> None:
        """One message; its outputs are appended to `outputs`, which the read loop processes once a drain: when
        the engine's steps come faster than this process streams their tokens (a fast model at high
        concurrency), a drain holds several steps' messages and each request gets one output (one SSE event)
        for all its new tokens instead of one a token, as vLLM's output collector merges them."""
        rank = msg.get("e", 0)
        core = self._pos.get(rank)
        if core is None:
            logger.error("a message from engine core %s, which this server does not drive", rank)
            return
        self._last_heard[core] = time.monotonic()
        if "hello" in msg:
            self._joined.add(rank)
        if "startup_error" in msg:
            reason = f"engine core {rank}: {msg['startup_error']}" if len(self._ins) > 1 else msg["startup_error"]
            if self._ready is not None and not self._ready.done():
                self._ready.set_exception(EngineStartupError(reason))
            self._mark_dead(reason)
            return
        if "stats" in msg:
            s = self.engine_stats[core] = wire.decode_stats(msg["stats"])
            self.stats = sum_stats(self.engine_stats)
            self.router.on_stats(core, s)
            observer = self._observers[core]
            if observer is not None:
                observer.on_engine_stats(s)
        if "ready" in msg:
            self.num_blocks = msg["ready"]["num_blocks"] if self.num_blocks == 0 else \
                min(self.num_blocks, msg["ready"]["num_blocks"])
            self._unready.discard(rank)
            if self._ready is not None and not self._ready.done() and not self._unready:
                self._ready.set_result(msg["ready"])
        for parent_id, err in msg.get("acks", ()):
            fut = self._pending_adds.get(parent_id)
            if fut is not None and not fut.done():
                fut.set_result(err)
        for call_id, ok, value in msg.get("results", ()):
            fut = self._pending_calls.get(call_id)
            if fut is not None and not fut.done():
                fut.set_result((ok, value))
        if "outputs" in msg:
            sent = msg.get("t")
            outputs.setdefault(core, []).extend(wire.decode_output(t, sent) for t in msg["outputs"])
        if "dead" in msg:
            for c, outs in outputs.items():  # what came before the engine died is delivered first
                self._process_outputs(outs, c)
            outputs.clear()
            self._mark_dead(f"engine core {rank}: {msg['dead']}" if len(self._ins) > 1 else msg["dead"])

    def _process_outputs(self, outputs: list[EngineCoreOutput], core: int = 0) -> None:
        self.output_processor.observer = self._observers[core]
        results, to_abort = self.output_processor.process_outputs(outputs)
        if to_abort:  # stop strings matched in the API process: the engine must drop these
            self._send(("abort", to_abort), core)
        for st, ro in results:
            if st.queue is not None:
                st.queue.put_nowait(ro)
