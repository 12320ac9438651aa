"""Shared fixtures. Heavy things (models, engines) are session-scoped and shared.

Environment set here, before any test module imports jax or triton:
- 8 fake CPU devices for sharding tests (jax reads XLA_FLAGS once);
- TRITON_INTERPRET=1 when no NVIDIA GPU is present;
- no hub access, ever;
- the jax backend's XLA compile cache in a folder of this run's own, removed when it ends (nothing written to
  the user's ~/.cache/xlaserve/xla, nothing left in /tmp to grow run after run).
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
HAS_GPU = bool(glob.glob("/dev/nvidia[0-9]*"))
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
_XLA_CACHE = None if "VLLM_XLA_CACHE_PATH" in os.environ else tempfile.mkdtemp(prefix="xlaserve-test-xla-cache-")
if _XLA_CACHE:
    os.environ["VLLM_XLA_CACHE_PATH"] = _XLA_CACHE

import pytest  # noqa: E402

from tests.outputs import assert_same_outputs  # noqa: E402


def pytest_unconfigure(config):
    if _XLA_CACHE:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU")
    skip_tpu = pytest.mark.skip(reason="needs a TPU")
    has_tpu = bool(glob.glob("/dev/accel*"))
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "tpu" in item.keywords and not has_tpu:
            item.add_marker(skip_tpu)


@pytest.fixture(autouse=True)
def _xlaserve_logging_restored():
    """A CLI entry point run in-process (`frontend.cli.main`) configures the "xlaserve" logger for the whole
    process (its own handler, no propagation): put it back after each test, so later tests' caplog sees it."""
    import logging

    log = logging.getLogger("xlaserve")
    saved = (list(log.handlers), log.level, log.propagate)
    yield
    log.handlers[:], log.propagate = saved[0], saved[2]
    log.setLevel(saved[1])  # (setLevel, not an assignment: it clears the child loggers' cached levels)


@pytest.fixture(params=[19, 6], ids=["blocked_from_19", "blocked_from_6"])
def blocked_from(request):
    """panel_gemm's k-blocked loop order from 19 rows (a CPU with AVX-512's start) or from 6 (one without), so
    both orders run on any CPU (`panel_blocked_rows`): in the torch backend's library, and in jax's where a test
    module has imported it (the torch tests never import jax)."""
    import sys

    from cpu_kernels import torch_ops

    jax_kernels = sys.modules.get("cpu_kernels.jax_ops")
    libs = [lib for lib in (torch_ops.lib(), jax_kernels and jax_kernels.lib()) if lib is not None]
    before = [lib.panel_blocked_rows(request.param) for lib in libs]
    yield request.param
    for lib, b in zip(libs, before):
        lib.panel_blocked_rows(b)


@pytest.fixture(scope="session")
def smollm2_source():
    """The embedded default model (GGUF), resolved once."""
    from enginecore.model_loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def mixed_gguf(tmp_path_factory):
    """The embedded GGUF with its linears in the types a llama.cpp K-quant or IQ4_XS file mixes: v Q8_0 in even
    layers (q and k Q4_1: qkv of both forms there), o Q5_0, down Q4_K in layers 0-9 and 15-19 (`_q4_k`, `_q6_k`,
    `_iq4`: the gguf package has no encoders for these), IQ4_XS in 10-14 and Q6_K from 20, gate and up IQ4_NL
    from layer 20, the rest as stored (Q4_1, a Q8_0 embedding); its tokenizer and metadata copied."""
    import gguf

    T = gguf.GGMLQuantizationType

    def types(name: str, layer: int):
        if name.endswith("attn_v.weight") and layer % 2 == 0:
            return T.Q8_0
        if name.endswith("attn_output.weight"):
            return T.Q5_0
        if name.endswith("ffn_down.weight"):
            return T.Q6_K if layer >= 20 else T.IQ4_XS if layer >= 10 and layer < 15 else T.Q4_K
        if name.endswith(("ffn_gate.weight", "ffn_up.weight")) and layer >= 20:
            return T.IQ4_NL
        return None

    return _requantized_gguf(tmp_path_factory, "mixed", types)


@pytest.fixture(scope="session")
def iq4_gguf(tmp_path_factory):
    """The embedded GGUF as an IQ4_XS file of it would be, every layer alike: gate and up IQ4_NL, down IQ4_XS
    (rows of 1536, whole super-blocks of 256), the rest as stored."""
    import gguf

    T = gguf.GGMLQuantizationType
    return _requantized_gguf(tmp_path_factory, "iq4", lambda name, layer: T.IQ4_XS if name.endswith(
        "ffn_down.weight") else T.IQ4_NL if name.endswith(("ffn_gate.weight", "ffn_up.weight")) else None)


def _requantized_gguf(tmp_path_factory, name: str, types) -> str:
    """The embedded GGUF with each tensor that `types(tensor name, layer)` names a GGML type for requantized to it
    (the gguf package's encoder, or `_q4_k`, `_q6_k`, `_iq4`), the rest as stored; its tokenizer and metadata
    copied. Returns its path."""
    import gguf

    from enginecore.model_loader import embedded_model_path

    src = gguf.GGUFReader(embedded_model_path())
    path = str(tmp_path_factory.mktemp(f"{name}_gguf") / f"{name}.gguf")
    w = gguf.GGUFWriter(path, src.fields["general.architecture"].contents())
    for f in src.fields.values():
        if f.name != "general.architecture" and not f.name.startswith("GGUF."):
            array = f.types[0] == gguf.GGUFValueType.ARRAY
            w.add_key_value(f.name, f.contents(), f.types[0], sub_type=f.types[-1] if array else None)
    T = gguf.GGMLQuantizationType
    encoders = {T.Q4_K: _q4_k, T.Q6_K: _q6_k, T.IQ4_NL: lambda a: _iq4(a, 32), T.IQ4_XS: lambda a: _iq4(a, 256)}
    for t in src.tensors:
        data, ty = t.data, t.tensor_type
        to = types(t.name, int(t.name.split(".")[1]) if t.name.startswith("blk.") else -1)
        if to is not None:
            w32 = gguf.quants.dequantize(data, ty)
            data, ty = (encoders[to](w32) if to in encoders else gguf.quants.quantize(w32, to)), to
        w.add_tensor(t.name, data, raw_dtype=ty)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def _q4_k(w):
    """float32 [N, K] (K a multiple of 256) -> GGUF Q4_K super-blocks [N, K / 256 * 144] uint8, roughly (per 32
    weights (d * sc) * q - dmin * mn, six-bit sc and mn packed in 12 bytes, q's nibbles as the gguf package reads
    them)."""
    import numpy as np

    N, K = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)  # [blocks, sub-blocks, 32]
    lo = np.minimum(x.min(axis=2), 0)
    s = (x.max(axis=2) - lo) / 15
    d = (s.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(axis=1) / 63).astype(np.float16).astype(np.float32)

    def six(a, u):
        return np.clip(np.round(np.divide(a, u[:, None], out=np.zeros_like(a), where=u[:, None] > 0)), 0, 63)

    sc, mn = six(s, d).astype(np.uint8), six(-lo, dmin).astype(np.uint8)
    eff, off = (d[:, None] * sc)[..., None], (dmin[:, None] * mn)[..., None]
    q = np.clip(np.round(np.divide(x + off, eff, out=np.zeros_like(x), where=eff != 0)), 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, mn[:, :4] | (mn[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4], axis=1)
    qs = (q[:, 0::2] | q[:, 1::2] << 4).reshape(-1, 128)  # chunk c: sub-block 2c low, 2c + 1 high
    out = np.concatenate([d.astype(np.float16)[:, None].view(np.uint8), dmin.astype(np.float16)[:, None].view(
        np.uint8), scales, qs], axis=1)
    return out.reshape(N, -1)


def _iq4(w, block):
    """float32 [N, K] -> GGUF IQ4_NL blocks (block 32: d, 16 bytes of nibbles) or IQ4_XS super-blocks (256: d, the
    eight sub-blocks' six-bit scales sc, d * (sc - 32) theirs, in two bits each of a uint16 and four bytes of
    nibbles, then 8 x 16 bytes), [N, K / block * bytes] uint8, roughly: each weight the index of the nearest of
    IQ4_NL's 16 values times its scale; nibbles as the gguf package reads them (element j < 16 the low one of byte
    j, j + 16 its high one, a sub-block of 32 at a time)."""
    import gguf
    import numpy as np

    N, K = w.shape
    values = np.asarray(gguf.quants.IQ4_NL.kvalues, np.float32)
    x = w.reshape(-1, block // 32, 32).astype(np.float32)  # [blocks, sub-blocks, 32]
    s = np.abs(x).max(axis=2) / 127  # per sub-block
    if block == 32:
        d = s[:, 0].astype(np.float16)
        eff = d.astype(np.float32)[:, None]
        head = [d[:, None].view(np.uint8)]
    else:
        d = (s.max(axis=1) / 31).astype(np.float16)
        sc = np.clip(np.round(np.divide(s, d.astype(np.float32)[:, None], out=np.zeros_like(s),
                                        where=d[:, None] > 0)), -32, 31).astype(np.int64) + 32
        eff = d.astype(np.float32)[:, None] * (sc - 32).astype(np.float32)
        hi = sum((sc[:, j] >> 4) << (2 * j) for j in range(8)).astype("<u2")
        lo = (sc[:, 0::2] & 15) | (sc[:, 1::2] & 15) << 4
        head = [d[:, None].view(np.uint8), hi[:, None].view(np.uint8), lo.astype(np.uint8)]
    scaled = np.divide(x, eff[..., None], out=np.zeros_like(x), where=eff[..., None] != 0)
    idx = np.abs(scaled[..., None] - values).argmin(axis=-1).astype(np.uint8)  # [blocks, sub-blocks, 32]
    qs = (idx[..., :16] | idx[..., 16:] << 4).reshape(len(x), -1)
    return np.concatenate([*head, qs], axis=1).reshape(N, -1)


def _q6_k(w):
    """float32 [N, K] (K a multiple of 256) -> GGUF Q6_K super-blocks [N, K / 256 * 210] uint8, roughly (per 16
    weights a scale d * sc, q - 32 in [-32, 31]; ql's nibbles and qh's 2-bit pairs laid out as the gguf package
    reads them)."""
    import numpy as np

    N, K = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)  # [blocks, groups of 16, 16]
    s = np.abs(x).max(axis=2) / 31  # per group
    d = (s.max(axis=1) / 127).astype(np.float16).astype(np.float32)  # per block
    sc = np.clip(np.round(np.divide(s, d[:, None], out=np.zeros_like(s), where=d[:, None] > 0)), -128, 127)
    eff = (d[:, None] * sc)[..., None]
    q = np.clip(np.round(np.divide(x, eff, out=np.zeros_like(x), where=eff != 0)), -32, 31).astype(np.int64) + 32
    q = q.reshape(-1, 2, 128)  # [blocks, half h, r]
    ql = np.zeros((len(q), 2, 64), np.int64)
    qh = np.zeros((len(q), 2, 32), np.int64)
    for part in range(2):  # r // 64: the nibble
        ql |= (q[:, :, part * 64 : (part + 1) * 64] & 15) << (4 * part)
    for part in range(4):  # r // 32: the 2-bit pair
        qh |= (q[:, :, part * 32 : (part + 1) * 32] >> 4) << (2 * part)
    out = np.concatenate([ql.reshape(-1, 128).astype(np.uint8), qh.reshape(-1, 64).astype(np.uint8),
                          sc.astype(np.int8).view(np.uint8), d.astype(np.float16)[:, None].view(np.uint8)], axis=1)
    return out.reshape(N, -1)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_source):
    from enginecore.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_source)


@pytest.fixture(scope="session")
def smollm2_hf_dir(tmp_path_factory, smollm2_source):
    """The embedded model written out as a Hugging Face folder (f32 safetensors + tokenizer)."""
    from enginecore.hf_folder import save_hf_folder

    return save_hf_folder(smollm2_source, str(tmp_path_factory.mktemp("smollm2_hf")))


TINY_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_hf_dir):
    """Factory: a tiny random model of an architecture, saved with transformers (f32), SmolLM2's tokenizer."""
    cache: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch in cache:
            return cache[arch]
        import shutil

        import torch
        import transformers as tf

        torch.manual_seed(0)
        common = dict(
            vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        )
        if arch == "llama":
            cfg = tf.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False,
                                 rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
            model = tf.LlamaForCausalLM(cfg)
        elif arch == "mistral":
            cfg = tf.MistralConfig(**common, head_dim=16, sliding_window=None, tie_word_embeddings=False)
            model = tf.MistralForCausalLM(cfg)
        elif arch == "qwen2":
            cfg = tf.Qwen2Config(**common, tie_word_embeddings=True, use_sliding_window=False)
            model = tf.Qwen2ForCausalLM(cfg)
        elif arch == "qwen3":
            cfg = tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, use_sliding_window=False)
            model = tf.Qwen3ForCausalLM(cfg)
        else:
            raise ValueError(arch)
        # random weights are tiny; scale them up so logits are not all ~0 (greedy ties)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.2)
        d = str(tmp_path_factory.mktemp(f"tiny_{arch}"))
        model.save_pretrained(d, safe_serialization=True)
        for fn in os.listdir(smollm2_hf_dir):
            if fn.startswith("tokenizer") or fn.endswith(".jinja") or fn == "special_tokens_map.json":
                shutil.copy(os.path.join(smollm2_hf_dir, fn), d)
        cache[arch] = d
        return d

    return make


def _tiny_llama_as(tiny_model_dir, tmp_path_factory, dtype: str) -> str:
    import shutil

    import torch
    import transformers as tf

    src = tiny_model_dir("llama")
    d = str(tmp_path_factory.mktemp(f"tiny_llama_{dtype}"))
    tf.AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype)).save_pretrained(d, safe_serialization=True)
    for fn in os.listdir(src):
        if fn.startswith("tokenizer") or fn.endswith(".jinja") or fn == "special_tokens_map.json":
            shutil.copy(os.path.join(src, fn), d)
    return d


@pytest.fixture(scope="session")
def tiny_bf16_llama_dir(tiny_model_dir, tmp_path_factory):
    """The tiny llama (untied LM head) saved as a bfloat16 checkpoint, as most Hugging Face models are."""
    return _tiny_llama_as(tiny_model_dir, tmp_path_factory, "bfloat16")


@pytest.fixture(scope="session")
def tiny_f16_llama_dir(tiny_model_dir, tmp_path_factory):
    """The tiny llama saved as a float16 checkpoint (as some Hugging Face models are)."""
    return _tiny_llama_as(tiny_model_dir, tmp_path_factory, "float16")


@pytest.fixture
def one_call_vs_python_layers(monkeypatch):
    """Factory: generate with the torch runner's one-call decode layers (cpu_layers.DecodeLayers), then with
    the Python layers, and assert the same tokens and logprobs to the bit. Returns whether the one-call path
    ran at all."""

    def check(llm, prompts, sp) -> bool:
        from torchengine.runner import TorchModelRunner

        real, used = TorchModelRunner._decode_layers, []

        def spy(self):
            layers = real(self)
            used.append(layers is not None)
            return layers

        monkeypatch.setattr(TorchModelRunner, "_decode_layers", spy)
        one_call = llm.generate(prompts, sp, use_tqdm=False)
        monkeypatch.setattr(TorchModelRunner, "_decode_layers", lambda self: None)
        python = llm.generate(prompts, sp, use_tqdm=False)
        monkeypatch.setattr(TorchModelRunner, "_decode_layers", real)
        assert_same_outputs(one_call, python)
        return any(used)

    return check
