"""The C sources of the CPU wing and how each backend builds them (`enginecore.native.build_shared` compiles,
caches and hashes them).

The torch backend loads the C topics alone, linked against libgomp (torch's OpenMP threads run them); the jax
backend links the same objects, built without OpenMP (XLA's own threads split the work), with the XLA FFI shim
`xla_ffi.cc`. Both include `cpu_kernels.h`, the one declaration of every entry point.
"""

from __future__ import annotations

import hashlib
import os

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
# by topic; each includes cpu_kernels.h (the interface) and simd.h (the vector helpers they share)
C_SOURCES = tuple(os.path.join(CSRC, f) for f in (
    "gguf_linear.c", "glue.c", "attention.c", "sampler.c", "panels.c", "qx.c", "layers.c"))
HEADERS = (os.path.join(CSRC, "cpu_kernels.h"), os.path.join(CSRC, "simd.h"))
XLA_FFI_SOURCE = os.path.join(CSRC, "xla_ffi.cc")
# x86-64 with AVX2, FMA and F16C; the AVX-512 tiles are built by target attributes and chosen at run time
C_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-std=c11", f"-I{CSRC}")


def c_units(openmp: bool = True) -> list[tuple[str, str, list[str]]]:
    """The C topics as `build_shared` units: with OpenMP (the torch backend), or without (linked into the XLA
    FFI library, whose calls run on XLA's threads)."""
    flags = list(C_FLAGS) if openmp else [f for f in C_FLAGS if f != "-fopenmp"] + ["-DXLASERVE_NO_OPENMP"]
    return [(src, "c", flags) for src in C_SOURCES]


def sources_digest() -> bytes:
    """A hash of every C source and header (the jax compile cache's key: its programs call these kernels)."""
    h = hashlib.sha256()
    for path in (*C_SOURCES, *HEADERS, XLA_FFI_SOURCE):
        with open(path, "rb") as f:
            h.update(f.read())
    return h.digest()
