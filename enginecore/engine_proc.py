"""The engine-core side of the socket: its own process by default, or a thread.

The loop blocks on its input socket while there is nothing to do, drains every
pending message before each step (adds, aborts, utility calls), steps the
`EngineCore` while it has work, and pushes one message per iteration with
the new outputs, the acks of the adds and the scheduler stats when they
changed. So a token is on its way to the API process as soon as the step
that made it returns.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import time
import traceback
from typing import Callable

import zmq

from enginecore.config import ConfigError, EngineConfig, ParallelConfig
from enginecore.engine import EngineCore
from enginecore.scheduler import RequestRejectedError, SchedulerOverloadedError, SchedulerStats
from enginecore import wire

logger = logging.getLogger("xlaserve.engine_core")

# While idle the loop wakes this often to notice a vanished parent process and to say it is alive.
_IDLE_WAKE_MS = 2000


# ---- data parallelism: which cores run where ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DPLayout:
    """The data-parallel ranks one process deals with. `served`: the cores this API server drives (empty on a
    `--headless` node); `local`: those it starts itself; `tcp`: the cores reach the API server over tcp at
    --data-parallel-address:--data-parallel-rpc-port (output) and rpc-port + 1 + rank (each core's input), as
    cores on other nodes and Ray actors must; else ipc."""

    served: list[int]
    local: list[int]
    tcp: bool
    address: str
    rpc_port: int

    @property
    def remote(self) -> bool:
        return any(r not in self.local for r in self.served)

    def _addr(self, port: int, bind: bool) -> str:
        return f"tcp://{'*' if bind and self.address not in ('127.0.0.1', 'localhost') else self.address}:{port}"

    def output_address(self, bind: bool = False) -> str:
        return self._addr(self.rpc_port, bind)

    def input_address(self, rank: int, bind: bool = False) -> str:
        return self._addr(self.rpc_port + 1 + rank, bind)


def dp_layout(pc: ParallelConfig, headless: bool = False) -> DPLayout:
    """vLLM's data-parallel deployments: one API server for every core (`--data-parallel-size-local L` of them on
    this node, the rest on `--headless` nodes from `--data-parallel-start-rank`), one per node for its own cores
    (`--data-parallel-hybrid-lb`), or one per rank (`--data-parallel-external-lb --data-parallel-rank R`)."""
    n, start = pc.data_parallel_size, pc.data_parallel_start_rank
    if n > 1 and pc.nnodes > 1:
        raise ConfigError(f"--data-parallel-size {n} with --nnodes {pc.nnodes}: each data-parallel core is an engine of "
                          "one node; spread the cores over nodes with --data-parallel-size-local / "
                          "--data-parallel-start-rank / --headless")
    local_n = n - start if pc.data_parallel_size_local is None else pc.data_parallel_size_local
    if start + local_n > n:
        raise ConfigError(f"--data-parallel-start-rank {start} + --data-parallel-size-local {local_n} exceeds "
                          f"--data-parallel-size {n}")
    local = list(range(start, start + local_n))
    address = pc.data_parallel_address or "127.0.0.1"
    ray = pc.data_parallel_backend == "ray" and n > 1
    if headless:
        if n == 1 or not local:
            raise ConfigError("--headless with data parallelism runs this node's cores: give --data-parallel-size N, "
                              "--data-parallel-size-local L (> 0) and --data-parallel-start-rank as the head's "
                              "--data-parallel-address / --data-parallel-rpc-port")
        if pc.data_parallel_hybrid_lb or pc.data_parallel_external_lb or ray:
            raise ConfigError("--headless nodes serve a head's API server over mp; with --data-parallel-hybrid-lb / "
                              "--data-parallel-external-lb every node runs its own server, with "
                              "--data-parallel-backend ray the head places every core")
        return DPLayout([], local, True, address, pc.data_parallel_rpc_port)
    if pc.data_parallel_external_lb:
        if n > 1 and pc.data_parallel_rank is None:
            raise ConfigError("--data-parallel-external-lb runs one rank a server: give --data-parallel-rank")
        rank = pc.data_parallel_rank or 0
        return DPLayout([rank], [rank], False, address, pc.data_parallel_rpc_port)
    if pc.data_parallel_hybrid_lb:
        if not local:
            raise ConfigError("--data-parallel-hybrid-lb: this node's server needs --data-parallel-size-local > 0")
        return DPLayout(local, local, False, address, pc.data_parallel_rpc_port)
    if start != 0:
        raise ConfigError(f"--data-parallel-start-rank {start}: the API server's node runs the cores from rank 0; "
                          "the other nodes run --headless")
    if ray:
        return DPLayout(list(range(n)), [], True, address, pc.data_parallel_rpc_port)
    served = list(range(n))
    return DPLayout(served, local, local != served, address, pc.data_parallel_rpc_port)


def core_config(config: EngineConfig, rank: int) -> EngineConfig:
    """What one data-parallel core runs: a plain DP-size-1 engine (its own --tensor-parallel-size group)."""
    pc = config.parallel_config
    if pc.data_parallel_size == 1:
        return config
    one = dataclasses.replace(pc, data_parallel_size=1, data_parallel_size_local=None, data_parallel_rank=None,
                              data_parallel_start_rank=0, data_parallel_hybrid_lb=False,
                              data_parallel_external_lb=False)
    return dataclasses.replace(config, parallel_config=one)


def core_placement(config: EngineConfig, index: int, num_local: int) -> tuple[dict[str, str], list[int] | None]:
    """(env, CPUs) of the `index`-th of this node's `num_local` cores. A CPU host's threads are split between
    them: each core pinned to its slice of the CPUs this process may use and OMP_NUM_THREADS of
    (OMP_NUM_THREADS or those CPUs) / num_local (XLA sizes its intra-op pool by the pinned CPUs, torch takes
    OMP_NUM_THREADS). CUDA: core i sees local devices [i*TP, (i+1)*TP); TPU: chips the same way."""
    tp = config.parallel_config.tensor_parallel_size
    platform = config.device_config.platform
    if platform == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = visible.split(",") if visible else [str(i) for i in range(num_local * tp)]
        mine = devices[index * tp:(index + 1) * tp]
        if len(mine) < tp:
            raise ConfigError(f"--data-parallel-size-local {num_local} x --tensor-parallel-size {tp} needs "
                              f"{num_local * tp} GPUs; CUDA_VISIBLE_DEVICES has {len(devices)}")
        return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}, None
    if platform == "tpu":
        chips = ",".join(str(c) for c in range(index * tp, (index + 1) * tp))
        return {"TPU_VISIBLE_CHIPS": chips, "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_CHIPS_PER_PROCESS_BOUNDS": f"1,{tp},1",
                "TPU_PROCESS_PORT": str(8476 + index), "TPU_PROCESS_ADDRESSES": f"localhost:{8476 + index}",
                "CLOUD_TPU_TASK_ID": "0"}, None
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = list(range(os.cpu_count() or 1))
    env_threads = os.environ.get("OMP_NUM_THREADS", "")
    threads = int(env_threads) if env_threads.isdigit() and int(env_threads) > 0 else len(cpus)
    per = max(1, len(cpus) // num_local)
    mine = cpus[index * per:(index + 1) * per] if len(cpus) >= num_local else [cpus[index % len(cpus)]]
    return {"OMP_NUM_THREADS": str(max(1, threads // num_local))}, mine


class EngineCoreLoop:
    """Runs `core` against two connected zmq sockets until told to shut down."""

    def __init__(self, core: EngineCore, in_sock: zmq.Socket, out_sock: zmq.Socket,
                 parent_alive: Callable[[], bool] | None = None, engine_index: int = 0):
        self.core = core
        self.engine_index = engine_index
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
                # idle, yet alive: what tells an API server on another node that this core still is
                self.out_sock.send(wire.pack({"e": self.engine_index}))
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
        msg: dict = {"e": self.engine_index}
        if fresh:
            msg["stats"] = wire.encode_stats(stats)
        if outputs:
            msg["outputs"] = [wire.encode_output(o) for o in outputs]
            msg["t"] = time.monotonic()
        if self._acks:
            msg["acks"], self._acks = self._acks, []
        if self._results:
            msg["results"], self._results = self._results, []
        self._last_stats = stats
        self.out_sock.send(wire.pack(msg))


def serve_engine_core(core_factory: Callable[[], EngineCore], ctx: zmq.Context, input_addr: str, output_addr: str,
                      parent_alive: Callable[[], bool] | None = None, engine_index: int = 0) -> int:
    """Build the core, announce it, run the loop. Shared by the process, the thread and the Ray actor.

    `engine_index`: the data-parallel rank of this core; every message carries it (`e`), since the cores of a
    data-parallel engine all push to the API process's one output socket."""

    def _send(sock: zmq.Socket, msg: dict) -> None:
        msg["e"] = engine_index
        sock.send(wire.pack(msg))

    in_sock = ctx.socket(zmq.PULL)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.SNDHWM, 0)
    out_sock.setsockopt(zmq.LINGER, 2000)
    in_sock.connect(input_addr)
    out_sock.connect(output_addr)
    core = None
    try:
        _send(out_sock, {"hello": os.getpid()})  # joined (the API server times out cores that never do)
        try:
            core = core_factory()
        except Exception as e:
            logger.error("engine core failed to start:\n%s", traceback.format_exc())
            _send(out_sock, {"startup_error": f"{type(e).__name__}: {e}"})
            return 1
        _send(out_sock, {"ready": {"num_blocks": core.num_blocks},
                         "stats": wire.encode_stats(core.get_stats())})
        try:
            EngineCoreLoop(core, in_sock, out_sock, parent_alive, engine_index).run()
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


def apply_core_placement(env: dict[str, str], cpus: list[int] | None) -> None:
    """A data-parallel core's share of the host, before jax / torch are imported: its devices (env:
    CUDA_VISIBLE_DEVICES, TPU_VISIBLE_CHIPS, ...) and on a CPU its threads (OMP_NUM_THREADS and the CPUs it may
    run on, which XLA's intra-op pool and torch size themselves by)."""
    os.environ.update(env)
    if cpus:
        try:
            os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError) as e:  # not Linux, or CPUs the host does not give us: threads only
            logger.warning("could not pin the engine core to CPUs %s: %s", cpus, e)


def run_engine_process(config: EngineConfig, input_addr: str, output_addr: str, log_level: int,
                       parent_pid: int, engine_index: int = 0, env: dict[str, str] | None = None,
                       cpus: list[int] | None = None) -> None:
    """Entry point of the engine-core process (multiprocessing, spawn)."""
    _set_parent_death_signal()
    apply_core_placement(env or {}, cpus)
    # Ctrl-C reaches the whole process group: the API process decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    from enginecore.logging_setup import configure_logging

    configure_logging(log_level, prefix="EngineCore" if env is None else f"EngineCore_DP{engine_index}")
    if os.getppid() != parent_pid:
        return

    def factory() -> EngineCore:
        from enginecore.model_loader import resolve_model

        return EngineCore(config, resolve_model(config.model_config.model))

    ctx = zmq.Context()
    try:
        code = serve_engine_core(factory, ctx, input_addr, output_addr, lambda: os.getppid() == parent_pid,
                                 engine_index)
    finally:
        ctx.term()
    sys.exit(code)


def start_core_process(config: EngineConfig, rank: int, index: int, num_local: int, input_addr: str,
                       output_addr: str):
    """Spawn data-parallel core `rank` (this node's `index`-th of `num_local`) on its share of the node."""
    import multiprocessing

    env, cpus = core_placement(config, index, num_local)
    level = logging.getLogger("xlaserve").getEffectiveLevel()
    proc = multiprocessing.get_context("spawn").Process(
        target=run_engine_process, name=f"EngineCore_DP{rank}", daemon=False,
        args=(core_config(config, rank), input_addr, output_addr, level, os.getpid(), rank, env, cpus))
    proc.start()
    logger.info("data-parallel engine core %d process started (pid %d; %s%s)", rank, proc.pid,
                ", ".join(f"{k}={v}" for k, v in sorted(env.items())), f", CPUs {cpus}" if cpus else "")
    return proc


def run_dp_node(config: EngineConfig, stop=None) -> int:
    """`serve --headless` with data parallelism: this node's cores (--data-parallel-size-local from
    --data-parallel-start-rank), connected over tcp to the head's API server at --data-parallel-address /
    --data-parallel-rpc-port, until it shuts them down. A core that dies is reported to the head as its death
    (the head serves 503 and exits); then this node stops its other cores and exits 1. `stop` (a
    threading.Event, set on SIGTERM / SIGINT): stop the cores and tell the head they are gone."""
    from multiprocessing.connection import wait

    layout = dp_layout(config.parallel_config, headless=True)
    logger.info("headless data-parallel node: engine cores %s of %d, API server at %s", layout.local,
                config.parallel_config.data_parallel_size, layout.output_address())
    procs = {r: start_core_process(config, r, i, len(layout.local), layout.input_address(r), layout.output_address())
             for i, r in enumerate(layout.local)}
    stopping: list[bool] = []
    code = 0
    while procs and not stopping:
        if stop is not None and stop.is_set():
            logger.info("headless data-parallel node: stopping engine cores %s", sorted(procs))
            for rank in procs:
                _report_death(layout.output_address(), rank, f"the headless node running engine core {rank} "
                                                             "was stopped")
            break
        for sentinel in wait([p.sentinel for p in procs.values()], timeout=1.0):
            rank = next(r for r, p in procs.items() if p.sentinel == sentinel)
            proc = procs.pop(rank)
            proc.join()
            if proc.exitcode != 0:
                how = f"killed by signal {-proc.exitcode}" if proc.exitcode < 0 else f"exit code {proc.exitcode}"
                logger.error("data-parallel engine core %d exited unexpectedly (%s)", rank, how)
                _report_death(layout.output_address(), rank, f"the engine core {rank} process exited unexpectedly "
                                                             f"({how}) on a headless node")
                code = 1
                stopping.append(True)
    for proc in procs.values():
        proc.terminate()
    for proc in procs.values():
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    logger.info("headless data-parallel node stopped")
    return code


def _report_death(output_addr: str, rank: int, reason: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    try:
        sock.connect(output_addr)
        sock.send(wire.pack({"e": rank, "dead": reason}))
    finally:
        sock.close()
        ctx.term()
