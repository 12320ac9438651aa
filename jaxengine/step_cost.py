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
* a sparse (Mixture-of-Experts) layer's MLP, ``tokens`` tokens routed to ``top_k`` of
  ``E`` experts each: FLOPs ``2 x tokens x top_k x 3 H Ie`` (spread over the devices,
  whether they hold E/N whole experts, expert parallelism, or every expert's Ie/N
  columns) + the router ``2 x tokens x H x E`` + the shared expert; bytes: router and
  shared expert once + only the experts the step's tokens reach. Under uniform
  routing, with each token picking top_k distinct experts independently of the
  others, an expert is missed by all tokens with probability ``(1 - k/E)^tokens``,
  so a step reads ``E x (1 - (1 - k/E)^tokens)`` distinct experts
  (`expected_distinct_experts`: 1 token reads k, 128 tokens of Qwen3-30B-A3B's
  top-8-of-128 read all but 0.04 of them), each device its share. Real routers are
  skewed, which reads fewer: an upper bound for a step's bytes, as a grouped matmul
  that skips empty groups reads them. Activations: the ``tokens x top_k`` rows
  sorted by expert, through the expert's gate/up/down.
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
    experts_ep: int = 1  # a sparse layer's experts split this many ways: E / experts_ep whole experts a device
    expert_cols_tp: int = 1  # each expert's Ie columns split this many ways
    shared_tp: int = 1  # the shared expert's columns

    @classmethod
    def of(cls, arch: ArchConfig, tp: int, heads_sharded: bool, dtype_bytes: int, kv_bytes: int,
           kv_padding: float = 1.0, expert_parallel: bool = False) -> "ShardedShape":
        ep, cols, shared = moe_split(arch, tp, expert_parallel)
        return cls(tp if heads_sharded else 1, tp if arch.intermediate_size % tp == 0 else 1,
                   tp if arch.vocab_size % tp == 0 else 1, dtype_bytes, kv_bytes, kv_padding, ep, cols, shared)


def moe_split(arch: ArchConfig, tp: int, expert_parallel: bool) -> tuple[int, int, int]:
    """(experts_ep, expert_cols_tp, shared_tp) of a MoE model on `tp` devices: whole experts per device with
    expert parallelism (when E divides), else every expert's columns (when Ie divides); (1, 1, 1) for a dense
    model or where nothing divides (replicated)."""
    m = arch.moe
    if m is None or tp == 1:
        return 1, 1, 1
    Is = m.shared_expert_intermediate_size
    shared = tp if Is and Is % tp == 0 else 1
    if expert_parallel and m.num_experts % tp == 0:
        return tp, 1, shared
    return 1, (tp if m.intermediate_size % tp == 0 else 1), shared


def expected_distinct_experts(num_experts: int, top_k: int, tokens: float) -> float:
    """Distinct experts `tokens` tokens reach when each picks `top_k` of `num_experts` uniformly at random,
    independently of the others: E x (1 - (1 - k/E)^T)."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def attention_params(arch: ArchConfig, s: ShardedShape) -> int:
    """q/k/v/o weights of one layer on one device."""
    return (2 * arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim * arch.hidden_size \
        // s.heads_tp


def layer_matmul_params(arch: ArchConfig, s: ShardedShape) -> int:
    """Weights of one dense decoder layer's matmuls on one device."""
    return attention_params(arch, s) + 3 * arch.hidden_size * arch.intermediate_size // s.mlp_tp


def expert_params(arch: ArchConfig, s: ShardedShape) -> int:
    """One expert's gate/up/down weights as one device holds them (its Ie / expert_cols_tp columns)."""
    return 3 * arch.hidden_size * arch.moe.intermediate_size // s.expert_cols_tp


def moe_fixed_params(arch: ArchConfig, s: ShardedShape) -> int:
    """What of a sparse layer's MLP every token reads on one device: the router (replicated), the shared
    expert's columns and its gate."""
    m, H = arch.moe, arch.hidden_size
    return m.num_experts * H + 3 * H * m.shared_expert_intermediate_size // s.shared_tp \
        + (H if m.shared_expert_gate else 0)


def sparse_layer_params(arch: ArchConfig, s: ShardedShape, tokens: float) -> tuple[float, float]:
    """A sparse layer's matmul weights on one device for `tokens` tokens: (params each token multiplies, on
    average over the devices: its top_k experts' share; params the step reads: the distinct experts reached
    among this device's E / experts_ep, `expected_distinct_experts`)."""
    m = arch.moe
    fixed = attention_params(arch, s) + moe_fixed_params(arch, s)
    per_token = fixed + m.top_k * expert_params(arch, s) / s.experts_ep
    local = expected_distinct_experts(m.num_experts, m.top_k, tokens) / s.experts_ep
    return per_token, fixed + local * expert_params(arch, s)


def weights_bytes_on_paper(arch: ArchConfig, s: ShardedShape) -> int:
    """Every param one device holds, from the shape alone (`jaxengine.hbm.weights_bytes_per_device` counts
    the real shardings; the tests hold them equal)."""
    H, V, L = arch.hidden_size, arch.vocab_size, arch.num_hidden_layers
    sparse = arch.moe.num_sparse_layers if arch.moe else 0
    per_layer = attention_params(arch, s) + 2 * H
    if arch.attention_bias:
        per_layer += (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim // s.heads_tp
    if arch.qk_norm:
        per_layer += 2 * arch.head_dim
    mlp = (L - sparse) * 3 * H * arch.intermediate_size // s.mlp_tp
    if sparse:
        mlp += sparse * (moe_fixed_params(arch, s)
                         + arch.moe.num_experts // s.experts_ep * expert_params(arch, s))
    emb = V // s.vocab_tp * H * (1 if arch.tie_word_embeddings else 2)
    return (L * per_layer + mlp + emb + H) * s.dtype_bytes


def model_step_cost(arch: ArchConfig, s: ShardedShape, *, tokens: int, reqs: int, context: int) -> StepCost:
    """The model program: `tokens` new tokens spread evenly over `reqs` requests with `context` cached tokens each."""
    L, H, D = arch.num_hidden_layers, arch.hidden_size, arch.head_dim
    hq, hkv = arch.num_attention_heads // s.heads_tp, arch.num_key_value_heads // s.heads_tp or 1
    q_len = tokens / max(reqs, 1)
    keys = context + (q_len + 1) / 2  # keys one new token sees on average (causal within its request)
    if arch.sliding_window:
        keys = min(keys, arch.sliding_window)
    sparse = arch.moe.num_sparse_layers if arch.moe else 0
    dense = L - sparse
    w = layer_matmul_params(arch, s)
    attn_flops = 4 * tokens * hq * D * keys
    kv_token = 2 * hkv * D * s.kv_bytes * s.kv_padding  # one token's K and V in one layer, as stored
    kv_read = reqs * min(context + q_len, arch.sliding_window or context + q_len) * kv_token
    qkv = (hq + 2 * hkv) * D
    attn_act = tokens * s.dtype_bytes * (6 * H + 3 * qkv)
    dense_act = tokens * s.dtype_bytes * (2 * H + 3 * arch.intermediate_size // s.mlp_tp)
    per_layer = kv_read + tokens * kv_token + attn_act
    flops = dense * (2 * tokens * w + attn_flops)
    byts = dense * (w * s.dtype_bytes + per_layer + dense_act) + tokens * H * s.dtype_bytes
    if sparse:
        per_token, read = sparse_layer_params(arch, s, tokens)
        flops += sparse * (2 * tokens * per_token + attn_flops)
        byts += sparse * (read * s.dtype_bytes + per_layer + moe_activation_bytes(arch, s, tokens))
    return StepCost(flops, byts)


def moe_activation_bytes(arch: ArchConfig, s: ShardedShape, tokens: float) -> float:
    """HBM traffic of a sparse layer's activations on one device: float32 router logits written and read, the
    tokens x top_k rows sorted by expert (gathered, written and read), the device's share of them through
    gate/up (two [rows, Ie] written, read by the activation, its product written and read by down) and down's
    rows written and read for the weighted sum, the shared expert as a dense MLP."""
    m, H = arch.moe, arch.hidden_size
    rows = tokens * m.top_k
    Ie = m.intermediate_size // s.expert_cols_tp
    mine = rows / s.experts_ep
    act = tokens * m.num_experts * 4 * 2 + rows * 2 * H * s.dtype_bytes + mine * (6 * Ie + 2 * H) * s.dtype_bytes
    if m.shared_expert_intermediate_size:
        act += tokens * s.dtype_bytes * 3 * m.shared_expert_intermediate_size // s.shared_tp
    return act


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


__all__ = ["ShardedShape", "StepCost", "attention_params", "expected_distinct_experts", "expert_params",
           "layer_matmul_params", "model_step_cost", "moe_activation_bytes", "moe_split", "prompt_logprobs_cost",
           "sample_step_cost", "sparse_layer_params", "weights_bytes_on_paper"]
