"""Model resolution and loading: GGUF, HF folders, errors."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from enginecore.model_loader import ModelLoadError, resolve_model


def test_embedded_gguf_config(smollm2_source):
    c = smollm2_source.config
    assert smollm2_source.kind == "gguf"
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        "LlamaForCausalLM", 30, 576, 9, 3)
    assert c.tie_word_embeddings and c.vocab_size == 49152 and c.head_dim == 64
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192


def test_gguf_and_saved_hf_folder_agree(smollm2_source, smollm2_hf_dir):
    hf = resolve_model(smollm2_hf_dir)
    assert hf.kind == "hf"
    a, b = smollm2_source.config.as_dict(), hf.config.as_dict()
    assert a == b
    wa = smollm2_source.load_weights()
    wb = hf.load_weights()
    assert set(wa) == set(wb)
    for k in wa:
        np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)


@pytest.mark.slow
def test_gguf_weights_match_transformers_gguf_loader(smollm2_source):
    """Independent reference: transformers' own GGUF reader and rope un-permutation."""
    import torch
    from transformers import AutoModelForCausalLM

    path = smollm2_source.path
    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                               dtype=torch.float32, local_files_only=True)
    sd = {k: v.numpy() for k, v in ref.state_dict().items()}
    ours = smollm2_source.load_weights()
    for k in ("model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight",
              "model.layers.29.mlp.down_proj.weight", "model.embed_tokens.weight", "model.norm.weight"):
        np.testing.assert_allclose(ours[k], sd[k], rtol=0, atol=1e-6, err_msg=k)


# Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS
@pytest.mark.parametrize("qtype,block", [(2, 18), (3, 20), (6, 22), (7, 24), (8, 34), (10, 84), (11, 110), (12, 144),
                                         (13, 176), (14, 210), (20, 18), (23, 136)])
def test_gguf_blocks_dequantize_to_the_gguf_packages_values(qtype, block):
    """enginecore/gguf_dequant.c (what loads every Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q2_K / Q3_K / Q4_K / Q5_K /
    Q6_K / IQ4_NL / IQ4_XS tensor) against the gguf package's numpy code, bit for bit: random blocks (every
    K-quant scale and min bit pattern, every IQ4 index), scales and offsets among them subnormal, zero, negative
    zero, huge, infinite and NaN float16s."""
    import gguf

    from enginecore.model_loader import _dequantize
    from enginecore.native import gguf_dequantizer

    if gguf_dequantizer() is None:
        pytest.skip("no C compiler: the gguf package's code loads GGUF tensors")
    rng = np.random.default_rng(qtype)
    blocks = rng.integers(0, 256, (4096 if block < 100 else 512, block), dtype=np.uint8)
    special = np.array([0x0001, 0x03FF, 0x0000, 0x8000, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0x3C00, 0x0400],
                       np.uint16)
    n = len(special)
    d = {14: 208, 11: 108, 10: 80}.get(qtype, 0)  # where d is (Q6_K's, Q3_K's and Q2_K's last)
    blocks[:n, d : d + 2] = special.view(np.uint8).reshape(n, 2)  # d
    if qtype in (3, 7, 12, 13, 10):  # m, dmin: after d
        blocks[n : 2 * n, d : d + 2] = special[::-1].copy().view(np.uint8).reshape(n, 2)
        blocks[:n, d + 2 : d + 4] = special[::-1].copy().view(np.uint8).reshape(n, 2)
    data = blocks.reshape(-1)
    got = _dequantize(data, qtype)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(qtype)).astype(np.float32).reshape(-1)
    assert got is not None and got.shape == want.shape
    # bit for bit, but a NaN's payload (which of two NaN operands a sum carries is the compiler's choice: it may
    # swap them; any NaN weight fails the load, `test_nan_weights_fail_at_load`)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and nan.any()
    assert np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    assert _dequantize(data[:-1], qtype) is None  # a partial block: left to the gguf package (which refuses it)
    assert _dequantize(data, 16) is None  # a type it does not read (IQ2_XXS)


def test_hf_folder_tokenizer_and_eos(smollm2_hf_dir):
    from enginecore.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(smollm2_hf_dir))
    assert 2 in tok.eos_token_ids
    assert tok.decode([2], skip_special_tokens=False) == "<|im_end|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")


def test_missing_path():
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        resolve_model("/nonexistent/model")


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    with pytest.raises(ModelLoadError, match="BertModel.*not supported"):
        resolve_model(str(tmp_path))


def test_corrupt_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: not valid JSON"):
        resolve_model(str(tmp_path))


def test_truncated_safetensors(tmp_path, smollm2_hf_dir):
    for fn in os.listdir(smollm2_hf_dir):
        if fn != "model.safetensors":
            shutil.copy(os.path.join(smollm2_hf_dir, fn), tmp_path)
    src = os.path.join(smollm2_hf_dir, "model.safetensors")
    with open(src, "rb") as f:
        data = f.read(1_000_000)
    (tmp_path / "model.safetensors").write_bytes(data)
    m = resolve_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="model.safetensors: truncated"):
        m.load_weights()


def test_corrupt_and_truncated_gguf(tmp_path, smollm2_source):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOTAGGUF" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match="bad.gguf: not a readable GGUF"):
        resolve_model(str(bad))
    trunc = tmp_path / "trunc.gguf"
    with open(smollm2_source.path, "rb") as f:
        trunc.write_bytes(f.read(3_000_000))
    with pytest.raises(ModelLoadError, match="trunc.gguf"):
        m = resolve_model(str(trunc))
        m.load_weights()


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "weights.bin"
    p.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_model(str(p))


@pytest.mark.slow
def test_gguf_tokenizer_matches_transformers_conversion(smollm2_source, smollm2_tokenizer):
    """Our fast GGUF tokenizer encodes exactly as transformers' (slow) GGUF conversion."""
    from transformers import AutoTokenizer

    path = smollm2_source.path
    ref = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                        local_files_only=True)
    texts = ["Hello world, 你好", "The year 2024 had 365 days!!", "  spaces\n\nnewlines\ttabs  ",
             "<|im_start|>user\nHi<|im_end|>\n", "émoji 🎉 café naïve", "def f(x):\n    return x**2  # 12345",
             "I'm sure they'll've done it", "URL: https://example.com/a?b=c&d=e"]
    for t in texts:
        assert smollm2_tokenizer.encode(t) == ref(t)["input_ids"], t
        ids = smollm2_tokenizer.encode(t)
        assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == t
    # EOS comes from the GGUF metadata (<|im_end|>), not transformers' guess
    assert smollm2_tokenizer.eos_token_ids == (2,)


def test_gguf_tokenizer_cache_gives_the_converted_tokenizer(smollm2_source, monkeypatch, tmp_path):
    """The first load converts the GGUF vocabulary and saves it; the second loads the saved copy, which
    encodes, decodes and templates exactly as the conversion; a damaged entry is converted again."""
    from enginecore.tokenizer import load_tokenizer

    monkeypatch.setenv("XLASERVE_CACHE", str(tmp_path))
    fresh = load_tokenizer(smollm2_source)
    entries = os.listdir(tmp_path / "tokenizers")
    assert len(entries) == 1 and not entries[0].startswith(".tmp")
    cached = load_tokenizer(smollm2_source)
    texts = ["Hello world, 你好", "<|im_start|>user\nHi<|im_end|>\n", "émoji 🎉 café", "  x\n\n\ty  "]
    for t in texts:
        assert cached.encode(t) == fresh.encode(t), t
        assert cached.decode(cached.encode(t), skip_special_tokens=False) == t
    assert (cached.eos_token_ids, cached.bos_token_id, cached.chat_template) == \
        (fresh.eos_token_ids, fresh.bos_token_id, fresh.chat_template)
    msgs = [{"role": "user", "content": "Hi"}]
    assert cached.apply_chat_template(msgs, add_generation_prompt=True) == \
        fresh.apply_chat_template(msgs, add_generation_prompt=True)
    # the saved entry loads as its class directly (not through AutoTokenizer's import): what AutoTokenizer gives
    from transformers import AutoTokenizer

    entry = tmp_path / "tokenizers" / entries[0]
    auto = AutoTokenizer.from_pretrained(str(entry), local_files_only=True, trust_remote_code=False)
    assert type(cached.hf) is type(auto)
    ids = auto.encode(texts[1] + texts[2])
    assert cached.hf.encode(texts[1] + texts[2]) == ids
    assert cached.hf.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    assert cached.hf.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    assert (len(cached.hf), cached.hf.all_special_ids, cached.hf.added_tokens_decoder.keys()) == \
        (len(auto), auto.all_special_ids, auto.added_tokens_decoder.keys())
    (entry / "tokenizer.json").write_text("{not json")
    again = load_tokenizer(smollm2_source)
    assert again.encode(texts[0]) == fresh.encode(texts[0])


def test_gguf_tokenizer_loads_without_torch(smollm2_source, tmp_path):
    """The API server's process needs no torch: loading the embedded model's tokenizer (converted from the
    GGUF, then the saved conversion) imports none, and transformers' GGUF weight reader, deferred, still works
    when called, the one real module in sys.modules and on the package, loaded once by racing threads."""
    import subprocess
    import sys

    code = f"""
import sys, threading
from enginecore.model_loader import resolve_model
from enginecore.tokenizer import load_tokenizer
src = resolve_model(None)
fresh = load_tokenizer(src)  # converted from the GGUF, then saved
cached = load_tokenizer(src)  # the saved conversion
ids = cached.encode("Hi <|im_end|>")
assert ids == fresh.encode("Hi <|im_end|>") and ids[-1] == 2 and len(ids) == 3, ids
assert "torch" not in sys.modules, "the tokenizer imported torch"
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
stand_in = transformers.modeling_gguf_pytorch_utils
got = []
ts = [threading.Thread(target=lambda: got.append(stand_in.TENSOR_PROCESSORS)) for _ in range(4)]
[t.start() for t in ts]
[t.join() for t in ts]
real = sys.modules["transformers.modeling_gguf_pytorch_utils"]
assert real is not stand_in and transformers.modeling_gguf_pytorch_utils is real and "torch" in sys.modules
assert len(got) == 4 and all(g is real.TENSOR_PROCESSORS for g in got)
out = load_gguf_checkpoint({smollm2_source.path!r}, return_tensors=False)
assert out["config"]["model_type"] == "llama", out["config"]
assert sys.modules["transformers.modeling_gguf_pytorch_utils"] is real
print("ok")
"""
    env = {**os.environ, "XLASERVE_CACHE": str(tmp_path)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr
    assert len(os.listdir(tmp_path / "tokenizers")) == 1
