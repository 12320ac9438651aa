"""Tiny random Mixture-of-Experts checkpoints written by transformers (float32, HF's per-expert tensors)."""

from __future__ import annotations

import os
import shutil

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")


def save_tiny_moe(arch: str, d: str, tokenizer_dir: str | None = None) -> str:
    """A tiny random `arch` model saved in `d` (SmolLM2's tokenizer copied from `tokenizer_dir`, if given); 3 layers,
    hidden 64, 4 / 2 heads:

    - mixtral: 8 experts of I=96, top-2 (renormalised);
    - qwen2_moe: 8 experts of I=32, top-2 (not renormalised), a shared expert of 48 with its gate, q/k/v biases;
    - qwen3_moe: 16 experts of I=32, top-4 renormalised, q/k norms, layer 1 dense (mlp_only_layers, I=96), tied
      embeddings.

    Weights are scaled up (so logits differ: no greedy ties, and routing is decided) and norms and biases are
    random, so a dropped norm or bias shows.
    """
    import torch
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if arch == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2,
                                                       tie_word_embeddings=False, sliding_window=None))
    elif arch == "qwen2_moe":
        model = tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, norm_topk_prob=False, tie_word_embeddings=False,
            use_sliding_window=False))
    elif arch == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            **common, head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
            norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=True, use_sliding_window=False))
    else:
        raise ValueError(arch)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(d, safe_serialization=True)
    if tokenizer_dir is not None:
        for fn in os.listdir(tokenizer_dir):
            if fn.startswith("tokenizer") or fn.endswith(".jinja") or fn == "special_tokens_map.json":
                shutil.copy(os.path.join(tokenizer_dir, fn), d)
    return d
