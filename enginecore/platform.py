"""Pick the hardware and the backend at start-up without importing jax or torch.

auto platform: a TPU if the machine exposes TPU chips (/dev/accel* or
/dev/vfio with a TPU environment), else CUDA if an NVIDIA device node exists,
else the CPU. auto backend: tpu -> jax, cuda -> torch, cpu -> jax.
"""

from __future__ import annotations

import glob
import os

from enginecore.config import DTYPE_ALIASES, ConfigError

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


# CPU: linears of 2 to this many rows run weights first (jaxengine.model.dense; torch's LM head), where
# XLA:CPU and MKL are 1.4-3.5x faster than in the usual orientation (benchmarks/bench_dense.py)
CPU_WEIGHTS_FIRST_ROWS = 32


def resolve_dtype(dtype: str, platform: str, compute_capability: tuple[int, int] | None = None) -> str:
    """`--dtype` -> float32 | bfloat16 | float16, the same rule for both backends.

    auto: float32 on the CPU (bf16 matmuls are slow there and less exact), bfloat16 on TPUs and GPUs,
    float16 on GPUs before Ampere (no bf16 tensor cores), as vLLM does.
    """
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype != "auto":
        return dtype
    if platform == "cpu":
        return "float32"
    if platform == "cuda" and compute_capability is not None and compute_capability[0] < 8:
        return "float16"
    return "bfloat16"
