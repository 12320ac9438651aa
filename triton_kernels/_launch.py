"""Launcher helpers shared by the kernels: device checks and interpreter quirks."""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch
from triton.runtime.jit import JITFunction


def _numpy_rejects_int_of_1d() -> bool:
    try:
        int(np.ones(1))
    except TypeError:
        return True
    return False


@contextlib.contextmanager
def launching(kernel: object, device: torch.device) -> Iterator[None]:
    """Wrap one kernel launch.

    Compiled kernels take CUDA tensors; CPU tensors need the interpreter, and
    whether triton interprets is fixed when it is first imported
    (TRITON_INTERPRET), so a CPU call in a compiling process gets a clear
    error here instead of a failure deep inside triton.

    Under the interpreter, triton 3.6 turns a scalar tensor (a shape-(1,)
    array) into a `range` bound with int(array), which numpy >= 2.4 rejects;
    for the launch, that one conversion uses .item() instead. Compiled
    kernels are untouched.
    """
    if isinstance(kernel, JITFunction):
        if device.type != "cuda":
            raise RuntimeError(
                f"Triton kernels got {device.type} tensors but triton is compiling for a GPU; "
                "set TRITON_INTERPRET=1 before triton is first imported to run them on CPU, "
                "or use torchengine.attention.TorchAttention (--attention-backend torch)"
            )
        yield
        return
    if not _numpy_rejects_int_of_1d():
        yield
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    try:
        yield
    finally:
        interpreter._patch_lang_tensor = original
