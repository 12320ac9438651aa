"""The model description both backends read: one set of field names, rope, one weight table.

`ArchConfig` is what distinguishes the supported Llama-family decoders (Llama
2/3, SmolLM2, Mistral, Qwen2, Qwen3); the backends read its fields as they are
named here. `rope_inv_freq` computes the rotary frequencies (with llama3 or
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
}


class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message names the file and the problem."""


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
        if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            sw = None
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=H,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=nh,
            num_key_value_heads=cfg.get("num_key_value_heads") or nh,
            head_dim=cfg.get("head_dim") or H // nh,
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            sliding_window=sw,
            hidden_act=cfg.get("hidden_act", "silu"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
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
        return d

    def as_dict(self) -> dict:
        return asdict(self)

    # -- derived sizes both backends use ------------------------------------------------

    @property
    def sm_scale(self) -> float:
        return self.head_dim**-0.5

    def num_params(self) -> int:
        H, I, D = self.hidden_size, self.intermediate_size, self.head_dim
        attn = H * D * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        per_layer = attn + 3 * H * I + 2 * H
        emb = self.vocab_size * H * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + emb + H

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
    tp_dim: the dimension tensor parallelism splits (0: output rows, 1: input columns), None: replicated.
    """

    param: str
    fused: str | None = None
    tp_dim: int | None = None


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
}
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
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def weight_spec(hf_name: str) -> tuple[int | None, WeightSpec] | None:
    """HF tensor name -> (layer index or None, its spec); None for tensors the engine ignores."""
    if hf_name in TOP_WEIGHTS:
        return None, TOP_WEIGHTS[hf_name]
    m = _LAYER_RE.fullmatch(hf_name)
    if m and m.group(2) in LAYER_WEIGHTS:
        return int(m.group(1)), LAYER_WEIGHTS[m.group(2)]
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    raise ModelLoadError(f"unexpected weight {hf_name!r}: not part of a supported Llama-family decoder")


def param_rows(arch: ArchConfig, param: str, tp_size: int = 1) -> int:
    """Output rows of a projection's (per-rank share of its) weight: heads x head_dim, or the MLP width."""
    D = arch.head_dim
    rows = {
        "q_proj": arch.num_attention_heads * D, "q_bias": arch.num_attention_heads * D,
        "k_proj": arch.num_key_value_heads * D, "k_bias": arch.num_key_value_heads * D,
        "v_proj": arch.num_key_value_heads * D, "v_bias": arch.num_key_value_heads * D,
        "gate_proj": arch.intermediate_size, "up_proj": arch.intermediate_size,
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
