"""One jax engine over two processes (jax.distributed, gloo on the CPU), through real servers: node 0 `xlaserve
serve --nnodes 2 --node-rank 0` and node 1 `--headless`, 4 fake CPU devices each, TP 8 over both; against one
process with 8 devices. Then the failures: a killed follower, a coordinator that never comes."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import subprocess
import sys

import httpx
import psutil
import pytest

from benchmarks._server import LoggedProcess, free_port
from tests.test_api_server import ServerProcess, wait_for

pytestmark = pytest.mark.slow

FLAGS = ["--backend", "jax", "--platform", "cpu", "--max-model-len", "256", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "64", "--tensor-parallel-size", "8", "--warmup", "none", "--seed", "0"]
PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
JOIN_TIMEOUT_S = 60  # a process's wait for the group (the test's processes start within seconds of each other)


def _env(devices: int, **extra) -> dict:
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
            "VLLM_XLA_CACHE_PATH": "off", "XLASERVE_DISTRIBUTED_TIMEOUT": str(JOIN_TIMEOUT_S), **extra}


def _headless(model: str, port: int, log: str, **env) -> LoggedProcess:
    return LoggedProcess([sys.executable, "-m", "frontend.cli", "serve", model, *FLAGS, "--nnodes", "2",
                          "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                          "--headless"], log, _env(4, **env))


def _pair(model: str, tmp_path, **env) -> tuple[ServerProcess, LoggedProcess]:
    port = free_port()
    head = ServerProcess([model, *FLAGS, "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                          "--master-port", str(port)], str(tmp_path / "node0.log"), _env(4, **env))
    follower = _headless(model, port, str(tmp_path / "node1.log"), **env)
    try:
        head.wait_ready(300)
    except BaseException:
        follower.stop(10)
        raise
    return head, follower


def _completions(url: str) -> list[str]:
    out = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for prompt in PROMPTS:
            for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
                r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, **kw})
                assert r.status_code == 200, r.text
                out.append(r.json()["choices"][0]["text"])
    return out


@pytest.fixture(scope="module")
def expected(tiny_model_dir, tmp_path_factory) -> list[str]:
    """The completions of one process with all 8 devices: what every multi-process layout must give."""
    one = ServerProcess([tiny_model_dir("llama"), *FLAGS], str(tmp_path_factory.mktemp("one") / "one.log"), _env(8))
    try:
        one.wait_ready(300)
        out = _completions(one.url)
        assert all(out), out
        return out
    finally:
        one.stop()


@pytest.mark.timeout(900)
def test_two_processes_tp8_match_one_process(tiny_model_dir, expected, tmp_path):
    model = tiny_model_dir("llama")
    head, follower = _pair(model, tmp_path)
    try:
        assert _completions(head.url) == expected
        assert "process 1 of 2" in open(follower.log_path).read()
    finally:
        assert head.stop() == 0
        # SIGTERM on node 0 stops the group: node 1 gets Shutdown and exits 0
        follower.proc.wait(60)
        follower.stop()
    assert follower.proc.returncode == 0, follower.log_tail()


def _follower_actor_pids() -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"]) if any("_FollowerActor" in a for a in p.info["cmdline"] or [])]


@pytest.mark.timeout(900)
def test_ray_executor_places_node1_as_actor(tiny_model_dir, expected, ray_cluster, tmp_path):
    """`--distributed-executor-backend ray`: only node 0 is started; node 1 is its Ray actor (4 devices too)."""
    head = ServerProcess([tiny_model_dir("llama"), *FLAGS, "--nnodes", "2", "--distributed-executor-backend", "ray"],
                         str(tmp_path / "node0.log"), _env(4))
    try:
        head.wait_ready(300)
        assert _follower_actor_pids()  # node 1 runs in the cluster's actor, not as a child of the server
        assert _completions(head.url) == expected
        assert "PACK" in open(head.log_path).read()  # (a one-host cluster)
        assert head.stop() == 0
        wait_for(lambda: not _follower_actor_pids(), timeout=60)
    finally:
        head.stop()


def _stream_until_killed(url: str, victim: LoggedProcess) -> list[str]:
    """A long streamed completion; `victim` is killed once its first tokens came (steps are running). Its
    lines."""
    body = {"prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 3:
                victim.proc.send_signal(signal.SIGKILL)
    return lines


@pytest.mark.timeout(600)
def test_killed_follower_fails_node0_fast(tiny_model_dir, tmp_path):
    head, follower = _pair(tiny_model_dir("llama"), tmp_path, XLASERVE_DISTRIBUTED_HEARTBEAT="5")
    try:
        with cf.ThreadPoolExecutor(2) as pool:
            # two requests in flight when node 1 dies mid-decode: node 0's steps cannot finish without it
            stream = pool.submit(_stream_until_killed, head.url, follower)
            plain = pool.submit(httpx.post, head.url + "/v1/completions", timeout=120,
                                json={"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True})
            lines = stream.result()
            assert plain.result().status_code == 503, plain.result().text
        assert any('"error"' in line for line in lines), lines[-3:]
        head.proc.wait(90)  # no hang: the server exits on its own
        assert head.proc.returncode not in (0, None), head.log_tail()
    finally:
        head.stop(10)
        follower.stop(10)


@pytest.mark.timeout(180)
def test_a_process_alone_names_whom_it_waited_for(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    env = {"XLASERVE_DISTRIBUTED_TIMEOUT": "5"}
    port, lonely_port = free_port(), free_port()  # nobody listens on `port`; node 0 alone hosts `lonely_port`
    follower = _headless(model, port, str(tmp_path / "node1.log"), **env)
    head = ServerProcess([model, *FLAGS, "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                          "--master-port", str(lonely_port)], str(tmp_path / "node0.log"), _env(4, **env))
    for proc in (follower, head):
        try:
            proc.proc.wait(90)
        except subprocess.TimeoutExpired:
            pass
        finally:
            proc.stop(10)
    for proc, needle in ((follower, f"coordinator 127.0.0.1:{port}"),
                         (head, f"node 1 (--node-rank, --headless) to join coordinator 127.0.0.1:{lonely_port}")):
        log = open(proc.log_path).read()
        assert proc.proc.returncode != 0, log[-3000:]
        assert needle in log and "XLASERVE_DISTRIBUTED_TIMEOUT" in log, log[-3000:]
