"""The model description both backends read: one set of field names, rope, one weight table.

`ArchConfig` is what distinguishes the supported decoders (Llama 2/3, SmolLM2,
Mistral, Qwen2, Qwen3, and the Mixture-of-Experts Mixtral, Qwen2-MoE and
Qwen3-MoE, whose sparse layers `MoEConfig` describes); the backends read its
fields as they are named here. `rope_inv_freq` computes the rotary frequencies (with llama3 or
linear scaling) once, in numpy. `WEIGHTS` maps every Hugging Face tensor name
to a logical parameter, the fused group it may join, and the dimension tensor
parallelism splits: jaxengine stores the logical parameters as they are,
torchengine fuses q/k/v and gate/up; both read this one table.

Nothing here imports jax or torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message names the file and the problem."""


@dataclass(frozen=True)
class MoEConfig:
    """The sparse MLP of a Mixture-of-Experts layer: a router picks `top_k` of `num_experts` SwiGLU experts per
    token and sums their outputs weighted by the router's probabilities.

    The router: probs = softmax(h . router^T) over all experts, the top_k largest kept, divided by their sum when
    `norm_topk_prob` (Mixtral always; Qwen3-MoE's 30B/235B; not Qwen2-MoE). A shared expert (Qwen2-MoE) is a
    dense SwiGLU MLP every token passes, its output scaled by sigmoid(h . shared_expert_gate^T). `sparse_layers`:
    which decoder layers are sparse (the others keep the dense MLP of `ArchConfig.intermediate_size`).
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    sparse_layers: tuple[bool, ...]
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # the shared expert's output scaled by a sigmoid gate (Qwen2-MoE)

    def __post_init__(self) -> None:
        if not isinstance(self.top_k, int) or not 0 < self.top_k <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok ({self.top_k!r}) must be a positive integer of at most the "
                                 f"expert count ({self.num_experts})")

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)

    def sparse_index(self, layer: int) -> int:
        """The position of sparse layer `layer` among the sparse layers (their stacked params' index)."""
        return sum(self.sparse_layers[:layer])

    def dense_index(self, layer: int) -> int:
        """The position of dense layer `layer` among the dense ones."""
        return layer - self.sparse_index(layer)


# Router settings of other MoE families (DeepSeek's grouped sigmoid routing): refused by name, not ignored
_ROUTER_KEYS = {"scoring_func": ("softmax",), "topk_method": ("greedy",), "n_group": (1,), "topk_group": (1,),
                "routed_scaling_factor": (1, 1.0)}


def _moe_from_hf(cfg: dict, model_type: str, num_layers: int, source: str) -> MoEConfig:
    for key, allowed in _ROUTER_KEYS.items():
        if cfg.get(key) is not None and cfg[key] not in allowed:
            raise ModelLoadError(f"{source}: {key} {cfg[key]!r} is not supported (the router is a softmax over all "
                                 f"experts, then the top-k: {key} must be {allowed[0]!r} or absent)")
    if model_type == "mixtral":
        E, inter, norm = cfg.get("num_local_experts", 8), cfg["intermediate_size"], True
        sparse = (True,) * num_layers
        shared = 0
    else:
        # (transformers 5 writes Qwen3-MoE's count as num_local_experts, the released configs as num_experts)
        E = cfg.get("num_experts", cfg.get("num_local_experts"))
        inter = cfg["moe_intermediate_size"]
        norm = cfg.get("norm_topk_prob", False)
        if not isinstance(norm, bool):
            raise ModelLoadError(f"{source}: norm_topk_prob {norm!r} must be true or false")
        step = cfg.get("decoder_sparse_step", 1)
        only = cfg.get("mlp_only_layers") or []
        if not isinstance(step, int) or step < 1:
            raise ModelLoadError(f"{source}: decoder_sparse_step {step!r} must be a positive integer")
        if not isinstance(only, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in only):
            raise ModelLoadError(f"{source}: mlp_only_layers {only!r} must list layer indices below "
                                 f"num_hidden_layers ({num_layers})")
        sparse = tuple(i not in only and E > 0 and (i + 1) % step == 0 for i in range(num_layers))
        shared = cfg.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
    if E is None:
        raise ModelLoadError(f"{source}: missing key 'num_experts'")
    for key, v in (("num_experts", E), ("moe_intermediate_size", inter), ("shared_expert_intermediate_size", shared)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key.startswith("shared") else 1):
            raise ModelLoadError(f"{source}: {key} {v!r} must be a positive integer")
    top_k = cfg.get("num_experts_per_tok", 2)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 < top_k <= E:
        raise ModelLoadError(f"{source}: num_experts_per_tok ({top_k!r}) must be a positive integer of at most the "
                             f"expert count ({E})")
    return MoEConfig(num_experts=E, top_k=top_k, intermediate_size=inter, sparse_layers=sparse,
                     norm_topk_prob=norm, shared_expert_intermediate_size=shared,
                     shared_expert_gate=bool(shared))


@dataclass(frozen=True)
class ArchConfig:
    """What the backends need to build a Llama-family decoder."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k (Qwen3)
    sliding_window: int | None = None
    hidden_act: str = "silu"
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    moe: MoEConfig | None = None  # the sparse layers' MLP (Mixtral, Qwen2-MoE, Qwen3-MoE); None: dense

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act not in ("silu", "swish"):
            raise ModelLoadError(f"hidden_act {self.hidden_act!r} is not supported (silu only)")

    @classmethod
    def from_hf_dict(cls, cfg: dict, source: str = "config.json") -> "ArchConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: architecture {archs or cfg.get('model_type')!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        model_type = cfg.get("model_type", SUPPORTED_ARCHITECTURES[arch])
        H = cfg["hidden_size"]
        nh = cfg["num_attention_heads"]
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rp = cfg.get("rope_parameters")  # transformers 5 folds theta and scaling here
        if isinstance(rp, dict):
            rope_theta = rope_theta or rp.get("rope_theta")
            if rp.get("rope_type", "default") != "default":
                rope_scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in ("llama3", "linear"):
                raise ModelLoadError(f"{source}: rope_scaling type {kind!r} is not supported (llama3, linear)")
        sw = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            sw = None
        L = cfg["num_hidden_layers"]
        moe = _moe_from_hf(cfg, model_type, L, source) if model_type in ("mixtral", "qwen2_moe", "qwen3_moe") else None
        if model_type == "qwen2_moe":  # transformers 5 names it qkv_bias
            bias = cfg.get("qkv_bias", cfg.get("attention_bias", True))
        else:
            bias = cfg.get("attention_bias", model_type == "qwen2")
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=H,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=L,
            num_attention_heads=nh,
            num_key_value_heads=cfg.get("num_key_value_heads") or nh,
            head_dim=cfg.get("head_dim") or H // nh,
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            attention_bias=bool(bias),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_window=sw,
            hidden_act=cfg.get("hidden_act", "silu"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            moe=moe,
        )

    def to_hf_dict(self) -> dict:
        d = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": self.hidden_act,
            "torch_dtype": self.torch_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
            d["use_sliding_window"] = True
        m = self.moe
        if m is not None:
            d["num_experts_per_tok"] = m.top_k
            if self.model_type == "mixtral":
                d["num_local_experts"] = m.num_experts
            else:
                d.update(num_experts=m.num_experts, moe_intermediate_size=m.intermediate_size,
                         norm_topk_prob=m.norm_topk_prob, decoder_sparse_step=1,
                         mlp_only_layers=[i for i, sp in enumerate(m.sparse_layers) if not sp])
            if self.model_type == "qwen2_moe":
                d["shared_expert_intermediate_size"] = m.shared_expert_intermediate_size
                d["qkv_bias"] = self.attention_bias
        return d

    def as_dict(self) -> dict:
        return asdict(self)

    # -- derived sizes both backends use ------------------------------------------------

    @property
    def sm_scale(self) -> float:
        return self.head_dim**-0.5

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the MoE MLP (else the dense one)."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    def moe_mlp_params(self, active: bool = False) -> int:
        """One sparse layer's MLP parameters: router, experts (only the top_k a token reads when `active`), shared
        expert and its gate."""
        m, H = self.moe, self.hidden_size
        experts = m.top_k if active else m.num_experts
        return (m.num_experts * H + experts * 3 * H * m.intermediate_size
                + 3 * H * m.shared_expert_intermediate_size + (H if m.shared_expert_gate else 0))

    def num_params(self, active: bool = False) -> int:
        """Every parameter; with `active`, those one token reads (a MoE layer's top_k experts, not all)."""
        H, I, D = self.hidden_size, self.intermediate_size, self.head_dim
        attn = H * D * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        if self.attention_bias:
            attn += D * (self.num_attention_heads + 2 * self.num_key_value_heads)
        if self.qk_norm:
            attn += 2 * D
        sparse = self.moe.num_sparse_layers if self.moe is not None else 0
        dense = self.num_hidden_layers - sparse
        mlp = dense * 3 * H * I + (sparse * self.moe_mlp_params(active) if sparse else 0)
        emb = self.vocab_size * H * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * (attn + 2 * H) + mlp + emb + H

    def kv_cache_bytes_per_block(self, block_size: int, dtype_bytes: int, tp_size: int = 1) -> int:
        """K and V of one block of `block_size` tokens, all layers, on one of `tp_size` head shards."""
        kv_heads = self.num_key_value_heads // tp_size if self.num_key_value_heads % tp_size == 0 \
            else self.num_key_value_heads
        return 2 * self.num_hidden_layers * block_size * kv_heads * self.head_dim * dtype_bytes


# ---------------------------------------------------------------------------------
# rotary embeddings


def rope_inv_freq(arch: ArchConfig) -> np.ndarray:
    """[D/2] float32 inverse frequencies, llama3 or linear scaling applied (transformers' formulas).

    Computed in float64 and rounded once, so both backends rotate by exactly the same angles.
    """
    D = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    rs = arch.rope_scaling
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        factor = float(rs["factor"])
        if kind == "linear":
            inv = inv / factor
        elif kind == "llama3":
            low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
            old = float(rs["original_max_position_embeddings"])
            low_wl, high_wl = old / low, old / high
            wl = 2 * math.pi / inv
            scaled = np.where(wl > low_wl, inv / factor, inv)
            smooth = (old / wl - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wl < high_wl) & ~(wl > low_wl)
            inv = np.where(medium, smoothed, scaled)
        else:
            raise ModelLoadError(f"rope_scaling type {kind!r} is not supported (llama3, linear)")
    return inv.astype(np.float32)


def rope_cos_sin(arch: ArchConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables [max_positions, D/2] float32 (the angle of position p is p * inv_freq in float32)."""
    ang = np.arange(max_positions, dtype=np.float32)[:, None] * rope_inv_freq(arch)[None, :]
    return np.cos(ang), np.sin(ang)


# ---------------------------------------------------------------------------------
# the weight table


class WeightSpec(NamedTuple):
    """Where a Hugging Face tensor goes.

    param: the logical parameter (jaxengine's field name, torchengine's key).
    fused: the fused parameter it is one part of (torchengine fuses them; parts in `FUSED` order).
    tp_dim: the dimension tensor parallelism splits (0: output rows, 1: input columns), None: replicated;
        of one expert's [out, in] matrix for expert params.
    experts: the param stacks every expert, [E, out, in] (a sparse layer's); expert parallelism splits E.
    expert: which expert this tensor holds (HF's per-expert tensors); None: all of them, stacked [E, out, in]
        (GGUF's `ffn_*_exps`), or not an expert param.
    """

    param: str
    fused: str | None = None
    tp_dim: int | None = None
    experts: bool = False
    expert: int | None = None


# Per-layer tensors, named after "model.layers.{i}.".
LAYER_WEIGHTS: dict[str, WeightSpec] = {
    "input_layernorm.weight": WeightSpec("attn_norm"),
    "self_attn.q_proj.weight": WeightSpec("q_proj", "qkv_proj", 0),
    "self_attn.k_proj.weight": WeightSpec("k_proj", "qkv_proj", 0),
    "self_attn.v_proj.weight": WeightSpec("v_proj", "qkv_proj", 0),
    "self_attn.q_proj.bias": WeightSpec("q_bias", "qkv_bias", 0),
    "self_attn.k_proj.bias": WeightSpec("k_bias", "qkv_bias", 0),
    "self_attn.v_proj.bias": WeightSpec("v_bias", "qkv_bias", 0),
    "self_attn.q_norm.weight": WeightSpec("q_norm"),
    "self_attn.k_norm.weight": WeightSpec("k_norm"),
    "self_attn.o_proj.weight": WeightSpec("o_proj", None, 1),
    "post_attention_layernorm.weight": WeightSpec("mlp_norm"),
    "mlp.gate_proj.weight": WeightSpec("gate_proj", "gate_up_proj", 0),
    "mlp.up_proj.weight": WeightSpec("up_proj", "gate_up_proj", 0),
    "mlp.down_proj.weight": WeightSpec("down_proj", None, 1),
    # a sparse layer's router [E, H], and its shared expert (Qwen2-MoE)
    "mlp.gate.weight": WeightSpec("router"),
    "block_sparse_moe.gate.weight": WeightSpec("router"),
    "mlp.shared_expert.gate_proj.weight": WeightSpec("shared_gate_proj", "shared_gate_up_proj", 0),
    "mlp.shared_expert.up_proj.weight": WeightSpec("shared_up_proj", "shared_gate_up_proj", 0),
    "mlp.shared_expert.down_proj.weight": WeightSpec("shared_down_proj", None, 1),
    "mlp.shared_expert_gate.weight": WeightSpec("shared_expert_gate"),
    # every expert stacked [E, out, in] (GGUF's ffn_*_exps; transformers 5's fused gate_up_proj is split into
    # these two by the loader)
    "mlp.experts.gate_proj": WeightSpec("experts_gate", "experts_gate_up", 0, experts=True),
    "mlp.experts.up_proj": WeightSpec("experts_up", "experts_gate_up", 0, experts=True),
    "mlp.experts.down_proj": WeightSpec("experts_down", None, 1, experts=True),
}
# One expert's tensor, "{prefix}.experts.{e}.{name}.weight" (Qwen's names, then Mixtral's w1 / w3 / w2).
EXPERT_WEIGHTS: dict[str, WeightSpec] = {
    "gate_proj": LAYER_WEIGHTS["mlp.experts.gate_proj"], "up_proj": LAYER_WEIGHTS["mlp.experts.up_proj"],
    "down_proj": LAYER_WEIGHTS["mlp.experts.down_proj"],
    "w1": LAYER_WEIGHTS["mlp.experts.gate_proj"], "w3": LAYER_WEIGHTS["mlp.experts.up_proj"],
    "w2": LAYER_WEIGHTS["mlp.experts.down_proj"],
}
# the params of a sparse layer's MLP, and of a dense layer's
MOE_PARAMS = ("router", "experts_gate", "experts_up", "experts_down", "shared_gate_proj", "shared_up_proj",
              "shared_down_proj", "shared_expert_gate")
DENSE_MLP_PARAMS = ("gate_proj", "up_proj", "down_proj")
TOP_WEIGHTS: dict[str, WeightSpec] = {
    "model.embed_tokens.weight": WeightSpec("embed"),
    "model.norm.weight": WeightSpec("final_norm"),
    "lm_head.weight": WeightSpec("lm_head"),
}
# Fused parameters and their parts, in row order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "qkv_bias": ("q_bias", "k_bias", "v_bias"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "experts_gate_up": ("experts_gate", "experts_up"),
    "shared_gate_up_proj": ("shared_gate_proj", "shared_up_proj"),
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT_RE = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")


def weight_spec(hf_name: str) -> tuple[int | None, WeightSpec] | None:
    """HF tensor name -> (layer index or None, its spec); None for tensors the engine ignores."""
    if hf_name in TOP_WEIGHTS:
        return None, TOP_WEIGHTS[hf_name]
    m = _LAYER_RE.fullmatch(hf_name)
    if m and m.group(2) in LAYER_WEIGHTS:
        return int(m.group(1)), LAYER_WEIGHTS[m.group(2)]
    e = _EXPERT_RE.fullmatch(m.group(2)) if m else None
    if e and e.group(2) in EXPERT_WEIGHTS:
        return int(m.group(1)), EXPERT_WEIGHTS[e.group(2)]._replace(expert=int(e.group(1)))
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    raise ModelLoadError(f"unexpected weight {hf_name!r}: not part of a supported decoder")


def param_rows(arch: ArchConfig, param: str, tp_size: int = 1) -> int:
    """Output rows of a projection's (per-rank share of its) weight: heads x head_dim, or the MLP width (of one
    expert, for expert params)."""
    D = arch.head_dim
    rows = {
        "q_proj": arch.num_attention_heads * D, "q_bias": arch.num_attention_heads * D,
        "k_proj": arch.num_key_value_heads * D, "k_bias": arch.num_key_value_heads * D,
        "v_proj": arch.num_key_value_heads * D, "v_bias": arch.num_key_value_heads * D,
        "gate_proj": arch.intermediate_size, "up_proj": arch.intermediate_size,
        "experts_gate": arch.moe.intermediate_size if arch.moe else 0,
        "experts_up": arch.moe.intermediate_size if arch.moe else 0,
        "shared_gate_proj": arch.moe.shared_expert_intermediate_size if arch.moe else 0,
        "shared_up_proj": arch.moe.shared_expert_intermediate_size if arch.moe else 0,
    }[param]
    return rows // tp_size


def fused_slices(arch: ArchConfig, fused: str, tp_size: int = 1) -> dict[str, slice]:
    """Rows of each part inside a fused parameter (of one rank's share)."""
    out, start = {}, 0
    for part in FUSED[fused]:
        n = param_rows(arch, part, tp_size)
        out[part] = slice(start, start + n)
        start += n
    return out
