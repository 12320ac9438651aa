"""Per-platform choices of the JAX backend: devices, attention kernel, host allocator, device memory."""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import jax

from enginecore.config import ConfigError

logger = logging.getLogger("xlaserve.jax")

_JAX_PLATFORM = {"cpu": "cpu", "tpu": "tpu", "cuda": "gpu"}


def devices_for(platform: str) -> list:
    if platform == "cpu" and not os.environ.get("JAX_PLATFORMS") and not jax.config.jax_platforms:
        # With libtpu installed (requirements.lock: it compiles for TPU targets), jax would also try to
        # open a TPU here and log libtpu's errors about the missing hardware before falling back.
        jax.config.update("jax_platforms", "cpu")
    try:
        devs = jax.devices(_JAX_PLATFORM[platform])
    except (RuntimeError, KeyError) as e:
        raise ConfigError(
            f"--platform {platform}: JAX sees no such device ({e}); for cuda install jax[cuda12], "
            "for tpu jax[tpu], or pass --platform cpu"
        ) from None
    return devs


def resolve_attention_backend(choice: str, platform: str) -> str:
    """auto: the Pallas kernel on TPU, the XLA implementation (jaxengine.attention) elsewhere."""
    if choice in ("triton", "torch"):
        raise ConfigError(f"--attention-backend {choice} belongs to the torch backend; the jax backend takes "
                          "auto, reference or pallas")
    if choice == "auto":
        if platform == "tpu" and _pallas_available():
            return "pallas"
        return "reference"
    if choice == "pallas":
        if platform == "cuda":
            raise ConfigError("--attention-backend pallas is a TPU (Mosaic) kernel; on cuda use auto or reference")
        if not _pallas_available():
            raise ConfigError("--attention-backend pallas: the pallas_kernels package is not importable")
    return choice


def _pallas_available() -> bool:
    try:
        import pallas_kernels  # noqa: F401

        return hasattr(pallas_kernels, "ragged_paged_attention")
    except ImportError:
        return False


def pallas_attention(platform: str, device_kind: str, *, group: int, block_size: int, kv_heads: int, head_dim: int,
                     kv_dtype):
    """The Pallas kernel with our call signature: ``(q, k, v, kv_cache, kv_lens, block_tables, cu_q_lens,
    distribution, *, sm_scale, sliding_window)``.

    On TPU it is compiled by Mosaic with the chip's chunk and q-block sizes
    (`pallas_kernels.tuning`, looked up by `device_kind`, for the per-device cache
    as the kernel reads it: `kv_heads` and `head_dim` padded as stored, `group` q
    heads per kv head). On CPU it runs in the TPU interpreter (tests only: slow).
    """
    import pallas_kernels

    if platform == "tpu":
        tuned = pallas_kernels.kernel_block_sizes(device_kind, block_size=block_size, num_kv_heads=kv_heads,
                                                  group=group, head_dim=head_dim, dtype=kv_dtype)
        if tuned:
            logger.info("pallas attention on %s: %s", device_kind, tuned)
        return _q_in_cache_dtype(_padded_cache(functools.partial(pallas_kernels.ragged_paged_attention, **tuned)))
    from jax.experimental.pallas import tpu as pltpu

    return _q_in_cache_dtype(functools.partial(pallas_kernels.ragged_paged_attention,
                                               interpret=pltpu.InterpretParams()))


def _q_in_cache_dtype(kernel):
    """`kernel` with q in the cache's dtype, as the Pallas kernel takes it (the model passes q in its own dtype:
    float32 queries over a 16-bit cache stay float32 on the XLA and CPU paths)."""

    def fn(q, k, v, kv_cache, *metadata, **kw):
        return kernel(q.astype(kv_cache.dtype), k, v, kv_cache, *metadata, **kw)

    return fn


def pallas_cache_heads(kv_heads: int, head_dim: int, platform: str, attention_backend: str) -> tuple[int, int]:
    """(kv heads, head dim) the KV cache stores on one device: padded for the Pallas kernel on TPU.

    XLA lays a TPU array out row-major only when its minor dim fills 128 lanes and
    its second-minor (``2 * Hkv``) is 2, 4 or a multiple of 8; otherwise it picks
    another dim order to save the padding (compiled for v5e and v6e:
    ``bf16[N,16,6,64]`` gets ``{0,3,2,1}``, ``[N,16,6,128]`` ``{3,1,2,0}``). The
    kernel needs heads row-major, so XLA would copy the whole cache into and out
    of every step. Padding the stored heads (D to a multiple of 128, Hkv to 1, 2
    or a multiple of 4) spends the memory that layout saved, and copies nothing.
    """
    if platform != "tpu" or attention_backend != "pallas":
        return kv_heads, head_dim
    heads = kv_heads if kv_heads in (1, 2) or kv_heads % 4 == 0 else -(-kv_heads // 4) * 4
    return heads, -(-head_dim // 128) * 128


def _padded_cache(kernel):
    """`kernel` on a cache whose kv heads / head dim are padded (`pallas_cache_heads`): q, k and v get
    zero heads and zero dims to match (zeros add nothing to q.k; padded heads' outputs are cut)."""
    import jax.numpy as jnp

    def fn(q, k, v, kv_cache, *metadata, **kw):
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        Hkv_p, D_p = kv_cache.shape[2] // 2, kv_cache.shape[3]
        if (Hkv_p, D_p) == (Hkv, D):
            return kernel(q, k, v, kv_cache, *metadata, **kw)
        pad_q = ((0, 0), (0, (Hkv_p - Hkv) * (Hq // Hkv)), (0, D_p - D))
        pad_kv = ((0, 0), (0, Hkv_p - Hkv), (0, D_p - D))
        out, kv_cache = kernel(jnp.pad(q, pad_q), jnp.pad(k, pad_kv), jnp.pad(v, pad_kv), kv_cache, *metadata, **kw)
        return out[:, :Hq, :D], kv_cache

    return fn


def tune_host_allocator() -> None:
    """Keep glibc from returning big buffers to the OS after every step.

    XLA:CPU allocates its temporaries per execution; above the mmap threshold
    each one is a fresh mmap whose first touch page-faults (several times slower
    on VMs; benchmarks/README.md, "CPU step notes").
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)  # glibc's maximum
    libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
    libc.mallopt(M_TOP_PAD, 64 << 20)


def device_kv_budget(device, utilization: float, activation_bytes: int) -> int:
    """Bytes left for the KV cache on one accelerator after weights (already loaded) and activations."""
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        raise ConfigError(
            f"{device.platform} device reports no memory limit; pass --num-gpu-blocks-override to size the KV cache"
        )
    used = stats.get("bytes_in_use", 0)
    return max(int(limit * utilization) - used - activation_bytes, 0)
