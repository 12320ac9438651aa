"""How long `xlaserve serve` takes to answer /health, each backend, warm and (optionally) cold.

    python -m benchmarks.bench_start [--backends jax,torch] [--rounds 3] [--cold] [--serve-args "..."]

Each round starts every backend in turn (alternating, so a slow minute hits both) on the embedded model and
times, from the process's spawn: /health answering 200 (`ready`), and from the server's own log the
engine's weight load and its `engine ready` time. A first start per backend is run untimed, so the rounds
are warm (the compiled programs in the persistent cache); `--cold` times one start per backend with an
empty compilation cache instead (`--compilation-cache-dir` in a temporary folder). The goal (issue 12): a
warm start within 10 s on 2 cores. Prints one table of medians (min-max).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import sys
import tempfile
import time

from benchmarks._server import ServerProcess

_LOADED = re.compile(r"(?:weights loaded|loaded .*) in ([0-9.]+)s")
_READY = re.compile(r"engine ready: .* in ([0-9.]+)s")


def start_once(backend: str, extra: list[str], log_path: str) -> dict:
    t0 = time.perf_counter()
    server = ServerProcess(["--backend", backend, *extra], log_path)
    try:
        server.wait_ready()
        ready = time.perf_counter() - t0
    finally:
        server.stop()
    with open(log_path) as f:
        log = f.read()
    loaded, engine = _LOADED.search(log), _READY.search(log)
    return {"ready": ready, "load": float(loaded.group(1)) if loaded else float("nan"),
            "engine": float(engine.group(1)) if engine else float("nan")}


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})" if xs else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="jax,torch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="also one start per backend with an empty XLA cache")
    ap.add_argument("--serve-args", default="", help="extra `xlaserve serve` flags")
    args = ap.parse_args()
    backends = args.backends.split(",")
    extra = shlex.split(args.serve_args)
    runs: dict[str, list[dict]] = {b: [] for b in backends}
    cold: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp:
        log = os.path.join(tmp, "serve.log")
        if args.cold:
            for b in backends:
                cold[b] = start_once(b, [*extra, "--compilation-cache-dir", os.path.join(tmp, f"xla-{b}")], log)
                print(f"  {b} cold: {cold[b]['ready']:.1f} s", file=sys.stderr, flush=True)
        for b in backends:  # untimed: fills the persistent cache, warms the page cache
            start_once(b, extra, log)
        for r in range(args.rounds):
            for b in backends:
                runs[b].append(start_once(b, extra, log))
                print(f"  round {r + 1} {b}: {runs[b][-1]['ready']:.1f} s", file=sys.stderr, flush=True)
    print(f"`xlaserve serve` on the embedded model, {os.cpu_count()} CPUs, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '-')}, seconds, median (min-max) of {args.rounds} warm starts")
    rows = [("backend", "to /health", "engine ready", "weights loaded", "cold to /health")]
    for b in backends:
        rows.append((b, summary([x["ready"] for x in runs[b]]), summary([x["engine"] for x in runs[b]]),
                     summary([x["load"] for x in runs[b]]), f"{cold[b]['ready']:.1f}" if b in cold else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
