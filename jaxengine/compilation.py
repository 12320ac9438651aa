"""Compilation bookkeeping: the persistent XLA cache, compile counting, and the recompilation guard.

Every program the runner dispatches is named by a *bucket key* (model step:
token x request bucket; sampler: request bucket x variant flags; prompt
logprobs: row bucket). Serving compiles only keys from a bounded set, but
which ones get compiled up front depends on the platform (see
`JaxModelRunner.warmup`). With ``XLASERVE_CHECK_RECOMPILATION=1`` the guard is
armed once warmup ends: a key that was not warmed, or any XLA compilation at
all observed during a step (a retrace from a dtype or weak-type drift, say),
raises `RecompilationError` instead of silently stalling the server.
"""

from __future__ import annotations

import logging
import os
import threading
import time
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


class CompileMonitor:
    """Counts XLA compilations (and persistent-cache hits/misses) in this process while installed.

    JAX's monitoring hooks are process-wide; the monitor counts only on the thread it is
    bound to (the one dispatching this runner's programs, see `bind_current_thread`), so a
    second engine compiling on another thread is not mistaken for ours.
    """

    def __init__(self) -> None:
        self.compiles = 0
        self.compile_seconds = 0.0
        self.hits = 0
        self.misses = 0
        self.names: list[str] = []
        self._thread = threading.get_ident()
        self._installed = False

    def _on_duration(self, event: str, duration: float, **kw) -> None:
        if event == BACKEND_COMPILE_EVENT and threading.get_ident() == self._thread:
            self.compiles += 1
            self.compile_seconds += duration
            self.names.append(str(kw.get("fun_name", "?")))

    def _on_event(self, event: str, **kw) -> None:
        if threading.get_ident() != self._thread:
            return
        if event == CACHE_HIT_EVENT:
            self.hits += 1
        elif event == CACHE_MISS_EVENT:
            self.misses += 1

    def bind_current_thread(self) -> None:
        self._thread = threading.get_ident()

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
    """The set of warmed bucket keys; armed, it refuses new keys and new compilations."""

    def __init__(self, monitor: CompileMonitor, enabled: bool | None = None) -> None:
        self.monitor = monitor
        self.enabled = check_recompilation_enabled() if enabled is None else enabled
        self.armed = False
        self.seen: set[tuple] = set()
        self.lazy_compiles: dict[tuple, float] = {}

    def arm(self) -> None:
        self.armed = self.enabled

    def check_key(self, key: tuple) -> None:
        if key in self.seen:
            return
        if self.armed:
            raise RecompilationError(
                f"bucket {key} was not compiled during warmup and XLASERVE_CHECK_RECOMPILATION=1 forbids "
                "compiling while serving; warm it (XLASERVE_WARMUP=all) or unset XLASERVE_CHECK_RECOMPILATION"
            )

    @contextmanager
    def dispatch(self, key: tuple):
        """Wrap one dispatch of a program named by `key`."""
        self.check_key(key)
        self.monitor.bind_current_thread()  # the step loop may run on another thread than __init__
        before = self.monitor.compiles
        t0 = time.perf_counter()
        yield
        n = self.monitor.compiles - before
        if n and key not in self.seen:
            self.lazy_compiles[key] = time.perf_counter() - t0
            logger.info("compiled bucket %s lazily in %.2fs", key, time.perf_counter() - t0)
        self.seen.add(key)
        if n and self.armed:
            raise RecompilationError(
                f"{n} XLA compilation(s) ({', '.join(self.monitor.names[-n:])}) while serving bucket {key} "
                "after warmup (XLASERVE_CHECK_RECOMPILATION=1): something retraced (shape, dtype or weak-type drift)"
            )
