"""`xlaserve` command line. Subcommands are registered by frontend modules."""

from __future__ import annotations

import argparse
import sys

from enginecore import __version__


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xlaserve", description="LLM inference and serving engine (JAX/XLA + torch).")
    p.add_argument("--version", action="version", version=f"xlaserve {__version__}")
    p.add_subparsers(dest="command", metavar="COMMAND")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
