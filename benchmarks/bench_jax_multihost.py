"""The per-step cost of the multi-host jax engine's command transport (`jaxengine.multihost.KVChannel`).

Two processes join one jax.distributed group on this host (gloo on the CPU); rank 0 sends `--steps` commands of
each payload size through the coordination service's key-value store, as it sends each step's
`enginecore.rank_commands.Execute`, and rank 1 receives them (reading, counting, deleting each key). Columns:
rank 0's time in `send` per step (what the scheduler's loop pays) and the round trip (send, then rank 1's
acknowledgement read back: the latency before the follower can launch the step).

    python -m benchmarks.bench_jax_multihost [--steps 500]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from benchmarks._server import free_port

SIZES = (1 << 10, 8 << 10, 64 << 10)  # a decode step of a few requests ... a prefill of many


class _Payload:
    def __init__(self, data: bytes):
        self.data = data


def _rank(rank: int, port: int, steps: int) -> None:
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    from jaxengine.multihost import KVChannel, _client

    ch, client = KVChannel(), _client()
    rows = []
    for size in SIZES:
        cmd = _Payload(os.urandom(size))
        send_s = trip_s = 0.0
        for i in range(steps):
            if rank == 0:
                t0 = time.perf_counter()
                ch.send(cmd)
                t1 = time.perf_counter()
                client.blocking_key_value_get_bytes(f"bench/ack/{size}/{i}", 30_000)
                send_s += t1 - t0
                trip_s += time.perf_counter() - t0
            else:
                ch.receive()
                client.key_value_set_bytes(f"bench/ack/{size}/{i}", b"1")
        rows.append((size, send_s / steps * 1e6, trip_s / steps * 1e3))
    if rank == 0:
        print(f"{'payload':>9} | {'rank 0 send (us/step)':>21} | {'round trip (ms/step)':>20}")
        for size, send_us, trip_ms in rows:
            print(f"{size >> 10:>6} KiB | {send_us:>21.0f} | {trip_ms:>20.2f}")
    jax.distributed.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank is not None:
        return _rank(a.rank, a.port, a.steps)
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.bench_jax_multihost", "--steps", str(a.steps), "--port", str(port)]
    follower = subprocess.Popen([*cmd, "--rank", "1"], stderr=subprocess.DEVNULL)
    try:
        subprocess.run([*cmd, "--rank", "0"], check=True, timeout=600, stderr=subprocess.DEVNULL)
    finally:
        follower.wait(60)


if __name__ == "__main__":
    main()
