"""Test helpers that look at the process's memory."""

from __future__ import annotations

import ctypes
import mmap


def resident_bytes(address: int, nbytes: int) -> int:
    """How many bytes of the pages that hold [address, address + nbytes) are in memory now (mincore(2)): what a
    lazily zeroed buffer has committed (the CPU KV caches). Raises OSError where mincore is refused."""
    page = mmap.PAGESIZE
    lo, hi = address // page * page, -(-(address + nbytes) // page) * page
    vec = (ctypes.c_ubyte * ((hi - lo) // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(lo, hi - lo, vec):
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) * page
