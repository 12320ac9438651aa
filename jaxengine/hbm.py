"""Does the model fit the chip? Weights + the KV cache + the largest bucket's temporaries against HBM.

One policy for `serve` on a TPU (checked in `load_model`, before any weight is
read) and for `xlaserve warmup --topology` (before any program is compiled):
per chip, weights (as sharded by `jaxengine.sharding`), the temporaries of the
largest step (an estimate here; `jaxengine.aot` reports the compiler's exact
figure afterwards), and the KV cache of at least one ``--max-model-len``
sequence must fit ``HBM x --gpu-memory-utilization``. Whatever is left goes to
the KV cache. A failure names how much is missing and which flags change it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from enginecore.arch import ArchConfig
from enginecore.config import ConfigError, EngineConfig
from enginecore.kv_cache import num_kv_blocks
from enginecore.platform import resolve_dtype
from jaxengine.model import abstract_params, is_spec, jnp_dtype
from jaxengine.sharding import ShardingRules, param_shardings
from jaxengine.step_cost import moe_split
from jaxengine.tpu_target import GiB, chip_for_device_kind

# The code of every compiled program (all stay loaded: 169 MiB for Llama-3.1-8B's 36 programs on v5e)
# and XLA's own reservations, on top of what is counted.
OVERHEAD_BYTES = 256 << 20


def weights_bytes_per_device(arch: ArchConfig, dtype: str, rules: ShardingRules, mesh) -> int:
    """Bytes of params one device holds: every leaf's shard (replicated leaves in full)."""
    spec = abstract_params(arch, dtype)
    shardings = param_shardings(spec, rules, mesh)
    leaves = zip(jax.tree.leaves(spec, is_leaf=is_spec), jax.tree.leaves(shardings))
    return int(sum(np.prod(sh.shard_shape(s.shape)) * jnp.dtype(s.dtype).itemsize for s, sh in leaves))


def step_temporaries_bytes(config: EngineConfig, arch: ArchConfig, mesh, rules: ShardingRules) -> int:
    """Estimated peak temporaries of one step on one device, before compiling: the larger of the model
    program at the largest token bucket (one layer's activations alive at a time: the layers are a
    scan) and the sample program at the largest request bucket (float32 [R, V] logits and the sampler's
    copies), plus OVERHEAD_BYTES. An upper bound: for Llama-3.1-8B on v5e:2x2 at tensor parallelism 4
    it gives 0.73 GiB where XLA's memory_analysis reports 0.37 GiB of temporaries + 0.17 GiB of code.
    """
    sc = config.scheduler_config
    tp = mesh.shape["model"]
    item = jnp.dtype(jnp_dtype(_dtype(config))).itemsize
    T = sc.max_num_batched_tokens
    model = layer_temporaries_bytes(arch, tp, rules.shard_heads, config.parallel_config.enable_expert_parallel,
                                    T, item)
    sample = sc.max_num_seqs * arch.vocab_size * 4 * 4
    return int(max(model, sample)) + OVERHEAD_BYTES


def layer_temporaries_bytes(arch: ArchConfig, tp: int, heads_sharded: bool, expert_parallel: bool, tokens: int,
                            item: int) -> int:
    """One layer's activations alive at once for `tokens` tokens on one of `tp` devices: the residual, norm and
    attention rows, and the larger MLP's. A dense MLP: gate and up [T, I / tp]. A sparse one
    (`step_cost.moe_split`): float32 router logits and probabilities [T, E], the T x top_k rows sorted by expert
    [T k, H] with their outputs, gate and up [T k, Ie] (Ie / tp with expert-column TP; whole under expert
    parallelism, where the sorted buffer keeps all T k rows and a device fills only its experts' groups) and
    the shared expert's [T, Is]."""
    H, D, I = arch.hidden_size, arch.head_dim, arch.intermediate_size
    heads_tp = tp if heads_sharded else 1
    qkv_d = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * D // heads_tp
    base = tokens * (4 * H + 2 * qkv_d) * item
    dense = tokens * 2 * (I // tp if I % tp == 0 else I) * item
    if arch.moe is None:
        return base + dense
    m = arch.moe
    _, cols, shared_tp = moe_split(arch, tp, expert_parallel)
    rows = tokens * m.top_k
    sparse = (tokens * m.num_experts * 4 * 2 + rows * (2 * H + 2 * m.intermediate_size // cols) * item
              + tokens * 2 * m.shared_expert_intermediate_size // shared_tp * item)
    has_dense = m.num_sparse_layers < arch.num_hidden_layers
    return base + max(sparse, dense if has_dense else 0)


def _dtype(config: EngineConfig) -> str:
    """The serving dtype, resolved as the runner resolves it."""
    return resolve_dtype(config.model_config.dtype, config.device_config.platform)


def device_hbm_bytes(device) -> int:
    """A TPU device's memory: what it reports when attached, else the chip table (compile-only devices)."""
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # compile-only devices refuse memory_stats
        limit = None
    if limit:
        return int(limit)
    chip = chip_for_device_kind(device.device_kind)
    if chip is None:
        raise ConfigError(f"{device.device_kind!r} reports no memory limit and is not in the chip table; pass "
                          "--num-gpu-blocks-override to size the KV cache")
    return chip.hbm_bytes


@dataclass(frozen=True)
class MemoryPlan:
    """Per-device HBM use of one engine configuration."""

    hbm_bytes: int
    utilization: float
    weights_bytes: int
    temporaries_bytes: int
    kv_bytes_per_block: int
    num_blocks: int  # KV blocks (the null block included)

    @property
    def budget_bytes(self) -> int:
        return int(self.hbm_bytes * self.utilization)

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.kv_bytes_per_block

    def describe(self) -> str:
        g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        return (f"per chip: weights {g(self.weights_bytes)} + KV cache {g(self.kv_bytes)} ({self.num_blocks} blocks) "
                f"+ temporaries ~{g(self.temporaries_bytes)} of {g(self.hbm_bytes)} HBM x {self.utilization}")


def check_fit(config: EngineConfig, arch: ArchConfig, mesh, rules: ShardingRules, kv_bytes_per_block: int,
              hbm_bytes: int, where: str) -> MemoryPlan:
    """The memory plan, or a ConfigError saying by how much the model misses and which flags to change.

    The KV cache gets what is left of ``hbm_bytes x --gpu-memory-utilization`` after weights and
    temporaries (capped at what the scheduler can use), or exactly --num-gpu-blocks-override blocks,
    or what --kv-cache-memory-bytes holds: the runner's own sizing policy, before it reads a weight.
    """
    cc, sc = config.cache_config, config.scheduler_config
    util = cc.gpu_memory_utilization
    weights = weights_bytes_per_device(arch, _dtype(config), rules, mesh)
    temps = step_temporaries_bytes(config, arch, mesh, rules)
    per_block = kv_bytes_per_block  # one block, all layers, on one device (JaxModelRunner.kv_bytes_per_block)
    per_seq = -(-sc.max_model_len // cc.block_size) + 1
    fixed, kv_what = None, f"the KV cache of one --max-model-len {sc.max_model_len} sequence"
    if cc.num_gpu_blocks_override:
        fixed, kv_what = cc.num_gpu_blocks_override, f"--num-gpu-blocks-override {cc.num_gpu_blocks_override} blocks"
    elif cc.kv_cache_memory_bytes is not None:
        fixed = num_kv_blocks(cc.kv_cache_memory_bytes, per_block, sc.max_num_seqs, sc.max_model_len, cc.block_size,
                              f"--kv-cache-memory-bytes {cc.kv_cache_memory_bytes}")
        kv_what = f"--kv-cache-memory-bytes' {fixed} blocks"
    need_blocks = fixed or per_seq
    budget = int(hbm_bytes * util)
    need = weights + temps + need_blocks * per_block
    if need > budget:
        g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        tp = mesh.shape["model"]
        why = ""
        if tp > 1 and not rules.shard_heads:
            why = (f" With {arch.num_key_value_heads} kv heads, tensor parallelism {tp} replicates the attention "
                   "weights and the KV cache on every chip: a --tensor-parallel-size that divides the kv heads "
                   "shards them.")
        raise ConfigError(
            f"the model does not fit {where} ({g(hbm_bytes)} HBM per chip x --gpu-memory-utilization {util} = "
            f"{g(budget)}): weights {g(weights)} (--tensor-parallel-size {tp}) + temporaries of the largest step "
            f"~{g(temps)} (--max-num-batched-tokens {sc.max_num_batched_tokens}, --max-num-seqs {sc.max_num_seqs}) "
            f"+ {kv_what} {g(need_blocks * per_block)} = {g(need)} per chip, {g(need - budget)} over. Shard over "
            "more chips (--tensor-parallel-size, a larger --topology), or lower --max-model-len / "
            "--max-num-batched-tokens / --max-num-seqs, or raise --gpu-memory-utilization." + why)
    if fixed:
        blocks = fixed
    else:
        blocks = num_kv_blocks(budget - weights - temps, per_block, sc.max_num_seqs, sc.max_model_len,
                               cc.block_size, f"--gpu-memory-utilization {util}")
    return MemoryPlan(hbm_bytes, util, weights, temps, per_block, blocks)


__all__ = ["MemoryPlan", "check_fit", "device_hbm_bytes", "layer_temporaries_bytes", "step_temporaries_bytes",
           "weights_bytes_per_device"]
