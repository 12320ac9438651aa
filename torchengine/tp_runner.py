"""The torch backend's entry (`create_runner`), and `--tensor-parallel-size N`: rank 0 and the other ranks' loop.

Rank 0 is a `TensorParallelRunner` inside the engine. When it loads the model it starts the other ranks: with
`--distributed-executor-backend mp` (the default) its host's ranks 1..N/M-1 as processes
(`torchengine.distributed.RankWorkers`: `python -m torchengine.tp_runner`), while each other node of `--nnodes M`
runs its own N/M ranks (`xlaserve serve --headless --node-rank R`: `run_node`); with `ray`, ranks 1..N-1 as Ray
actors (`RayRankActors`), wherever the cluster places them. Each rank resolves the model, builds a
`TorchModelRunner` of its rank and `serve_rank`s (`serve_as_rank`, in every kind of rank). All N join one
`torch.distributed` group (NCCL on CUDA, gloo on the CPU). Each call on rank 0 (`determine_num_blocks`,
`init_kv_cache`, `warmup`, `execute`) is first broadcast over the gloo group as one of `enginecore.rank_commands`',
so every rank runs the same steps on its own `InputBatch` replica and meets rank 0 in the same collectives (the
all-reduces of the row-parallel layers). Only rank 0 samples. `shutdown()` broadcasts `Shutdown` and joins the
ranks.

A rank that dies fails rank 0's next step (gloo sees the closed connection; rank 0 also checks its own ranks'
processes / actors before each command), which is an engine death; the other ranks then see rank 0's connection
close and exit non-zero.

It sits above `torchengine.runner` (one rank) and `torchengine.distributed` (the group, the processes); neither
imports it.
"""

from __future__ import annotations

import logging

from enginecore.config import ConfigError, EngineConfig
from enginecore.model_loader import ModelSource, resolve_model
from enginecore.rank_commands import LeaderRunner, RankCommand, Shutdown, serve_rank
from torchengine.distributed import (RankJoinError, RankPlacement, RankWorkers, RayRankActors, die_with_parent,
                                     free_init_method, node_placements, ranks_per_node, read_worker_args)
from torchengine.runner import TorchModelRunner

logger = logging.getLogger("xlaserve.torchengine")

_WORKER_MODULE = "torchengine.tp_runner"  # what `python -m` runs in the ranks RankWorkers starts: this module
_JOIN_S = 60.0  # how long a shut-down group's ranks may take to leave before they are killed


class TensorParallelRunner(LeaderRunner):
    """Rank 0 of `--tensor-parallel-size N`: each call is broadcast to the other ranks over the gloo group
    (`enginecore.rank_commands`), then run here.

    The other ranks (`serve_rank`) run the same calls on their own `TorchModelRunner`, meeting rank 0 in the
    collectives; only rank 0's results are returned.
    """

    def __init__(self, config: EngineConfig, model: ModelSource):
        pc = config.parallel_config
        self._ray = pc.distributed_executor_backend == "ray"
        if self._ray:
            from enginecore.ray_utils import rendezvous_address

            host, port = rendezvous_address()
            self._placement = RankPlacement(0, 0, 1, f"tcp://{host}:{port}")
        else:
            init_method = f"tcp://{pc.master_addr}:{pc.master_port}" if pc.nnodes > 1 else free_init_method()
            self._placement = node_placements(pc, init_method)[0]
        super().__init__(TorchModelRunner(config, model, self._placement), self._broadcast)
        self._workers: RankWorkers | RayRankActors | None = None

    def _broadcast(self, command: RankCommand) -> bool:
        """Send `command` to the other ranks; False before the group exists (nothing to tell)."""
        if self.local.tp is None:
            return False
        if self._workers is not None:
            self._workers.check()
        self.local.tp.broadcast(command)
        return True

    def load_model(self) -> None:
        # the other ranks load theirs on their own; the group forms once all have joined
        config = self.local.config
        if self._ray:
            self._workers = RayRankActors(serve_as_rank, config, self._placement.init_method)
        else:
            self._workers = RankWorkers(_WORKER_MODULE, config,
                                        node_placements(config.parallel_config, self._placement.init_method)[1:])
        pc = config.parallel_config
        logger.info("rank 0 of %d (%s%s): the group's rendezvous is %s", pc.tensor_parallel_size,
                    pc.distributed_executor_backend or "mp", f", node 0 of {pc.nnodes}" if pc.nnodes > 1 else "",
                    self._placement.init_method)
        self.local.load_model()

    def shutdown(self) -> None:
        self.local.release()
        told = False
        try:
            told = self._broadcast(Shutdown())
        except RuntimeError as e:  # a rank died (the engine's death, already reported): stop the others
            logger.warning("tensor-parallel ranks not told to shut down (%s): stopping them", e)
        finally:
            if told:
                self.local.leave_group()
            if self._workers is not None:  # ranks never told (no group, or a rank died) are stopped at once
                self._workers.join(_JOIN_S if told else 0.0)
                self._workers = None


def serve_as_rank(config: EngineConfig, placement: RankPlacement, model: ModelSource | None = None) -> None:
    """Rank `placement.rank` > 0 (a process, a Ray actor, a headless node's first rank): join the group and run
    rank 0's commands until it shuts the group down."""
    pc = config.parallel_config
    logger.info("tensor-parallel rank %d of %d (local rank %d of %d), rendezvous %s", placement.rank,
                pc.tensor_parallel_size, placement.local_rank, placement.local_size, placement.init_method)
    model = model or resolve_model(config.model_config.model)
    runner = TorchModelRunner(config, model, placement)
    runner.load_model()
    serve_rank(runner, lambda: runner.tp.broadcast(None), name=f"rank {placement.rank}")


def worker_main(config: EngineConfig, placement: RankPlacement, parent_pid: int) -> None:
    """A rank in the process `RankWorkers` started."""
    if not die_with_parent(parent_pid):
        return
    try:
        serve_as_rank(config, placement)
    except RankJoinError as e:
        raise SystemExit(str(e)) from None


def run_node(config: EngineConfig, model: ModelSource) -> int:
    """Node `--node-rank` R > 0 of `--nnodes` M (`xlaserve serve --headless`): its N/M ranks, the first in this
    process, until node 0 shuts the group down (0) or a rank fails (1)."""
    pc = config.parallel_config
    if pc.distributed_executor_backend == "ray":
        raise ConfigError("--distributed-executor-backend ray places every rank from node 0 onto the Ray cluster: "
                          "start no --headless nodes")
    placements = node_placements(pc, f"tcp://{pc.master_addr}:{pc.master_port}")
    logger.info("node %d of %d: tensor-parallel ranks %d..%d of %d, rendezvous %s", pc.node_rank, pc.nnodes,
                placements[0].rank, placements[-1].rank, pc.tensor_parallel_size, placements[0].init_method)
    workers = RankWorkers(_WORKER_MODULE, config, placements[1:])
    ok = False
    try:
        serve_as_rank(config, placements[0], model)
        ok = True
    except RankJoinError as e:
        logger.error("%s", e)
    except ConfigError:
        raise
    except Exception:
        logger.exception("node %d: rank %d failed", pc.node_rank, placements[0].rank)
    finally:
        codes = workers.join(_JOIN_S if ok else 0.0)
    return 0 if ok and not any(codes) else 1


def create_runner(config: EngineConfig, model: ModelSource):
    """The torch backend's runner: one rank, or rank 0 of a tensor-parallel group."""
    pc = config.parallel_config
    ranks_per_node(pc)  # --nnodes must divide --tensor-parallel-size
    if pc.tensor_parallel_size > 1:
        return TensorParallelRunner(config, model)
    return TorchModelRunner(config, model)


if __name__ == "__main__":
    # run the imported module's worker_main, not this __main__ copy's (whose classes would be a second copy)
    from torchengine.tp_runner import worker_main as _worker_main

    _worker_main(*read_worker_args())
