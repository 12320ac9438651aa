"""`xlaserve warmup [MODEL] [serve flags]`: compile every bucket ahead of time (JAX backend).

The work is done by `jaxengine.warmup.run_warmup(engine_args, level)`, owned by
the JAX backend; this subcommand parses the same flags as `serve`, hands them
over and prints one row per compiled bucket (a second run shows cache hits).

With ``--topology v5e:2x2`` it compiles for that TPU slice on this host, TPU or
not (`jaxengine.aot.run_aot_warmup`, libtpu's compile-only devices, abstract
weights: MODEL may be a folder holding only config.json) and prints, per
bucket, the compile time, the HBM footprint, FLOPs, bytes and a roofline
estimate, then what was and was not verified.
"""

from __future__ import annotations

import argparse
import logging

from frontend.args import build_serve_parser, parse_serve_args, serving_engine_args

logger = logging.getLogger("xlaserve.warmup")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "warmup", usage="xlaserve warmup [MODEL] [--level {all,decode}] [serve options]",
        help="Compile the JAX engine's programs ahead of time (fills the compilation cache).",
        description="Compile every bucket the server can hit, with the same flags as `serve`, into the persistent "
                    "XLA cache (--compilation-cache-dir), so that a later `serve` with the same flags starts warm.")
    p.add_argument("--level", default="all", choices=["all", "decode"],
                   help="all: every (tokens, requests) bucket; decode: only pure-decode buckets (default: all).")
    g = p.add_argument_group("TPU AOT", "With --topology: compile for a TPU slice on a host without one.")
    g.add_argument("--executables-dir", default=None, metavar="DIR",
                   help="Also write each compiled program as a serialized executable (plus manifest.json) here: "
                        "a TPU host loads them without relying on persistent-cache keys matching.")
    g.add_argument("--roofline-context", type=int, default=None, metavar="TOKENS",
                   help="Cached tokens per request assumed by the roofline estimate of a model step "
                        "(default: 1024).")
    build_serve_parser(p)
    p.set_defaults(_run=run_warmup_cli)


def _load_run_warmup():
    try:
        from jaxengine.warmup import run_warmup
    except ImportError as e:
        raise SystemExit(f"xlaserve warmup: the JAX backend's warm-up (jaxengine.warmup.run_warmup) is not "
                         f"available in this build ({e})") from None
    return run_warmup


def run_warmup_cli(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    from enginecore.config import ConfigError
    from enginecore.model_loader import ModelLoadError

    ns = parse_serve_args(parser, argv)
    engine_args = serving_engine_args(ns)  # the shapes `serve` will run
    if engine_args.backend == "torch":
        parser.error("xlaserve warmup compiles the JAX engine; --backend torch has nothing to warm up ahead of time")
    if not engine_args.topology and (ns.executables_dir or ns.roofline_context is not None):
        parser.error("--executables-dir and --roofline-context need --topology (a TPU slice to compile for)")
    try:
        if engine_args.topology:
            return _run_aot(engine_args, ns)
        rows = _load_run_warmup()(engine_args, level=ns.level)
    except (ConfigError, ModelLoadError) as e:
        hint = ""
        if not engine_args.topology and isinstance(e, ModelLoadError) and "safetensors" in str(e):
            hint = (" (a folder holding only config.json is enough to compile for a TPU target: add --topology, "
                    "e.g. --topology v5e:2x2; compiling for this host's own devices needs the weights)")
        logger.error("%s%s", e, hint)
        return 2
    print_rows(rows)
    return 0


def _run_aot(engine_args, ns: argparse.Namespace) -> int:
    """`--topology`: compile for a TPU slice. ConfigError / ModelLoadError go to the caller."""
    try:
        from jaxengine.aot import DEFAULT_ROOFLINE_CONTEXT, format_report, run_aot_warmup
    except ImportError as e:
        raise SystemExit(f"xlaserve warmup --topology: the JAX backend's AOT compiler is not available ({e})") from None

    def progress(done, total, key):
        logger.info("compiled %d/%d: %s", done, total, key.describe())

    report = run_aot_warmup(engine_args, engine_args.topology, ns.level, executables_dir=ns.executables_dir,
                            roofline_context=ns.roofline_context or DEFAULT_ROOFLINE_CONTEXT, progress=progress)
    print(format_report(report))
    return 0 if report.fit["fits_hbm"] else 3


def print_rows(rows: list[dict]) -> None:
    cols = ("bucket", "seconds", "compiles", "cache_hits", "cache_misses", "status")
    table = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) if table else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths)))
