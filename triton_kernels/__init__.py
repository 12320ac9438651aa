"""Triton kernels for the torch backend, each with a pure-torch reference.

- `unified_attention`: ragged paged attention, decode and chunked prefill in
  one launch (GQA, sliding window, logit soft-cap, split-KV for small batches).
- `reshape_and_cache`: writes this step's K/V into the paged cache.
- `fused_moe`: a Mixture-of-Experts layer's routed experts, a grouped GEMM over
  the tokens sorted by expert.
- `ref_unified_attention`, `ref_reshape_and_cache`, `ref_fused_moe`: the references.

The package imports without triton: `HAS_TRITON` is then False and the two
kernels raise ImportError when called. Triton decides once, when it is first
imported, whether it compiles (CUDA tensors) or interprets (CPU tensors,
TRITON_INTERPRET=1; tests only), so set that variable before importing this
package.
"""

from __future__ import annotations

from typing import Any, Callable

from triton_kernels.reference import ref_fused_moe, ref_reshape_and_cache, ref_unified_attention

try:
    import triton  # noqa: F401
except ImportError:
    HAS_TRITON = False
else:
    HAS_TRITON = True

__all__ = [
    "HAS_TRITON",
    "fused_moe",
    "interpreted",
    "ref_fused_moe",
    "ref_reshape_and_cache",
    "ref_unified_attention",
    "reshape_and_cache",
    "unified_attention",
]


def _needs_triton(name: str, cpu: str = "attention is torchengine.attention.TorchAttention "
                                          "(--attention-backend torch)") -> Callable[..., Any]:
    def launcher(*args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"triton_kernels.{name} needs triton; on a CPU, {cpu}")

    launcher.__name__ = launcher.__qualname__ = name
    return launcher


if HAS_TRITON:
    # Imported here so the names below are the functions, not the submodules
    # of the same name (import binds a submodule on its package).
    from triton_kernels.fused_moe import fused_moe
    from triton_kernels.reshape_and_cache import reshape_and_cache
    from triton_kernels.unified_attention import unified_attention
else:
    fused_moe = _needs_triton("fused_moe", "the experts are torchengine.moe.fused_moe_sorted")
    reshape_and_cache = _needs_triton("reshape_and_cache")
    unified_attention = _needs_triton("unified_attention")


def interpreted() -> bool:
    """True when triton runs kernels in its interpreter (TRITON_INTERPRET=1 at first import): CPU tensors work."""
    if not HAS_TRITON:
        return False
    from triton.runtime.jit import JITFunction

    from triton_kernels.unified_attention import _unified_attention_kernel

    return not isinstance(_unified_attention_kernel, JITFunction)
