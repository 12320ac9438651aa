"""The engine-core side of the socket: its own process by default, or a thread.

The loop blocks on its input socket while there is nothing to do, drains every
pending message before each step (adds, aborts, utility calls), steps the
`EngineCore` while it has work, and pushes one message per iteration with
the new outputs, the acks of the adds and the scheduler stats when they
changed. So a token is on its way to the API process as soon as the step
that made it returns.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback
from typing import Callable

import zmq

from enginecore.config import EngineConfig
from enginecore.engine import EngineCore
from enginecore.scheduler import RequestRejectedError, SchedulerOverloadedError, SchedulerStats
from enginecore import wire

logger = logging.getLogger("xlaserve.engine_core")

# While idle the loop wakes this often only to notice a vanished parent process.
_IDLE_WAKE_MS = 2000


class EngineCoreLoop:
    """Runs `core` against two connected zmq sockets until told to shut down."""

    def __init__(self, core: EngineCore, in_sock: zmq.Socket, out_sock: zmq.Socket,
                 parent_alive: Callable[[], bool] | None = None):
        self.core = core
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.parent_alive = parent_alive
        self.stopped = False
        self._acks: list = []
        self._results: list = []
        self._last_stats: SchedulerStats | None = None

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.in_sock, zmq.POLLIN)
        while not self.stopped:
            if not self.core.has_work() and not poller.poll(_IDLE_WAKE_MS):
                if self.parent_alive is not None and not self.parent_alive():
                    logger.error("the API process is gone; engine core exits")
                    return
                continue
            self._drain_inputs()
            if self.stopped:
                break
            if self._acks or self._results:  # answer adds and calls now, not after a whole step
                self._publish([])
            outputs = self.core.step() if self.core.has_work() else []
            self._publish(outputs)

    def _drain_inputs(self) -> None:
        while True:
            try:
                msg = wire.unpack(self.in_sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind = msg[0]
            if kind == "add":
                self._add(msg[1], msg[2])
            elif kind == "abort":
                self.core.abort_requests(msg[1])
            elif kind == "call":
                self._call(msg[1], msg[2], msg[3])
            elif kind == "shutdown":
                self.stopped = True
                return
            else:
                logger.error("unknown message %r from the API process", kind)

    def _add(self, parent_id: str, encoded: list) -> None:
        added: list[str] = []
        try:
            for t in encoded:
                req = wire.decode_request(t)
                self.core.add_request(req)
                added.append(req.request_id)
        except SchedulerOverloadedError as e:
            self.core.abort_requests(added)
            self._acks.append((parent_id, ("overloaded", str(e))))
            return
        except (RequestRejectedError, ValueError) as e:
            self.core.abort_requests(added)
            self._acks.append((parent_id, ("rejected", str(e))))
            return
        except Exception as e:  # per-request code: this request fails (HTTP 500), the engine goes on
            logger.error("adding request %s failed", parent_id, exc_info=e)
            self.core.abort_requests(added)
            self._acks.append((parent_id, ("failed", f"{type(e).__name__}: {e}")))
            return
        self._acks.append((parent_id, None))

    def _call(self, call_id: int, method: str, args: list) -> None:
        try:
            if method == "reset_prefix_cache":
                value = self.core.reset_prefix_cache()
            elif method == "check_invariants":
                self.core.scheduler.check_invariants()
                value = True
            elif method == "get_stats":
                value = wire.encode_stats(self.core.get_stats())
            else:
                raise ValueError(f"unknown utility call {method!r}")
            self._results.append((call_id, True, value))
        except Exception as e:  # reported to the caller, the engine keeps running
            self._results.append((call_id, False, f"{type(e).__name__}: {e}"))

    def _publish(self, outputs) -> None:
        stats = self.core.get_stats()
        fresh = stats != self._last_stats  # (unchanged stats are not encoded or sent again: most decode steps')
        if not outputs and not self._acks and not self._results and not fresh:
            return
        msg: dict = {"stats": wire.encode_stats(stats)} if fresh else {}
        if outputs:
            msg["outputs"] = [wire.encode_output(o) for o in outputs]
            msg["t"] = time.monotonic()
        if self._acks:
            msg["acks"], self._acks = self._acks, []
        if self._results:
            msg["results"], self._results = self._results, []
        self._last_stats = stats
        self.out_sock.send(wire.pack(msg))


def _send(sock: zmq.Socket, msg: dict) -> None:
    sock.send(wire.pack(msg))


def serve_engine_core(core_factory: Callable[[], EngineCore], ctx: zmq.Context, input_addr: str, output_addr: str,
                      parent_alive: Callable[[], bool] | None = None) -> int:
    """Build the core, announce it, run the loop. Shared by the process and the thread."""
    in_sock = ctx.socket(zmq.PULL)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.SNDHWM, 0)
    out_sock.setsockopt(zmq.LINGER, 2000)
    in_sock.connect(input_addr)
    out_sock.connect(output_addr)
    core = None
    try:
        try:
            core = core_factory()
        except Exception as e:
            logger.error("engine core failed to start:\n%s", traceback.format_exc())
            _send(out_sock, {"startup_error": f"{type(e).__name__}: {e}"})
            return 1
        _send(out_sock, {"ready": {"num_blocks": core.num_blocks},
                         "stats": wire.encode_stats(core.get_stats())})
        try:
            EngineCoreLoop(core, in_sock, out_sock, parent_alive).run()
        except Exception as e:
            logger.error("engine core step loop failed:\n%s", traceback.format_exc())
            _send(out_sock, {"dead": f"{type(e).__name__}: {e}"})
            return 1
        return 0
    finally:
        if core is not None:
            try:
                core.shutdown()
            except Exception:
                logger.exception("runner shutdown failed")
        in_sock.close(linger=0)
        out_sock.close()




def _set_parent_death_signal() -> None:
    """Linux: get SIGKILL when the API process dies, even by SIGKILL."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except Exception:  # not Linux: the idle check of the parent pid still applies
        pass


def run_engine_process(config: EngineConfig, input_addr: str, output_addr: str, log_level: int,
                       parent_pid: int) -> None:
    """Entry point of the engine-core process (multiprocessing, spawn)."""
    _set_parent_death_signal()
    # Ctrl-C reaches the whole process group: the API process decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    from enginecore.logging_setup import configure_logging

    configure_logging(log_level, prefix="EngineCore")
    if os.getppid() != parent_pid:
        return

    def factory() -> EngineCore:
        from enginecore.model_loader import resolve_model

        return EngineCore(config, resolve_model(config.model_config.model))

    ctx = zmq.Context()
    try:
        code = serve_engine_core(factory, ctx, input_addr, output_addr, lambda: os.getppid() == parent_pid)
    finally:
        ctx.term()
    sys.exit(code)
