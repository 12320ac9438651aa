"""Memory for the CPU wing: weights on transparent huge pages, a KV cache committed in the background, the heap's
free pages handed back after a load. Pure Python + numpy (mmap, madvise through ctypes)."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading

import numpy as np

from enginecore import envs

HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page


def huge_page_array(count: int, dtype=np.float32) -> np.ndarray:
    """An uninitialised (zero) 1-D array of `count` items, 2 MiB-aligned, whose whole 2 MiB pages the kernel
    backs with huge pages where it can: an anonymous mapping advised MADV_HUGEPAGE before anything touches
    it (Linux's transparent huge pages in their common "madvise" mode; elsewhere, or when refused, plain
    pages). Both backends pack their CPU weights into one (`cpu_kernels.torch_ops.huge_page_buffer`,
    `cpu_kernels.jax_ops.onto_huge_pages`): the weights a decode step streams then cross 512x fewer
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
    page then costs a fault, seconds a GiB of huge pages (docs/design-notes.md): this moves that work off the
    steps, to while a new server waits for requests (`python -m benchmarks.bench_peers --servers ours` with
    `XLASERVE_KV_POPULATE=off` against on; benchmarks/HISTORY.md, bench_peers). Where the kernel has no
    MADV_POPULATE_WRITE (or outside Linux) the thread stops at once and the pages come as steps write them, as
    before. `XLASERVE_KV_POPULATE=off` turns it off. `owner` (the
    array that holds the mapping) is kept alive until the thread ends."""
    stop = threading.Event()
    if not envs.XLASERVE_KV_POPULATE or not sys.platform.startswith("linux") or nbytes <= 0:
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
