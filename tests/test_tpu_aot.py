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


# ------------------------------------------------------------------------- MoE on paper (no libtpu needed)


# A Qwen3-MoE small enough to count by hand: E 8, top-2, Ie 32; and the two released models the benchmark compiles.
TINY_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
            "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 4, "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
            "norm_topk_prob": True, "vocab_size": 256, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "tie_word_embeddings": False}


def _arch(cfg):
    from enginecore.arch import ArchConfig

    return ArchConfig.from_hf_dict(cfg)


def test_expected_distinct_experts():
    from jaxengine.step_cost import expected_distinct_experts as distinct

    assert distinct(8, 2, 0) == 0 and distinct(8, 2, 1) == 2  # one token: its top-k
    # two tokens of top-2 of 8: the second token's 2 picks each miss the first's 2 with probability 6/8
    assert distinct(8, 2, 2) == pytest.approx(2 + 2 * 6 / 8)
    assert distinct(128, 8, 128) == pytest.approx(128 - 128 * (120 / 128) ** 128) and distinct(128, 8, 4096) <= 128
    assert 127.9 < distinct(128, 8, 128) < distinct(128, 8, 129)


def test_moe_decode_step_reads_only_the_reached_experts():
    """FLOPs of top_k experts a token, bytes of the experts reached, router and attention: by hand."""
    from jaxengine.step_cost import ShardedShape, model_step_cost

    arch = _arch(TINY_MOE)
    H, E, k, Ie, L, D, Hq, Hkv = 64, 8, 2, 32, 2, 16, 4, 4
    s = ShardedShape.of(arch, 1, False, 2, 2)
    attn, router, expert = (2 * Hq + 2 * Hkv) * D * H, E * H, 3 * H * Ie
    ctx = 100
    one = model_step_cost(arch, s, tokens=1, reqs=1, context=ctx)
    keys = ctx + 1
    assert one.flops == pytest.approx(L * (2 * (attn + router + k * expert) + 4 * Hq * D * keys))
    kv = 2 * Hkv * D * 2
    acts = (6 * H + 3 * (Hq + 2 * Hkv) * D) * 2 + E * 4 * 2 + k * 2 * H * 2 + k * (6 * Ie + 2 * H) * 2
    assert one.bytes == pytest.approx(L * ((attn + router + k * expert) * 2 + (ctx + 1) * kv + kv + acts) + H * 2)
    # two decode tokens: twice the FLOPs of the experts, but 3.5 experts read, not 4 (not 8)
    two = model_step_cost(arch, s, tokens=2, reqs=2, context=ctx)
    assert two.flops - 2 * one.flops == pytest.approx(0)
    w_two = L * (attn + router + 3.5 * expert) * 2
    assert two.bytes == pytest.approx(w_two + 2 * (one.bytes - L * (attn + router + k * expert) * 2))


@pytest.mark.parametrize("ep", [False, True])
def test_moe_sharded_per_device(ep):
    """Expert parallelism: E / N whole experts a device; expert-column TP: every expert's Ie / N columns. Either
    way a device does 1/N of the experts' FLOPs and holds 1/N of their weights; the router stays replicated."""
    from jaxengine.step_cost import (ShardedShape, expert_params, model_step_cost, moe_split, sparse_layer_params,
                                     weights_bytes_on_paper)

    arch = _arch(TINY_MOE)
    H, E, k, Ie = 64, 8, 2, 32
    s1 = ShardedShape.of(arch, 1, False, 2, 2)
    s4 = ShardedShape.of(arch, 4, True, 2, 2, expert_parallel=ep)
    assert (s4.experts_ep, s4.expert_cols_tp) == ((4, 1) if ep else (1, 4))
    assert expert_params(arch, s4) == 3 * H * Ie // (1 if ep else 4)
    attn4 = (2 * 4 + 2 * 4) * 16 * H // 4
    per_token, read = sparse_layer_params(arch, s4, 1)
    assert per_token == pytest.approx(attn4 + E * H + k * 3 * H * Ie / 4)
    assert read == pytest.approx(attn4 + E * H + k * 3 * H * Ie / 4)
    _, read_all = sparse_layer_params(arch, s4, 10**6)
    assert read_all == pytest.approx(attn4 + E * H + E * 3 * H * Ie / 4)
    one, four = (model_step_cost(arch, s, tokens=64, reqs=64, context=10) for s in (s1, s4))
    router = 2 * 2 * 64 * E * H  # L x 2 T E H, on every device
    assert four.flops == pytest.approx((one.flops - router) / 4 + router)
    # weights a device holds: all but the norms and the router divided by 4
    L, V = 2, 256
    norms = L * 2 * H + L * 2 * 16 + H
    whole = arch.num_params() * 2
    assert weights_bytes_on_paper(arch, s1) == whole
    assert weights_bytes_on_paper(arch, s4) == (whole - (norms + L * E * H) * 2) // 4 + (norms + L * E * H) * 2
    # 6 experts on 4 devices: no expert parallelism, the columns split instead
    assert moe_split(_arch(dict(TINY_MOE, num_experts=6)), 4, True) == (1, 4, 1)


def test_moe_step_temporaries_by_hand():
    """Qwen3-30B-A3B at 512 tokens on 4 chips: the sorted T x top_k rows with gate/up of a whole expert under
    expert parallelism, of its quarter of the columns with expert-column TP."""
    from jaxengine.hbm import layer_temporaries_bytes

    from benchmarks.bench_tpu_aot import QWEN3_30B_A3B

    arch = _arch(QWEN3_30B_A3B)
    T, H, E, k, Ie = 512, 2048, 128, 8, 768
    base = T * (4 * H + 2 * (32 + 8) * 128 // 4) * 2
    router = T * E * 4 * 2
    assert layer_temporaries_bytes(arch, 4, True, True, T, 2) == base + router + T * k * (2 * H + 2 * Ie) * 2
    assert layer_temporaries_bytes(arch, 4, True, False, T, 2) == base + router + T * k * (2 * H + 2 * Ie // 4) * 2


def test_roofline_model_cost_counts_active_params():
    from benchmarks.bench_roofline import ModelCost
    from benchmarks.bench_tpu_aot import MIXTRAL_8X7B, QWEN3_30B_A3B

    for cfg in (QWEN3_30B_A3B, MIXTRAL_8X7B, TINY_MOE):
        arch = _arch(cfg)
        cost = ModelCost.from_arch(arch)
        H, V, L = arch.hidden_size, arch.vocab_size, arch.num_hidden_layers
        assert cost.linear_params == arch.num_params(active=True) - L * 2 * H - H - V * H - (
            L * 2 * arch.head_dim if arch.qk_norm else 0)
        # one token reads its top_k experts; a long prefill all of them
        assert cost.weight_bytes("bfloat16", 1) == cost.linear_params * 2
        every = cost.weight_bytes("bfloat16", 10**6) / 2
        assert every == pytest.approx(arch.num_params() - L * 2 * H - H - V * H
                                      - (L * 2 * arch.head_dim if arch.qk_norm else 0))
    assert 3.0e9 < _arch(QWEN3_30B_A3B).num_params(active=True) < 3.5e9


# ------------------------------------------------------------------------- the routed experts' grouped matmul


def _experts_case(T=8, k=2, E=8, Ie=128, H=256, seed=0):
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    f = lambda *shape, s=1.0: jnp.asarray(rng.standard_normal(shape) * s, jnp.float32)  # noqa: E731
    ids = jnp.asarray(np.stack([rng.choice(E, k, replace=False) for _ in range(T)]), jnp.int32)
    # gate / up [E, Ie, H] ([out, in]), down [E, Ie, H] ([in, out]), as jaxengine.moe stores them
    return f(T, H), ids, jnp.asarray(rng.random((T, k)), jnp.float32), f(E, Ie, H, s=0.05), f(E, Ie, H, s=0.05), \
        f(E, Ie, H, s=0.05)


def _experts_reference(h, ids, w, gate, up, down, first=0):
    """One (token, expert) pair at a time, in float64."""
    import numpy as np

    h, gate, up, down = (np.asarray(a, np.float64) for a in (h, gate, up, down))
    out = np.zeros(h.shape)
    for t, j in np.ndindex(*ids.shape):
        e = int(ids[t, j]) - first
        if 0 <= e < gate.shape[0]:
            g = gate[e] @ h[t]
            out[t] += float(w[t, j]) * ((g / (1 + np.exp(-g)) * (up[e] @ h[t])) @ down[e])
    return out


@pytest.mark.parametrize("T,first", [(8, 0), (8, 4), (64, 2)])
def test_gmm_experts_in_the_pallas_interpreter(T, first):
    """megablox's gmm over [out, in] experts (all of them, or an expert-parallel device's 4 from `first`) against
    the per-pair loop, in Pallas' TPU interpreter with its race detector; 64 tokens x top-2 span one 128-row
    tile, several groups to a tile."""
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas import tpu as pltpu

    from jaxengine.tpu_moe import gmm_experts

    h, ids, w, gate, up, down = _experts_case(T=T)
    n = 8 if first == 0 else 4
    sl = slice(first, first + n)
    got = gmm_experts(h, ids, w, gate[sl], up[sl], down[sl], first_expert=jnp.int32(first),
                      interpret=pltpu.InterpretParams(detect_races=True))
    np.testing.assert_allclose(np.asarray(got), _experts_reference(h, ids, w, gate[sl], up[sl], down[sl], first),
                               rtol=1e-5, atol=1e-5)


def test_gmm_experts_on_the_whole_stack_multiply_the_layers_experts():
    """Given [Ls, E, N, K] stacks and a layer index (an expert-parallel device's 4 experts of 8 from 4), the
    layer's experts, in the Pallas interpreter: the form that spares the scan a copy of the layer's slice."""
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.pallas import tpu as pltpu

    from jaxengine.tpu_moe import gmm_experts

    h, ids, w, gate, up, down = _experts_case(T=8)
    stack = lambda a: jnp.stack([a[4:] * 0.5, a[4:], -a[4:]])  # noqa: E731 (3 layers; layer 1 is the one)
    got = gmm_experts(h, ids, w, stack(gate), stack(up), stack(down), first_expert=jnp.int32(4),
                      layer=jnp.int32(1), interpret=pltpu.InterpretParams(detect_races=True))
    np.testing.assert_allclose(np.asarray(got), _experts_reference(h, ids, w, gate[4:], up[4:], down[4:], 4),
                               rtol=1e-5, atol=1e-5)


@needs_libtpu
def test_gmm_on_the_whole_stack_spares_the_scan_a_copy_of_each_layers_experts():
    """A scan over 4 sparse layers of 32 [768, 2048] experts, compiled for v6e: sliced per layer (xs), XLA
    materializes each layer's experts for the custom call; the whole stack with the layer index needs none."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxengine.tpu_moe import gmm_experts
    from jaxengine.tpu_target import topology_devices

    device = topology_devices(parse_topology("v6e:1x1"))[0]
    one = NamedSharding(Mesh(np.array([device]), ("x",)), P())
    L, E, Ie, H, T, k = 4, 32, 768, 2048, 16, 8
    sd = lambda shape, d=jnp.bfloat16: jax.ShapeDtypeStruct(shape, d, sharding=one)  # noqa: E731
    args = (sd((T, H)), sd((T, k), jnp.int32), sd((T, k)), sd((L, E, Ie, H)), sd((L, E, Ie, H)), sd((L, E, Ie, H)))

    def sliced(h, ids, w, g, u, d):
        return jax.lax.scan(lambda x, lw: (x + gmm_experts(x, ids, w, *lw), None), h, (g, u, d))[0]

    def stacked(h, ids, w, g, u, d):
        return jax.lax.scan(lambda x, l: (x + gmm_experts(x, ids, w, g, u, d, layer=l), None), h,
                            jnp.arange(L, dtype=jnp.int32))[0]

    temps = [jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes for f in (sliced, stacked)]
    one_expert_tensor = E * Ie * H * 2
    assert temps[0] >= one_expert_tensor > 16 * temps[1], temps


def test_gmm_tiling_keeps_the_weight_tile_in_vmem():
    from jaxengine.tpu_moe import MAX_WEIGHT_TILE, gmm_tiling

    assert gmm_tiling(16, 2048, 768) == (16, 2048, 768)  # Qwen3-30B-A3B's expert whole
    assert gmm_tiling(512, 2048, 768) == (128, 2048, 768)
    for k, n in ((4096, 1792), (1792, 4096), (4096, 14336)):  # Mixtral over 8 chips, and whole
        tm, tk, tn = gmm_tiling(128, k, n)
        assert tk * tn <= MAX_WEIGHT_TILE and k % tk == 0 and n % tn == 0 and tk % 128 == 0 and tn % 128 == 0


@needs_libtpu
@pytest.mark.parametrize("method", ["gmm", "ragged_dot"])
def test_experts_grouped_matmul_for_tpu_copies_no_weight(method):
    """Compiled for v6e with Qwen3-30B-A3B's expert shape (8 of them), the weights as jaxengine.moe stores them:
    megablox reads them as they are; ragged_dot's native kernel (`routed_experts`' "ragged") makes XLA copy
    gate and up ([out, in]) into [E, in, out] first (why the runner uses gmm on a TPU)."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from jaxengine.moe import routed_experts
    from jaxengine.tpu_moe import gmm_experts
    from jaxengine.tpu_target import topology_devices

    device = topology_devices(parse_topology("v6e:1x1"))[0]
    one = NamedSharding(Mesh(np.array([device]), ("x",)), P())
    T, k, E, Ie, H = 16, 8, 8, 768, 2048
    sd = lambda shape, d=jnp.bfloat16: jax.ShapeDtypeStruct(shape, d, sharding=one)  # noqa: E731
    fn = gmm_experts if method == "gmm" else functools.partial(routed_experts, method="ragged", platform="tpu")
    args = (sd((T, H)), sd((T, k), jnp.int32), sd((T, k)), sd((E, Ie, H)), sd((E, Ie, H)), sd((E, Ie, H)))
    compiled = jax.jit(fn).lower(*args).compile()
    text, temp = compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes
    expert_bytes = E * Ie * H * 2
    copies = [line for line in text.splitlines() if " copy(" in line and f"[{E}," in line.split(" copy(")[0]]
    if method == "gmm":
        assert text.count('custom_call_target="tpu_custom_call"') == 3 and not copies and temp < expert_bytes / 8
    else:
        assert "ragged-dot" in text and len(copies) == 2  # gate and up, each transposed


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
def test_tiny_model_compiles_for_a_four_host_v5e_slice(tmp_path):
    """v5e:4x4 at TP 16: 4 hosts of 4 chips (libtpu's pod hosts), one mesh over all of them (kv heads repeated
    to shard), each program compiled once for the whole slice; the report names each host's chips and says
    every host runs the same programs; the executables' manifest names the chips in mesh order."""
    from jaxengine.aot import format_report, run_aot_warmup

    folder = config_folder(tmp_path / "tiny", dict(TINY, num_attention_heads=16))
    args = EngineArgs(model=folder, tensor_parallel_size=16, compilation_cache_dir="none", **SMALL_SERVER)
    report = run_aot_warmup(args, "v5e:4x4", "decode", executables_dir=str(tmp_path / "exe"))
    t = report.target
    assert (t["chips"], t["hosts"], t["chips_per_host"], t["mesh_chips"], t["mesh_hosts"]) == (16, 4, 4, 16, 4)
    assert t["heads_sharded"] and [len(ids) for ids in t["host_chips"]] == [4] * 4
    assert sorted(i for ids in t["host_chips"] for i in ids) == list(range(16))
    assert [k.describe() for k in (r["key"] for r in report.rows)] == [
        "model tokens=16", "sample reqs=8 greedy", "sample reqs=8 sample"]
    assert report.rows[0]["kv_layout"] == "3,2,1,0" and report.fit["fits_hbm"]
    text = format_report(report)
    assert "v5e:4x4, 4 host(s) of 4 chips" in text and "WARNING" not in text
    assert "a 4-host slice (4 chips a host): every host runs the same 3 SPMD programs" in text
    assert all(f"host {h}: chips {ids}" in text for h, ids in enumerate(t["host_chips"]))
    with open(tmp_path / "exe" / "manifest.json") as f:
        manifest = json.load(f)
    assert manifest["hosts"] == 4 and manifest["mesh_device_ids"] == [i for ids in t["host_chips"] for i in ids]
    with pytest.raises(ConfigError, match=r"--nnodes 2: --topology v5e:4x4 is 4 host\(s\) of 4 chips"):
        run_aot_warmup(EngineArgs(model=folder, tensor_parallel_size=16, nnodes=2, **SMALL_SERVER), "v5e:4x4")
    # a mesh on some of the hosts: refused before libtpu sees it (it aborts the process on such a subset)
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 4: .* pass --tensor-parallel-size 16"):
        run_aot_warmup(EngineArgs(model=folder, tensor_parallel_size=4, **SMALL_SERVER), "v5e:4x4")


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


# ------------------------------------------------------------------------- a MoE model's step


# TINY_MOE with lane-sized experts (Ie 128, H 256) and 4 kv heads: 8 experts split 2 a chip over v5e:2x2
TINY_MOE_TPU = dict(TINY_MOE, hidden_size=256, moe_intermediate_size=128, head_dim=32, num_attention_heads=8)


@needs_libtpu
@pytest.mark.parametrize("cfg,tp,ep", [(TINY, 4, False), (TINY_MOE_TPU, 4, True), (TINY_MOE_TPU, 4, False),
                                       (TINY_MOE_TPU, 2, True)])
def test_weights_per_device_on_paper_match_the_shardings(cfg, tp, ep):
    """step_cost's paper count of one device's params (the roofline's) is what jaxengine.sharding gives it."""
    from jax.sharding import Mesh
    import numpy as np

    from jaxengine.hbm import weights_bytes_per_device
    from jaxengine.sharding import MESH_AXES, ShardingRules
    from jaxengine.step_cost import ShardedShape, weights_bytes_on_paper
    from jaxengine.tpu_target import topology_devices

    arch = _arch(cfg)
    devices = topology_devices(parse_topology("v5e:2x2"))[:tp]
    mesh = Mesh(np.array(devices, dtype=object).reshape(1, tp), MESH_AXES)
    rules = ShardingRules.for_model(arch, mesh, expert_parallel=ep)
    shape = ShardedShape.of(arch, tp, rules.shard_heads, 2, 2, expert_parallel=ep)
    assert weights_bytes_per_device(arch, "bfloat16", rules, mesh) == weights_bytes_on_paper(arch, shape)


@needs_libtpu
def test_tiny_moe_compiles_for_v5e_with_expert_parallelism(tmp_path, capsys):
    """`xlaserve warmup --topology v5e:2x2 --tensor-parallel-size 4 --enable-expert-parallel` on a Qwen3-MoE:
    every bucket compiles, the fit holds, the table counts the experts a step reaches (2 of a chip's 2 at 16
    tokens of top-2 of 8: 1.8), the model step calls megablox's gmm and copies no expert weight."""
    from frontend.cli import main

    folder = config_folder(tmp_path / "moe", TINY_MOE_TPU)
    argv = ["warmup", folder, "--platform", "tpu", "--topology", "v5e:2x2", "--tensor-parallel-size", "4",
            "--enable-expert-parallel", "--max-num-seqs", "8", "--max-num-batched-tokens", "16",
            "--max-model-len", "256", "--compilation-cache-dir", "none", "--level", "decode"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 sparse layers of 8 experts, top-2: 2 whole experts per chip (expert parallel)" in out
    model = next(line for line in out.splitlines() if line.startswith("model tokens=16"))
    from jaxengine.step_cost import expected_distinct_experts

    assert " compiled " in model and model.split()[-1] == f"{expected_distinct_experts(8, 2, 16) / 4:.1f}"
    assert "fits --gpu-memory-utilization" in out and "WARNING" not in out


@needs_libtpu
@pytest.mark.parametrize("ep", [True, False])
def test_moe_model_step_for_tpu_runs_gmm_without_copying_experts(tmp_path, ep):
    """The runner's sparse layers on a TPU call megablox's gmm, not ragged_dot, and XLA relayouts no expert
    weight (the scan still materializes each layer's slice of them: jaxengine.tpu_moe says why and how not)."""
    from jaxengine.aot import _engine_config
    from jaxengine.programs import ProgramKey
    from jaxengine.runner import JaxModelRunner
    from jaxengine.tpu_target import topology_devices

    topo = parse_topology("v5e:2x2")
    args = EngineArgs(model=config_folder(tmp_path / "moe", TINY_MOE_TPU), compilation_cache_dir="none",
                      tensor_parallel_size=4, enable_expert_parallel=ep, **SMALL_SERVER)
    config, source = _engine_config(args, topo)
    runner = JaxModelRunner(config, source, devices=topology_devices(topo))
    runner.init_kv_cache(64, allocate=False)
    text = runner._compile(ProgramKey("model", 16)).as_text()
    runner.shutdown()
    local = "2," if ep else "8,"
    copies = [line for line in text.splitlines() if " copy(" in line and f"[{local}" in line.split(" copy(")[0]]
    # the attention kernel + 3 gmm calls in the scanned sparse layer
    assert text.count('custom_call_target="tpu_custom_call"') >= 4 and "ragged-dot" not in text and not copies
