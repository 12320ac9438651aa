"""Issue 15, part 6: corrupt or hostile model files give a clear ModelLoadError at load, quickly, and
never an allocation of the size they declare; chat templates render in jinja2's sandbox; no remote code.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from enginecore.model_checks import ARCH_LIMITS, MAX_SAFETENSORS_HEADER_BYTES
from enginecore.model_loader import ModelLoadError, resolve_model

# ---- GGUF headers written by hand: what the gguf package's reader would trust ------------------------------


def _s(text: str) -> bytes:
    b = text.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_file(tmp_path, kv: bytes = b"", n_kv: int = 0, tensors: bytes = b"", n_tensors: int = 0,
              tail: bytes = b"\0" * 64) -> str:
    p = tmp_path / "hostile.gguf"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kv + tensors + tail)
    return str(p)


def kv_u32_array(key: str, count: int) -> bytes:
    return _s(key) + struct.pack("<IIQ", 9, 4, count)  # ARRAY of UINT32


HOSTILE_GGUF = {
    # the reader loops count times over an empty slice past the end: ~forever, a list growing each time
    "u32 array of 2**62": (lambda: dict(kv=kv_u32_array("tokenizer.ggml.token_type", 2**62), n_kv=1),
                           "2**62"),
    "string array of 2**40": (lambda: dict(kv=_s("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**40),
                                           n_kv=1), "items"),
    "string of 2**50 bytes": (lambda: dict(kv=_s("general.name") + struct.pack("<IQ", 8, 2**50), n_kv=1),
                              "general.name"),
    "2**60 metadata entries": (lambda: dict(n_kv=2**60), "metadata entries"),
    "2**60 tensors": (lambda: dict(n_tensors=2**60), "tensor descriptions"),
    "unknown value type": (lambda: dict(kv=_s("x") + struct.pack("<I", 99), n_kv=1), "unknown value type 99"),
    "7 dimensions": (lambda: dict(tensors=_s("t") + struct.pack("<I", 7) + b"\0" * 80, n_tensors=1),
                     "7 dimensions"),
    "a 2**40-element tensor in 64 bytes": (
        lambda: dict(tensors=_s("token_embd.weight") + struct.pack("<IQQIQ", 2, 2**20, 2**20, 0, 0), n_tensors=1),
        "past the end of the file"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_GGUF))
def test_hostile_gguf_headers_fail_fast(tmp_path, case):
    make, needle = HOSTILE_GGUF[case]
    path = gguf_file(tmp_path, **make())
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError) as e:
        resolve_model(path)
    assert time.monotonic() - t0 < 5
    msg = str(e.value)
    assert "hostile.gguf" in msg and (needle in msg or needle == "2**62" and str(2**62) in msg), msg


def _small_gguf(tmp_path, name="m.gguf", block_count=1, tensors=True, nan=False, **meta) -> str:
    import gguf

    H, I, V, nh = 8, 16, 32, 2
    path = str(tmp_path / name)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(meta.get("block_count", block_count))
    w.add_embedding_length(meta.get("embedding_length", H))
    w.add_feed_forward_length(I)
    w.add_head_count(nh)
    w.add_head_count_kv(nh)
    w.add_context_length(meta.get("context_length", 64))
    w.add_vocab_size(V)
    rng = np.random.default_rng(0)
    if tensors:
        shapes = {"token_embd.weight": (V, H), "output_norm.weight": (H,)}
        for i in range(block_count):
            shapes.update({f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.ffn_norm.weight": (H,),
                           f"blk.{i}.attn_q.weight": (H, H), f"blk.{i}.attn_k.weight": (H, H),
                           f"blk.{i}.attn_v.weight": (H, H), f"blk.{i}.attn_output.weight": (H, H),
                           f"blk.{i}.ffn_gate.weight": (I, H), f"blk.{i}.ffn_up.weight": (I, H),
                           f"blk.{i}.ffn_down.weight": (H, I)})
        for n, shape in shapes.items():
            a = rng.standard_normal(shape).astype(np.float32)
            if nan and n == "blk.0.ffn_up.weight":
                a[3, 5] = np.nan
            w.add_tensor(n, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_small_gguf_loads_and_hostile_metadata_is_refused(tmp_path):
    src = resolve_model(_small_gguf(tmp_path))
    assert src.config.num_hidden_layers == 1 and len(src.load_weights()) == 11
    # declared sizes far beyond any model: refused before anything is sized from them
    with pytest.raises(ModelLoadError, match=f"num_hidden_layers is 1000000000; it must be a positive integer of "
                                             f"at most {ARCH_LIMITS['num_hidden_layers']}"):
        resolve_model(_small_gguf(tmp_path, "a.gguf", tensors=False, block_count=10**9))
    with pytest.raises(ModelLoadError, match="max_position_embeddings"):
        resolve_model(_small_gguf(tmp_path, "b.gguf", context_length=2**31))
    # plausible sizes that the file's tensors do not back: refused before a backend allocates them
    with pytest.raises(ModelLoadError, match="shape"):
        resolve_model(_small_gguf(tmp_path, "c.gguf", embedding_length=4096))
    with pytest.raises(ModelLoadError, match="needs tensors the file does not have: .*layer 0"):
        resolve_model(_small_gguf(tmp_path, "d.gguf", tensors=False))


def test_nan_weights_fail_at_load(tmp_path):
    src = resolve_model(_small_gguf(tmp_path, nan=True))
    with pytest.raises(ModelLoadError, match=r"blk|model.layers.0.mlp.up_proj.weight.*non-finite value \(nan\)"):
        src.load_weights()


# ---- Hugging Face folders ------------------------------------------------------------------------------


@pytest.fixture
def hf_copy(tmp_path, tiny_model_dir):
    src = tiny_model_dir("llama")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder, **changes):
    p = folder / "config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


@pytest.mark.parametrize("changes, needle", [
    (dict(vocab_size=10**12), f"vocab_size is 1000000000000; it must be a positive integer of at most "
                              f"{ARCH_LIMITS['vocab_size']}"),
    (dict(hidden_size="big"), "hidden_size is 'big'; it must be a positive integer"),
    (dict(num_key_value_heads=-2), "num_key_value_heads is -2"),
    (dict(num_attention_heads=None), "missing key 'num_attention_heads'"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps"),
    (dict(num_hidden_layers=3), "needs tensors the file does not have: .*layer 2"),
    (dict(intermediate_size=256), r"mlp\..*_proj.weight has shape \[.*\]; the config implies"),
])
def test_hostile_config_json_is_refused_before_allocation(hf_copy, changes, needle):
    _edit_config(hf_copy, **changes)
    with pytest.raises(ModelLoadError, match=needle):
        resolve_model(str(hf_copy))


def _rewrite_safetensors(folder, edit_header=None, edit_arrays=None):
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    if edit_arrays is not None:
        arrays = load_file(str(path))
        edit_arrays(arrays)
        save_file(arrays, str(path))
    if edit_header is not None:
        data = path.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        edit_header(header)
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    return path


def _first_weight(header):
    return next(k for k in header if k.endswith("q_proj.weight"))


@pytest.mark.parametrize("edit, needle", [
    (lambda h: h[_first_weight(h)].update(shape=[2**31, 2**31]), "bytes but its data_offsets span"),
    (lambda h: h[_first_weight(h)].update(data_offsets=[-5, 10]), "not 0 <= start <= end"),
    (lambda h: h[_first_weight(h)].update(dtype="Q9"), "unknown dtype 'Q9'"),
    (lambda h: h[_first_weight(h)].update(shape="big"), "is not a list"),
])
def test_hostile_safetensors_headers(hf_copy, edit, needle):
    _rewrite_safetensors(hf_copy, edit_header=edit)
    with pytest.raises(ModelLoadError, match=needle):
        resolve_model(str(hf_copy))


def test_integer_weights_and_nan_weights_are_refused(hf_copy):
    name = "model.layers.0.mlp.up_proj.weight"

    def to_int(a):
        a[name] = a[name].astype(np.int32)

    _rewrite_safetensors(hf_copy, edit_arrays=to_int)
    with pytest.raises(ModelLoadError, match=f"{name} has dtype I32; weights must be one of F32"):
        resolve_model(str(hf_copy))

    def poison(a):
        a[name] = a[name].astype(np.float32)
        a[name][1, 2] = np.inf

    _rewrite_safetensors(hf_copy, edit_arrays=poison)
    src = resolve_model(str(hf_copy))  # the header is fine; the values are read at load
    with pytest.raises(ModelLoadError, match=f"{name} holds a non-finite value \\(inf\\)"):
        src.load_weights()


def test_huge_declared_safetensors_header_is_not_read(hf_copy):
    path = hf_copy / "model.safetensors"
    size = MAX_SAFETENSORS_HEADER_BYTES + (1 << 20)
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", MAX_SAFETENSORS_HEADER_BYTES + 1))
        f.truncate(size)  # sparse: the claim fits the file, so only the cap stops a 100 MB read
    t0 = time.monotonic()
    with pytest.raises(ModelLoadError, match=f"the limit is {MAX_SAFETENSORS_HEADER_BYTES}"):
        resolve_model(str(hf_copy))
    assert time.monotonic() - t0 < 5


# ---- tokenizers and chat templates ---------------------------------------------------------------------


def test_corrupt_tokenizer_is_a_load_error(hf_copy):
    from enginecore.tokenizer import load_tokenizer

    tj = hf_copy / "tokenizer.json"
    tj.write_bytes(tj.read_bytes()[: 5000])
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        load_tokenizer(resolve_model(str(hf_copy)))


def test_tokenizer_remote_code_is_never_run(hf_copy, tmp_path):
    from enginecore.tokenizer import load_tokenizer

    marker = tmp_path / "remote-code-ran"
    (hf_copy / "evil_tokenizer.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    cfg_path = hf_copy / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["auto_map"] = {"AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]}
    cfg_path.write_text(json.dumps(cfg))
    try:
        load_tokenizer(resolve_model(str(hf_copy)))
    except ModelLoadError as e:  # refusing it is as good as ignoring it
        assert "remote" in str(e).lower() or "trust" in str(e).lower(), e
    assert not marker.exists()


@pytest.mark.parametrize("template, needle", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "access to attribute"),
    ("{{ messages.__class__.__init__.__globals__ }}", "access to attribute"),
    ("{% for i in range(10**9) %}x{% endfor %}", "(?i)range too big"),
])
def test_chat_templates_render_in_the_sandbox(smollm2_tokenizer, template, needle):
    t0 = time.monotonic()
    with pytest.raises(Exception, match=needle) as e:
        smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], template)
    assert "SecurityError" in type(e.value).__name__ or "OverflowError" in type(e.value).__name__
    assert time.monotonic() - t0 < 5


@pytest.mark.slow
def test_serve_exits_2_with_the_reason(hf_copy):
    _edit_config(hf_copy, vocab_size=10**12)
    r = subprocess.run([sys.executable, "-m", "frontend.cli", "serve", str(hf_copy), "--platform", "cpu"],
                       capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "vocab_size is 1000000000000" in r.stderr


def test_unknown_tensor_type(tmp_path):
    path = gguf_file(tmp_path, tensors=_s("t") + struct.pack("<IQIQ", 1, 32, 9999, 0), n_tensors=1)
    with pytest.raises(ModelLoadError, match="unknown type 9999"):
        resolve_model(path)
