"""Pick the hardware and the backend at start-up without importing jax or torch.

auto platform: a TPU if the machine exposes TPU chips (/dev/accel* or
/dev/vfio with a TPU environment), else CUDA if an NVIDIA device node exists,
else the CPU. auto backend: tpu -> jax, cuda -> torch; on the CPU torch where
its AVX2 kernels run (`cpu_kernels/csrc`) and the settings are theirs
(float32, one replica, no tensor parallelism, torch attention), else jax
(`cpu_auto_backend`).
"""

from __future__ import annotations

import glob
import os
import platform as _platform

from enginecore import envs
from enginecore.flags import DTYPE_ALIASES, ConfigError
from enginecore.model_loader import is_orbax_checkpoint
from enginecore.native import c_compiler

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


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_kernels_unavailable() -> str:
    """Why our AVX2 CPU kernels (cpu_kernels/csrc, and cpu_kernels/csrc/xla_ffi.cc's custom calls that
    link it) cannot run on this machine ("" if they can; building them can still fail, which
    `cpu_kernels.torch_ops.load` and `cpu_kernels.jax_ops.available` report).
    `XLASERVE_CPU_KERNELS=off` (or `torch`, its earlier name) turns them off: torch's and XLA's own ops run."""
    setting = envs.XLASERVE_CPU_KERNELS
    if setting in envs.CPU_KERNELS_OFF:
        return f"XLASERVE_CPU_KERNELS={setting}"
    if _platform.machine() not in ("x86_64", "AMD64"):
        return f"not an x86-64 CPU ({_platform.machine()})"
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}"
    if c_compiler() is None:
        return "no C compiler (set CC)"
    return ""


def cpu_auto_backend(dtype: str = "auto", data_parallel_size: int = 1, attention_backend: str = "auto",
                     kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1, load_format: str = "auto",
                     model: str | None = None, compilation_cache_dir: str | None = None) -> str:
    """`--backend auto` on a CPU: torch where its AVX2 kernels run and the settings are the ones they serve
    (float32 weights, a float32, float16 or bfloat16 KV cache, one replica on one process, torch's
    attention), else jax (which also
    repeats KV heads for tensor parallelism wider than the model's KV heads; torch refuses that). jax also
    for its own features, orbax weights (the flag or the folder) and an XLA compilation cache, unless
    `--attention-backend torch` asks for torch.

    Why: with the kernels torch serves float32 faster than jax; without them (torch's own ops) jax is the faster
    one. bfloat16 where the CPU multiplies it natively (AVX512-BF16, AMX): torch, which on AVX512-BF16 runs the
    linears in bfloat16 on the kernels (QX_BDOT) with nothing to compile, and on AMX alone uses oneDNN, where
    XLA:CPU converts every stacked weight to float32 each step (`cpu_dtype_note`); elsewhere jax. Measured with
    `python -m benchmarks.bench_peers --servers ours --ours-args "--backend jax"` against `--backend torch`
    (benchmarks/README.md and HISTORY.md, bench_peers).
    """
    if data_parallel_size != 1 or tensor_parallel_size != 1 or attention_backend not in ("auto", "torch"):
        return "jax"
    if resolve_dtype(dtype, "cpu") == "bfloat16" and cpu_bf16_matmuls() and DTYPE_ALIASES.get(
            kv_cache_dtype, kv_cache_dtype) in ("auto", "float32", "float16", "bfloat16") and not _jax_features(
            attention_backend, load_format, model, compilation_cache_dir):
        return "torch"
    if cpu_kernels_unavailable():
        return "jax"
    if resolve_dtype(dtype, "cpu") != "float32" or DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype) not in (
            "auto", "float32", "float16", "bfloat16"):
        return "jax"
    return "jax" if _jax_features(attention_backend, load_format, model, compilation_cache_dir) else "torch"


def _jax_features(attention_backend: str, load_format: str, model: str | None,
                  compilation_cache_dir: str | None) -> bool:
    """Whether the settings ask for jax's own features (orbax weights, an XLA compilation cache), unless
    `--attention-backend torch` asks for torch."""
    if attention_backend == "torch":
        return False
    return load_format == "orbax" or compilation_cache_dir is not None or (
        load_format == "auto" and bool(model) and is_orbax_checkpoint(model))


def cpu_bf16_matmuls() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16)."""
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


def cpu_dtype_note(dtype: str) -> str:
    """A warning for serving 16-bit weights on a CPU ("" for float32): they run the framework's own ops, not the
    float32 CPU kernels, and are much slower here than float32, which is exact and reads a bfloat16
    checkpoint's weights as bfloat16 in decode steps anyway."""
    if dtype == "float32":
        return ""
    return (f"--dtype {dtype} on a CPU runs the framework's own {dtype} ops, not the CPU kernels (float32): a "
            "decode step is many times slower than in float32 (the embedded model at batch 1 on a 2-core Zen 4: "
            "torch 30 ms, jax 0.2 s, against 6-7 ms in float32). float32, the default on a CPU, computes a "
            "bfloat16 checkpoint exactly and reads its weights as bfloat16 in decode steps of few rows. (On a CPU "
            "with AVX512-BF16, --dtype bfloat16 runs its linears on the kernels' bfloat16 products instead.)")


# CPU: linears of 2 to this many rows run weights first (jaxengine.model.dense; torch's LM head), where
# XLA:CPU and MKL are faster than in the usual orientation (`python -m benchmarks.bench_dense`)
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
