"""`--data-parallel-backend ray`: the data-parallel engine cores as Ray actors, one bundle each in one
placement group on the user's cluster (`enginecore.ray_utils`). Each actor runs the same core loop as a core
process (`enginecore.engine_proc.serve_engine_core`), connected over tcp to the API server's sockets; its
`run` call returning or failing (the actor or its node died) is the core's exit, which the engine client
treats as the engine's death. Imported only when Ray is asked for.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable

from enginecore.config import EngineConfig
from enginecore.engine_proc import DPLayout, core_config

logger = logging.getLogger("xlaserve.ray")


class _EngineCoreActor:
    """One data-parallel core in a Ray worker process."""

    def run(self, config: EngineConfig, rank: int, input_addr: str, output_addr: str, log_level: int) -> int:
        import zmq

        from enginecore.engine import EngineCore
        from enginecore.engine_proc import serve_engine_core
        from enginecore.logging_setup import configure_logging
        from enginecore.model_loader import resolve_model

        configure_logging(log_level, prefix=f"EngineCore_DP{rank}")
        ctx = zmq.Context()
        try:
            return serve_engine_core(lambda: EngineCore(config, resolve_model(config.model_config.model)), ctx,
                                     input_addr, output_addr, None, rank)
        finally:
            ctx.term()


def _bundle(config: EngineConfig) -> dict:
    tp = config.parallel_config.tensor_parallel_size
    platform = config.device_config.platform
    if platform == "cuda":
        return {"GPU": tp, "CPU": 1}
    if platform == "tpu":
        return {"TPU": tp, "CPU": 1}
    return {"CPU": 1}


class RayEngineCores:
    def __init__(self, config: EngineConfig, layout: DPLayout, input_addrs: dict[int, str], output_addr: str,
                 on_exit: Callable[[str], None]):
        self.config = config
        self.ranks = list(layout.served)
        self.input_addrs = input_addrs
        self.output_addr = output_addr
        self.on_exit = on_exit
        self.actors: list = []
        self.runs: list = []
        self.pg = None
        self._closing = False

    async def start(self) -> None:
        await asyncio.to_thread(self._start)
        loop = asyncio.get_running_loop()
        for rank, ref in zip(self.ranks, self.runs):
            ref.future().add_done_callback(
                lambda f, rank=rank: loop.call_soon_threadsafe(self._exited, rank, f))

    def _start(self) -> None:
        from enginecore.ray_utils import bundle_options, init_ray, placement_group

        ray = init_ray()
        bundle = _bundle(self.config)
        self.pg = placement_group([dict(bundle) for _ in self.ranks], strategy="PACK")
        # the workers import this checkout's packages as the API process does
        env = {k: os.environ[k] for k in ("PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "XLA_FLAGS")
               if k in os.environ}
        actor_cls = ray.remote(_EngineCoreActor)
        level = logging.getLogger("xlaserve").getEffectiveLevel()
        for i, rank in enumerate(self.ranks):
            opts = dict(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), runtime_env={"env_vars": env},
                        **bundle_options(self.pg, i))
            if "TPU" in bundle:
                opts["resources"] = {"TPU": bundle["TPU"]}
            actor = actor_cls.options(**opts).remote()
            self.actors.append(actor)
            self.runs.append(actor.run.remote(core_config(self.config, rank), rank, self.input_addrs[rank],
                                              self.output_addr, level))
        logger.info("data-parallel engine cores %s started as Ray actors (bundles %s)", self.ranks, bundle)

    def _exited(self, rank: int, fut) -> None:
        if self._closing:
            return
        try:
            how = f"exit code {fut.result()}"
        except Exception as e:  # the actor died (its process, its node) or the core raised
            how = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        self.on_exit(f"the engine core {rank} Ray actor exited unexpectedly ({how})")

    async def shutdown(self, timeout: float) -> None:
        """After the client sent each core its shutdown: wait for the actors' runs, then release them."""
        self._closing = True
        import ray

        def stop() -> None:
            if not ray.is_initialized():  # (the start failed before any actor)
                return
            if self.runs:
                ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)
            for actor in self.actors:
                ray.kill(actor)
            if self.pg is not None:
                ray.util.remove_placement_group(self.pg)

        await asyncio.to_thread(stop)
