"""What rank 0 of a multi-process engine tells the other ranks, and their loop (both backends).

Rank 0 runs the scheduler; each call it makes on its runner (`determine_num_blocks`, `init_kv_cache`, `warmup`,
`execute`) is first sent to every other rank as one of the typed commands below, so each rank runs the same
calls on its own runner (its own `InputBatch` replica) and meets rank 0 in the same collectives; only rank 0's
results are returned. The transport is the backend's: torch.distributed's gloo group
(`torchengine.distributed.TPGroup.broadcast`), jax.distributed's coordination service (`jaxengine.multihost`).

`LeaderRunner` is rank 0's side for any runner and transport; `serve_rank` the other ranks'. Pure Python: this
module imports neither backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from enginecore.outputs import SchedulerOutput


@dataclass(frozen=True)
class DetermineNumBlocks:
    """`determine_num_blocks()`; the ranks agree on the minimum (each transport's `min_over_ranks`)."""


@dataclass(frozen=True)
class InitKVCache:
    num_blocks: int


@dataclass(frozen=True)
class Warmup:
    pass


@dataclass(frozen=True)
class Execute:
    scheduler_output: SchedulerOutput


@dataclass(frozen=True)
class Shutdown:
    """Sent after rank 0 has released its model and cache; every rank then leaves the group."""


RankCommand = DetermineNumBlocks | InitKVCache | Warmup | Execute | Shutdown


class LeaderRunner:
    """Rank 0's runner: each call is sent to the other ranks (`send(command)`), then run on `local`.

    `send` returns False while there is no group to send to (before it formed): the call then runs here only.
    """

    def __init__(self, local, send: Callable[[RankCommand], bool]):
        self.local = local
        self._send = send

    def load_model(self) -> None:
        self.local.load_model()

    def determine_num_blocks(self) -> int:
        self._send(DetermineNumBlocks())
        return self.local.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self._send(InitKVCache(num_blocks))
        self.local.init_kv_cache(num_blocks)

    def warmup(self) -> dict:
        self._send(Warmup())
        return self.local.warmup()

    def execute(self, so: SchedulerOutput):
        self._send(Execute(so))
        return self.local.execute(so)

    def __getattr__(self, name):  # model, input_batch, kv_caches ... for tests and tools
        if name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)


def serve_rank(runner, receive: Callable[[], RankCommand], name: str = "rank") -> None:
    """Ranks > 0: run rank 0's commands (`receive()` blocks for the next) until it shuts down. Each step runs to
    its end: these ranks return nothing. `runner.shutdown()` ends the loop on `Shutdown`."""
    while True:
        match receive():
            case DetermineNumBlocks():
                runner.determine_num_blocks()
            case InitKVCache(num_blocks):
                runner.init_kv_cache(num_blocks)
            case Warmup():
                runner.warmup()
            case Execute(scheduler_output):
                runner.execute(scheduler_output).result()
            case Shutdown():
                runner.shutdown()
                return
            case other:
                raise TypeError(f"{name}: {other!r} is not a command of rank 0")
