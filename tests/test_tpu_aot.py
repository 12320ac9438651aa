"""TPU targets compiled on this CPU host with libtpu's compile-only devices (no TPU, no weights).

The Pallas kernel for v5e and v6e over a small shape matrix; the tiny model's
whole jaxengine step for v5e:2x2 at tensor parallelism 1 (through the CLI) and
4; the fit check refusing a model too large for the chips; the step cost model
against XLA's FLOP count. Everything that needs libtpu skips with the reason
where it is not installed (requirements.lock pins it; it installs on x86-64
Linux). Compiles are kept small: this file takes about a minute on 2 cores.
"""

from __future__ import annotations

import functools
import json
import os

import pytest

from enginecore.config import ConfigError, EngineArgs
from jaxengine.tpu_target import libtpu_missing_reason, parse_topology

# Compile-only use opens no TPU, so another process holding libtpu (a warmup, a benchmark) is harmless.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
needs_libtpu = pytest.mark.skipif(libtpu_missing_reason() is not None, reason=str(libtpu_missing_reason()))

# Llama-family decoders small enough to compile in seconds. TINY: GQA 2, head_dim 32 (stored padded to
# 128 lanes in the Pallas cache), 4 kv heads so that tensor parallelism 4 shards heads. TINY_GQA3: SmolLM2's
# head shape in small (3 kv heads, stored as 4: XLA would otherwise lay the cache out transposed).
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
        "vocab_size": 1024, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False}
TINY_GQA3 = dict(TINY, num_attention_heads=9, num_key_value_heads=3, hidden_size=288, tie_word_embeddings=True)
LLAMA_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
             "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
             "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}}
SMALL_SERVER = dict(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=256)


def config_folder(path, cfg: dict) -> str:
    """A model folder holding config.json only: all AOT compilation needs."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


# ------------------------------------------------------------------------- no libtpu needed


def test_topology_names():
    t = parse_topology("v5e:2x2")
    assert (t.chip.device_kind, t.num_chips, t.chips_per_host_bounds) == ("TPU v5 lite", 4, [2, 2, 1])
    assert parse_topology("v6e:4x4").chips_per_host_bounds is None  # a pod: libtpu's 2x2-chip hosts
    assert parse_topology("v5p:2x2x1").chip.hbm_bytes == 95 * 2**30
    for bad in ("v5e-4", "v7:2x2", "v5e:2x2x1", "v5p:2x2"):
        with pytest.raises(ConfigError, match="--topology"):
            parse_topology(bad)


def test_config_only_folder_is_for_aot_only(tmp_path):
    from enginecore.model_loader import ModelLoadError, resolve_model
    from jaxengine.aot import resolve_aot_model

    folder = config_folder(tmp_path / "tiny", TINY)
    assert resolve_aot_model(folder).config.num_key_value_heads == 4
    with pytest.raises(ModelLoadError, match="safetensors"):
        resolve_model(folder)


# ------------------------------------------------------------------------- the kernel


KERNEL_CASES = [  # (dtype, Hq, Hkv, D, block_size, sliding_window, soft_cap)
    ("bfloat16", 8, 2, 128, 16, 64, 30.0),
    ("float32", 4, 4, 128, 32, None, None),
    ("bfloat16", 16, 2, 64, 16, None, 20.0),
]


@needs_libtpu
@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_kernel_compiles_for_tpu(topology):
    """Mosaic compiles the kernel with the chip's tuned chunk / q-block sizes (pallas_kernels.tuning)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxengine.tpu_target import topology_devices
    from pallas_kernels import estimate_vmem_bytes, kernel_block_sizes, ragged_paged_attention

    device = topology_devices(parse_topology(topology))[0]
    one = NamedSharding(Mesh(np.array([device]), ("x",)), P())
    T, R, bps, NB = 48, 8, 6, 64
    for dtype, Hq, Hkv, D, bs, window, cap in KERNEL_CASES:
        dt = jnp.dtype(dtype)
        sd = lambda shape, d=dt: jax.ShapeDtypeStruct(shape, d, sharding=one)  # noqa: E731
        args = (sd((T, Hq, D)), sd((T, Hkv, D)), sd((T, Hkv, D)), sd((NB, bs, 2 * Hkv, D)), sd((R,), jnp.int32),
                sd((R * bps,), jnp.int32), sd((R + 1,), jnp.int32), sd((3,), jnp.int32))
        tuned = kernel_block_sizes(device.device_kind, block_size=bs, num_kv_heads=Hkv, group=Hq // Hkv,
                                   head_dim=D, dtype=dt)
        assert tuned and estimate_vmem_bytes(num_kv_heads=Hkv, group=Hq // Hkv, head_dim=D, block_size=bs, dtype=dt,
                                             num_kv_blocks_per_chunk=tuned["num_kv_blocks_per_chunk"],
                                             num_queries_per_block=tuned["num_queries_per_block"]) \
            <= tuned["vmem_limit_bytes"]
        fn = jax.jit(functools.partial(ragged_paged_attention, sm_scale=D**-0.5, sliding_window=window,
                                       soft_cap=cap, **tuned), donate_argnums=3)
        with jax.default_device(device):
            compiled = fn.lower(*args).compile()
        assert "tpu_custom_call" in compiled.as_text()
        assert compiled.memory_analysis().alias_size_in_bytes >= NB * bs * 2 * Hkv * D * dt.itemsize


# ------------------------------------------------------------------------- the engine step


@needs_libtpu
def test_tiny_model_compiles_for_v5e_through_the_cli(tmp_path, capsys):
    """`xlaserve warmup --topology v5e:2x2` at TP 1: one compiled program per bucket, cache entries written,
    the target named, what is and is not verified said, the KV cache in the kernel's layout (no WARNING)."""
    from frontend.cli import main

    folder = config_folder(tmp_path / "tiny", TINY_GQA3)
    cache = tmp_path / "xla"
    argv = ["warmup", folder, "--topology", "v5e:2x2", "--max-num-seqs", "8", "--max-num-batched-tokens", "16",
            "--max-model-len", "256", "--compilation-cache-dir", str(cache)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # buckets: tokens (16,), requests (8,): 1 model + 5 sampler variants + 2 prompt-logprobs programs
    table = [line for line in out.splitlines() if line.startswith(("model ", "sample ", "prompt_logprobs "))]
    assert [line.split("  ")[0].strip() for line in table] == [
        "model tokens=16", "sample reqs=8 greedy", "sample reqs=8 sample", "sample reqs=8 full",
        "sample reqs=8 masked", "sample reqs=8 processed", "prompt_logprobs rows=32", "prompt_logprobs rows=256"]
    assert all(" compiled " in line for line in table)
    assert "TPU v5 lite x 4 (v5e:2x2" in out and "verified: all 8 programs compile" in out
    assert "not verified" in out and "--num-gpu-blocks-override" in out and "WARNING" not in out
    assert len([f for f in os.listdir(cache) if f.endswith("-cache")]) >= 8


@needs_libtpu
def test_tiny_model_compiles_for_v5e_tp4(tmp_path):
    """TP 4 on v5e:2x2: heads sharded, the Pallas kernel under shard_map, the KV cache in the kernel's
    layout, the per-device HBM XLA reports matching the plan, serialized executables written."""
    from jaxengine.aot import run_aot_warmup

    folder = config_folder(tmp_path / "tiny", TINY)
    args = EngineArgs(model=folder, tensor_parallel_size=4, compilation_cache_dir="none", **SMALL_SERVER)
    report = run_aot_warmup(args, "v5e:2x2", "decode", executables_dir=str(tmp_path / "exe"))
    t = report.target
    assert (t["mesh_chips"], t["tensor_parallel_size"], t["heads_sharded"], t["attention"]) == (4, 4, True, "pallas")
    keys = [r["key"] for r in report.rows]
    assert [k.describe() for k in keys] == ["model tokens=16", "sample reqs=8 greedy", "sample reqs=8 sample"]
    model = report.rows[0]
    assert model["kv_layout"] == "3,2,1,0" and report.fit["fits_hbm"]
    # arguments on one device: its quarter of the KV cache + its weight shards (all but the LM head, which
    # only the sampler reads) + small inputs
    plan = report.plan
    low, high = plan.kv_bytes + plan.weights_bytes // 2, plan.kv_bytes + plan.weights_bytes + (1 << 20)
    assert low < model["args_bytes"] < high
    # the second artifact: one serialized executable per program, and what they were compiled for
    with open(tmp_path / "exe" / "manifest.json") as f:
        manifest = json.load(f)
    assert (manifest["device_kind"], manifest["num_blocks"], len(manifest["programs"])) == (
        "TPU v5 lite", plan.num_blocks, 3)
    assert all(os.path.getsize(tmp_path / "exe" / name) > 1000 for name in manifest["programs"])


@needs_libtpu
def test_model_too_large_for_the_chips_is_refused_before_compiling(tmp_path, monkeypatch):
    from jaxengine import runner as runner_mod
    from jaxengine.aot import run_aot_warmup

    monkeypatch.setattr(runner_mod.JaxModelRunner, "warmup", lambda *a, **k: pytest.fail("compiled anyway"))
    folder = config_folder(tmp_path / "llama70b", LLAMA_70B)
    args = EngineArgs(model=folder, tensor_parallel_size=4, max_model_len=8192, compilation_cache_dir="none")
    with pytest.raises(ConfigError, match=r"does not fit v5e:2x2 .*GiB over.*--tensor-parallel-size"):
        run_aot_warmup(args, "v5e:2x2")


@needs_libtpu
def test_step_cost_flops_match_xla_on_an_unrolled_step(tmp_path):
    """XLA counts a scanned layer once; unrolled, its FLOPs are the cost model's (attention is a Mosaic
    call XLA does not count, so compare at one cached token)."""
    from jaxengine.aot import _engine_config
    from jaxengine.programs import ProgramKey
    from jaxengine.runner import JaxModelRunner
    from jaxengine.step_cost import ShardedShape, model_step_cost
    from jaxengine.tpu_target import topology_devices

    topo = parse_topology("v5e:2x2")
    args = EngineArgs(model=config_folder(tmp_path / "tiny", TINY), compilation_cache_dir="none",
                      compilation_config={"scan_layers": False}, **SMALL_SERVER)
    config, source = _engine_config(args, topo)
    runner = JaxModelRunner(config, source, devices=topology_devices(topo))
    runner.init_kv_cache(64, allocate=False)
    xla = runner._compile(ProgramKey("model", 16)).cost_analysis()["flops"]
    ours = model_step_cost(source.config, ShardedShape.of(source.config, 1, False, 2, 2), tokens=16, reqs=16,
                           context=0).flops
    runner.shutdown()
    assert abs(xla - ours) / ours < 0.1, (xla, ours)
