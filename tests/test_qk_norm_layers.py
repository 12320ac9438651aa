"""Qwen3's q/k norms in the one-call decoder layers (cpu_kernels/csrc/layers.c's run_layers, which both backends
run on a CPU): a tiny random Qwen3 with random norm weights gives, on each backend, the bits of its per-op path
(torch: the Python layers; jax: the scan's custom call per kernel), the same bits on the two backends, and
transformers' greedy tokens. Prompts longer than the token budget, so prefill chunks run beside decodes."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from enginecore import LLM, SamplingParams
from tests.outputs import assert_same_outputs

torch = pytest.importorskip("torch")

PROMPTS = [[1] + [(31 * i + 7 * j) % 900 + 50 for j in range(n)] for i, n in enumerate([37, 5, 20])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def qwen3_dir(tiny_model_dir, tmp_path_factory):
    """The tiny Qwen3 with its 1-D weights (the norms, q_norm and k_norm among them: the fixture leaves them at 1)
    made random."""
    from safetensors.numpy import load_file, save_file

    d = shutil.copytree(tiny_model_dir("qwen3"), tmp_path_factory.mktemp("qwen3_qk") / "m")
    assert json.loads((d / "config.json").read_text())["model_type"] == "qwen3"
    rng = np.random.default_rng(1)
    for f in d.glob("*.safetensors"):
        t = load_file(f)
        assert any("q_norm" in k for k in t) and any("k_norm" in k for k in t)
        save_file({k: (v + rng.normal(0, 0.2, v.shape)).astype(v.dtype) if v.ndim == 1 else v for k, v in t.items()},
                  f, metadata={"format": "pt"})
    return str(d)


def check_greedy(model_dir: str, outs) -> None:
    """Each generated token is transformers' argmax given the tokens before it (one teacher-forced forward)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, (p, o) in enumerate(zip(PROMPTS, outs)):
        got = list(o.outputs[0].token_ids)
        with torch.inference_mode():
            logits = model(torch.tensor([p + got[:-1]])).logits[0, len(p) - 1 :]
        assert logits.argmax(-1).tolist() == got, f"prompt {i}"


@pytest.fixture(scope="module")
def torch_outputs(qwen3_dir):
    """(the torch backend's outputs through its one-call layers, through its Python layers, whether the one-call
    layers ran)."""
    from cpu_kernels import torch_ops
    from torchengine.runner import TorchModelRunner

    if torch_ops.lib() is None:
        pytest.skip("the AVX2 kernels do not run here")
    llm = LLM(qwen3_dir, backend="torch", platform="cpu", max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=16, kv_cache_memory_bytes=16 << 20)
    reqs = [{"prompt_token_ids": p} for p in PROMPTS]
    real, used = TorchModelRunner._decode_layers, []

    def spy(self):
        layers = real(self)
        used.append(layers is not None)
        return layers

    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(TorchModelRunner, "_decode_layers", spy)
        one_call = llm.generate(reqs, GREEDY, use_tqdm=False)
        mp.setattr(TorchModelRunner, "_decode_layers", lambda self: None)
        python = llm.generate(reqs, GREEDY, use_tqdm=False)
    finally:
        mp.undo()
        llm.llm_engine.core.shutdown()
    return one_call, python, any(used)


def test_torch_runs_qk_norms_in_one_call_with_the_python_layers_bits(torch_outputs, qwen3_dir):
    one_call, python, ran = torch_outputs
    assert ran
    assert_same_outputs(one_call, python)
    check_greedy(qwen3_dir, one_call)


@pytest.fixture(scope="module")
def jax_outputs(qwen3_dir):
    """{cpu_layers: the jax backend's outputs} with every layer in one custom call and with the scan."""
    try:
        from cpu_kernels import jax_ops
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        pytest.skip(f"jax cannot be imported ({type(e).__name__}: {e})")
    if jax_ops.available():
        pytest.skip(jax_ops.available())
    res = {}
    for on in (True, False):
        llm = LLM(qwen3_dir, backend="jax", platform="cpu", dtype="float32", max_model_len=256, max_num_seqs=8,
                  max_num_batched_tokens=16, enable_prefix_caching=False, seed=0,
                  compilation_config={"cpu_layers": on})
        try:
            assert llm.llm_engine.core.runner.cpu_layers == on
            res[on] = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        finally:
            llm.llm_engine.core.shutdown()
    return res


def test_jax_runs_qk_norms_in_one_call_with_the_scans_bits(jax_outputs, qwen3_dir):
    assert_same_outputs(jax_outputs[True], jax_outputs[False])
    check_greedy(qwen3_dir, jax_outputs[True])


def test_the_two_backends_one_call_layers_give_the_same_bits(jax_outputs, torch_outputs):
    assert_same_outputs(jax_outputs[True], torch_outputs[0])
