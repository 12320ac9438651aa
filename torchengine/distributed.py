"""The process group of `--tensor-parallel-size N`, and the local processes of ranks 1..N-1.

- `TPGroup`: a rank's view of the group: the model's collectives (NCCL on CUDA, gloo on the CPU) and a gloo
  group that carries rank 0's commands (`broadcast`) and host-side reductions (`min_over_ranks`).
- `RankWorkers`: rank 0 starts ranks 1..N-1 as fresh interpreters, `python -m <module> rank init_method
  parent_pid` with the pickled `EngineConfig` on stdin (a fresh interpreter, unlike multiprocessing's spawn,
  never re-imports the user's `__main__`), and reaps them; `read_worker_args` and `die_with_parent` are the
  worker's side of that start.

What the ranks run, and the commands rank 0 broadcasts, are `torchengine.tp_runner`'s, which sits above this
module and `torchengine.runner`: this module imports neither.

Single host only: the ranks are local processes (multi-host torch runs would start the ranks with torchrun
instead; not done).
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import functools
import os
import pickle
import signal
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

from enginecore.config import EngineConfig

_TIMEOUT = datetime.timedelta(minutes=10)


def free_init_method() -> str:
    """A TCP rendezvous on a free local port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def start_worker(module: str, rank: int, config: EngineConfig, init_method: str) -> subprocess.Popen:
    """`python -m module rank init_method parent_pid`, the pickled config on its stdin (`read_worker_args`)."""
    cmd = [sys.executable, "-m", module, str(rank), init_method, str(os.getpid())]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where `torchengine` is importable from
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    # no preexec_fn: running Python between fork and exec is unsafe in a multithreaded parent
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
    proc.stdin.write(pickle.dumps(config))
    proc.stdin.close()
    return proc


def read_worker_args() -> tuple[int, EngineConfig, str, int]:
    """In a worker `start_worker` started: (rank, config, init_method, parent_pid)."""
    return int(sys.argv[1]), pickle.load(sys.stdin.buffer), sys.argv[2], int(sys.argv[3])


def die_with_parent(parent_pid: int) -> bool:
    """Linux: SIGTERM this worker when the engine process dies (best effort). False if it has died already
    (before the signal was armed)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    return os.getppid() == parent_pid


class RankWorkers:
    """Rank 0's processes of ranks 1..N-1, each `python -m module` (`start_worker`)."""

    def __init__(self, module: str, config: EngineConfig, init_method: str):
        world_size = config.parallel_config.tensor_parallel_size
        self._procs = [start_worker(module, r, config, init_method) for r in range(1, world_size)]
        # if the engine exits without shutdown(), the ranks wait for a command forever: stop them
        self._atexit = functools.partial(_reap, self._procs, 0.0)
        atexit.register(self._atexit)

    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for each to exit, then kill it."""
        _reap(self._procs, timeout)
        atexit.unregister(self._atexit)


class TPGroup:
    """The process group of the ranks, plus the gloo group that carries rank 0's commands."""

    def __init__(self, rank: int, world_size: int, group, cpu_group):
        self.rank, self.world_size = rank, world_size
        self.group = group  # collectives of the model (NCCL or gloo)
        self.cpu_group = cpu_group  # commands and host-side reductions (gloo)

    @classmethod
    def create(cls, config: EngineConfig, rank: int, device: torch.device, init_method: str) -> "TPGroup":
        """Join the group (every rank calls this; it returns once all have)."""
        world_size = config.parallel_config.tensor_parallel_size
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=_TIMEOUT, **kwargs)
        group = dist.group.WORLD
        cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else group
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


def _reap(workers: list[subprocess.Popen], timeout: float) -> None:
    """Wait up to `timeout` seconds for each worker to exit, then kill it."""
    for p in workers:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
