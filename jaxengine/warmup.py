"""`xlaserve warmup`: compile every bucket the server would use into the compilation cache.

Run it once per (model, flags, machine); later `xlaserve serve` starts (and
later warmups) read the compiled programs back from the cache instead of
compiling: the second run reports every bucket as a cache hit. On CPU the
cache holds serialized executables (`jaxengine.compilation.ExecutableStore`),
elsewhere it is JAX's persistent cache.
"""

from __future__ import annotations

import dataclasses
import time

from enginecore.config import EngineArgs
from jaxengine.compilation import DEFAULT_CACHE_DIR, resolve_cache_dir


def run_warmup(engine_args: EngineArgs, level: str = "all") -> list[dict]:
    """Build the jax runner for `engine_args`, compile every program of `level`, return one row per program.

    Each row: {"bucket": str, "seconds": float, "cache_hits": int, "cache_misses": int,
    "status": "hit" | "compiled"}. The persistent cache lives at --compilation-cache-dir,
    else $VLLM_XLA_CACHE_PATH, else ~/.cache/xlaserve/xla.
    """
    from enginecore.model_loader import resolve_model
    from jaxengine.runner import JaxModelRunner

    args = dataclasses.replace(engine_args)
    if args.backend == "auto":
        args.backend = "jax"
    if args.compilation_cache_dir is None:
        args.compilation_cache_dir = resolve_cache_dir(None) or DEFAULT_CACHE_DIR
    import jax

    # programs compiled earlier in this process would be served from memory and never
    # reach the persistent cache: start from an empty in-process cache
    jax.clear_caches()
    source = resolve_model(args.model)
    config = args.create_engine_config(model_max_len=source.config.max_position_embeddings)
    runner = JaxModelRunner(config, source)
    t0 = time.perf_counter()
    runner.load_model()
    override = config.cache_config.num_gpu_blocks_override
    runner.init_kv_cache(override if override is not None else runner.determine_num_blocks())
    stats = runner.warmup(level)
    runner.shutdown()
    rows = []
    for p in stats["programs"]:
        rows.append({"bucket": p["key"].describe(), "seconds": p["seconds"], "compiles": p["compiles"],
                     "cache_hits": p["cache_hits"], "cache_misses": p["cache_misses"], "status": p["status"]})
    rows.append({"bucket": "TOTAL", "seconds": round(time.perf_counter() - t0, 3), "compiles": stats["compiles"],
                 "cache_hits": stats["cache_hits"], "cache_misses": stats["cache_misses"],
                 "status": stats["cache_dir"] or "no persistent cache"})
    return rows


def format_table(rows: list[dict]) -> str:
    """Plain-text table of `run_warmup` rows (for the CLI)."""
    cols = ("bucket", "seconds", "cache_hits", "cache_misses", "status")
    width = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    line = lambda vals: "  ".join(str(v).ljust(width[c]) for c, v in zip(cols, vals))  # noqa: E731
    return "\n".join([line(cols), line("-" * width[c] for c in cols)] + [line(r[c] for c in cols) for r in rows])
