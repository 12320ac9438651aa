"""Issue 15, part 7: a 30-second soak of a real server (benchmarks/soak.py, shortened).

8 clients send the mix a new user would (completions and chats, plain and streamed, n 1-2, greedy and
seeded, stop strings, streams dropped after a few chunks, abandoned requests, malformed bodies) to
`xlaserve serve` on the torch backend (its warm-up takes seconds) with a KV cache of 15 usable blocks,
small enough for the load to preempt. Checks: no 5xx, every bad input a 400, greedy/seeded requests asked
twice give the same text, nothing running or waiting and no KV block used afterwards, RSS flat; then the
engine process is SIGKILLed with a request in flight: 503, and the server exits with status 1.
`python -m benchmarks.soak --duration 600` is the long version.
"""

from __future__ import annotations

import pytest

from benchmarks.soak import kill_engine, report, run_soak, start_server

pytestmark = pytest.mark.slow

SERVER_ARGS = ["--backend", "torch", "--platform", "cpu", "--max-num-seqs", "8", "--max-model-len", "1024",
               "--max-num-batched-tokens", "512", "--num-gpu-blocks-override", "16", "--disable-log-stats"]


def test_soak_30s(tmp_path):
    srv = start_server(SERVER_ARGS, str(tmp_path / "server.log"))
    try:
        result = run_soak(srv.url, duration=30, clients=8, server_pid=srv.proc.pid, seed=15)
        result.engine_kill = kill_engine(srv.url, srv.proc)
    finally:
        srv.stop()
    text = report(result)
    print(text)
    assert not result.problems(), text
    assert result.good >= 10 and result.cancelled >= 1 and result.bad_input_400 >= 5, text
