"""Shared fixtures. Heavy things (models, engines) are session-scoped and shared.

Environment set here, before any test module imports jax or triton:
- 8 fake CPU devices for sharding tests (jax reads XLA_FLAGS once);
- TRITON_INTERPRET=1 when no NVIDIA GPU is present;
- no hub access, ever.
"""

from __future__ import annotations

import glob
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
HAS_GPU = bool(glob.glob("/dev/nvidia[0-9]*"))
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


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


@pytest.fixture(scope="session")
def smollm2_source():
    """The embedded default model (GGUF), resolved once."""
    from enginecore.model_loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_source):
    from enginecore.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_source)


@pytest.fixture(scope="session")
def smollm2_hf_dir(tmp_path_factory, smollm2_source):
    """The embedded model written out as a Hugging Face folder (f32 safetensors + tokenizer)."""
    from enginecore.model_loader import save_hf_folder

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


@pytest.fixture(scope="session")
def tiny_bf16_llama_dir(tiny_model_dir, tmp_path_factory):
    """The tiny llama (untied LM head) saved as a bfloat16 checkpoint, as most Hugging Face models are."""
    import shutil

    import torch
    import transformers as tf

    src = tiny_model_dir("llama")
    d = str(tmp_path_factory.mktemp("tiny_llama_bf16"))
    tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).save_pretrained(d, safe_serialization=True)
    for fn in os.listdir(src):
        if fn.startswith("tokenizer") or fn.endswith(".jinja") or fn == "special_tokens_map.json":
            shutil.copy(os.path.join(src, fn), d)
    return d


@pytest.fixture
def one_call_vs_python_layers(monkeypatch):
    """Factory: generate with the torch runner's one-call decode layers (cpu_kernels.DecodeLayers), then with
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
        for a, b in zip(one_call, python):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert (a.outputs[0].logprobs is None) == (b.outputs[0].logprobs is None)
            for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
                assert {t: e.logprob for t, e in x.items()} == {t: e.logprob for t, e in y.items()}
        return any(used)

    return check
