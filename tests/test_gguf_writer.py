"""tests/gguf_writer.py round trip: a tiny llama written with it reads back, with the gguf package's reader, as the
fields and blocks written, each type's blocks decode to the weights they encode (within the type's rounding), and
enginecore.model_loader gives the config the fields declare and the decoded weights in Hugging Face order."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from enginecore.model_loader import resolve_model
from tests.gguf_writer import T, encode, llama_cpp_rows, write_gguf

V = gguf.GGUFValueType
H, I, VOCAB, NH, NKV, L = 256, 512, 64, 4, 2, 2  # rows of 256 and 512: whole K-quant super-blocks
# each linear's type: ours (Q4_K, Q6_K, IQ4_NL, IQ4_XS) and the gguf package's (Q8_0, Q5_0, F16) in one file
TYPES = {
    0: {"attn_q": T.Q4_K, "attn_k": T.Q6_K, "attn_v": T.IQ4_NL, "attn_output": T.IQ4_XS, "ffn_gate": T.Q8_0,
        "ffn_up": T.Q5_0, "ffn_down": T.Q4_K},
    1: {"attn_q": T.IQ4_XS, "attn_k": T.IQ4_NL, "attn_v": T.Q6_K, "attn_output": T.Q4_K, "ffn_gate": T.IQ4_NL,
        "ffn_up": T.F16, "ffn_down": T.Q6_K},
}
# the largest RMS error relative to the weights' RMS each type may have (random normal weights); a wrong nibble,
# scale or sign layout decodes to errors of 0.7 and more
RMS_ERROR = {T.Q4_K: 0.12, T.Q6_K: 0.04, T.IQ4_NL: 0.1, T.IQ4_XS: 0.1, T.Q8_0: 0.01, T.Q5_0: 0.06, T.F16: 1e-3,
             T.F32: 0.0}
HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
      "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
      "ffn_down": "mlp.down_proj"}
FIELDS = [
    ("llama.block_count", L, V.UINT32, None), ("llama.embedding_length", H, V.UINT32, None),
    ("llama.feed_forward_length", I, V.UINT32, None), ("llama.attention.head_count", NH, V.UINT32, None),
    ("llama.attention.head_count_kv", NKV, V.UINT32, None), ("llama.context_length", 128, V.UINT32, None),
    ("llama.vocab_size", VOCAB, V.UINT32, None), ("llama.rope.freq_base", 50000.0, V.FLOAT32, None),
    ("llama.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32, None), ("general.name", "tiny", V.STRING, None),
    ("tokenizer.ggml.eos_token_id", 2, V.UINT32, None),
    ("xlaserve.test.ints", [3, -1, 7], V.ARRAY, V.INT32), ("xlaserve.test.words", ["a", "bc"], V.ARRAY, V.STRING),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, {GGUF name: (Hugging Face name, float32 weight in HF order, type, blocks as written)})."""
    rng = np.random.default_rng(0)
    hd = H // NH
    shapes = {"attn_q": (H, H), "attn_k": (NKV * hd, H), "attn_v": (NKV * hd, H), "attn_output": (H, H),
              "ffn_gate": (I, H), "ffn_up": (I, H), "ffn_down": (H, I)}
    spec = {"token_embd.weight": ("model.embed_tokens.weight", rng.standard_normal((VOCAB, H)), T.Q8_0),
            "output_norm.weight": ("model.norm.weight", 1 + 0.1 * rng.standard_normal(H), T.F32)}
    for i in range(L):
        spec[f"blk.{i}.attn_norm.weight"] = (f"model.layers.{i}.input_layernorm.weight",
                                             1 + 0.1 * rng.standard_normal(H), T.F32)
        spec[f"blk.{i}.ffn_norm.weight"] = (f"model.layers.{i}.post_attention_layernorm.weight",
                                            1 + 0.1 * rng.standard_normal(H), T.F32)
        for n, shape in shapes.items():
            w = rng.standard_normal(shape) * 0.05
            w[0, :32] *= 40  # one block of outliers: its scales differ from its neighbours'
            spec[f"blk.{i}.{n}.weight"] = (f"model.layers.{i}.{HF[n]}.weight", w, TYPES[i][n])
    tensors = {}
    for name, (hf, w, ty) in spec.items():
        w = w.astype(np.float32)
        heads = NH if name.endswith("attn_q.weight") else NKV if name.endswith("attn_k.weight") else 0
        stored = llama_cpp_rows(w, heads) if heads else w
        tensors[name] = (hf, w, ty, encode(stored, ty) if ty != T.F32 else stored)
    path = str(tmp_path_factory.mktemp("gguf_writer") / "tiny.gguf")
    write_gguf(path, "llama", FIELDS, ((n, blocks, ty) for n, (_, _, ty, blocks) in tensors.items()))
    return path, tensors


def test_the_gguf_reader_reads_the_fields_and_blocks_written(tiny):
    path, tensors = tiny
    r = gguf.GGUFReader(path)
    assert r.fields["general.architecture"].contents() == "llama"
    for key, value, vtype, sub_type in FIELDS:
        f = r.fields[key]
        assert f.types == ([vtype, sub_type] if sub_type else [vtype]), key
        assert f.contents() == pytest.approx(value) if vtype == V.FLOAT32 else f.contents() == value, key
    assert [t.name for t in r.tensors] == list(tensors)
    for t in r.tensors:
        hf, w, ty, blocks = tensors[t.name]
        assert t.tensor_type == ty and tuple(reversed(t.shape.tolist())) == w.shape, t.name
        assert np.asarray(t.data).tobytes() == np.ascontiguousarray(blocks).tobytes(), t.name


@pytest.mark.parametrize("ty", [T.Q4_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.Q8_0, T.Q5_0, T.F16])
def test_each_types_blocks_decode_to_the_weights_they_encode(tiny, ty):
    """The gguf package's decoder gives back each weight within its type's rounding: our encoders lay out their
    scales and nibbles as that decoder (and llama.cpp) reads them."""
    _, tensors = tiny
    named = [(n, w, blocks) for n, (_, w, t, blocks) in tensors.items() if t == ty]
    assert named, ty
    for name, w, blocks in named:
        heads = NH if name.endswith("attn_q.weight") else NKV if name.endswith("attn_k.weight") else 0
        stored = llama_cpp_rows(w, heads) if heads else w
        got = gguf.quants.dequantize(blocks, ty).reshape(w.shape)
        err = np.sqrt(np.mean((got - stored) ** 2) / np.mean(stored**2))
        assert err <= RMS_ERROR[ty], (name, ty.name, err)


def test_our_loader_gives_the_declared_config_and_the_decoded_weights(tiny):
    path, tensors = tiny
    src = resolve_model(path)
    c = src.config
    assert src.kind == "gguf" and src.name == "tiny"
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.vocab_size, c.max_position_embeddings, c.eos_token_id) == (
        "llama", L, H, I, NH, NKV, H // NH, VOCAB, 128, 2)
    assert c.rope_theta == 50000.0 and c.rms_norm_eps == pytest.approx(1e-5)
    assert c.tie_word_embeddings and not c.attention_bias  # no output.weight, no q bias
    weights = src.load_weights()
    assert sorted(weights) == sorted(hf for hf, _, _, _ in tensors.values())
    for name, (hf, w, ty, blocks) in tensors.items():
        # rows are encoded one at a time, so decoding llama.cpp's q/k rows and putting them back in Hugging Face
        # order is decoding the Hugging Face rows' blocks: the loader's q and k must be exactly that
        want = (gguf.quants.dequantize(encode(w, ty), ty).reshape(w.shape) if ty != T.F32 else w)
        assert weights[hf].dtype == np.float32 and weights[hf].shape == w.shape, hf
        np.testing.assert_array_equal(weights[hf], want, err_msg=f"{name} ({ty.name})")
