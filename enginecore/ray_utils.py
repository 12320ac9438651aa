"""Ray, where the user runs a Ray cluster: `--distributed-executor-backend ray` (an engine's ranks) and
`--data-parallel-backend ray` (engine cores) place their processes as actors of one placement group.

The cluster is the user's: `ray start --head` (and `ray start --address HEAD:PORT` on the other hosts), found
through RAY_ADDRESS or `address`; none running, `ray.init()` starts a local one (one host). One bundle per
process (`bundles`), of the CPUs / GPUs / TPU chips it needs; STRICT_SPREAD puts one bundle per host, as
tpu-inference places a TPU slice's hosts, PACK keeps them together. Imported only when Ray is asked for.
"""

from __future__ import annotations

import logging
import os

from enginecore.config import ConfigError

logger = logging.getLogger("xlaserve.ray")


def import_ray():
    try:
        import ray
    except ImportError as e:  # pragma: no cover - pinned in requirements.lock
        raise ConfigError("--distributed-executor-backend ray / --data-parallel-backend ray need Ray: "
                          "pip install 'xlaserve[ray]'") from e
    return ray


def init_ray(address: str | None = None):
    """Connect to the cluster (RAY_ADDRESS, or `address`), or start a local one; returns the `ray` module."""
    ray = import_ray()
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        ray.init(address=address, include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
        logger.info("ray: connected to %s (%s)", address or "a local cluster",
                    ", ".join(f"{k} {v:g}" for k, v in sorted(ray.cluster_resources().items())
                              if k in ("CPU", "GPU", "TPU")))
    return ray


def rendezvous_address() -> tuple[str, int]:
    """(host, port) for a group's rendezvous in this process: this host's address as the Ray cluster knows it
    (the actors may be on other hosts) and a port free there now."""
    import socket

    ray = init_ray()
    node_id = ray.get_runtime_context().get_node_id()
    host = next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)
    with socket.socket() as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


def placement_group(bundles: list[dict], strategy: str = "PACK", timeout_s: float = 120.0):
    """A ready placement group of `bundles`, or a ConfigError saying what the cluster lacks."""
    ray = import_ray()
    from ray.util.placement_group import placement_group as make_pg

    pg = make_pg(bundles, strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise ConfigError(f"the Ray cluster could not place {len(bundles)} bundle(s) {bundles} ({strategy}) within "
                          f"{timeout_s:.0f}s: it has {ray.available_resources()}")
    return pg


def bundle_options(pg, index: int) -> dict:
    """`.options(**...)` of an actor in bundle `index` of `pg`."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=index, placement_group_capture_child_tasks=True)}


def release(actors: list, pg) -> None:
    """Kill `actors` and remove their placement group `pg` (nothing to do once Ray is down)."""
    ray = import_ray()
    if pg is None or not ray.is_initialized():
        return
    for a in actors:
        ray.kill(a)
    ray.util.remove_placement_group(pg)
