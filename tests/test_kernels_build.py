"""Where this machine can run our C code, it builds and loads. The tests that need the kernels skip where they do
not load ("the AVX2 kernels do not run here"); that skip is for a CPU or a compiler that is not there, and these
tests fail instead when the reason is our own code (a compile error, a missing symbol, a layout mismatch)."""

from __future__ import annotations

import pytest

from enginecore.platform import c_compiler, cpu_kernels_unavailable

NO_KERNELS = cpu_kernels_unavailable()  # "" on an x86-64 CPU with AVX2, FMA and F16C, and a C compiler


@pytest.mark.skipif(bool(NO_KERNELS), reason=f"the kernels cannot run here: {NO_KERNELS}")
def test_the_torch_backends_kernels_build_and_load():
    from cpu_kernels import torch_ops

    lib, why = torch_ops.load()
    assert lib is not None, why


@pytest.mark.skipif(bool(NO_KERNELS), reason=f"the kernels cannot run here: {NO_KERNELS}")
def test_the_jax_backends_custom_calls_build_and_register():
    from cpu_kernels import jax_ops

    assert jax_ops.available() == "" and jax_ops.lib() is not None


@pytest.mark.skipif(c_compiler() is None, reason="no C compiler (set CC)")
def test_the_gguf_dequantizer_builds():
    from enginecore.native import gguf_dequantizer

    assert gguf_dequantizer() is not None
