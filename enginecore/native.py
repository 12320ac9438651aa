"""Build a shared library from C/C++ sources once a machine, cached by a hash of what went into it.

Used by the CPU kernels (`cpu_kernels.build`) and the GGUF loader's dequantizer (`gguf_dequant.c`); imports
neither jax nor torch. The library lands in `$XLASERVE_CACHE/kernels/` (default `~/.cache/xlaserve`) under a name that
hashes the sources, the compilers' versions and the flags, so an edit or a new compiler builds a new one;
each builder writes its own temporary file and renames it into place (concurrent test workers or TP ranks
never see half a library).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import numpy as np

from enginecore import envs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# enginecore/gguf_dequant.c: GGUF's blocks (GGUF_DEQUANT_TYPES) to float32 at load (portable C)
GGUF_DEQUANT_C = os.path.join(REPO, "enginecore", "gguf_dequant.c")
GGUF_DEQUANT_TYPES = (2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23)  # the GGML types it reads: Q4_0, Q4_1, Q5_0,
# Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS


def gguf_block(ggml_type: int) -> tuple[int, int] | None:
    """(values, bytes) a block of a GGML type `GGUF_DEQUANT_C` reads (the gguf package's table), else None."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)] if ggml_type in GGUF_DEQUANT_TYPES else None


def c_compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def cxx_compiler() -> str | None:
    for cxx in (os.environ.get("CXX"), "c++", "g++"):
        if cxx and shutil.which(cxx):
            return shutil.which(cxx)
    return None


@functools.lru_cache(maxsize=None)
def _version(tool: str) -> str:
    return subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=30).stdout


def build_shared(name: str, units: list[tuple[str, str, list[str]]], link_flags: tuple[str, ...] = (),
                 headers: tuple[str, ...] = ()) -> tuple[str | None, str]:
    """units: (source path, "c" or "c++", compile flags); link_flags beyond -shared; headers: the files the units
    include (hashed with them, so an edited header builds a new library).
    -> (path of the .so, "") or (None, why not).

    One unit is compiled and linked in one command; several are compiled to objects, then linked with the
    C++ compiler if any unit is C++, else the C compiler."""
    tools = {"c": c_compiler(), "c++": cxx_compiler()}
    h = hashlib.sha256()
    try:
        for src, lang, flags in units:
            if tools[lang] is None:
                return None, f"no {'C' if lang == 'c' else 'C++'} compiler (set {'CC' if lang == 'c' else 'CXX'})"
            with open(src, "rb") as f:
                h.update(f.read())
            h.update(f"{lang} {' '.join(flags)}\n".encode())
        for header in headers:
            with open(header, "rb") as f:
                h.update(f.read())
        for tool in sorted({tools[lang] for _, lang, _ in units}):
            h.update(_version(tool).encode())
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"cannot read the sources or query the compilers: {e}"
    link_flags = ["-shared", *link_flags]
    h.update(" ".join(link_flags).encode())
    cache = envs.cache_dir("kernels")
    path = os.path.join(cache, f"{name}-{h.hexdigest()[:16]}.so")
    if os.path.isfile(path):
        return path, ""
    try:  # an unwritable cache: the caller falls back, as without a compiler
        os.makedirs(cache, exist_ok=True)
        tmpdir = tempfile.mkdtemp(dir=cache)
    except OSError as e:
        return None, f"cannot write the kernel cache {cache}: {e}"
    what = ", ".join(os.path.basename(s) for s, _, _ in units)
    try:
        out = os.path.join(tmpdir, "lib.so")
        if len(units) == 1:
            src, lang, flags = units[0]
            stages = [[[tools[lang], *flags, *link_flags, src, "-o", out]]]
        else:  # the objects side by side (one compiler a core), then the link
            objs = [os.path.join(tmpdir, f"{i}.o") for i in range(len(units))]
            linker = tools["c++"] if any(lang == "c++" for _, lang, _ in units) else tools["c"]
            stages = [[[tools[lang], *flags, "-c", src, "-o", o] for (src, lang, flags), o in zip(units, objs)],
                      [[linker, *link_flags, *objs, "-o", out]]]
        for cmds in stages:
            with concurrent.futures.ThreadPoolExecutor(max_workers=min(len(cmds), os.cpu_count() or 1)) as pool:
                runs = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True, timeout=300),
                                     cmds))
            for r in runs:
                if r.returncode != 0:
                    return None, f"building {what} failed: {r.stderr.strip()[-500:]}"
        os.replace(out, path)  # atomic
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building {what} failed: {e}"
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return path, ""


@functools.lru_cache(maxsize=None)
def gguf_dequantizer():
    """gguf_dequantize(type, blocks, out) -> bool from `GGUF_DEQUANT_C` (the gguf package's values, ~4x
    faster), or None where it cannot be built (no C compiler, an unwritable cache): then the gguf package's."""
    import ctypes

    path, _why = build_shared("gguf_dequant", [(GGUF_DEQUANT_C, "c", ["-O3", "-ffp-contract=off", "-fPIC",
                                                                        "-std=c11"])])
    if path is None:
        return None
    try:
        fn = ctypes.CDLL(path).gguf_dequantize
    except OSError:  # e.g. a noexec mount
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    fn.restype = ctypes.c_int

    def dequantize(ggml_type: int, blocks: np.ndarray, out: np.ndarray) -> bool:
        """blocks: uint8, whole blocks of `ggml_type`, C-contiguous; out: float32 [its values a block (`gguf_block`)
        per block], C-contiguous."""
        values, size = gguf_block(ggml_type)
        n = blocks.size // size
        assert blocks.dtype == np.uint8 and blocks.flags.c_contiguous and out.flags.c_contiguous
        assert out.dtype == np.float32 and out.size == values * n and n * size == blocks.size
        return fn(ggml_type, blocks.ctypes.data, n, out.ctypes.data) == 0

    return dequantize
