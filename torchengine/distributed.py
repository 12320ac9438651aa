"""One process per tensor-parallel rank, driven by rank 0 (`--tensor-parallel-size N`).

Rank 0 is the `TorchModelRunner` inside the engine. When it loads the model
it starts ranks 1..N-1 as fresh interpreters, `python -m
torchengine.distributed` with the pickled `EngineConfig` on stdin (a fresh
interpreter, unlike multiprocessing's spawn, never re-imports the user's
`__main__`); each resolves the model, builds a runner and `serve_rank()`s. All
N join one
`torch.distributed` process group (NCCL on CUDA, gloo on the CPU). Each
runner call on rank 0 (`determine_num_blocks`, `init_kv_cache`, `warmup`,
`execute`) is first broadcast, as a pickled `(name, args)`, over a gloo group,
so every rank runs the same steps on its own `InputBatch` replica and meets
rank 0 in the same collectives (the all-reduces of the row-parallel layers).
Only rank 0 samples. `shutdown()` broadcasts "shutdown" and joins the ranks.

Single host only: the ranks are local processes (multi-host torch runs would
start the ranks with torchrun instead; not done).
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: SIGTERM this worker when the engine process dies (best effort)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_worker(rank: int, config: EngineConfig, init_method: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torchengine.distributed", str(rank), init_method, str(os.getpid())]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where `torchengine` is importable from
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    # no preexec_fn: running Python between fork and exec is unsafe in a multithreaded parent
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
    proc.stdin.write(pickle.dumps(config))
    proc.stdin.close()
    return proc


def worker_main(rank: int, config: EngineConfig, init_method: str, parent_pid: int) -> None:
    _die_with_parent()
    if os.getppid() != parent_pid:  # the engine died before the signal was armed
        return
    from enginecore.model_loader import resolve_model
    from torchengine.runner import TorchModelRunner

    runner = TorchModelRunner(config, resolve_model(config.model_config.model), rank=rank, init_method=init_method)
    runner.load_model()
    runner.serve_rank()


class TPGroup:
    """The process group of the ranks, plus the gloo group that carries rank 0's commands."""

    def __init__(self, rank: int, world_size: int, group, cpu_group, workers: list):
        self.rank, self.world_size = rank, world_size
        self.group = group  # collectives of the model (NCCL or gloo)
        self.cpu_group = cpu_group  # commands and host-side reductions (gloo)
        self._workers = workers  # rank 0 only: the spawned processes
        self._atexit = None
        if workers:
            self._start_reaper()

    @classmethod
    def create(cls, config: EngineConfig, rank: int, device: torch.device, init_method: str | None) -> "TPGroup":
        world_size = config.parallel_config.tensor_parallel_size
        workers = []
        if rank == 0:
            init_method = init_method or f"tcp://127.0.0.1:{_free_port()}"
            workers = [start_worker(r, config, init_method) for r in range(1, world_size)]
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=_TIMEOUT, **kwargs)
        group = dist.group.WORLD
        cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else group
        return cls(rank, world_size, group, cpu_group, workers)

    def _start_reaper(self) -> None:
        # if the engine exits without shutdown(), the ranks wait for a command forever: stop them
        self._atexit = functools.partial(_reap, self._workers, 0.0)
        atexit.register(self._atexit)

    def broadcast(self, obj):
        """Rank 0 sends `obj`; every rank returns it."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def shutdown(self, rank: int) -> None:
        """Every rank tears its group down at about the same time (NCCL teardown may wait on the peers)."""
        if rank == 0:
            self.broadcast(("shutdown", ()))
        dist.destroy_process_group()
        if rank == 0:
            _reap(self._workers, 60.0)
            atexit.unregister(self._atexit)


def _reap(workers: list[subprocess.Popen], timeout: float) -> None:
    """Wait up to `timeout` seconds for each worker to exit, then kill it."""
    for p in workers:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


if __name__ == "__main__":
    worker_main(int(sys.argv[1]), pickle.load(sys.stdin.buffer), sys.argv[2], int(sys.argv[3]))

