"""Issue 15 on a real `xlaserve serve` (subprocess, a tiny random Llama so start-up takes seconds):

- KV pressure, both backends: a cache of 13 usable blocks for 6 concurrent requests that need ~25; they are
  preempted and recomputed, none fails or hangs, and every output (greedy and seeded) equals the same
  request served alone; a request that can never fit is a 400 at admission.
- SIGTERM with tensor-parallel ranks: new requests get 503 while the streams in flight run to their end,
  then the server exits 0 and nothing is left: engine process, ranks, zmq ipc sockets, the port.
- A tokenizer that fails to load while the engine core starts (the two load side by side): the server says
  why and exits 2 (as for any model error), and the engine core process it had spawned is gone.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import signal
import socket
import threading
import time

import httpx
import psutil
import pytest

from benchmarks._server import sse_events
from tests.test_api_server import ServerProcess, metrics, wait_for

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir("llama")


def _requests() -> list[dict]:
    """6 prompts of 10-40 tokens, 32 new tokens each; every second one seeded.

    The seeded ones keep the top 50 tokens: a random model's distribution is nearly flat over the whole
    vocabulary, and an inverse-CDF draw over ~44k near-equal probabilities (top_p alone) moves by a few ids
    with the last bit of a cumulative sum, which the jax backend's programs for other batch shapes do
    round differently (also without any preemption)."""
    out = []
    for i in range(6):
        body = {"prompt": list(range(100 + 37 * i, 110 + 43 * i)), "max_tokens": 32, "ignore_eos": True,
                "return_token_ids": True}
        body.update({"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 1000 + i} if i % 2
                    else {"temperature": 0.0})
        out.append(body)
    return out


def _tokens(http: httpx.Client, body: dict) -> list[int]:
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _stream_tokens(http: httpx.Client, body: dict) -> list[int]:
    toks = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for chunk in sse_events(r.iter_lines()):
            assert "error" not in chunk, chunk
            toks += chunk["choices"][0].get("token_ids") or []
    return toks


def _metric(http: httpx.Client, name: str) -> float:
    return metrics(http)[name]


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_kv_pressure_outputs_equal_alone(tmp_path, tiny_llama, backend):
    srv = ServerProcess([tiny_llama, "--backend", backend, "--platform", "cpu", "--max-model-len",
                         str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                         "--num-gpu-blocks-override", "14", "--warmup", "none", "--disable-log-stats"],
                        str(tmp_path / "server.log"))
    try:
        srv.wait_ready()
        with httpx.Client(base_url=srv.url, timeout=300) as http:
            reqs = _requests()
            alone = [_tokens(http, b) for b in reqs]
            assert all(len(t) == 32 for t in alone)
            before = _metric(http, "vllm:num_preemptions_total")
            with cf.ThreadPoolExecutor(len(reqs)) as pool:  # half streamed, half not
                futs = [pool.submit(_stream_tokens if i % 4 < 2 else _tokens, http, b) for i, b in enumerate(reqs)]
                together = [f.result(timeout=600) for f in futs]
            assert together == alone
            assert _metric(http, "vllm:num_preemptions_total") > before, "the cache was meant to be too small"
            # 13 blocks of 16 = 208 tokens: a 220-token prompt can never fit, nor 100 + 150 tokens
            r = http.post("/v1/completions", json={"prompt": list(range(100, 320)), "max_tokens": 1})
            assert r.status_code == 400 and "KV-cache blocks" in r.json()["error"]["message"], r.text
            r = http.post("/v1/completions", json={"prompt": list(range(100, 200)), "max_tokens": 150})
            assert r.status_code == 400 and "max_tokens (150)" in r.json()["error"]["message"], r.text
            wait_for(lambda: _metric(http, "xlaserve:kv_cache_used_blocks") == 0, timeout=30, interval=0.2)
            assert _metric(http, "xlaserve:kv_cache_used_blocks") == 0
            assert _metric(http, "vllm:num_requests_running") == 0
            assert _metric(http, 'vllm:request_success_total{finished_reason="length"}') >= 12
    finally:
        srv.stop()


def test_sigterm_drains_then_exits_0_leaving_nothing(tmp_path, tiny_llama):
    srv = ServerProcess([tiny_llama, "--backend", "torch", "--platform", "cpu", "--tensor-parallel-size", "2",
                         "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--shutdown-timeout", "60",
                         "--disable-log-stats"], str(tmp_path / "server.log"), env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        srv.wait_ready()
        http = httpx.Client(base_url=srv.url, timeout=120)
        engine = psutil.Process(http.get("/server_info").json()["engine_pid"])
        ranks = engine.children(recursive=True)
        assert len(ranks) == 1, ranks  # tensor-parallel rank 1
        ipc = [c.laddr for c in psutil.Process(srv.proc.pid).net_connections(kind="unix") if "xlaserve-" in c.laddr]
        assert ipc
        streams: list[list] = [[], []]

        def consume(i: int) -> None:
            with httpx.Client(base_url=srv.url, timeout=120) as c, c.stream(
                    "POST", "/v1/completions", json={"prompt": "Count:", "max_tokens": 160, "ignore_eos": True,
                                                     "stream": True}) as r:
                streams[i].append(r.status_code)
                streams[i].extend(line for line in r.iter_lines() if line)

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while not all(len(s) > 2 for s in streams):
            assert time.monotonic() < deadline and all(t.is_alive() for t in threads), streams
            time.sleep(0.05)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # the port stays open while the streams finish: new requests get a 503 that says why
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"], r.text
        assert http.get("/health").status_code == 503
        assert srv.proc.wait(120) == 0
        for t in threads:
            t.join(30)
        for s in streams:  # both ran to their end
            assert s[0] == 200 and s[-1] == "data: [DONE]"
            last = json.loads(s[-2][6:])
            assert last["choices"][0]["finish_reason"] == "length", s[-3:]
        # nothing left behind: the engine process, the rank, the zmq ipc sockets, the port
        for p in [engine, *ranks]:
            assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE, p
        assert not any(os.path.exists(p) for p in ipc)
        with socket.socket() as s:  # (connections of this test may sit in TIME_WAIT: that is not a listener)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", srv.port))
        log = srv.log_tail(20000)
        assert "waiting up to 60s for 2 request(s) in flight" in log and "server stopped" in log
        http.close()
    finally:
        srv.stop()


def test_a_tokenizer_that_fails_beside_the_starting_engine_ends_the_start_cleanly(tmp_path, tiny_llama):
    empty = tmp_path / "no-tokenizer"
    empty.mkdir()
    srv = ServerProcess([tiny_llama, "--backend", "torch", "--platform", "cpu", "--tokenizer", str(empty),
                         "--max-model-len", str(MAX_MODEL_LEN), "--disable-log-stats"], str(tmp_path / "server.log"))
    try:
        assert srv.proc.wait(300) == 2  # as any model or config error
        log = srv.log_tail(20000)
        assert "cannot load the tokenizer" in log, log
        started = re.search(r"engine core process started \(pid (\d+)\)", log)
        assert started, log  # the engine core was already starting when the tokenizer failed
        pid = int(started.group(1))
        deadline = time.monotonic() + 30
        while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"engine core {pid} outlived the server"
            time.sleep(0.1)
    finally:
        srv.stop()
