"""Compilation bookkeeping: the caches (JAX's persistent cache; on CPU our store of serialized
executables, `ExecutableStore`), compile counting, and the recompilation guard.

Every program the runner runs is named by a `ProgramKey` (`jaxengine.programs`)
and compiled once, ahead of time at warmup or lazily on first use. With
``XLASERVE_CHECK_RECOMPILATION=1`` the guard is armed once warmup ends: a
program that was not compiled at warmup, or any XLA compilation at all seen
while a step is dispatched (a stray jitted helper, a dtype drift), raises
`RecompilationError` instead of silently stalling the server.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
import pickle
import tempfile
import threading
from contextlib import contextmanager

import jax
from jax import monitoring

from cpu_kernels.build import sources_digest
from enginecore import envs

logger = logging.getLogger("xlaserve.jax")

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_MISS_EVENT = "/jax/compilation_cache/cache_misses"
DEFAULT_CACHE_DIR = envs.DEFAULT_XLA_CACHE_DIR


class RecompilationError(RuntimeError):
    """A compilation after warmup while XLASERVE_CHECK_RECOMPILATION=1."""


def check_recompilation_enabled() -> bool:
    return envs.XLASERVE_CHECK_RECOMPILATION


def resolve_cache_dir(configured: str | None) -> str | None:
    """--compilation-cache-dir, else $VLLM_XLA_CACHE_PATH, else the default. '' or 'none' disables."""
    path = configured if configured is not None else envs.VLLM_XLA_CACHE_PATH
    if path is None or path.strip().lower() in ("", "none", "off"):
        return None
    return os.path.abspath(os.path.expanduser(path))


def use_persistent_cache(path: str | None) -> str | None:
    """Point JAX's persistent compilation cache at `path` and cache every program (no size/time floor), or turn
    it off (None).

    The setting is process-wide, and JAX binds it at the first compile after a reset: without one, a change made
    after any compile would be silently ignored. So every runner says what it wants. Left on by an earlier
    runner (one that compiled for a TPU target), a runner with caching off would still write to it, and a CPU
    runner that stores executables would have its compiles served from it, which XLA:CPU cannot re-serialize:
    it would store nothing (`_load_or_compile`) and compile again at every start. The newest runner decides for
    all of them: runners alive together in one process (in-process tests, a library user's) that want different
    settings get its setting (`serve` and `warmup` make one runner a process)."""
    current = jax.config.jax_compilation_cache_dir
    if path is not None:
        os.makedirs(path, exist_ok=True)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    elif current is not None:
        logger.info("JAX's persistent compilation cache (%s) off: this runner caches its own way or not at all",
                    current)
    if current != path:
        from jax._src import compilation_cache

        jax.config.update("jax_compilation_cache_dir", path)
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

    def _thread_counts(self) -> list[_Counts]:
        return getattr(self._local, "counts", None) or []

    def _on_duration(self, event: str, duration: float, **kw) -> None:
        if event != BACKEND_COMPILE_EVENT:
            return
        with self._lock:
            self.compiles += 1
            self.compile_seconds += duration
            self.names.append(str(kw.get("fun_name", "?")))
        for c in self._thread_counts():
            c.compiles += 1

    def _on_event(self, event: str, **kw) -> None:
        counters = self._thread_counts()
        with self._lock:
            if event == CACHE_HIT_EVENT:
                self.hits += 1
                for c in counters:
                    c.hits += 1
            elif event == CACHE_MISS_EVENT:
                self.misses += 1
                for c in counters:
                    c.misses += 1

    @contextmanager
    def counting(self):
        """Counts of this thread's compilations inside the block (blocks nest: each counts what is inside it)."""
        c = _Counts()
        outer = self._thread_counts()
        self._local.counts = outer + [c]
        try:
            yield c
        finally:
            self._local.counts = outer

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


# ---- serialized executables -----------------------------------------------------------------------

_SOURCE_PACKAGES = ("jaxengine", "pallas_kernels", "cpu_kernels", "enginecore")


@functools.lru_cache(maxsize=1)
def source_fingerprint() -> str:
    """A hash of the code that defines the programs (every .py and .cc of the packages that build them, and
    the C kernels the CPU custom call links) and of the jax/jaxlib versions: any edit to it retires every
    stored executable."""
    import jaxlib

    h = hashlib.sha256(f"{jax.__version__}:{jaxlib.__version__}".encode())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for pkg in _SOURCE_PACKAGES:
        d = os.path.join(root, pkg)
        for fn in sorted(os.listdir(d)) if os.path.isdir(d) else ():
            if fn.endswith((".py", ".cc")):
                with open(os.path.join(d, fn), "rb") as f:
                    h.update(fn.encode() + b"\0" + f.read())
    h.update(sources_digest())  # the C kernels the CPU custom calls run
    return h.hexdigest()


# hashed now, with the modules that define the programs just imported: an edit made later while this process
# runs (a test run in flight) must not store the executables of the code already imported under the new hash
source_fingerprint()


class _TreeUnpickler(pickle.Unpickler):
    """Unpickles the stored in/out pytree definitions (and the jaxengine classes they name), nothing else."""

    ALLOWED = {("jaxlib._jax.pytree", "PyTreeDef"), ("jax._src.tree_util", "default_registry"),
               ("jax._src.tree_util", "tracing_registry")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        if module.split(".")[0] == "jaxengine":  # our pytree node classes (the parameters' NamedTuples)
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not a pytree definition")


def serialize_program(compiled) -> bytes:
    """A compiled program as bytes: the executable and its argument/result pytree definitions."""
    from jax.experimental.serialize_executable import serialize

    return pickle.dumps(serialize(compiled))


def load_program(blob: bytes, devices=None):
    """`serialize_program`'s bytes loaded onto `devices` (the ones it was compiled for, in mesh order; None: the
    default backend's). Only pytree definitions are unpickled (`_TreeUnpickler`)."""
    from jax.experimental.serialize_executable import deserialize_and_load

    payload, in_tree, out_tree = _TreeUnpickler(io.BytesIO(blob)).load()
    return deserialize_and_load(payload, in_tree, out_tree,
                                execution_devices=list(devices) if devices is not None else None)


class ExecutableStore:
    """This runner's compiled programs, serialized, next to the persistent XLA cache.

    On a warm start JAX's persistent cache still traces and lowers every program
    to compute its key (about 0.2 s a program on a 2-core CPU, most of a warm
    start with 42 programs); a serialized executable loads in ~30 ms. An entry's
    key covers everything that shapes a program: the source of the packages
    that build it and the jax/jaxlib versions (`source_fingerprint`), the engine
    config, the architecture, the devices, the abstract inputs (shapes, dtypes,
    shardings), `XLA_FLAGS` and the program's own key. Anything unreadable is a
    miss: the program is compiled (through the persistent cache) and stored
    again. Like JAX's own cache entries these files are executable code: the
    cache directory must be as trusted as the installed packages.
    """

    def __init__(self, cache_dir: str, context: str):
        self.dir = os.path.join(cache_dir, "executables")
        self._context = hashlib.sha256(
            f"{source_fingerprint()}\n{os.environ.get('XLA_FLAGS', '')}\n{context}".encode()).hexdigest()
        self.hits = 0
        self.stores = 0

    def _path(self, key) -> str:
        name = hashlib.sha256(f"{self._context}:{key!r}".encode()).hexdigest()[:32]
        return os.path.join(self.dir, name + ".exe")

    def load(self, key, devices):
        """The stored executable of `key` for `devices` (those it was compiled for, in mesh order), or None."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                compiled = load_program(f.read(), devices)
        except FileNotFoundError:
            return None
        except Exception as e:  # a truncated, stale or foreign entry: compile instead
            logger.warning("stored executable %s for %r is unusable (%s: %s); compiling", path, key,
                           type(e).__name__, e)
            return None
        self.hits += 1
        return compiled

    def save(self, key, compiled) -> None:
        try:
            blob = serialize_program(compiled)
            os.makedirs(self.dir, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))  # atomic: a concurrent start reads all of it or nothing
            self.stores += 1
        except Exception as e:  # a read-only or full disk: the persistent cache still serves
            logger.warning("cannot store the executable of %r in %s (%s: %s)", key, self.dir, type(e).__name__, e)
