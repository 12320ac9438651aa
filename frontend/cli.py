"""`xlaserve` command line. Subcommands are registered by frontend modules.

Each module in SUBCOMMAND_MODULES exposes `register(subparsers)`, which adds
its subparser and sets one of two defaults:
- `_run=fn(parser, argv) -> exit code`: the subcommand parses its own argv
  (so `serve --help=CacheConfig`, `--config` and dotted JSON flags work);
- `func=fn(args) -> exit code`: plain argparse (e.g. `frontend.bench`).
Optional modules are skipped when absent.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from enginecore import __version__

SUBCOMMAND_MODULES = (
    "frontend.serve",
    "frontend.clients",
    "frontend.run_batch",
    "frontend.collect_env",
    "frontend.warmup",
)
OPTIONAL_SUBCOMMAND_MODULES = ("frontend.bench",)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xlaserve", description="LLM inference and serving engine (JAX/XLA + torch).")
    p.add_argument("--version", action="version", version=f"xlaserve {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for name in OPTIONAL_SUBCOMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and name.startswith(e.name):
                continue  # not written yet
            raise
        if hasattr(mod, "register"):
            mod.register(sub)
    if "bench" not in sub.choices:
        b = sub.add_parser("bench", help="Benchmarks (not installed yet).", add_help=False)
        b.set_defaults(_run=_bench_missing)
    return p


def _bench_missing(_parser, _argv) -> int:
    print("xlaserve bench: the benchmark subcommand is not part of this build yet "
          "(it will live in frontend/bench/).", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    from enginecore.logging_setup import configure_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    configure_logging()
    if argv and argv[0] in sub.choices:
        subparser = sub.choices[argv[0]]
        run = subparser.get_default("_run")
        if run is not None:
            return int(run(subparser, argv[1:]) or 0)
    args = parser.parse_args(argv)  # --help, --version, unknown commands, func-style subcommands
    if getattr(args, "func", None) is not None:
        return int(args.func(args) or 0)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
