"""The MoE model description (enginecore/arch.py, model_checks, model_loader): configs, parameter counts, weight
names and the load-time refusals, against transformers' own classes. No backend runs here."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from enginecore.arch import ArchConfig, ModelLoadError, weight_spec
from enginecore.model_loader import resolve_model

H, V = 32, 128


def _model(kind: str, **kw):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2)
    if kind == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**common, num_local_experts=4, **kw))
    if kind == "qwen2_moe":
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=16,
                                                        shared_expert_intermediate_size=48, **kw))
    return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=16,
                                                    norm_topk_prob=True, mlp_only_layers=[1], **kw))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for kind in ("mixtral", "qwen2_moe", "qwen3_moe"):
        m = _model(kind)
        d = str(tmp_path_factory.mktemp(kind))
        m.save_pretrained(d)
        out[kind] = (m, d)
    return out


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_config_and_parameter_counts_match_transformers(saved, kind):
    m, d = saved[kind]
    arch = resolve_model(d).config
    moe = arch.moe
    assert moe is not None and moe.num_experts == 4 and moe.top_k == 2
    assert arch.num_params() == sum(p.numel() for p in m.parameters())
    # active: a token reads top_k of the experts' weights (and every router / shared / dense weight)
    per_expert = 3 * H * moe.intermediate_size
    assert arch.num_params() - arch.num_params(active=True) == moe.num_sparse_layers * 2 * per_expert
    assert ArchConfig.from_hf_dict(arch.to_hf_dict()) == arch
    if kind == "mixtral":
        assert moe.norm_topk_prob and moe.intermediate_size == 64 and moe.sparse_layers == (True,) * 3
    elif kind == "qwen2_moe":
        assert arch.attention_bias and not moe.norm_topk_prob
        assert moe.shared_expert_intermediate_size == 48 and moe.shared_expert_gate
    else:
        assert arch.qk_norm and moe.norm_topk_prob and moe.sparse_layers == (True, False, True)
        assert [moe.sparse_index(i) for i in (0, 2)] == [0, 1] and moe.dense_index(1) == 0


def test_every_tensor_has_a_place(saved):
    for kind, (m, d) in saved.items():
        for name in m.state_dict():  # (in memory transformers 5 stacks experts: tested below)
            if ".experts." not in name:
                assert weight_spec(name) is not None, name
        names = [n for n, _ in resolve_model(d).declared_weights()]
        expert_names = [n for n in names if ".experts." in n]
        assert expert_names and all(weight_spec(n)[1].expert is not None for n in expert_names), kind


def test_transformers5_stacked_experts_load_as_the_per_expert_ones(saved, tmp_path):
    """transformers 5 keeps experts stacked in memory (mlp.experts.gate_up_proj [E, 2I, H]); a checkpoint saved from
    its state dict loads into the same arrays as the per-expert one save_pretrained writes."""
    import shutil

    from safetensors.torch import save_file

    m, d = saved["qwen2_moe"]
    shutil.copy(os.path.join(d, "config.json"), tmp_path)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(tmp_path / "model.safetensors"))
    per_expert = dict(resolve_model(d).iter_weights())
    stacked = dict(resolve_model(str(tmp_path)).iter_weights())
    for proj in ("gate_proj", "up_proj", "down_proj"):
        whole = stacked["model.layers.1.mlp.experts." + proj]
        for e in range(4):
            np.testing.assert_array_equal(whole[e], per_expert[f"model.layers.1.mlp.experts.{e}.{proj}.weight"])


def _edit_config(d: str, dst, **changes) -> str:
    import shutil

    shutil.copytree(d, dst, dirs_exist_ok=True)
    path = os.path.join(dst, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))
    return str(dst)


@pytest.mark.parametrize("changes,field", [
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"scoring_func": "sigmoid"}, "scoring_func"),
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"mlp_only_layers": [7]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"moe_intermediate_size": 24}, "the config implies"),  # the tensors no longer fit the config
    ({"num_experts": 8, "num_local_experts": 8}, "mlp.gate.weight"),
])
def test_bad_moe_configs_are_refused_naming_the_field(saved, tmp_path, changes, field):
    d = _edit_config(saved["qwen3_moe"][1], tmp_path / "m", **changes)
    with pytest.raises(ModelLoadError, match=field.replace(".", r"\.")):
        resolve_model(d)


def test_a_missing_expert_is_named(saved, tmp_path):
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    d = saved["mixtral"][1]
    shutil.copy(os.path.join(d, "config.json"), tmp_path)
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.2.block_sparse_moe.experts.3.w3.weight"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.block_sparse_moe\.experts\.3\.w3\.weight"):
        resolve_model(str(tmp_path))
    # an expert past the config's count, and a dense MLP tensor in a sparse layer
    tensors["model.layers.2.block_sparse_moe.experts.3.w3.weight"] = tensors[
        "model.layers.2.block_sparse_moe.experts.2.w3.weight"].clone()
    for extra, msg in (("model.layers.0.block_sparse_moe.experts.4.w1.weight", "expert 4"),
                       ("model.layers.0.mlp.gate_proj.weight", "layer 0")):
        bad = dict(tensors, **{extra: tensors["model.layers.0.block_sparse_moe.experts.0.w1.weight"].clone()})
        save_file(bad, str(tmp_path / "model.safetensors"))
        with pytest.raises(ModelLoadError, match=msg):
            resolve_model(str(tmp_path))


def test_mismatched_expert_shapes_are_refused(saved, tmp_path):
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    d = saved["qwen2_moe"][1]
    shutil.copy(os.path.join(d, "config.json"), tmp_path)
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.0.mlp.experts.1.down_proj.weight"] = torch.zeros(H, 17)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"experts\.1\.down_proj\.weight has shape \[32, 17\]"):
        resolve_model(str(tmp_path))
