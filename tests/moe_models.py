"""Tiny random Mixture-of-Experts checkpoints written by transformers (float32, HF's per-expert tensors)."""

from __future__ import annotations

import os
import shutil

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def save_tiny_moe(arch: str, d: str, tokenizer_dir: str | None = None) -> str:
    """A tiny random `arch` model saved in `d` (SmolLM2's tokenizer copied from `tokenizer_dir`, if given):

    - mixtral: 2 layers, 8 experts of I=32, top-2 (renormalized);
    - qwen2_moe: 2 layers, 8 experts of I=32, top-2 (not renormalized), a shared expert of 48 with its gate,
      q/k/v biases;
    - qwen3_moe: 3 layers, layer 1 dense (mlp_only_layers, I=128), 8 experts of I=32, top-3 renormalized, q/k
      norms.
    """
    import torch
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=49152, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)
    if arch == "mixtral":
        cfg = tf.MixtralConfig(**common, intermediate_size=32, num_hidden_layers=2, num_local_experts=8,
                               num_experts_per_tok=2, head_dim=16, sliding_window=None)
        model = tf.MixtralForCausalLM(cfg)
    elif arch == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32,
                                shared_expert_intermediate_size=48, num_hidden_layers=2, num_experts=8,
                                num_experts_per_tok=2, norm_topk_prob=False, use_sliding_window=False)
        model = tf.Qwen2MoeForCausalLM(cfg)
    elif arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                                num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, head_dim=32,
                                mlp_only_layers=[1], use_sliding_window=False)
        model = tf.Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(arch)
    # random weights are tiny; scale them up so logits are not all ~0 (greedy ties) and routing is decided
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    model.save_pretrained(d, safe_serialization=True)
    if tokenizer_dir is not None:
        for fn in os.listdir(tokenizer_dir):
            if fn.startswith("tokenizer") or fn.endswith(".jinja") or fn == "special_tokens_map.json":
                shutil.copy(os.path.join(tokenizer_dir, fn), d)
    return d
