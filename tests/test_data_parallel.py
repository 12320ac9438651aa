"""Data parallelism: `--data-parallel-size 2` engine cores behind one API server (`frontend.engine_client`,
`frontend.dp_router`). The router alone first (no processes); then real servers on the tiny Llama: 32
concurrent requests on both cores with every output the same as one core's, prefix affinity, a killed core;
a `--headless` node's core; Ray actors as the cores."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import signal
import time

import httpx
import pytest

from benchmarks._server import ServerProcess, parse_metrics
from enginecore.scheduler import SchedulerStats
from frontend.dp_router import DPRouter, sum_stats

MAX_MODEL_LEN = 256
FLAGS = ["--platform", "cpu", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8",
         "--max-num-batched-tokens", "128", "--warmup", "none", "--seed", "0", "--disable-log-stats"]
STARTUP_S = 600


def _stats(running: int, waiting: int = 0) -> SchedulerStats:
    return SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting)


# ---- the router alone -----------------------------------------------------------------------------------


def test_router_least_loaded_counts_what_was_sent_since_the_stats():
    r = DPRouter(3, block_size=4)
    r.on_stats(0, _stats(2, 1))
    r.on_stats(1, _stats(1))
    r.on_stats(2, _stats(4))
    # loads 3, 1, 4: core 1 twice (1, 2), then 0 (a tie at 3 goes to the lower rank), then 1
    assert [r.choose([1, 2, 3]) for _ in range(4)] == [1, 1, 0, 1]
    assert [r.load(e) for e in range(3)] == [4, 4, 4]
    r.on_stats(1, _stats(0))  # fresh stats replace what was counted as sent
    assert r.load(1) == 0 and r.choose([9]) == 1


def test_router_prefix_affinity_until_the_owner_is_much_busier():
    r = DPRouter(2, block_size=4, prefix_caching=True, imbalance=2)
    prefix = list(range(100, 116))  # 4 full blocks
    first = r.choose(prefix + [1])
    assert first == 0
    # the prefix's core, although the other is less loaded, while within `imbalance` requests of it
    assert r.choose(prefix + [2, 3]) == 0 and r.choose(prefix + [4]) == 0
    assert r.load(0) == 3 and r.load(1) == 0
    assert r.choose(prefix + [5]) == 1  # 3 - 0 > 2: balance instead
    assert r.choose(prefix + [6]) == 1  # and the blocks' owner moved with it
    # a prompt that shares only its first block goes where that block went
    assert r.choose(prefix[:4] + [7, 7, 7, 7, 8]) == 1
    # a prompt of less than one full block (+1 token) hashes nothing: least loaded
    r.on_stats(0, _stats(0))
    r.on_stats(1, _stats(5))
    assert r.block_hashes(prefix[:4]) == [] and r.choose(prefix[:4]) == 0
    # without prefix caching: least loaded only
    plain = DPRouter(2, block_size=4)
    plain.on_stats(0, _stats(1))
    assert plain.choose(prefix + [1]) == 1 and plain.choose(prefix + [1]) == 0 and not plain.blocks


def test_router_hashes_like_the_engine_and_keeps_a_bounded_map():
    from enginecore.kv_cache import KVCacheManager
    from enginecore.request import Request
    from enginecore.sampling_params import SamplingParams

    ids = list(range(1, 40))
    r = DPRouter(2, block_size=8, prefix_caching=True, max_blocks=6)
    kv = KVCacheManager(16, 8, enable_caching=True)
    req = Request(request_id="a", prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=1))
    kv.get_computed_blocks(req)
    assert r.block_hashes(ids) == [h for h, _ in req.block_hashes][:(len(ids) - 1) // 8]
    for i in range(5):  # 4 blocks each: the map keeps the 6 most recent
        r.choose([1000 * i + t for t in range(33)])
    assert len(r.blocks) == 6
    assert set(r.blocks) == set(r.block_hashes([4000 + t for t in range(33)]) +
                                r.block_hashes([3000 + t for t in range(33)])[2:])


def test_sum_stats():
    a = SchedulerStats(num_running_reqs=1, num_used_blocks=3, num_total_blocks=10, prefix_cache_hits=16)
    b = SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, num_used_blocks=1, num_total_blocks=10)
    s = sum_stats([a, b])
    assert (s.num_running_reqs, s.num_waiting_reqs, s.num_used_blocks, s.prefix_cache_hits) == (3, 1, 4, 16)
    assert s.kv_cache_usage == pytest.approx(0.2)


def test_dp_layouts_as_vllm_deploys_them():
    from enginecore.config import ConfigError, ParallelConfig
    from enginecore.engine_proc import core_config, core_placement, dp_layout

    def layout(headless=False, **kw):
        lay = dp_layout(ParallelConfig(**kw), headless)
        return lay.served, lay.local, lay.tcp

    assert layout() == ([0], [0], False)
    assert layout(data_parallel_size=4) == ([0, 1, 2, 3], [0, 1, 2, 3], False)  # one node: ipc
    # a head with 2 of 4 cores, a headless node with the others: tcp at the head's address
    assert layout(data_parallel_size=4, data_parallel_size_local=2) == ([0, 1, 2, 3], [0, 1], True)
    assert layout(True, data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2) == \
        ([], [2, 3], True)
    assert layout(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2,
                  data_parallel_hybrid_lb=True) == ([2, 3], [2, 3], False)  # a server per node, its cores
    assert layout(data_parallel_size=4, data_parallel_rank=3, data_parallel_external_lb=True) == ([3], [3], False)
    assert layout(data_parallel_size=2, data_parallel_backend="ray") == ([0, 1], [], True)
    lay = dp_layout(ParallelConfig(data_parallel_size=2, data_parallel_address="10.0.0.1", data_parallel_rpc_port=5000))
    assert (lay.output_address(), lay.input_address(1), lay.input_address(1, bind=True)) == \
        ("tcp://10.0.0.1:5000", "tcp://10.0.0.1:5002", "tcp://*:5002")
    for kw, flag in ((dict(data_parallel_size=2, data_parallel_external_lb=True), "--data-parallel-rank"),
                     (dict(data_parallel_size=4, data_parallel_start_rank=2), "--headless"),
                     (dict(data_parallel_size=2, nnodes=2), "--data-parallel-size-local"),
                     (dict(data_parallel_size=4, data_parallel_size_local=3, data_parallel_start_rank=2),
                      "--data-parallel-size-local")):
        with pytest.raises(ConfigError, match=flag):
            dp_layout(ParallelConfig(**kw))
    with pytest.raises(ConfigError, match="--data-parallel-size N"):
        dp_layout(ParallelConfig(), headless=True)

    from enginecore.config import EngineArgs
    from enginecore.engine import build_engine_config

    config, _ = build_engine_config(EngineArgs(data_parallel_size=2, platform="cpu", backend="torch"))
    assert core_config(config, 1).parallel_config.data_parallel_size == 1  # each core: a DP-size-1 engine
    env, cpus = core_placement(config, 1, 2)
    assert env["OMP_NUM_THREADS"] == str(max(1, int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
                                             // 2)) and len(cpus) >= 1
    cuda = dataclasses.replace(config, device_config=dataclasses.replace(config.device_config, platform="cuda"),
                               parallel_config=dataclasses.replace(config.parallel_config, tensor_parallel_size=2))
    old = os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    try:
        assert core_placement(cuda, 1, 2) == ({"CUDA_VISIBLE_DEVICES": "2,3"}, None)
    finally:
        if old is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


# ---- real servers -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama")


def _server(tmp_path, name: str, args: list[str], env: dict | None = None) -> ServerProcess:
    srv = ServerProcess([*FLAGS, *args], str(tmp_path / f"{name}.log"), env=env)
    srv.wait_ready(STARTUP_S)
    return srv


def _bodies() -> list[dict]:
    """32 requests: greedy and seeded sampling, prompts of 20-60 token ids (no shared blocks)."""
    out = []
    for i in range(32):
        prompt = [(7 * i + 13 * t) % 4000 + 500 for t in range(20 + i)]
        body = {"prompt": prompt, "max_tokens": 12, "ignore_eos": True}
        if i % 2:
            body.update(temperature=1.0, top_p=0.9, seed=1000 + i)
        else:
            body.update(temperature=0.0)
        out.append(body)
    return out


def _complete(http: httpx.Client, body: dict) -> list[int]:
    r = http.post("/v1/completions", json={**body, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _run_all(http: httpx.Client, bodies: list[dict]) -> list[list[int]]:
    with cf.ThreadPoolExecutor(len(bodies)) as pool:
        return [f.result(timeout=300) for f in [pool.submit(_complete, http, b) for b in bodies]]


def _per_engine(http: httpx.Client, name: str, engines=(0, 1)) -> list[float]:
    m = parse_metrics(http.get("/metrics").text)
    return [sum(v for k, v in m.items() if k.startswith(name + "{") and f'engine="{e}"' in k) for e in engines]


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_dp2_serves_on_both_cores_as_dp1(tmp_path, tiny, backend):
    bodies = _bodies()
    one = _server(tmp_path, "dp1", [tiny, "--backend", backend])
    try:
        with httpx.Client(base_url=one.url, timeout=300) as http:
            expected = _run_all(http, bodies)
            assert "engine=" not in http.get("/metrics").text  # one core: vLLM's series as they were
    finally:
        assert one.stop() == 0
    srv = _server(tmp_path, "dp2", [tiny, "--backend", backend, "--data-parallel-size", "2"],
                  env={"VLLM_SERVER_DEV_MODE": "1"})  # (/server_info: the cores' pids)
    try:
        with httpx.Client(base_url=srv.url, timeout=300) as http:
            assert _run_all(http, bodies) == expected
            done = _per_engine(http, "vllm:request_success_total")
            assert sum(done) == 32 and min(done) >= 8, done  # both cores, roughly balanced
            # prefix affinity: requests sharing a cached 128-token prefix all go where it is
            prefix = [(31 * t) % 3000 + 700 for t in range(128)]
            _complete(http, {"prompt": prefix + [5], "max_tokens": 2})
            hits = _per_engine(http, "vllm:prefix_cache_hits_total")
            shared = [{"prompt": prefix + [9, i], "max_tokens": 4} for i in range(6)]
            others = [{"prompt": [(11 * i + 3 * t) % 3000 + 900 for t in range(40)], "max_tokens": 4}
                      for i in range(6)]
            _run_all(http, [b for pair in zip(shared, others) for b in pair])
            gained = [a - b for a, b in zip(_per_engine(http, "vllm:prefix_cache_hits_total"), hits)]
            assert sorted(gained) == [0, 6 * 128], gained
            info = http.get("/server_info").json()
            assert sorted(info["engine_pids"]) == ["0", "1"]
            if backend == "jax":  # a core that dies: the engine's death (503), the server exits non-zero
                os.kill(info["engine_pids"]["1"], signal.SIGKILL)
                deadline = time.monotonic() + 60
                while srv.alive() and time.monotonic() < deadline:
                    try:
                        r = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
                        if r.status_code == 503:
                            assert "engine core 1" in r.json()["error"]["message"], r.text
                            break
                    except httpx.HTTPError:
                        break
                    time.sleep(0.1)
                srv.proc.wait(60)
                assert srv.proc.returncode not in (0, None)
                assert "engine core 1 process exited unexpectedly" in srv.log_tail(20000)
    finally:
        srv.stop()


def _both_cores_serve(http: httpx.Client, n: int = 8) -> list[list[int]]:
    outs = _run_all(http, _bodies()[:n])
    done = _per_engine(http, "vllm:request_success_total")
    assert sum(done) == n and min(done) >= 1, done
    return outs


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_headless_node_runs_the_second_core(tmp_path, tiny):
    """One machine as two nodes: the head serves HTTP with core 0 (--data-parallel-size-local 1), a --headless
    node runs core 1 (--data-parallel-start-rank 1), which connects to the head over tcp."""
    import sys

    from benchmarks._server import LoggedProcess, free_port

    def start(name: str):
        port = str(free_port())
        dp = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-address",
              "127.0.0.1", "--data-parallel-rpc-port", port]
        node = LoggedProcess([sys.executable, "-m", "frontend.cli", "serve", tiny, *FLAGS, "--backend", "jax", *dp,
                              "--data-parallel-start-rank", "1", "--headless"], str(tmp_path / f"{name}-node.log"))
        try:
            return node, _server(tmp_path, f"{name}-head", [tiny, "--backend", "jax", *dp])
        except BaseException:
            node.stop()
            raise

    node, head = start("a")
    try:
        with httpx.Client(base_url=head.url, timeout=300) as http:
            _both_cores_serve(http)
        assert head.stop() == 0
        assert node.proc.wait(60) == 0, node.log_tail()  # the head's shutdown stopped the node's core
        assert "engine cores [1] of 2" in node.log_tail(20000)
    finally:
        head.stop()
        node.stop()
    # the node stopped under a running head (SIGTERM: it says so; SIGKILL: its core falls silent): its core's
    # death is the engine's
    for name, sig, needle in (("b", signal.SIGTERM, "the headless node running engine core 1 was stopped"),
                              ("c", signal.SIGKILL, "engine core 1 sent nothing for")):
        node, head = start(name)
        try:
            node.proc.send_signal(sig)
            node.proc.wait(60)
            assert head.proc.wait(120) not in (0, None)
            assert needle in head.log_tail(20000)
        finally:
            head.stop()
            node.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ray_actors_as_cores(tmp_path, tiny, ray_cluster):
    srv = _server(tmp_path, "ray", [tiny, "--backend", "jax", "--data-parallel-size", "2",
                                    "--data-parallel-backend", "ray"])
    try:
        with httpx.Client(base_url=srv.url, timeout=300) as http:
            _both_cores_serve(http)
        assert "started as Ray actors" in srv.log_tail(200000)
    finally:
        assert srv.stop() == 0
