"""Compilation bookkeeping: the persistent XLA cache, compile counting, and the recompilation guard.

Every program the runner runs is named by a `ProgramKey` (`jaxengine.programs`)
and compiled once, ahead of time at warmup or lazily on first use. With
``XLASERVE_CHECK_RECOMPILATION=1`` the guard is armed once warmup ends: a
program that was not compiled at warmup, or any XLA compilation at all seen
while a step is dispatched (a stray jitted helper, a dtype drift), raises
`RecompilationError` instead of silently stalling the server.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager

import jax
from jax import monitoring

logger = logging.getLogger("xlaserve.jax")

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_MISS_EVENT = "/jax/compilation_cache/cache_misses"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "xlaserve", "xla")


class RecompilationError(RuntimeError):
    """A compilation after warmup while XLASERVE_CHECK_RECOMPILATION=1."""


def check_recompilation_enabled() -> bool:
    return os.environ.get("XLASERVE_CHECK_RECOMPILATION", "0").lower() in ("1", "true", "yes")


def resolve_cache_dir(configured: str | None) -> str | None:
    """--compilation-cache-dir, else $VLLM_XLA_CACHE_PATH, else the default. '' or 'none' disables."""
    path = configured if configured is not None else os.environ.get("VLLM_XLA_CACHE_PATH", DEFAULT_CACHE_DIR)
    if path is None or path.strip().lower() in ("", "none", "off"):
        return None
    return os.path.abspath(os.path.expanduser(path))


def enable_persistent_cache(path: str) -> str:
    """Point JAX's persistent compilation cache at `path` and cache every program (no size/time floor)."""
    os.makedirs(path, exist_ok=True)
    current = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if current != path:
        from jax._src import compilation_cache

        # JAX decides once per process (at the first compile) whether a cache is in use and binds
        # its path then: without a reset, enabling it after any compile would be silently ignored
        compilation_cache.reset_cache()
    return path


class _Counts:
    def __init__(self) -> None:
        self.compiles = 0
        self.hits = 0
        self.misses = 0


class CompileMonitor:
    """Counts XLA compilations (and persistent-cache hits/misses) in this process while installed.

    JAX's monitoring hooks are process-wide. `snapshot()` totals count every thread;
    `counting()` counts what the calling thread compiles inside the block (warmup
    compiles several programs at once on a thread pool).
    """

    def __init__(self) -> None:
        self.compiles = 0
        self.compile_seconds = 0.0
        self.hits = 0
        self.misses = 0
        self.names: list[str] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._installed = False

    def _thread_counts(self) -> _Counts | None:
        return getattr(self._local, "counts", None)

    def _on_duration(self, event: str, duration: float, **kw) -> None:
        if event != BACKEND_COMPILE_EVENT:
            return
        with self._lock:
            self.compiles += 1
            self.compile_seconds += duration
            self.names.append(str(kw.get("fun_name", "?")))
        c = self._thread_counts()
        if c is not None:
            c.compiles += 1

    def _on_event(self, event: str, **kw) -> None:
        c = self._thread_counts()
        with self._lock:
            if event == CACHE_HIT_EVENT:
                self.hits += 1
                if c is not None:
                    c.hits += 1
            elif event == CACHE_MISS_EVENT:
                self.misses += 1
                if c is not None:
                    c.misses += 1

    @contextmanager
    def counting(self):
        """Counts of this thread's compilations inside the block."""
        c = _Counts()
        self._local.counts = c
        try:
            yield c
        finally:
            self._local.counts = None

    def install(self) -> "CompileMonitor":
        if not self._installed:
            monitoring.register_event_duration_secs_listener(self._on_duration)
            monitoring.register_event_listener(self._on_event)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            monitoring.unregister_event_duration_listener(self._on_duration)
            monitoring.unregister_event_listener(self._on_event)
            self._installed = False

    def snapshot(self) -> tuple[int, int, int]:
        return self.compiles, self.hits, self.misses


class CompileGuard:
    """Armed (XLASERVE_CHECK_RECOMPILATION=1, after warmup), it refuses programs that were not warmed up
    and any compilation while a step is dispatched."""

    def __init__(self, monitor: CompileMonitor, enabled: bool | None = None) -> None:
        self.monitor = monitor
        self.enabled = check_recompilation_enabled() if enabled is None else enabled
        self.armed = False
        self.warmed: set = set()

    def arm(self, warmed: set) -> None:
        self.warmed = set(warmed)
        self.armed = self.enabled

    def check_key(self, key) -> None:
        if self.armed and key not in self.warmed:
            desc = key.describe() if hasattr(key, "describe") else str(key)
            raise RecompilationError(
                f"program {desc} was not compiled during warmup and XLASERVE_CHECK_RECOMPILATION=1 forbids "
                "compiling while serving; start with --warmup all (the default of `xlaserve serve`) or unset "
                "XLASERVE_CHECK_RECOMPILATION"
            )

    @contextmanager
    def dispatch(self):
        """Wrap the dispatch of a step's programs: armed, any compilation inside raises."""
        if not self.armed:
            yield
            return
        with self.monitor.counting() as counts:
            yield
        if counts.compiles:
            n = counts.compiles
            raise RecompilationError(
                f"{n} XLA compilation(s) ({', '.join(self.monitor.names[-n:])}) while serving after warmup "
                "(XLASERVE_CHECK_RECOMPILATION=1): something retraced (shape, dtype or weak-type drift)"
            )
