"""Build a shared library from C/C++ sources once a machine, cached by a hash of what went into it.

Used by both backends' CPU kernels (`torchengine.cpu_kernels`, `jaxengine.cpu_kernels`); imports neither jax
nor torch. The library lands in `$XLASERVE_CACHE/kernels/` (default `~/.cache/xlaserve`) under a name that
hashes the sources, the compilers' versions and the flags, so an edit or a new compiler builds a new one;
each builder writes its own temporary file and renames it into place (concurrent test workers or TP ranks
never see half a library).
"""

from __future__ import annotations

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

from enginecore.platform import c_compiler

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# torchengine/cpu_kernels.c: the AVX2 kernels both backends link (x86-64 with AVX2, FMA and F16C)
CPU_KERNELS_C = os.path.join(REPO, "torchengine", "cpu_kernels.c")
CPU_KERNELS_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-fPIC", "-std=c11"]
# enginecore/gguf_dequant.c: GGUF's blocks (GGUF_DEQUANT_TYPES) to float32 at load (portable C)
GGUF_DEQUANT_C = os.path.join(REPO, "enginecore", "gguf_dequant.c")
GGUF_DEQUANT_TYPES = (2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23)  # the GGML types it reads: Q4_0, Q4_1, Q5_0,
# Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS


def gguf_block(ggml_type: int) -> tuple[int, int] | None:
    """(values, bytes) a block of a GGML type `GGUF_DEQUANT_C` reads (the gguf package's table), else None."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)] if ggml_type in GGUF_DEQUANT_TYPES else None


def cxx_compiler() -> str | None:
    for cxx in (os.environ.get("CXX"), "c++", "g++"):
        if cxx and shutil.which(cxx):
            return shutil.which(cxx)
    return None


@functools.lru_cache(maxsize=None)
def _version(tool: str) -> str:
    return subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=30).stdout


def build_shared(name: str, units: list[tuple[str, str, list[str]]], link_flags: tuple[str, ...] = ()
                 ) -> tuple[str | None, str]:
    """units: (source path, "c" or "c++", compile flags); link_flags beyond -shared.
    -> (path of the .so, "") or (None, why not).

    One unit is compiled and linked in one command; several are compiled to objects, then linked with the
    C++ compiler."""
    tools = {"c": c_compiler(), "c++": cxx_compiler()}
    h = hashlib.sha256()
    try:
        for src, lang, flags in units:
            if tools[lang] is None:
                return None, f"no {'C' if lang == 'c' else 'C++'} compiler (set {'CC' if lang == 'c' else 'CXX'})"
            with open(src, "rb") as f:
                h.update(f.read())
            h.update(f"{lang} {' '.join(flags)}\n".encode())
        for tool in sorted({tools[lang] for _, lang, _ in units}):
            h.update(_version(tool).encode())
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"cannot read the sources or query the compilers: {e}"
    link_flags = ["-shared", *link_flags]
    h.update(" ".join(link_flags).encode())
    cache = os.path.join(os.environ.get("XLASERVE_CACHE", os.path.expanduser("~/.cache/xlaserve")), "kernels")
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
            cmds = [[tools[lang], *flags, *link_flags, src, "-o", out]]
        else:
            objs = [os.path.join(tmpdir, f"{i}.o") for i in range(len(units))]
            cmds = [[tools[lang], *flags, "-c", src, "-o", o] for (src, lang, flags), o in zip(units, objs)]
            cmds.append([tools["c++"], *link_flags, *objs, "-o", out])
        for cmd in cmds:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                return None, f"building {what} failed: {r.stderr.strip()[-500:]}"
        os.replace(out, path)  # atomic
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building {what} failed: {e}"
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return path, ""


HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page


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


def huge_page_array(count: int, dtype=np.float32) -> np.ndarray:
    """An uninitialised (zero) 1-D array of `count` items, 2 MiB-aligned, whose whole 2 MiB pages the kernel
    backs with huge pages where it can: an anonymous mapping advised MADV_HUGEPAGE before anything touches
    it (Linux's transparent huge pages in their common "madvise" mode; elsewhere, or when refused, plain
    pages). Both backends pack their CPU weights into one (`torchengine.cpu_kernels.huge_page_buffer`,
    `jaxengine.cpu_kernels.onto_huge_pages`): the weights a decode step streams then cross 512x fewer
    pages, so fewer TLB misses, and the hardware prefetchers, which stop at 4 KiB page boundaries, run on
    (`benchmarks/bench_huge_pages.py`). The mapping's unaligned head is never touched: address space, not
    memory. The array holds the mapping."""
    nbytes = count * np.dtype(dtype).itemsize
    if not hasattr(mmap, "MAP_PRIVATE"):  # not a POSIX system
        return np.zeros(count, dtype)
    # private: a shared anonymous mapping is shmem, which transparent huge pages leave alone by default
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = np.frombuffer(mm, np.uint8, count=1).ctypes.data
    offset = -addr % HUGE_PAGE
    length = nbytes // HUGE_PAGE * HUGE_PAGE  # whole huge pages only: the tail stays in small pages
    if length and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE, offset, length)
        except OSError:  # advice only: a refusal leaves plain pages
            pass
    return np.frombuffer(mm, dtype, count=count, offset=offset)


MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def release_free_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's `malloc_trim(0)`; elsewhere nothing): after a load
    has packed a model's weights into new buffers and freed the loaded ones, whose holes in the heap would
    otherwise stay resident."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def populate_in_background(addr: int, nbytes: int, chunk: int = 32 << 20, owner=None) -> threading.Event:
    """Commit the pages of [addr, addr + nbytes) from a daemon thread at the lowest priority, `chunk` bytes at a
    time (madvise MADV_POPULATE_WRITE: each page faulted in writable, its contents untouched, so steps may write
    the memory meanwhile); returns an Event that stops it (set it before the memory is unmapped). A CPU KV cache
    is a mapping the OS hands out page by page as steps first write it (fast to start); the first write of a
    page then costs a fault, ~2.3 s a GiB of huge pages on a 2-core Zen 4 (a 4096-token prefill's KV writes
    0.22 s of its 3.0 s, the next pass 0.014 s): this moves that work off the steps, to while a new server
    waits for requests. Where the kernel has no MADV_POPULATE_WRITE (or outside Linux) the thread stops at once
    and the pages come as steps write them, as before. `XLASERVE_KV_POPULATE=off` turns it off. `owner` (the
    array that holds the mapping) is kept alive until the thread ends."""
    stop = threading.Event()
    if os.environ.get("XLASERVE_KV_POPULATE", "on") == "off" or not sys.platform.startswith("linux") or nbytes <= 0:
        stop.set()
        return stop

    def run(owner=owner) -> None:  # (owner: held until the last call returns)
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            page = mmap.PAGESIZE
            lo, hi = -(-addr // page) * page, (addr + nbytes) // page * page
            for a in range(lo, hi, chunk):
                # (ctypes lets the GIL go for the call)
                if stop.is_set() or libc.madvise(a, min(chunk, hi - a), MADV_POPULATE_WRITE) != 0:
                    break
        except (OSError, AttributeError):  # no setpriority / libc here: leave the pages to the steps
            pass

    threading.Thread(target=run, name="xlaserve-kv-populate", daemon=True).start()
    return stop


def huge_page_bytes(a: np.ndarray, smaps: str = "/proc/self/smaps") -> int:
    """How many bytes of `a`'s memory the kernel backs with transparent huge pages now: the AnonHugePages of
    the mappings that hold it (`smaps`), at most its size; 0 where that cannot be read."""
    lo = a.ctypes.data
    hi, total, inside = lo + a.nbytes, 0, False
    try:
        with open(smaps) as f:
            for line in f:
                head = line.split(None, 1)[0] if line.strip() else ""
                if head and not head.endswith(":"):  # a mapping's first line: "start-end perms offset ..."
                    start, end = (int(v, 16) for v in head.split("-"))
                    inside = start < hi and end > lo
                elif inside and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return min(total, a.nbytes)


def describe_huge_pages(a: np.ndarray) -> str:
    """"N MiB, M MiB of it on huge pages" for a `huge_page_array` (the engines log it once their weights are
    in; reading smaps takes ~20 ms, once at load)."""
    return f"{a.nbytes / 2**20:.0f} MiB, {huge_page_bytes(a) / 2**20:.0f} MiB of it on huge pages"
