"""The one protocol both backends implement, and their lazy lookup by name.

enginecore never imports jax or torch: a backend is imported only when
`create_runner` builds it.
"""

from __future__ import annotations

import importlib
from typing import Protocol, runtime_checkable

from enginecore.config import ConfigError, EngineConfig
from enginecore.model_loader import ModelSource
from enginecore.outputs import ModelRunnerOutput, SchedulerOutput

_RUNNERS = {
    "jax": ("jaxengine.multihost", "create_runner"),
    "torch": ("torchengine.tp_runner", "create_runner"),
}


class StepHandle(Protocol):
    """A launched step; `result()` waits for it and returns its output (once)."""

    def result(self) -> ModelRunnerOutput: ...


@runtime_checkable
class ModelRunner(Protocol):
    """A backend: owns the model weights and the paged KV cache on its device.

    Lifecycle: ``load_model()`` -> ``determine_num_blocks()`` ->
    ``init_kv_cache(num_blocks)`` -> ``warmup()`` -> ``execute()`` per step.
    Block ids stay on the host; each runner copies its own block table to the
    device. ``execute`` must honour ``scheduler_output.finished_req_ids`` and
    ``preempted_req_ids`` (drop those rows) even when nothing is scheduled.

    ``execute`` launches the step and returns at once where the device allows;
    the engine may call ``execute`` for the next step before it asks this
    step's ``result()`` (asynchronous scheduling), and always asks results in
    launch order. The runner keeps its own copy of each request and appends
    the tokens it samples (`enginecore.input_batch`).
    """

    def __init__(self, config: EngineConfig, model: ModelSource) -> None: ...

    def load_model(self) -> None: ...

    def determine_num_blocks(self) -> int:
        """KV blocks that fit the memory budget (gpu_memory_utilization / kv_cache_memory_bytes)."""
        ...

    def init_kv_cache(self, num_blocks: int) -> None: ...

    def execute(self, scheduler_output: SchedulerOutput) -> StepHandle: ...

    def warmup(self) -> dict:
        """Compile / capture every bucket the server can hit; returns stats for the log."""
        ...

    def shutdown(self) -> None: ...


def create_runner(config: EngineConfig, model: ModelSource) -> ModelRunner:
    """The backend named by --backend, built for `config` (imports it now)."""
    backend = config.device_config.backend
    if backend not in _RUNNERS:
        raise ConfigError(f"--backend must be one of {', '.join(_RUNNERS)}; got {backend!r}.")
    mod_name, factory = _RUNNERS[backend]
    try:
        mod = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        raise ConfigError(f"the {backend} backend is not available: {e}") from None
    return getattr(mod, factory)(config, model)


# the loop of a host other than node 0 of `--nnodes N` (`xlaserve serve --headless --node-rank R`): its share of
# the engine, driven by node 0's scheduler, until node 0 stops; by backend (module, function)
_NODE_LOOPS = {"jax": ("jaxengine.multihost", "run_node"), "torch": ("torchengine.tp_runner", "run_node")}


def run_node(config: EngineConfig, model: ModelSource) -> int:
    """Run this host's ranks of a multi-host engine (`--node-rank` > 0) until node 0 shuts them down; the exit
    status."""
    mod_name, fn = _NODE_LOOPS[config.device_config.backend]
    return getattr(importlib.import_module(mod_name), fn)(config, model)
