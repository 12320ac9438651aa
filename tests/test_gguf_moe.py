"""Mixture-of-Experts GGUF files (Qwen2-MoE `qwen2moe`, Qwen3-MoE `qwen3moe`, Mixtral `llama` with experts) load as
the Hugging Face folder they were converted from: the same config (MoEConfig included) and, weight by weight, the
same arrays (float32 files exactly; quantized ones as their blocks decode), experts stacked [E, out, in] however
the file stores them, Mixtral's Q/K rows un-interleaved; bad MoE metadata and missing expert tensors are refused
by name. The files are written by tests/gguf_writer.py's `hf_gguf`, as llama.cpp's converter writes them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from enginecore import gguf_config
from enginecore.arch import weight_spec
from enginecore.model_loader import ModelLoadError, resolve_model
from tests.gguf_writer import T, encode, hf_gguf

V = gguf.GGUFValueType
COMMON = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=256)


def _hf(family: str):
    import transformers as tf

    if family == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4))
    if family == "qwen2_moe":  # layer 1 dense (mlp_only_layers): a MoE file's dense layer
        return tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            **COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            num_experts=4, mlp_only_layers=[1]))
    return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32,
                                                    head_dim=16, num_experts=4, norm_topk_prob=True))


FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """family -> a tiny random float32 Hugging Face folder."""
    import torch

    out = {}
    for i, family in enumerate(FAMILIES):
        torch.manual_seed(i)
        model = _hf(family).float()
        with torch.no_grad():  # every weight random and away from zero: a swapped row or expert shows
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * 0.5)
        out[family] = str(tmp_path_factory.mktemp(family))
        model.save_pretrained(out[family])
    return out


def quantized(name: str) -> T:
    """The quantized files' types: attention Q8_0, experts Q5_0 (the router stays float32, as llama.cpp keeps it)."""
    if "ffn_gate_inp" in name or name.startswith(("token_embd", "output")):
        return T.F32
    return T.Q5_0 if "ffn_" in name else T.Q8_0


def roundtrip(w: np.ndarray, ty: T) -> np.ndarray:
    """A Hugging Face weight as the file's `ty` blocks decode it (rows quantize independently, so llama.cpp's row
    order of Q and K does not change the values)."""
    if ty == T.F32 or w.ndim == 1:
        return w
    return gguf.quants.dequantize(encode(w.reshape(-1, w.shape[-1]), ty), ty).reshape(w.shape)


def by_param(src) -> dict[tuple[int | None, str], np.ndarray]:
    """(layer, logical param) -> its array, one expert's tensors stacked [E, out, in]."""
    out, experts = {}, {}
    for name, arr in src.iter_weights():
        layer, spec = weight_spec(name)
        if spec.expert is None:
            out[(layer, spec.param)] = np.asarray(arr, np.float32)
        else:
            experts.setdefault((layer, spec.param), {})[spec.expert] = np.asarray(arr, np.float32)
    for key, by_e in experts.items():
        out[key] = np.stack([by_e[e] for e in range(len(by_e))])
    return out


def _gguf_types(path: str) -> dict[str, T]:
    return {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}


VARIANTS = [(f, "f32", False) for f in FAMILIES] + [(f, "quant", False) for f in FAMILIES] + [
    ("mixtral", "f32", True), ("mixtral", "quant", True)]


@pytest.mark.parametrize("family,kind,per_expert", VARIANTS,
                         ids=[f"{f}-{k}{'-per-expert' if p else ''}" for f, k, p in VARIANTS])
def test_moe_gguf_loads_as_the_hf_folder(folders, tmp_path, family, kind, per_expert):
    path = hf_gguf(folders[family], str(tmp_path / "m.gguf"), quantized if kind == "quant" else lambda n: T.F32,
                   per_expert=per_expert)
    hf, gg = resolve_model(folders[family]), resolve_model(path)
    for field in ("architecture", "model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "attention_bias", "qk_norm",
                  "tie_word_embeddings", "moe"):
        assert getattr(gg.config, field) == getattr(hf.config, field), field
    assert gg.config.moe is not None and gg.config.num_params() == hf.config.num_params()
    assert gg.config.num_params(active=True) == hf.config.num_params(active=True) < gg.config.num_params()

    E, Ie, H = hf.config.moe.num_experts, hf.config.moe.intermediate_size, hf.config.hidden_size
    declared = dict(gg.declared_weights())
    if per_expert:
        assert declared["model.layers.0.mlp.experts.3.down_proj.weight"] == (H, Ie)
    else:
        assert declared["model.layers.0.mlp.experts.gate_proj"] == (E, Ie, H)
        assert declared["model.layers.0.mlp.experts.down_proj"] == (E, H, Ie)

    # which GGUF type each (layer, param) was stored as, to decode the reference the same way
    types = {}
    for name, ty in _gguf_types(path).items():
        layer, spec = weight_spec(gguf_config.hf_name(path, name))
        types[(layer, spec.param)] = ty
    want, got = by_param(hf), by_param(gg)
    assert sorted(got, key=str) == sorted(want, key=str)
    for key, w in want.items():
        ref = roundtrip(w, types[key]) if w.ndim < 3 else np.stack([roundtrip(x, types[key]) for x in w])
        assert got[key].shape == w.shape, key
        np.testing.assert_array_equal(got[key], ref, err_msg=str(key))
        assert np.abs(w).max() > 0
    if kind == "quant":
        assert types[(0, "experts_gate")] == T.Q5_0 and types[(0, "q_proj")] == T.Q8_0


def test_quantized_experts_never_reach_the_quantized_paths(folders, tmp_path):
    """`iter_quantized_weights` hands the 4/8-bit linear paths the attention's blocks, never an expert's (they
    load dequantized): stacked [E, out, in] or one tensor an expert."""
    for per_expert in (False, True):
        src = resolve_model(hf_gguf(folders["mixtral"], str(tmp_path / f"m{per_expert}.gguf"), quantized,
                                    per_expert=per_expert))
        names = [n for n, _ in src.iter_quantized_weights(("Q8_0", "Q5_0"))]
        assert "model.layers.0.self_attn.q_proj.weight" in names
        assert not [n for n in names if "experts" in n]


def test_qwen3moe_expert_weights_norm_is_read(folders, tmp_path):
    """llama.cpp normalizes Qwen3-MoE's top-k weights unless `expert_weights_norm` says not to."""
    src = resolve_model(hf_gguf(folders["qwen3_moe"], str(tmp_path / "m.gguf"),
                                fields={"expert_weights_norm": (False, V.BOOL)}))
    assert src.config.moe.norm_topk_prob is False
    assert resolve_model(hf_gguf(folders["qwen2_moe"], str(tmp_path / "q2.gguf"))).config.moe.norm_topk_prob is False


BAD = {
    "top_k over the expert count": ("qwen3_moe", dict(fields={"expert_used_count": (5, V.UINT32)}),
                                    r"qwen3moe\.expert_used_count is 5; it must be at most qwen3moe\.expert_count "
                                    r"\(4\)"),
    "no expert count": ("qwen3_moe", dict(fields={"expert_count": None}), r"missing metadata qwen3moe\.expert_count"),
    "no expert width": ("qwen2_moe", dict(fields={"expert_feed_forward_length": None}),
                        r"missing metadata qwen2moe\.expert_feed_forward_length"),
    "sigmoid router": ("qwen3_moe", dict(fields={"expert_gating_func": (2, V.UINT32)}),
                       r"qwen3moe\.expert_gating_func is 2; only 1 \(softmax\)"),
    "a stacked experts tensor missing": ("qwen3_moe", dict(skip=["blk.1.ffn_up_exps.weight"]),
                                         r"missing tensor blk\.1\.ffn_up_exps\.weight"),
    "one expert's tensor missing": ("mixtral", dict(per_expert=True, skip=["blk.0.ffn_down.2.weight"]),
                                    r"missing tensor blk\.0\.ffn_down\.2\.weight"),
    "the router missing": ("mixtral", dict(skip=["blk.1.ffn_gate_inp.weight"]),
                           r"missing tensor blk\.1\.ffn_gate_inp\.weight"),
    "the shared expert missing": ("qwen2_moe", dict(skip=["blk.0.ffn_down_shexp.weight"]),
                                  r"missing tensor blk\.0\.ffn_down_shexp\.weight"),
    "experts of the wrong width": ("qwen3_moe", dict(fields={"expert_feed_forward_length": (48, V.UINT32)}),
                                   r"tensor model\.layers\.0\.mlp\.experts\.\w+_proj has shape \[4, (32, 64|64, 32)\]"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_moe_gguf_is_refused_by_name(folders, tmp_path, case):
    family, kw, match = BAD[case]
    path = hf_gguf(folders[family], str(tmp_path / "bad.gguf"), **kw)
    with pytest.raises(ModelLoadError, match=match) as e:
        resolve_model(path)
    assert "bad.gguf" in str(e.value)


def test_the_writer_writes_what_transformers_gguf_reader_reads_back(folders, tmp_path):
    """transformers' own GGUF reader (llama.cpp's names and layout) reads hf_gguf's Qwen3-MoE file back as the
    model it was written from: the files above are llama.cpp's, not a format of our own making."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    model = AutoModelForCausalLM.from_pretrained(folders["qwen3_moe"], dtype=torch.float32)
    path = hf_gguf(folders["qwen3_moe"], str(tmp_path / "m.gguf"))
    got = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    want = model.state_dict()
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert torch.equal(got[k].float(), w), k
