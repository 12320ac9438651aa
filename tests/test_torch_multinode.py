"""torch tensor parallelism beyond one process tree, for real: `xlaserve serve` on "2 nodes" (two servers on this
host, node 1 `--headless`, gloo between them through the rendezvous --master-addr:--master-port), and
`--distributed-executor-backend ray` on a local Ray cluster; each gives TP 1's tokens through the HTTP API. Then
what fails: a killed node 1 is an engine death (503, rank 0 exits non-zero), a node without its master exits
naming the rendezvous, and SIGTERM on rank 0 stops the group."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import psutil
import pytest

from benchmarks._server import free_port
from enginecore.config import ConfigError, ParallelConfig
from tests.test_api_server import ServerProcess, wait_for

FLAGS = ["--backend", "torch", "--platform", "cpu", "--max-model-len", "256", "--max-num-seqs", "4",
         "--max-num-batched-tokens", "64", "--kv-cache-memory-bytes", str(1 << 20), "--warmup", "none",
         "--disable-log-stats"]
PROMPTS = [[101, 2045, 318, 257, 1332], [88, 301, 77, 5, 9, 632, 1625, 7, 19, 4, 13]]
# greedy, and seeded over a peaked distribution (over a random model's flat one, float-level differences between
# TP 1 and TP 2 logits would flip a draw now and then)
SAMPLING = [dict(temperature=0.0), dict(temperature=0.5, top_k=20, top_p=0.9, seed=7)]
EXIT_S = 60  # how long a server or node may take to exit once it should


def tokens(url: str) -> list[list[int]]:
    """The completion token ids of every prompt under every sampling setting."""
    out = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for s in SAMPLING:
            for p in PROMPTS:
                r = c.post("/v1/completions", json={"prompt": p, "max_tokens": 8, "ignore_eos": True,
                                                    "return_token_ids": True, **s})
                assert r.status_code == 200, r.text
                out.append(r.json()["choices"][0]["token_ids"])
    return out


def start_two_nodes(model: str, tmp_path, tag: str) -> tuple[ServerProcess, subprocess.Popen, str]:
    """Node 0 (the API server, rank 0) and node 1 (`--headless`, rank 1) of TP 2; node 1's log path."""
    nodes = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port",
             str(free_port())]
    node1_log = str(tmp_path / f"{tag}-node1.log")
    with open(node1_log, "w") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "frontend.cli", "serve", model, *FLAGS, *nodes,
                                  "--node-rank", "1", "--headless"], stdout=log, stderr=subprocess.STDOUT)
    node0 = ServerProcess([model, *FLAGS, *nodes, "--node-rank", "0"], str(tmp_path / f"{tag}-node0.log"))
    try:
        node0.wait_ready()
    except BaseException:
        node1.kill()
        node1.wait(EXIT_S)
        raise
    return node0, node1, node1_log


def test_nodes_must_divide_the_ranks():
    from torchengine.distributed import node_placements

    with pytest.raises(ConfigError, match="--tensor-parallel-size 3 must be a multiple of --nnodes 2"):
        node_placements(ParallelConfig(tensor_parallel_size=3, nnodes=2), "tcp://127.0.0.1:1")
    # node 1 of 2 runs global ranks 2 and 3, on its devices 0 and 1
    pc = ParallelConfig(tensor_parallel_size=4, nnodes=2, node_rank=1)
    assert [(p.rank, p.local_rank, p.local_size) for p in node_placements(pc, "tcp://a:1")] == [(2, 0, 2), (3, 1, 2)]


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def tp1_tokens(model, tmp_path_factory) -> list[list[int]]:
    srv = ServerProcess([model, *FLAGS], str(tmp_path_factory.mktemp("tp1") / "server.log"))
    try:
        srv.wait_ready()
        return tokens(srv.url)
    finally:
        srv.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_match_tp1_and_sigterm_stops_both(model, tp1_tokens, tmp_path):
    node0, node1, _ = start_two_nodes(model, tmp_path, "ok")
    try:
        assert tokens(node0.url) == tp1_tokens
        assert node0.stop(EXIT_S) == 0
        assert node1.wait(EXIT_S) == 0  # told to shut down by rank 0, not left waiting
        assert "rendezvous is tcp://127.0.0.1:" in node0.log_tail(100000)
    finally:
        node0.stop()
        node1.kill()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_node_is_503_and_rank0_exits(model, tmp_path):
    node0, node1, _ = start_two_nodes(model, tmp_path, "kill")
    try:
        node1.kill()
        node1.wait(EXIT_S)
        r = httpx.post(node0.url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4}, timeout=EXIT_S)
        assert r.status_code == 503, r.text
        assert node0.proc.wait(EXIT_S) == 1
        assert "engine core died" in node0.log_tail(100000)
    finally:
        node0.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_headless_node_without_master_names_the_rendezvous(model):
    port = free_port()
    p = subprocess.run([sys.executable, "-m", "frontend.cli", "serve", model, *FLAGS, "--tensor-parallel-size", "2",
                        "--nnodes", "2", "--node-rank", "1", "--headless", "--master-addr", "127.0.0.1",
                        "--master-port", str(port)], env={**os.environ, "XLASERVE_DISTRIBUTED_TIMEOUT": "3"},
                       capture_output=True, text=True, timeout=240)
    assert p.returncode != 0
    assert f"could not reach rank 0 (node 0) at the rendezvous 127.0.0.1:{port}" in p.stdout + p.stderr


def _rank_actor_pids() -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"]) if any("_RankActor" in a for a in p.info["cmdline"] or [])]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_executor_matches_tp1_and_sigterm_kills_actors(model, tp1_tokens, ray_cluster, tmp_path):
    srv = ServerProcess([model, *FLAGS, "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"],
                        str(tmp_path / "server.log"))
    try:
        srv.wait_ready()
        assert _rank_actor_pids()  # rank 1 runs in a Ray actor of the cluster, not a child of the server
        assert tokens(srv.url) == tp1_tokens
        assert srv.stop(EXIT_S) == 0
        wait_for(lambda: not _rank_actor_pids(), timeout=EXIT_S)
    finally:
        srv.stop()
