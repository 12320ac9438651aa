"""Every environment variable xlaserve reads, in one place (vLLM's `vllm/envs.py`).

Each entry names the variable, its default, how its text is parsed and why it exists. Read one as
`envs.XLASERVE_Q4X`: the value is parsed from `os.environ` at each access, so a variable set after import (a
test's `monkeypatch.setenv`, a parent process's environment) is seen. `ENV_VARS` is the table README.md's
"Environment variables" section shows; tests/test_envs.py keeps the two in step.

Variables of other tools that the code consults where it runs them (OMP_NUM_THREADS, XLA_FLAGS, CC, TPU_NAME,
CUDA_VISIBLE_DEVICES, ...) are theirs and are not repeated here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Mapping

DEFAULT_CACHE_ROOT = os.path.join("~", ".cache", "xlaserve")
# where JAX's persistent compilation cache lives without --compilation-cache-dir or VLLM_XLA_CACHE_PATH
DEFAULT_XLA_CACHE_DIR = os.path.join(DEFAULT_CACHE_ROOT, "xla")
# the values that turn XLASERVE_CPU_KERNELS off; `torch` is the name it had when only the torch backend used them
CPU_KERNELS_OFF = ("off", "torch")


@dataclass(frozen=True)
class EnvVar:
    """One variable: `parse` turns its text into the value; unset, the value is `default()`."""

    name: str
    default_text: str  # the default as README.md shows it
    default: Callable[[], Any]
    parse: Callable[[str], Any]
    why: str
    test_only: bool = False  # read by tests/ alone (directly: they need not import the engine), never by the server

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None:
            return self.default()
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r}: {e}") from None


def _truthy(*values: str, strip: bool = False) -> Callable[[str], bool]:
    """On for these lower-cased values, off for any other (each variable keeps the spellings it has always had)."""
    def parse(raw: str) -> bool:
        return (raw.strip() if strip else raw).lower() in values

    return parse


def _not_off(raw: str) -> bool:
    return raw != "off"


def _cpu_kernels(raw: str) -> str:
    return raw if raw in CPU_KERNELS_OFF else "auto"


def _strip(raw: str) -> str:
    return raw.strip()


def _text(raw: str) -> str:
    return raw


def _const(value: Any) -> Callable[[], Any]:
    return lambda: value


_V = EnvVar
ENV_VARS: tuple[EnvVar, ...] = (
    _V("XLASERVE_CACHE", "~/.cache/xlaserve", lambda: os.path.expanduser(DEFAULT_CACHE_ROOT), _text,
       "Folder of the built CPU kernels (`kernels/`) and of GGUF files' converted tokenizers (`tokenizers/`)."),
    _V("XLASERVE_CPU_KERNELS", "auto", _const("auto"), _cpu_kernels,
       "`off` (or `torch`, its earlier name) turns the AVX2/AVX-512 CPU kernels off on both backends: torch's "
       "and XLA's own ops run (a reference to compare against); any other value: auto."),
    _V("XLASERVE_Q4X", "on", _const(True), _not_off,
       "`off`: the CPU runners keep float32 weights only, not also the stored Q4/Q8/BF16... panels that decode "
       "steps of few rows read (the same bits; `off` to compare speed or save their memory)."),
    _V("XLASERVE_KV_POPULATE", "on", _const(True), _not_off,
       "`off`: a CPU KV cache's pages are not committed in the background at start-up but by the steps that "
       "first write them (`cpu_kernels.memory.populate_in_background`)."),
    _V("XLASERVE_CHECK_RECOMPILATION", "0", _const(False), _truthy("1", "true", "yes"),
       "`1`/`true`/`yes`: after warmup, a jax program that was not warmed up (or any XLA compile during a step) "
       "raises `RecompilationError` instead of stalling the server."),
    _V("XLASERVE_FAULT_INJECTION", "unset", _const(""), _strip,
       "Tests only: `site:regex[,...]` makes matching requests fail at a site (`enginecore.faults`); never on "
       "a server that takes requests from people."),
    _V("XLASERVE_DISTRIBUTED_TIMEOUT", "300", _const(300), int,
       "Seconds a process of a multi-process engine waits to join its group (jax: jax.distributed's coordinator "
       "of --nnodes; torch: the tensor-parallel rendezvous at --master-addr:--master-port) before it exits with an "
       "error naming whom it waited for."),
    _V("XLASERVE_DISTRIBUTED_HEARTBEAT", "30", _const(30), int,
       "Seconds without a heartbeat after which a multi-host jax engine's processes count a peer dead and all "
       "exit (node 0's server answers 503 and exits non-zero)."),
    _V("VLLM_XLA_CACHE_PATH", "~/.cache/xlaserve/xla", _const(DEFAULT_XLA_CACHE_DIR), _text,
       "JAX's persistent compilation cache without --compilation-cache-dir (vLLM's name); `''`, `none` or "
       "`off`: no cache."),
    _V("VLLM_API_KEY", "unset", _const(None), _text,
       "The API key `serve` requires without --api-key, and the one `chat` / `complete` send without "
       "--api-key or OPENAI_API_KEY (vLLM's name)."),
    _V("VLLM_LOG_STATS_INTERVAL", "10", _const(10.0), float,
       "Seconds between the server's stats lines (vLLM's name)."),
    _V("VLLM_SERVER_DEV_MODE", "0", _const(False), _truthy("1", "true", "yes", "on", strip=True),
       "`1`: the server's development endpoints, /reset_prefix_cache and /server_info (vLLM's name)."),
    _V("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "0", _const(False), _truthy("1", "true", "yes", "on", strip=True),
       "`1`: the server stays up answering 503 after its engine core dies, instead of exiting (vLLM's name)."),
    _V("XLASERVE_TEST_BACKEND", "each test's own", _const(None), _text,
       "Tests only: the backend the server tests start (tests/test_api_server.py: jax where importable, else "
       "torch; tests/test_structured_outputs_server.py: torch).", test_only=True),
    _V("XLASERVE_TEST_STARTUP_TIMEOUT", "600", _const(600.0), float,
       "Tests only: seconds a test server may take to get ready (tests/test_api_server.py).", test_only=True),
)
environment_variables: Mapping[str, EnvVar] = MappingProxyType({v.name: v for v in ENV_VARS})

if TYPE_CHECKING:
    XLASERVE_CACHE: str
    XLASERVE_CPU_KERNELS: str
    XLASERVE_Q4X: bool
    XLASERVE_KV_POPULATE: bool
    XLASERVE_CHECK_RECOMPILATION: bool
    XLASERVE_FAULT_INJECTION: str
    XLASERVE_DISTRIBUTED_TIMEOUT: int
    XLASERVE_DISTRIBUTED_HEARTBEAT: int
    VLLM_XLA_CACHE_PATH: str
    VLLM_API_KEY: str | None
    VLLM_LOG_STATS_INTERVAL: float
    VLLM_SERVER_DEV_MODE: bool
    VLLM_KEEP_ALIVE_ON_ENGINE_DEATH: bool
    XLASERVE_TEST_BACKEND: str | None
    XLASERVE_TEST_STARTUP_TIMEOUT: float


def __getattr__(name: str) -> Any:
    var = environment_variables.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (not a variable in enginecore.envs)")
    return var.read()


def __dir__() -> list[str]:
    return sorted([*globals(), *environment_variables])


def cache_dir(*parts: str) -> str:
    """A folder under $XLASERVE_CACHE (not created)."""
    return os.path.join(environment_variables["XLASERVE_CACHE"].read(), *parts)
