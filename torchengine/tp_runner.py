"""The torch backend's entry (`create_runner`), and `--tensor-parallel-size N`: rank 0 and the other ranks' loop.

Rank 0 is a `TensorParallelRunner` inside the engine. When it loads the model it starts ranks 1..N-1
(`torchengine.distributed.RankWorkers`: `python -m torchengine.tp_runner`); each resolves the model, builds a
`TorchModelRunner` of its rank and `serve_rank`s. All N join one `torch.distributed` group (NCCL on CUDA,
gloo on the CPU). Each call on rank 0 (`determine_num_blocks`, `init_kv_cache`, `warmup`, `execute`) is first
broadcast over the gloo group as one of `enginecore.rank_commands`', so every rank runs the same steps on its own
`InputBatch` replica and meets rank 0 in the same collectives (the all-reduces of the row-parallel layers).
Only rank 0 samples. `shutdown()` broadcasts `Shutdown` and joins the ranks.

It sits above `torchengine.runner` (one rank) and `torchengine.distributed` (the group, the processes); neither
imports it.
"""

from __future__ import annotations

from enginecore.config import EngineConfig
from enginecore.model_loader import ModelSource, resolve_model
from enginecore.rank_commands import LeaderRunner, RankCommand, Shutdown, serve_rank
from torchengine.distributed import RankWorkers, die_with_parent, free_init_method, read_worker_args
from torchengine.runner import TorchModelRunner

_WORKER_MODULE = "torchengine.tp_runner"  # what `python -m` runs in ranks 1..N-1: this module


class TensorParallelRunner(LeaderRunner):
    """Rank 0 of `--tensor-parallel-size N`: each call is broadcast to the other ranks over the gloo group
    (`enginecore.rank_commands`), then run here.

    The other ranks (`serve_rank`) run the same calls on their own `TorchModelRunner`, meeting rank 0 in the
    collectives; only rank 0's results are returned.
    """

    def __init__(self, config: EngineConfig, model: ModelSource):
        self._init_method = free_init_method()
        super().__init__(TorchModelRunner(config, model, rank=0, init_method=self._init_method), self._broadcast)
        self._workers: RankWorkers | None = None

    def _broadcast(self, command: RankCommand) -> bool:
        """Send `command` to the other ranks; False before the group exists (nothing to tell)."""
        if self.local.tp is None:
            return False
        self.local.tp.broadcast(command)
        return True

    def load_model(self) -> None:
        # the other ranks load theirs on their own; the group forms once all have joined
        self._workers = RankWorkers(_WORKER_MODULE, self.local.config, self._init_method)
        self.local.load_model()

    def shutdown(self) -> None:
        self.local.release()
        told = self._broadcast(Shutdown())
        self.local.leave_group()
        if self._workers is not None:  # ranks never told (no group formed) are stopped at once
            self._workers.join(60.0 if told else 0.0)
            self._workers = None


def worker_main(rank: int, config: EngineConfig, init_method: str, parent_pid: int) -> None:
    """Rank `rank` > 0, in the process `RankWorkers` started."""
    if not die_with_parent(parent_pid):
        return
    runner = TorchModelRunner(config, resolve_model(config.model_config.model), rank=rank, init_method=init_method)
    runner.load_model()
    serve_rank(runner, lambda: runner.tp.broadcast(None), name=f"rank {rank}")


def create_runner(config: EngineConfig, model: ModelSource):
    """The torch backend's runner: one rank, or rank 0 of a tensor-parallel group."""
    if config.parallel_config.tensor_parallel_size > 1:
        return TensorParallelRunner(config, model)
    return TorchModelRunner(config, model)


if __name__ == "__main__":
    # run the imported module's worker_main, not this __main__ copy's (whose classes would be a second copy)
    from torchengine.tp_runner import worker_main as _worker_main

    _worker_main(*read_worker_args())
