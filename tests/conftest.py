"""Shared fixtures. Heavy things (models, engines) are session-scoped and shared.

Environment set here, before any test module imports jax or triton:
- 8 fake CPU devices for sharding tests (jax reads XLA_FLAGS once);
- TRITON_INTERPRET=1 when no NVIDIA GPU is present;
- no hub access, ever;
- the jax backend's XLA compile cache in a folder of this run's own, removed when it ends (nothing written to
  the user's ~/.cache/xlaserve/xla, nothing left in /tmp to grow run after run).
"""

from __future__ import annotations

import contextlib
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

from tests.gguf_writer import requantized_gguf  # noqa: E402
from tests.outputs import assert_same_outputs  # noqa: E402


def pytest_unconfigure(config):
    if _XLA_CACHE:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)


# `make test-fast` runs `-m "not slow"`: what it leaves out is marked slow here, in one place, beside the tests
# marked in their own files: whole files (and tests) that start servers, run kernels in the Pallas or Triton
# interpreter, spawn processes, or build and compile whole engines. `make test` runs everything.
SLOW_FILES = {
    "test_api_server.py": "servers",
    "test_api_torch_smoke.py": "a server",
    "test_bench_frontend.py": "servers",
    "test_reliability_server.py": "servers",
    "test_structured_outputs_server.py": "a server",
    "test_soak.py": "a server under load",
    "test_pallas_attention.py": "the Pallas interpreter",
    "test_triton_kernels.py": "the Triton interpreter",
    "test_torch_cuda_path_cpu.py": "the Triton interpreter",
    "test_torch_tp.py": "processes",
    "test_async_scheduling.py": "engines",
    "test_cpu_bfloat16.py": "engines",
    "test_jax_model.py": "engines",
    "test_jax_runtime.py": "engines: warmup, tensor parallelism, orbax",
    "test_torch_engine.py": "engines",
    "test_torch_model.py": "engines",
    "test_torch_moe.py": "engines, processes",
    "test_triton_moe.py": "the Triton interpreter",
    "test_tpu_aot.py": "whole programs compiled for TPUs",
}
SLOW_TESTS = {  # file::test (every parametrization)
    "test_torch_attention.py::test_triton_attention_wrapper": "the Triton interpreter",
    "test_torch_quant.py::test_engine_answers_like_the_dequantized_model": "engines",
    "test_torch_quant.py::test_decode_layers_in_one_call_run_the_4_bit_linears_bit_identically": "engines",
    "test_torch_quant.py::test_float32_decode_multiplies_a_mixed_gguf_files_types_to_the_same_bits": "engines",
    "test_torch_quant.py::test_float32_decode_multiplies_a_16_bit_checkpoints_values_to_the_same_bits": "engines",
    "test_torch_quant.py::test_float32_decode_multiplies_the_files_4_bit_blocks_to_the_same_bits": "engines",
    "test_torch_quant.py::test_flag_refused_where_it_cannot_run": "engines",
    "test_jax_moe.py::test_moe_greedy_matches_transformers": "engines",
    "test_jax_moe.py::test_tensor_parallel_8_with_and_without_expert_parallel": "engines",
    "test_jax_moe.py::test_chunked_prefix_cached_async_and_unscanned_runs_give_the_plain_tokens": "engines",
}


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(os.path.abspath(__file__))
    stale = [f for f in SLOW_FILES if not os.path.isfile(os.path.join(here, f))]
    skip_gpu = pytest.mark.skip(reason="needs an NVIDIA GPU")
    skip_tpu = pytest.mark.skip(reason="needs a TPU")
    has_tpu = bool(glob.glob("/dev/accel*"))
    modules = {}
    for item in items:
        name = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
        modules[item.path.name] = getattr(item, "module", None)
        if item.path.name in SLOW_FILES or name in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip_gpu)
        if "tpu" in item.keywords and not has_tpu:
            item.add_marker(skip_tpu)
    # a renamed file or test would silently join the fast run: a stale entry stops the run instead
    stale += [t for t in SLOW_TESTS if (m := modules.get(t.split("::")[0])) is not None
              and not hasattr(m, t.split("::")[1])]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py marks slow what does not exist: {', '.join(stale)}")


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


@pytest.fixture(scope="module")
def lib():
    """The torch backend's CPU kernels' library (`cpu_kernels.torch_ops`); skips where the CPU or the compiler
    cannot run them (tests/test_kernels_build.py fails instead where they should build)."""
    from cpu_kernels import torch_ops

    lib, why = torch_ops.load()
    if lib is None:
        pytest.skip(f"the AVX2 kernels do not run here: {why}")
    return lib


@pytest.fixture(scope="session")
def smollm2_source():
    """The embedded default model (GGUF), resolved once."""
    from enginecore.model_loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def mixed_gguf(tmp_path_factory):
    """The embedded GGUF with its linears in the types a llama.cpp K-quant or IQ4_XS file mixes: v Q8_0 in even
    layers (q and k Q4_1: qkv of both forms there), o Q5_0, down Q4_K in layers 0-9 and 15-19 (tests/gguf_writer.py
    encodes these: the gguf package cannot), IQ4_XS in 10-14 and Q6_K from 20, gate and up IQ4_NL
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
    """The embedded GGUF requantized as `types(tensor name, layer)` says (tests.gguf_writer.requantized_gguf)."""
    from enginecore.model_loader import embedded_model_path

    path = str(tmp_path_factory.mktemp(f"{name}_gguf") / f"{name}.gguf")
    return requantized_gguf(embedded_model_path(), path, types)


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


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory, smollm2_hf_dir):
    """Factory: a tiny random Mixture-of-Experts model of an architecture (`tests.moe_models.save_tiny_moe`)."""
    from tests.moe_models import save_tiny_moe

    cache: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in cache:
            cache[arch] = save_tiny_moe(arch, str(tmp_path_factory.mktemp(f"tiny_{arch}")), smollm2_hf_dir)
        return cache[arch]

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


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A real local Ray cluster (`ray start --head`), as a user runs one; its address, also in RAY_ADDRESS for
    the servers the tests start. Its own processes are killed when the session ends (`_stop_ray_cluster`)."""
    import subprocess
    import sys

    from benchmarks._server import free_port

    port = free_port()
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    tmp = str(tmp_path_factory.mktemp("ray"))
    # Ray turns token auth on for a `ray start` where ~/.ray/auth_token exists (any local `ray.init()` writes one)
    # but not for the clients that connect to it: off, explicitly, for the cluster and the servers the tests start
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    subprocess.run([ray_bin, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                    "--num-cpus", "8", "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={tmp}"],
                   check=True, env=env, stdout=subprocess.DEVNULL, timeout=120)
    address = f"127.0.0.1:{port}"
    old = {k: os.environ.get(k) for k in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    os.environ.update(RAY_ADDRESS=address, RAY_AUTH_MODE="disabled")
    try:
        yield address
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _stop_ray_cluster(tmp)


def _stop_ray_cluster(temp_dir: str) -> None:
    """Kill this cluster's processes only (`ray stop` would stop every cluster on the machine): those whose
    command line names its --temp-dir, and their children."""
    import psutil

    procs = []
    for p in psutil.process_iter(["cmdline"]):
        if any(temp_dir in a for a in (p.info["cmdline"] or [])):
            procs += [p, *p.children(recursive=True)]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=10)
