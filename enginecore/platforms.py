"""Pick the hardware and the backend at start-up without importing jax or torch.

auto platform: a TPU if the machine exposes TPU chips (/dev/accel* or
/dev/vfio with a TPU environment), else CUDA if an NVIDIA device node exists,
else the CPU. auto backend: tpu -> jax, cuda -> torch, cpu -> jax.
"""

from __future__ import annotations

import glob
import os

from enginecore.config import ConfigError

PLATFORMS = ("auto", "tpu", "cuda", "cpu")
BACKENDS = ("auto", "jax", "torch")


def detect_platform() -> str:
    if glob.glob("/dev/accel*") or os.environ.get("TPU_ACCELERATOR_TYPE") or os.environ.get("TPU_NAME"):
        return "tpu"
    if glob.glob("/dev/nvidia[0-9]*") and os.environ.get("CUDA_VISIBLE_DEVICES", "x") != "":
        return "cuda"
    return "cpu"


def resolve_platform_and_backend(platform: str = "auto", backend: str = "auto") -> tuple[str, str]:
    if platform not in PLATFORMS:
        raise ConfigError(f"--platform must be one of {', '.join(PLATFORMS)}; got {platform!r}.")
    if backend not in BACKENDS:
        raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}; got {backend!r}.")
    plat = detect_platform() if platform == "auto" else platform
    if backend == "auto":
        backend = {"tpu": "jax", "cuda": "torch", "cpu": "jax"}[plat]
    if plat == "tpu" and backend == "torch":
        raise ConfigError("--backend torch does not run on --platform tpu; use --backend jax (or auto) on TPUs.")
    return plat, backend
