"""Each host loads only its own shards: 2 real processes (jax.distributed, gloo) x 4 CPU devices, one mesh.

Every process places the tiny models' weights with TP shardings over devices of both processes and checks
that each of its devices' shards equals the same slice of the single-device load, and that it read exactly
the bytes of the slices its devices hold (`ModelSource.bytes_read`), well under the whole file. An orbax
checkpoint restores into the same 2-process shardings.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks._server import free_port

pytestmark = [pytest.mark.slow]

WORKER_TIMEOUT = 300


def _worker(process_id: int, port: int, cases: list[dict], orbax_dir: str, out_path: str) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
                               initialization_timeout=120)
    import numpy as np

    from enginecore.model_loader import resolve_model
    from jaxengine.checkpoint import load_orbax_params
    from jaxengine.loader import load_params, repeat_heads
    from jaxengine.model import abstract_params
    from jaxengine.sharding import ShardingRules, kv_head_repeats, make_mesh, param_shardings, repeat_kv_heads

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    assert len(devices) == 8 and len(jax.local_devices()) == 4
    one = make_mesh(1, 1, jax.local_devices()[:1])

    def shardings(arch, mesh, ep=False):
        return param_shardings(abstract_params(arch, "float32"), ShardingRules.for_model(arch, mesh, ep), mesh)

    def check_shards(params, want) -> int:
        """Every addressable shard against the single-device params' slice; returns the bytes the shards hold
        (a fully replicated param once: it is read once a process)."""
        held = 0
        for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
            ref = np.asarray(ref)
            assert not got.is_fully_addressable  # the mesh spans both processes
            for s in got.addressable_shards:
                np.testing.assert_array_equal(np.asarray(s.data), ref[s.index])
            held += ref.nbytes if got.sharding.is_fully_replicated else sum(
                s.data.nbytes for s in got.addressable_shards)
        return held

    report = []
    for case in cases:
        src = resolve_model(case["dir"])
        repeats = kv_head_repeats(src.config, case["tp"])
        arch = repeat_kv_heads(src.config, repeats)
        want = load_params(src, arch, "float32", shardings(arch, one), kv_repeats=repeats)
        whole = src.bytes_read
        if repeats > 1:  # the lazy reader's repeated heads against the whole-tensor reference
            k = np.asarray(src.load_weights()["model.layers.1.self_attn.k_proj.weight"])
            np.testing.assert_array_equal(np.asarray(want.layers.k_proj[1]).reshape(-1, k.shape[1]),
                                          repeat_heads(k, repeats, arch.head_dim))
        picked = [devices[i] for i in case["devices"]]
        mesh = make_mesh(case["tp"], 1, picked)
        before = src.bytes_read
        params = load_params(src, arch, "float32", shardings(arch, mesh, case["ep"]), kv_repeats=repeats)
        read = src.bytes_read - before
        held = check_shards(params, want)
        report.append({"name": case["name"], "repeats": repeats, "whole": whole, "read": read, "held": held})
        if case["name"] == "llama" and orbax_dir:
            restored = load_orbax_params(orbax_dir, arch, "float32", shardings(arch, mesh))
            check_shards(restored, want)
            report[-1]["orbax"] = True
    with open(out_path, "w") as f:
        json.dump(report, f)
    jax.distributed.shutdown()


def _run_two_processes(cases, orbax_dir, tmp_path) -> list[list[dict]]:
    port = free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    outs = [str(tmp_path / f"rank{i}.json") for i in range(2)]
    args = json.dumps([cases, orbax_dir])
    procs = [subprocess.Popen([sys.executable, __file__, str(i), str(port), args, outs[i]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=WORKER_TIMEOUT)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{logs[i][-4000:] if i < len(logs) else ''}"
    return [json.load(open(o)) for o in outs]


@pytest.mark.timeout(WORKER_TIMEOUT + 60)
def test_two_processes_load_only_their_shards(tiny_model_dir, tiny_moe_dir, tmp_path):
    from enginecore.model_loader import resolve_model
    from jaxengine.checkpoint import convert_to_orbax

    llama = tiny_model_dir("llama")
    orbax_dir = convert_to_orbax(resolve_model(llama), str(tmp_path / "orbax"), "float32")
    cases = [
        # TP 8 over all 8 devices: MLP columns and the vocabulary split, the (2) kv heads replicated
        {"name": "llama", "dir": llama, "tp": 8, "devices": list(range(8)), "ep": False},
        # TP 4 over 2 devices of each process: 2 copies of each kv head (repeat_heads), heads split
        {"name": "llama_tp4", "dir": llama, "tp": 4, "devices": [0, 1, 4, 5], "ep": False},
        # experts' columns split (the down projection transposed), a dense layer among sparse ones, tied embeddings
        {"name": "qwen3_moe", "dir": tiny_moe_dir("qwen3_moe"), "tp": 8, "devices": list(range(8)), "ep": False},
        # whole experts split: each process reads its 8 of the 16 experts
        {"name": "qwen3_moe_ep", "dir": tiny_moe_dir("qwen3_moe"), "tp": 8, "devices": list(range(8)), "ep": True},
    ]
    reports = _run_two_processes(cases, orbax_dir, tmp_path)
    for case in cases:
        got = [next(r for r in rep if r["name"] == case["name"]) for rep in reports]
        for r in got:
            # exactly the slices its devices hold, a fraction of the file
            assert r["read"] == r["held"], r
            assert r["read"] < 0.6 * r["whole"], r
        assert got[0]["repeats"] == (2 if case["name"] == "llama_tp4" else 1)
    assert all(next(r for r in rep if r["name"] == "llama").get("orbax") for rep in reports)


if __name__ == "__main__":
    cases, orbax_dir = json.loads(sys.argv[3])
    _worker(int(sys.argv[1]), int(sys.argv[2]), cases, orbax_dir, sys.argv[4])
