"""One jax engine over several hosts: JAX's multi-controller runtime (`jax.distributed`).

Who joins (`initialize`, before any device is touched, in node 0's engine-core process and in each headless
process):
- `--nnodes N` (N > 1): `jax.distributed.initialize("A:P", num_processes=N, process_id=R)` with vLLM's
  `--master-addr A --master-port P --node-rank R`; node 0 hosts the coordinator and serves HTTP, nodes R > 0
  run `xlaserve serve ... --headless --node-rank R`.
- a Cloud TPU VM slice (`--platform tpu`, `--nnodes 1`, the TPU environment naming several workers:
  `TPU_WORKER_HOSTNAMES`): `jax.distributed.initialize()` with no arguments, so jax reads the process count and
  id from the TPU environment and the same `xlaserve serve ...` runs on every worker (worker 0, `TPU_WORKER_ID`,
  serves HTTP; the others run headless: `frontend.serve`).
- `--nnodes N --distributed-executor-backend ray`: node 0 alone is started; its engine core places nodes 1..N-1
  as Ray actors (`RayFollowers`, one placement group, a bundle each) that run `run_node` as a `--headless`
  node does, then joins them on a coordinator at the address the cluster knows node 0's host by.
- otherwise one process: nothing to join.
A process that cannot join within XLASERVE_DISTRIBUTED_TIMEOUT seconds exits with an error naming the
coordinator; once joined, jax's heartbeats (XLASERVE_DISTRIBUTED_HEARTBEAT seconds) end every process of the
group when one dies, so node 0's engine core dies too and the server answers 503 and exits non-zero.

Then the mesh spans `jax.devices()` (every process's); every process runs the same compiled SPMD programs.

Step inputs: rank 0 runs the scheduler and sends each runner call as an `enginecore.rank_commands` command
through the coordination service's key-value store (`KVChannel`): one pickled command per key, read by every
follower, deleted by the last reader; each follower replays it on its own `JaxModelRunner` (its own
`InputBatch` replica) and meets rank 0 in the step's collectives. Chosen over replicating the scheduler
(sglang-jax): the scheduler, the tokenizer and the frontend stay on node 0 alone, followers cannot diverge
from it, and a command is a few KiB; chosen over `multihost_utils.broadcast_one_to_all`: that is a device
collective per step (a compiled program, padded shapes) where the store is one RPC off the device stream.
Measured on this 2-core CPU (`python -m benchmarks.bench_jax_multihost`, 2 processes; a decode step of 16
requests pickles to ~0.65 KiB, their prefill to ~5 KiB): rank 0's `send` ~0.4-0.5 ms per step for 1-8 KiB, send
+ the follower's reply 0.75-1.3 ms.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import socket
import threading
import time

from enginecore import envs
from enginecore.config import ConfigError, EngineConfig
from enginecore.model_loader import ModelSource
from enginecore.rank_commands import LeaderRunner, RankCommand, Shutdown, serve_rank

logger = logging.getLogger("xlaserve.jax")

_PREFIX = "xlaserve/cmd"
_POLL_MS = 60_000  # a follower's wait per attempt between commands (it waits for as long as node 0 is idle)


def tpu_slice_workers() -> int:
    """Workers the TPU environment names (Cloud TPU VM slice, GKE): 1 where it names none."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h.strip()]) or 1


def tpu_worker_id() -> int:
    return int(os.environ.get("TPU_WORKER_ID", "0") or 0)


def is_multi_process(config: EngineConfig) -> bool:
    pc, dc = config.parallel_config, config.device_config
    return pc.nnodes > 1 or (dc.platform == "tpu" and tpu_slice_workers() > 1)


def initialize(config: EngineConfig) -> bool:
    """Join the group this config names (module docstring); False where it names none. Call before any device
    is touched (`jax.devices()`, an array)."""
    if not is_multi_process(config):
        return False
    import jax
    from jax._src import distributed

    if distributed.global_state.client is not None:  # (joined already in this process)
        return True
    pc, dc = config.parallel_config, config.device_config
    if dc.platform == "cpu":
        # cross-process collectives of XLA:CPU (none by default)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if not os.environ.get("JAX_PLATFORMS"):
            jax.config.update("jax_platforms", "cpu")
    timeout = int(envs.XLASERVE_DISTRIBUTED_TIMEOUT)
    heartbeat = int(envs.XLASERVE_DISTRIBUTED_HEARTBEAT)
    kw = dict(initialization_timeout=timeout, heartbeat_timeout_seconds=heartbeat,
              shutdown_timeout_seconds=max(heartbeat, 10))
    if pc.nnodes > 1:
        coordinator = f"{pc.master_addr}:{pc.master_port}"
        kw.update(coordinator_address=coordinator, num_processes=pc.nnodes, process_id=pc.node_rank)
    else:
        coordinator = "the TPU slice's worker 0 (TPU environment)"
    logger.info("jax multi-controller: joining the group of coordinator %s as %s (up to %ds)", coordinator,
                f"node {pc.node_rank} of {pc.nnodes}" if pc.nnodes > 1 else f"TPU worker {tpu_worker_id()}", timeout)
    if pc.nnodes > 1 and pc.node_rank > 0:
        # jax's own join ends the process with a fatal log line once its deadline passes: wait for the
        # coordinator's port here first, to exit with an error that names it
        kw["initialization_timeout"] = _wait_for_coordinator(pc.master_addr, pc.master_port, timeout)
    others = "node 1" if pc.nnodes == 2 else f"nodes 1..{pc.nnodes - 1}"
    how = "Ray actors" if pc.distributed_executor_backend == "ray" else "--node-rank, --headless"
    waited_for = (f"{others} ({how}) to join coordinator {coordinator}"
                  if pc.nnodes > 1 and pc.node_rank == 0 else f"the jax group of coordinator {coordinator}")
    # past its deadline jax ends the process with a fatal log line that names no one: say first whom we waited for
    overdue = threading.Timer(timeout, lambda: logger.error(
        "waited %ds (XLASERVE_DISTRIBUTED_TIMEOUT) for %s; giving up", timeout, waited_for))
    overdue.daemon = True
    overdue.start()
    try:
        jax.distributed.initialize(**kw)
    except Exception as e:  # jax raises its runtime's error types (deadline exceeded, unavailable ...)
        raise RuntimeError(f"waited {timeout}s (XLASERVE_DISTRIBUTED_TIMEOUT) for {waited_for}: {e}") from None
    finally:
        overdue.cancel()
    devs = jax.devices()
    logger.info("jax multi-controller: process %d of %d (coordinator %s%s): %d local %s device(s) of %d",
                jax.process_index(), jax.process_count(), coordinator,
                ", hosted here" if jax.process_index() == 0 else "", len(jax.local_devices()),
                devs[0].platform, len(devs))
    return True


def _wait_for_coordinator(host: str, port: int, timeout: float) -> int:
    """Until `host:port` accepts a connection; the seconds left of `timeout` (at least 1). A RuntimeError naming
    the coordinator when it does not come in time."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return max(1, int(deadline - time.monotonic()))
        except OSError as e:
            if time.monotonic() + 0.5 > deadline:
                raise RuntimeError(f"the jax coordinator {host}:{port} (--master-addr / --master-port, node 0) did "
                                   f"not answer within {timeout:g}s (XLASERVE_DISTRIBUTED_TIMEOUT): {e}") from None
            time.sleep(0.5)


def check_group_size(config: EngineConfig) -> None:
    """The mesh must cover every process's devices: each runs its part of every program."""
    import jax

    tp, n = config.parallel_config.tensor_parallel_size, jax.device_count()
    if tp != n:
        raise ConfigError(f"--tensor-parallel-size {tp}: a multi-host jax engine shards over all {n} devices of its "
                          f"{jax.process_count()} processes ({len(jax.local_devices())} here); pass "
                          f"--tensor-parallel-size {n}")


def _client():
    from jax._src import distributed

    return distributed.global_state.client


class KVChannel:
    """Rank 0's commands to the other processes over the coordination service's key-value store.

    Command `n` is the key `xlaserve/cmd/n`; each follower reads the keys in order and bumps `n`'s read count;
    the last one deletes the key (and its count), so the store holds only commands not all have read.
    """

    def __init__(self):
        import jax

        self.followers = jax.process_count() - 1
        self.seq = 0

    def send(self, command: RankCommand) -> bool:
        _client().key_value_set_bytes(f"{_PREFIX}/{self.seq}", pickle.dumps(command, pickle.HIGHEST_PROTOCOL))
        self.seq += 1
        return True

    def receive(self) -> RankCommand:
        client, key = _client(), f"{_PREFIX}/{self.seq}"
        while True:
            try:
                data = client.blocking_key_value_get_bytes(key, _POLL_MS)
                break
            except Exception as e:  # a deadline while node 0 is idle: wait on (a dead node 0 ends us: heartbeats)
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
        if client.key_value_increment(f"{key}/read", 1) == self.followers:
            client.key_value_delete(key)
            client.key_value_delete(f"{key}/read")
        self.seq += 1
        return pickle.loads(data)


class MultiHostLeader(LeaderRunner):
    """Rank 0 of a multi-process engine: each call goes to the followers (`KVChannel`), then runs here."""

    def __init__(self, local, channel: KVChannel, followers: RayFollowers | None = None):
        super().__init__(local, channel.send)
        self.channel = channel
        self.followers = followers  # (--distributed-executor-backend ray: the other nodes' actors)

    def shutdown(self) -> None:
        import jax

        try:
            self.local.shutdown()
            self.channel.send(Shutdown())
            jax.distributed.shutdown()
        finally:
            if self.followers is not None:  # they end on Shutdown; killed in any case
                self.followers.join(30.0)


# what a follower actor needs of node 0's environment before it imports jax (devices, platforms, our knobs)
_ENV_PREFIXES = ("JAX_", "XLA_", "XLASERVE_", "VLLM_", "HF_", "TPU_", "TRANSFORMERS_", "OMP_", "PYTHONPATH")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where `jaxengine` is importable from


class _FollowerActor:
    """A Ray actor that is one headless node of the group: `run` returns `run_node`'s exit status."""

    def run(self, config: EngineConfig, log_level: int) -> int:
        from enginecore.logging_setup import configure_logging
        from enginecore.model_loader import resolve_model

        configure_logging(log_level, prefix=f"node {config.parallel_config.node_rank}")
        return run_node(config, resolve_model(config.model_config.model), actor=True)


class RayFollowers:
    """Nodes 1..N-1 of `--nnodes N --distributed-executor-backend ray` as Ray actors, one bundle each of one
    placement group: STRICT_SPREAD (one per host, as tpu-inference places a TPU slice's hosts) where the cluster
    has a node for each besides this one, else PACK (a one-host cluster)."""

    def __init__(self, config: EngineConfig):
        from enginecore.ray_utils import bundle_options, init_ray, placement_group

        ray = init_ray()
        pc = config.parallel_config
        node_id = ray.get_runtime_context().get_node_id()
        others = [n for n in ray.nodes() if n["Alive"] and n["NodeID"] != node_id]
        strategy = "STRICT_SPREAD" if len(others) >= pc.nnodes - 1 else "PACK"
        bundle = {"TPU": 1} if config.device_config.platform == "tpu" else {"CPU": 1}
        logger.info("ray: placing jax nodes 1..%d in one placement group (%s: the cluster has %d other node(s))",
                    pc.nnodes - 1, strategy, len(others))
        self.pg = placement_group([dict(bundle) for _ in range(pc.nnodes - 1)], strategy=strategy)
        env = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
        actor_cls = ray.remote(**({"num_cpus": 0, "resources": bundle} if "TPU" in bundle else {"num_cpus": 1})
                               )(_FollowerActor)
        level = logging.getLogger("xlaserve").getEffectiveLevel()
        self.actors = [actor_cls.options(runtime_env={"env_vars": env}, **bundle_options(self.pg, i)).remote()
                       for i in range(pc.nnodes - 1)]
        self.runs = [a.run.remote(dataclasses.replace(config, parallel_config=dataclasses.replace(pc, node_rank=i + 1)),
                                  level) for i, a in enumerate(self.actors)]
        atexit.register(self.kill)

    def join(self, timeout: float) -> None:
        import ray

        ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout)
        self.kill()
        atexit.unregister(self.kill)

    def kill(self) -> None:
        from enginecore.ray_utils import release

        release(self.actors, self.pg)
        self.actors, self.pg = [], None


def _ray_coordinator(config: EngineConfig) -> EngineConfig:
    """`config` with the coordinator on a free port of this host, at the address the Ray cluster knows it by
    (the followers may be on other hosts)."""
    from enginecore.ray_utils import rendezvous_address

    host, port = rendezvous_address()
    pc = dataclasses.replace(config.parallel_config, master_addr=host, master_port=port)
    return dataclasses.replace(config, parallel_config=pc)


def create_runner(config: EngineConfig, model: ModelSource):
    """The jax backend's runner in node 0's engine core: one process's, or rank 0 of a group (joined here)."""
    from jaxengine.runner import JaxModelRunner

    pc = config.parallel_config
    followers = None
    if pc.distributed_executor_backend == "ray" and pc.nnodes > 1:
        if pc.node_rank != 0:
            raise ConfigError("--distributed-executor-backend ray places nodes 1..N-1 from node 0 onto the Ray "
                              "cluster: start only node 0 (no --node-rank, no --headless nodes)")
        config = _ray_coordinator(config)
        followers = RayFollowers(config)  # before `initialize`, which waits for them
    try:
        if not initialize(config):
            return JaxModelRunner(config, model)
        import jax

        if jax.process_index() != 0:
            raise ConfigError(f"process {jax.process_index()} of the jax group serves no HTTP: run it with --headless")
        check_group_size(config)
        return MultiHostLeader(JaxModelRunner(config, model), KVChannel(), followers)
    except BaseException:
        if followers is not None:
            followers.kill()
        raise


def run_node(config: EngineConfig, model: ModelSource, *, actor: bool = False) -> int:
    """A headless process of the group (`--node-rank R > 0`, or a TPU slice's worker > 0, or node 0's Ray actor
    with `actor`): join, load this host's shards, replay rank 0's commands until it sends Shutdown; the exit
    status."""
    import jax

    from jaxengine.runner import JaxModelRunner

    if config.parallel_config.distributed_executor_backend == "ray" and not actor:
        raise ConfigError("--distributed-executor-backend ray places nodes 1..N-1 from node 0 onto the Ray "
                          "cluster: start no --headless nodes")
    try:
        joined = initialize(config)
    except RuntimeError as e:  # (the coordinator never came)
        logger.error("%s", e)
        return 1
    if not joined:
        raise ConfigError("--headless runs a host's share of an engine: give --nnodes N --node-rank R (R > 0)")
    check_group_size(config)
    rank = jax.process_index()
    runner = JaxModelRunner(config, model)
    runner.load_model()
    logger.info("process %d: model loaded; replaying rank 0's steps", rank)
    serve_rank(runner, KVChannel().receive, name=f"process {rank}")
    logger.info("process %d: rank 0 shut the engine down", rank)
    jax.distributed.shutdown()
    return 0
