"""A GGUF file's metadata and tensor names as the model description: `ArchConfig` (with its `MoEConfig`) and
Hugging Face tensor names.

llama.cpp's converter (convert_hf_to_gguf.py, the gguf package's constants) writes Llama / Mistral / Mixtral as
architecture `llama` (Mixtral: `llama.expert_count` > 0), Qwen2 / Qwen3 as `qwen2` / `qwen3`, Qwen2-MoE and
Qwen3-MoE as `qwen2moe` / `qwen3moe`. Its Q and K rows of `llama` files interleave each head's rotary halves
(`unpermute_rope` undoes it). A sparse layer's experts are stacked, `blk.N.ffn_{gate,up,down}_exps.weight`
([E, out, in] once the GGUF dimensions are reversed), or, in Mixtral files of 2023, one tensor an expert,
`blk.N.ffn_gate.E.weight`; its router is `ffn_gate_inp`, the shared expert `ffn_*_shexp` and its gate
`ffn_gate_inp_shexp` (one row, stored [H] or [H, 1]).

Nothing here imports jax or torch.
"""

from __future__ import annotations

import math

import numpy as np

from enginecore.arch import ArchConfig, ModelLoadError, MoEConfig

GGUF_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
             "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}

_LAYER_MAP = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# the stacked experts: the weight table's names have no `.weight`
_STACKED = {"ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
            "ffn_down_exps": "mlp.experts.down_proj"}
_PER_EXPERT = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}  # blk.N.ffn_gate.E.weight
_EXPERT_PARTS = ("ffn_gate", "ffn_up", "ffn_down")
_SHARED_PARTS = ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
# llama.cpp's router settings of other MoE families (its enum: 1 softmax, 2 sigmoid): refused by name
_GATING_SOFTMAX = 1


def hf_name(path: str, name: str) -> str | None:
    """A GGUF tensor name -> its Hugging Face name (the weight table's); None for tensors recomputed from the
    config."""
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    if name.startswith("rope_"):
        return None  # rope frequency tables are recomputed from the config
    parts = name.split(".")
    if len(parts) >= 4 and parts[0] == "blk" and parts[1].isdigit():
        layer, kind, rest = parts[1], parts[2], parts[3:]
        if rest == ["weight"] and kind in _STACKED:
            return f"model.layers.{layer}.{_STACKED[kind]}"
        if len(rest) == 2 and rest[0].isdigit() and rest[1] == "weight" and kind in _PER_EXPERT:
            return f"model.layers.{layer}.mlp.experts.{rest[0]}.{_PER_EXPERT[kind]}.weight"
        if len(rest) == 1 and kind in _LAYER_MAP:
            return f"model.layers.{layer}.{_LAYER_MAP[kind]}.{rest[0]}"
    raise ModelLoadError(f"{path}: unexpected tensor {name}")


def hf_shape(name: str, gguf_dims: tuple[int, ...]) -> tuple[int, ...]:
    """A tensor's Hugging Face shape from its GGUF dimensions (innermost first): reversed, and the shared expert's
    gate as the one row [1, H] Hugging Face stores (llama.cpp writes it [H] or [H, 1])."""
    shape = tuple(reversed(gguf_dims))
    if name.endswith("mlp.shared_expert_gate.weight") and len(shape) == 1:
        return (1, *shape)
    return shape


def unpermute_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of rotary halves in Q/K rows ([out, in] or [out])."""
    out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, out // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def rope_permuted_heads(cfg: ArchConfig, name: str) -> int:
    """Heads of a Q/K weight whose rows llama.cpp interleaved (its `llama` files: Llama, Mistral, Mixtral); 0 for
    every other tensor."""
    if cfg.model_type not in ("llama", "mixtral"):
        return 0
    if name.endswith("self_attn.q_proj.weight"):
        return cfg.num_attention_heads
    if name.endswith("self_attn.k_proj.weight"):
        return cfg.num_key_value_heads
    return 0


def arch_config(path: str, meta: dict, tensor_names: set[str]) -> ArchConfig:
    """The GGUF metadata (and which tensors the file has) as an ArchConfig; missing or invalid metadata is a
    ModelLoadError naming the key."""
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCH:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCH)}")
    try:
        return _arch_config(path, meta, arch, tensor_names)
    except ModelLoadError:
        raise
    except (KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError) as e:
        raise ModelLoadError(f"{path}: missing or invalid {arch}.* metadata ({type(e).__name__}: {e})") from None


def _arch_config(path: str, meta: dict, arch: str, tensor_names: set[str]) -> ArchConfig:
    g = lambda k, d=None: meta.get(f"{arch}.{k}", d)  # noqa: E731
    H = int(g("embedding_length"))
    nh = int(g("attention.head_count"))
    L = int(g("block_count"))
    vocab = g("vocab_size")
    if vocab is None:
        vocab = len(meta["tokenizer.ggml.tokens"])  # a KeyError without a vocabulary
    rope_scaling = None
    if g("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    eos = meta.get("tokenizer.ggml.eos_token_id")
    moe = _moe_config(path, meta, arch, L, tensor_names)
    architecture, model_type = GGUF_ARCH[arch], _MODEL_TYPE[arch]
    if arch == "llama" and moe is not None:
        architecture, model_type = "MixtralForCausalLM", "mixtral"
    ffn = g("feed_forward_length")
    if ffn is None and moe is not None:  # every layer sparse: the dense width is never used
        ffn = moe.intermediate_size
    return ArchConfig(
        architecture=architecture,
        model_type=model_type,
        vocab_size=int(vocab),
        hidden_size=H,
        intermediate_size=int(ffn),
        num_hidden_layers=L,
        num_attention_heads=nh,
        num_key_value_heads=int(g("attention.head_count_kv", nh)),
        head_dim=int(g("attention.key_length", H // nh)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=int(g("context_length", 2048)),
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm=arch in ("qwen3", "qwen3moe"),
        sliding_window=None,
        torch_dtype="float32",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=int(eos) if eos is not None else None,
        moe=moe,
    )


def _count(path: str, meta: dict, key: str, default=None, low: int = 1) -> int:
    v = meta.get(key, default)
    if v is None:
        raise ModelLoadError(f"{path}: missing metadata {key} (a Mixture-of-Experts file needs it)")
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ModelLoadError(f"{path}: {key} is {v!r}; it must be an integer of at least {low}")
    return v


def _moe_config(path: str, meta: dict, arch: str, L: int, names: set[str]) -> MoEConfig | None:
    """The sparse layers' MoEConfig from `{arch}.expert_*`; None for a dense file (no expert count, or 0 in a
    `llama` one). Which layers are sparse: those with a router (`blk.N.ffn_gate_inp.weight`) or expert tensors."""
    key = f"{arch}.expert_count"
    if arch in ("llama", "qwen2", "qwen3") and not meta.get(key):
        return None
    E = _count(path, meta, key)
    used = f"{arch}.expert_used_count"
    top_k = _count(path, meta, used)
    if top_k > E:
        raise ModelLoadError(f"{path}: {used} is {top_k}; it must be at most {key} ({E})")
    # Mixtral's converter writes the experts' width as feed_forward_length
    inter = _count(path, meta, f"{arch}.expert_feed_forward_length",
                   meta.get(f"{arch}.feed_forward_length") if arch == "llama" else None)
    shared = _count(path, meta, f"{arch}.expert_shared_feed_forward_length", 0, low=0) if arch == "qwen2moe" else 0
    norm_key = f"{arch}.expert_weights_norm"
    # llama.cpp normalizes the top-k weights of Mixtral and Qwen3-MoE, not of Qwen2-MoE, unless the file says
    norm = meta.get(norm_key, arch != "qwen2moe")
    if not isinstance(norm, bool):
        raise ModelLoadError(f"{path}: {norm_key} is {norm!r}; it must be a bool")
    for k, ok, want in ((f"{arch}.expert_gating_func", lambda v: v == _GATING_SOFTMAX, "1 (softmax)"),
                        (f"{arch}.expert_weights_scale", lambda v: math.isclose(float(v), 1.0), "1.0"),
                        (f"{arch}.expert_group_count", lambda v: v in (0, 1), "1"),
                        (f"{arch}.expert_shared_count", lambda v: v in (0, 1), "1")):
        if k in meta and not ok(meta[k]):
            raise ModelLoadError(f"{path}: {k} is {meta[k]!r}; only {want} is supported (the router is a softmax "
                                 "over all experts, then the top-k)")
    sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in names or any(
        f"blk.{i}.{p}_exps.weight" in names or f"blk.{i}.{p}.0.weight" in names for p in _EXPERT_PARTS)
        for i in range(L))
    if not any(sparse):
        raise ModelLoadError(f"{path}: {key} is {E} but no layer has expert tensors (blk.N.ffn_gate_inp.weight, "
                             "blk.N.ffn_gate_exps.weight)")
    for i, sp in enumerate(sparse):
        if sp:
            _check_sparse_layer(path, names, i, E, shared)
    return MoEConfig(num_experts=E, top_k=top_k, intermediate_size=inter, sparse_layers=sparse,
                     norm_topk_prob=norm, shared_expert_intermediate_size=shared, shared_expert_gate=bool(shared))


def _check_sparse_layer(path: str, names: set[str], i: int, E: int, shared: int) -> None:
    """Every tensor sparse layer `i` needs, named as the GGUF file would name it."""
    need = [f"blk.{i}.ffn_gate_inp.weight"]
    for p in _EXPERT_PARTS:
        if f"blk.{i}.{p}_exps.weight" in names:
            continue
        per = [f"blk.{i}.{p}.{e}.weight" for e in range(E)]
        if any(n in names for n in per):
            need += per
        else:
            need.append(f"blk.{i}.{p}_exps.weight")
    if shared:
        need += [f"blk.{i}.{p}.weight" for p in (*_SHARED_PARTS, "ffn_gate_inp_shexp")]
    missing = [n for n in need if n not in names]
    if missing:
        raise ModelLoadError(f"{path}: missing tensor {missing[0]} (layer {i} is sparse: it has expert tensors)"
                             + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
