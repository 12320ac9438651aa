"""TPU targets on a machine without a TPU: chip specs, topology names, libtpu's compile-only devices.

libtpu compiles for a TPU it is not attached to: `jax.experimental.topologies.
get_topology_desc("v5e:2x2", "tpu")` gives compile-only devices of that slice,
and programs lowered with shardings on them compile for that chip (no TPU, no
weights needed). `CHIPS` holds the per-chip numbers the fit check and the
roofline use, from Google's published specs.

Topology names are ``<chip>:<AxB>`` (v5e, v6e) or ``<chip>:<AxBxC>`` (v5p). A
slice of at most 8 v5e/v6e chips is described as one host, as the single-host
Cloud TPU VMs (v5e-1/4/8, v6e-1/4/8) are; larger slices as 2x2-chip hosts
(v5e/v6e pods) and v5p as 2x2x1-chip hosts, libtpu's defaults. A multi-host
slice compiles from one process here but needs one process per host to run.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass

from enginecore.config import ConfigError, parse_topology_name

LIBTPU_PIN = "libtpu==0.0.42.1"  # what jax[tpu]==0.10.2 pins (requirements.lock)
GiB = 1 << 30


@dataclass(frozen=True)
class ChipSpec:
    """One TPU chip as jax sees it (one device per chip: v5p's two TensorCores run as one megacore device)."""

    name: str  # v5e
    device_kind: str  # jax's Device.device_kind
    hbm_bytes: int  # per chip
    peak_bf16_flops: float  # per chip, dense
    hbm_bandwidth: float  # bytes/s per chip
    # slices up to this size are one host (a single Cloud TPU VM) whose shape libtpu must be told;
    # 0: libtpu's default host shape always holds (v5p's 2x2x1 hosts)
    max_single_host_chips: int


CHIPS: dict[str, ChipSpec] = {
    "v5e": ChipSpec("v5e", "TPU v5 lite", 16 * GiB, 197e12, 819e9, 8),
    "v6e": ChipSpec("v6e", "TPU v6 lite", 32 * GiB, 918e12, 1640e9, 8),
    "v5p": ChipSpec("v5p", "TPU v5", 95 * GiB, 459e12, 2765e9, 0),
}


def chip_for_device_kind(device_kind: str) -> ChipSpec | None:
    """'TPU v5 lite' -> CHIPS['v5e']; None for a device kind the table does not hold (one table of jax's
    device-kind strings: the kernel's, `pallas_kernels.tuning.DEVICE_KINDS`)."""
    from pallas_kernels.tuning import chip_of

    name = chip_of(device_kind)
    return CHIPS.get(name) if name else None


@dataclass(frozen=True)
class Topology:
    """A named TPU slice: its chip and its chip grid."""

    name: str  # v5e:2x2
    chip: ChipSpec
    dims: tuple[int, ...]  # chips along each axis

    @property
    def num_chips(self) -> int:
        return math.prod(self.dims)

    @property
    def chips_per_host_bounds(self) -> list[int] | None:
        """libtpu's host shape: the whole slice when it is a single-host VM type, else libtpu's default."""
        if self.num_chips <= self.chip.max_single_host_chips:
            return [*self.dims, 1]
        return None


def parse_topology(name: str) -> Topology:
    """'v5e:2x2' -> Topology; a ConfigError that names the value and the accepted forms otherwise."""
    chip, grid = parse_topology_name(name)
    return Topology(f"{chip}:{'x'.join(map(str, grid))}", CHIPS[chip], grid)


def libtpu_missing_reason() -> str | None:
    """None when libtpu is importable; else what to install (no TPU is needed to install it)."""
    if importlib.util.find_spec("libtpu") is None:
        return (f"libtpu is not installed: `pip install {LIBTPU_PIN}` (pinned in requirements.lock; it installs "
                "and compiles for TPU targets on any x86-64 Linux host, no TPU needed)")
    return None


def topology_devices(topology: Topology) -> list:
    """libtpu's compile-only devices of the slice (jax devices with platform 'tpu', not addressable)."""
    reason = libtpu_missing_reason()
    if reason:
        raise ConfigError(f"--topology {topology.name}: {reason}")
    from jax.experimental import topologies

    from enginecore.platform import detect_platform

    if detect_platform() != "tpu":
        # Off a TPU VM libtpu looks for the slice's worker hosts in the environment and logs an error
        # when they are not there; a compile-only client needs none.
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    kwargs = {}
    if topology.chips_per_host_bounds is not None:
        kwargs["chips_per_host_bounds"] = topology.chips_per_host_bounds
    try:
        desc = topologies.get_topology_desc(topology_name=topology.name, platform="tpu", **kwargs)
    except Exception as e:  # libtpu raises JaxRuntimeError / RuntimeError with its own message
        msg = str(e).splitlines()[0]
        hint = ""
        if "lockfile" in msg:
            hint = ("; another process holds libtpu: let it finish, or set ALLOW_MULTIPLE_LIBTPU_LOAD=1 (safe when "
                    "only compiling, as here: no TPU is opened)")
        raise ConfigError(f"--topology {topology.name}: libtpu refused the slice ({msg}){hint}") from None
    devices = list(desc.devices)
    if devices[0].device_kind != topology.chip.device_kind:
        raise ConfigError(f"--topology {topology.name}: libtpu describes {devices[0].device_kind!r} chips, "
                          f"not the expected {topology.chip.device_kind!r}")
    return devices


def num_hosts(devices) -> int:
    return len({d.process_index for d in devices})


def check_attached(name: str, devices) -> None:
    """`serve --topology NAME` on a TPU host: the attached chips must be that slice."""
    topo = parse_topology(name)
    kind = devices[0].device_kind
    if chip_for_device_kind(kind) is not topo.chip:
        raise ConfigError(f"--topology {name}: the attached TPU chips are {kind!r}, not {topo.chip.device_kind!r}")
    if len(devices) != topo.num_chips:
        raise ConfigError(f"--topology {name} has {topo.num_chips} chips; jax sees {len(devices)} {kind} devices")


__all__ = ["CHIPS", "ChipSpec", "LIBTPU_PIN", "Topology", "check_attached", "chip_for_device_kind",
           "libtpu_missing_reason",
           "num_hosts", "parse_topology", "topology_devices"]
