"""The process group of `--tensor-parallel-size N`, and the processes (or Ray actors) of its ranks.

- `RankPlacement`: where a rank runs: its global rank, its index among its host's ranks (its CUDA device) and the
  rendezvous `tcp://A:P`. With `--nnodes M` every node runs N / M ranks (`ranks_per_node`), node R ranks
  R * N/M .. (R + 1) * N/M - 1; rank 0 (node 0) serves the rendezvous, a torch `TCPStore`.
- `TPGroup`: a rank's view of the group: the model's collectives (NCCL on CUDA, gloo on the CPU) and a gloo
  group that carries rank 0's commands (`broadcast`) and host-side reductions (`min_over_ranks`). Joining
  waits `XLASERVE_DISTRIBUTED_TIMEOUT` seconds for every rank, then fails naming the rendezvous and the ranks
  missing (`RankJoinError`).
- `RankWorkers` (`--distributed-executor-backend mp`): a host's ranks other than its first as fresh
  interpreters, `python -m <module> parent_pid` with the pickled `(EngineConfig, RankPlacement)` on stdin (a
  fresh interpreter, unlike multiprocessing's spawn, never re-imports the user's `__main__`); `read_worker_args`
  and `die_with_parent` are the worker's side of that start.
- `RayRankActors` (`--distributed-executor-backend ray`): ranks 1..N-1 as Ray actors, one placement-group bundle
  per rank (`enginecore.ray_utils`), wherever the cluster has room.

Both watch their ranks (`check()`: rank 0 calls it before each command), so a rank that died fails the next step
at once instead of leaving rank 0 waiting in a collective.

What the ranks run, and the commands rank 0 broadcasts, are `torchengine.tp_runner`'s, which sits above this
module and `torchengine.runner`: this module imports neither.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import functools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from enginecore import envs
from enginecore.config import ConfigError, EngineConfig, ParallelConfig
from enginecore.logging_setup import configure_logging

_TIMEOUT = datetime.timedelta(minutes=10)  # one collective of a step
# ranks > 0 wait for rank 0's next command on the command group: a server may sit idle for days
_IDLE_TIMEOUT = datetime.timedelta(days=365)
_RAY_CHECK_S = 0.5  # how often rank 0 asks Ray whether its rank actors are alive
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where `torchengine` is importable from


class RankJoinError(RuntimeError):
    """A rank could not reach the rendezvous, or not every rank joined it, within the join timeout."""


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank of the group runs."""

    rank: int  # global rank, 0..tensor_parallel_size - 1
    local_rank: int  # among the ranks of its host (or its Ray actor): its CUDA device
    local_size: int  # ranks on its host: they share its CPU threads
    init_method: str  # tcp://A:P, the TCPStore rank 0 serves


def ranks_per_node(pc: ParallelConfig) -> int:
    """`--tensor-parallel-size` / `--nnodes`: the ranks each node runs."""
    if pc.tensor_parallel_size % pc.nnodes:
        raise ConfigError(f"--tensor-parallel-size {pc.tensor_parallel_size} must be a multiple of --nnodes "
                          f"{pc.nnodes}: every node runs the same number of ranks")
    return pc.tensor_parallel_size // pc.nnodes


def node_placements(pc: ParallelConfig, init_method: str) -> list[RankPlacement]:
    """The ranks of node `--node-rank`, its first (the one in the node's main process) first."""
    local = ranks_per_node(pc)
    return [RankPlacement(pc.node_rank * local + i, i, local, init_method) for i in range(local)]


def free_init_method(host: str = "127.0.0.1") -> str:
    """A TCP rendezvous on a free port of `host` (an address of this machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def _host_port(init_method: str) -> tuple[str, int]:
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


def start_worker(module: str, config: EngineConfig, placement: RankPlacement) -> subprocess.Popen:
    """`python -m module parent_pid`, the pickled (config, placement, log level) on its stdin
    (`read_worker_args`)."""
    cmd = [sys.executable, "-m", module, str(os.getpid())]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])))
    # no preexec_fn: running Python between fork and exec is unsafe in a multithreaded parent
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
    proc.stdin.write(pickle.dumps((config, placement, _log_level())))
    proc.stdin.close()
    return proc


def read_worker_args() -> tuple[EngineConfig, RankPlacement, int]:
    """In a worker `start_worker` started: (config, placement, parent_pid); its log set up as its parent's."""
    config, placement, log_level = pickle.load(sys.stdin.buffer)
    configure_logging(log_level, prefix=f"rank {placement.rank}")
    return config, placement, int(sys.argv[1])


def _log_level() -> int:
    return logging.getLogger("xlaserve").getEffectiveLevel()


def die_with_parent(parent_pid: int) -> bool:
    """Linux: SIGTERM this worker when the engine process dies (best effort). False if it has died already
    (before the signal was armed)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    return os.getppid() == parent_pid


class RankWorkers:
    """A host's processes of the ranks `placements`, each `python -m module` (`start_worker`)."""

    def __init__(self, module: str, config: EngineConfig, placements: list[RankPlacement]):
        self._ranks = [p.rank for p in placements]
        self._procs = [start_worker(module, config, p) for p in placements]
        # if the engine exits without shutdown(), the ranks wait for a command forever: stop them
        self._atexit = functools.partial(_reap, self._procs, 0.0)
        atexit.register(self._atexit)

    def check(self) -> None:
        """Raise if a rank's process has exited (the group cannot run a step without it)."""
        for rank, p in zip(self._ranks, self._procs):
            if p.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} (pid {p.pid}) exited with status {p.returncode}")

    def join(self, timeout: float) -> list[int]:
        """Wait up to `timeout` seconds for each to exit, then kill it; their exit statuses."""
        _reap(self._procs, timeout)
        atexit.unregister(self._atexit)
        return [p.returncode for p in self._procs]


class _RankActor:
    """A Ray actor that runs one rank: `run` returns when rank 0 shuts the group down."""

    def run(self, target: Callable, config: EngineConfig, placement: RankPlacement, log_level: int) -> None:
        configure_logging(log_level, prefix=f"rank {placement.rank}")
        target(config, placement)


class RayRankActors:
    """Ranks 1..N-1 as Ray actors, in bundles 1..N-1 of one placement group (bundle 0 holds rank 0's share: the
    engine process's CPU or GPU). Each runs `target(config, placement)` (the same loop as a process rank)."""

    def __init__(self, target: Callable, config: EngineConfig, init_method: str):
        from enginecore.ray_utils import bundle_options, import_ray, placement_group

        ray = import_ray()
        pc = config.parallel_config
        cuda = config.device_config.platform == "cuda"
        n = pc.tensor_parallel_size
        # PACK keeps one host's ranks together; with --nnodes > 1 SPREAD lays them over the cluster's nodes
        self._pg = placement_group([{"GPU": 1} if cuda else {"CPU": 1} for _ in range(n)],
                                   strategy="SPREAD" if pc.nnodes > 1 else "PACK")
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))}
        actor_cls = ray.remote(num_cpus=0 if cuda else 1, num_gpus=1 if cuda else 0)(_RankActor)
        self._ranks = list(range(1, n))
        # each actor sees only its own GPU (Ray sets CUDA_VISIBLE_DEVICES): device 0, its CPU share alone
        self._actors = [actor_cls.options(runtime_env={"env_vars": env}, **bundle_options(self._pg, r)).remote()
                        for r in self._ranks]
        self._runs = [a.run.remote(target, config, RankPlacement(r, 0, 1, init_method), _log_level())
                      for r, a in zip(self._ranks, self._actors)]
        self._checked = 0.0  # time.monotonic() of the last check
        self._atexit = self.kill
        atexit.register(self._atexit)

    def check(self) -> None:
        """Raise if a rank's actor has ended (it only ends on Shutdown). Asks Ray at most every
        `_RAY_CHECK_S` (a question costs ~0.1 ms; a step on a GPU a few ms)."""
        import ray

        now = time.monotonic()
        if now - self._checked < _RAY_CHECK_S:
            return
        self._checked = now
        done, _ = ray.wait(self._runs, num_returns=1, timeout=0)
        if done:
            rank = self._ranks[self._runs.index(done[0])]
            try:
                ray.get(done[0])
            except Exception as e:
                raise RuntimeError(f"tensor-parallel rank {rank} (Ray actor) failed: {e}") from None
            raise RuntimeError(f"tensor-parallel rank {rank} (Ray actor) left the group")

    def join(self, timeout: float) -> list[int]:
        """Wait up to `timeout` seconds for each actor's loop to end, then kill the actors and free the placement
        group; 0 for each loop that ended by itself, 1 otherwise."""
        import ray

        done, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout)
        codes = []
        for ref in self._runs:
            ok = ref in done
            if ok:
                try:
                    ray.get(ref)
                except Exception:  # the rank's loop raised
                    ok = False
            codes.append(0 if ok else 1)
        self.kill()
        atexit.unregister(self._atexit)
        return codes

    def kill(self) -> None:
        """Kill the actors and free their placement group (once)."""
        from enginecore.ray_utils import release

        release(self._actors, self._pg)
        self._actors, self._pg = [], None


class TPGroup:
    """The process group of the ranks, plus the gloo group that carries rank 0's commands."""

    def __init__(self, rank: int, world_size: int, group, cpu_group):
        self.rank, self.world_size = rank, world_size
        self.group = group  # collectives of the model (NCCL or gloo)
        self.cpu_group = cpu_group  # commands and host-side reductions (gloo)

    @classmethod
    def create(cls, config: EngineConfig, placement: RankPlacement, device: torch.device) -> "TPGroup":
        """Join the group (every rank calls this; it returns once all have, or raises `RankJoinError`)."""
        rank, world_size = placement.rank, config.parallel_config.tensor_parallel_size
        store = _join(placement, world_size, envs.XLASERVE_DISTRIBUTED_TIMEOUT)
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=_TIMEOUT, **kwargs)
        group = dist.group.WORLD
        # its own group, even on the CPU: waiting for a command must not time out as a step's collective does
        cpu_group = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        return cls(rank, world_size, group, cpu_group)

    def broadcast(self, obj):
        """Rank 0 sends `obj`; every rank returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def shutdown(self) -> None:
        """Leave the group. Every rank does so at about the same time (NCCL teardown may wait on the peers)."""
        dist.destroy_process_group()


def _join(placement: RankPlacement, world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous: rank 0 serves a TCPStore at A:P, each rank connects and checks in, and all wait until every
    rank has; within `timeout_s`, else a `RankJoinError` naming A:P and the ranks that did not come."""
    host, port = _host_port(placement.init_method)
    timeout = datetime.timedelta(seconds=timeout_s)
    rank = placement.rank
    try:
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    except dist.DistError as e:
        what = "could not serve" if rank == 0 else "could not reach rank 0 (node 0) at"
        raise RankJoinError(f"tensor-parallel rank {rank}: {what} the rendezvous {host}:{port} within {timeout_s:g}s "
                            f"(--master-addr / --master-port; XLASERVE_DISTRIBUTED_TIMEOUT): {e}") from None
    keys = [f"xlaserve/joined/{r}" for r in range(world_size)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, timeout)
    except dist.DistError:
        try:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
        except dist.DistError:  # rank 0, and its store, are gone
            missing = "unknown"
        raise RankJoinError(f"tensor-parallel rank {rank}: ranks {missing} of {world_size} did not join the "
                            f"rendezvous {host}:{port} within {timeout_s:g}s (XLASERVE_DISTRIBUTED_TIMEOUT)") from None
    return store


def _reap(workers: list[subprocess.Popen], timeout: float) -> None:
    """Wait up to `timeout` seconds for each worker to exit, then kill it."""
    for p in workers:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
