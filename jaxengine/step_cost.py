"""A step's FLOPs and HBM bytes on one device, and its roofline time on a chip: an estimate on paper.

Why a model of our own and not XLA's ``cost_analysis()``: XLA counts the body
of a while loop once, and the decoder scans over its layers (the figure would
be 1/L of the truth), and it charges a Pallas call the bytes of its whole
operands (the entire KV cache, every layer), while the kernel reads only the
blocks of the scheduled requests. `tests/test_tpu_aot.py` checks this model's
FLOPs against XLA's on a loop-free (unrolled) program compiled for a TPU.

The model, per device (tensor parallelism divides what `jaxengine.sharding`
shards: heads when the kv heads divide, MLP columns, the vocabulary):

* model program, ``tokens`` new tokens from ``reqs`` requests that each have
  ``context`` tokens already cached: FLOPs ``2 x tokens x (matmul params)`` +
  attention ``4 x Hq x D x (keys each token sees)`` per layer; bytes: every
  layer weight once + each request's K/V read once per layer + the new K/V
  written + the activations in and out of each fused op.
* sample program, ``reqs`` rows: the LM head ``2 x reqs x H x V``, its weight
  read once, the float32 logits written and read a few times by the sampler.

Roofline time = max(FLOPs / peak bf16 FLOP/s, bytes / HBM bandwidth): what the
chip cannot beat, not what it does. Collectives (tensor parallelism's
all-reduces over ICI) and kernel overheads are not in it.
"""

from __future__ import annotations

from dataclasses import dataclass

from enginecore.arch import ArchConfig


@dataclass(frozen=True)
class StepCost:
    """FLOPs and HBM bytes of one program run on one device."""

    flops: float
    bytes: float

    def seconds(self, peak_flops: float, bandwidth: float) -> float:
        return max(self.flops / peak_flops, self.bytes / bandwidth)

    def bound(self, peak_flops: float, bandwidth: float) -> str:
        return "compute" if self.flops / peak_flops >= self.bytes / bandwidth else "memory"

    def __add__(self, other: "StepCost") -> "StepCost":
        return StepCost(self.flops + other.flops, self.bytes + other.bytes)


@dataclass(frozen=True)
class ShardedShape:
    """How one device sees the model: the divisors tensor parallelism applies (1 where replicated)."""

    heads_tp: int  # attention heads (and the KV cache) split this many ways
    mlp_tp: int  # MLP columns
    vocab_tp: int  # embedding / LM head rows
    dtype_bytes: int  # weights and activations
    kv_bytes: int  # KV cache element
    kv_padding: float = 1.0  # stored / real K-V elements (the Pallas cache pads heads: platform.pallas_cache_heads)

    @classmethod
    def of(cls, arch: ArchConfig, tp: int, heads_sharded: bool, dtype_bytes: int, kv_bytes: int,
           kv_padding: float = 1.0) -> "ShardedShape":
        return cls(tp if heads_sharded else 1, tp if arch.intermediate_size % tp == 0 else 1,
                   tp if arch.vocab_size % tp == 0 else 1, dtype_bytes, kv_bytes, kv_padding)


def layer_matmul_params(arch: ArchConfig, s: ShardedShape) -> int:
    """Weights of one decoder layer's matmuls on one device."""
    H, D, I = arch.hidden_size, arch.head_dim, arch.intermediate_size
    attn = (2 * arch.num_attention_heads + 2 * arch.num_key_value_heads) * D * H // s.heads_tp
    return attn + 3 * H * I // s.mlp_tp


def model_step_cost(arch: ArchConfig, s: ShardedShape, *, tokens: int, reqs: int, context: int) -> StepCost:
    """The model program: `tokens` new tokens spread evenly over `reqs` requests with `context` cached tokens each."""
    L, H, D = arch.num_hidden_layers, arch.hidden_size, arch.head_dim
    hq, hkv = arch.num_attention_heads // s.heads_tp, arch.num_key_value_heads // s.heads_tp or 1
    q_len = tokens / max(reqs, 1)
    keys = context + (q_len + 1) / 2  # keys one new token sees on average (causal within its request)
    if arch.sliding_window:
        keys = min(keys, arch.sliding_window)
    w = layer_matmul_params(arch, s)
    flops = L * (2 * tokens * w + 4 * tokens * hq * D * keys)
    kv_token = 2 * hkv * D * s.kv_bytes * s.kv_padding  # one token's K and V in one layer, as stored
    kv_read = reqs * min(context + q_len, arch.sliding_window or context + q_len) * kv_token
    qkv = (hq + 2 * hkv) * D
    act = tokens * s.dtype_bytes * (8 * H + 3 * qkv + 3 * arch.intermediate_size // s.mlp_tp)
    byts = L * (w * s.dtype_bytes + kv_read + tokens * kv_token + act) + tokens * H * s.dtype_bytes
    return StepCost(flops, byts)


def sample_step_cost(arch: ArchConfig, s: ShardedShape, *, reqs: int) -> StepCost:
    """The sample program over `reqs` rows: final norm, LM head, sampler over float32 logits."""
    H, V = arch.hidden_size, arch.vocab_size
    v_d = V // s.vocab_tp
    flops = 2 * reqs * H * v_d + 20 * reqs * V
    byts = v_d * H * s.dtype_bytes + reqs * V * 4 * 4 + reqs * H * s.dtype_bytes
    return StepCost(flops, byts)


def prompt_logprobs_cost(arch: ArchConfig, s: ShardedShape, *, rows: int) -> StepCost:
    """The prompt-logprobs program: LM head + log-softmax + top-k over `rows` hidden rows."""
    H, V = arch.hidden_size, arch.vocab_size
    v_d = V // s.vocab_tp
    return StepCost(2 * rows * H * v_d + 10 * rows * V, v_d * H * s.dtype_bytes + rows * V * 4 * 3)


__all__ = ["ShardedShape", "StepCost", "layer_matmul_params", "model_step_cost", "prompt_logprobs_cost",
           "sample_step_cost"]
