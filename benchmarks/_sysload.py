"""How busy the rest of the machine was while a benchmark ran (psutil), so noisy runs can be discarded.

On a shared 2-core machine another process's compile can halve a result;
every benchmark here records the CPU time that processes outside its own
process tree used during each measurement and prints it next to the number.
"""

from __future__ import annotations

import os
import time

import psutil


def _own_tree(roots: list[int]) -> set[int]:
    pids = set()
    for pid in roots:
        try:
            p = psutil.Process(pid)
            pids.add(pid)
            pids.update(c.pid for c in p.children(recursive=True))
        except psutil.Error:
            continue
    return pids


def _cpu_by_pid() -> dict[int, float]:
    out = {}
    for p in psutil.process_iter(["pid", "cpu_times"]):
        ct = p.info.get("cpu_times")
        if ct is not None:
            out[p.info["pid"]] = ct.user + ct.system
    return out


def _busy_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (all cores, every process, short-lived ones too)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


class OtherCpu:
    """Context manager: CPU seconds used by everything outside the `own_pids` process trees (default: this process).

    Measured as the machine's busy time minus the CPU time of our own trees,
    so short-lived processes (a compiler, a test run) are counted too.
    `share` is that time as a fraction of the machine's capacity over the
    block (1.0 = every core busy with something else the whole time).
    """

    def __init__(self, own_pids: list[int] | None = None):
        self.own_roots = own_pids or [os.getpid()]
        self.seconds = 0.0
        self.share = 0.0
        self.wall = 0.0

    def _own_cpu(self) -> dict[int, float]:
        own = _own_tree(self.own_roots + [os.getpid()])
        return {pid: t for pid, t in _cpu_by_pid().items() if pid in own}

    def __enter__(self) -> "OtherCpu":
        self._t0 = time.perf_counter()
        self._busy0 = _busy_seconds()
        self._own0 = self._own_cpu()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._t0
        busy = _busy_seconds() - self._busy0
        own = sum(max(0.0, t - self._own0.get(pid, 0.0)) for pid, t in self._own_cpu().items())
        self.seconds = max(0.0, busy - own)
        self.share = min(1.0, self.seconds / max(self.wall * (os.cpu_count() or 1), 1e-9))

    def note(self) -> str:
        return f"{100 * self.share:.0f}%"
