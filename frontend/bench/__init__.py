"""`xlaserve bench ...`: the benchmark subcommands, spelled as vLLM's `vllm bench ...`.

- `latency`: one fixed batch, in-process; avg and percentiles of end-to-end latency.
- `throughput`: offline throughput, in-process, on random token ids or a JSONL of prompts.
- `serve`: a streaming client against any OpenAI-compatible server (TTFT/TPOT/ITL/E2EL).
- `compare`: one request trace through two backends; speed and token agreement.

The frontend CLI mounts this with `bench.register(subparsers)`; `python -m
frontend.bench ...` runs it without the rest of the CLI.
"""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> argparse.ArgumentParser:
    """Add `bench` and its subcommands to an argparse subparsers object; returns the `bench` parser.

    Each leaf sets `func(args) -> int`. The `bench` parser also sets the
    frontend CLI's hook `_run(parser, argv) -> int`, which parses the rest of
    argv itself and runs the leaf.
    """
    from frontend.bench.compare import add_compare_parser
    from frontend.bench.offline import add_latency_parser, add_throughput_parser
    from frontend.bench.serve import add_serve_parser

    p = subparsers.add_parser("bench", help="benchmarks: latency, throughput, serve, compare",
                              description="Benchmarks, as `vllm bench`.")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    add_latency_parser(sub)
    add_throughput_parser(sub)
    add_serve_parser(sub)
    add_compare_parser(sub)
    p.set_defaults(func=lambda args: (p.print_help(), 0)[1], _run=_run)
    return p


def _run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xlaserve")
    register(parser.add_subparsers(dest="command", metavar="COMMAND"))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)
