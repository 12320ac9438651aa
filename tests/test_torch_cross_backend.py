"""The same requests on LLM(backend="jax") and LLM(backend="torch") give the same tokens (CPU, fp32, SmolLM2).

Greedy requests and seeded sampled ones (temperature, top-p, top-k): the draw
is the host's counter-based uniform on both backends, so only float-level
differences between the two models could move a token. On a mismatch the
message names the request, the first diverging position and both backends'
top logprobs there.
"""

from __future__ import annotations

import pytest

import jaxengine.runner  # noqa: F401 - a broken jax backend fails this file, never skips it
from cpu_kernels import torch_ops
from enginecore import LLM, SamplingParams
from tests.outputs import assert_same_outputs

SAME_KERNELS = torch_ops.lib() is not None  # both backends on the C kernels (x86 with AVX2)

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    "def quicksort(xs):",
    "Write a haiku about the sea.",
    "1, 1, 2, 3, 5, 8,",
    "In 1969, the first person to walk on the Moon was",
    "Translate to French: I would like a cup of coffee.",
]
MAX_TOKENS = 16
LOGPROBS = 3
PARAMS = {
    "greedy": [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=LOGPROBS)] * len(TEXTS),
    "seeded": [
        SamplingParams(temperature=t, top_p=p, top_k=k, seed=1000 + i, max_tokens=MAX_TOKENS, ignore_eos=True,
                       logprobs=LOGPROBS)
        for i, (t, p, k) in enumerate([(0.7, 0.9, 50), (1.0, 0.95, 0), (0.8, 1.0, 20), (0.5, 0.8, 0),
                                        (1.0, 0.9, 40), (0.6, 1.0, 0)])
    ],
}


def engine(backend: str, model_dir: str, **kw) -> LLM:
    return LLM(model_dir, backend=backend, platform="cpu", dtype="float32", max_model_len=256, max_num_seqs=8,
               max_num_batched_tokens=64, kv_cache_memory_bytes=32 << 20, seed=0, **kw)


@pytest.fixture(scope="module")
def outputs(smollm2_hf_dir):
    prompts = [{"prompt": t} for t in TEXTS]
    res = {}
    for backend in ("jax", "torch"):
        llm = engine(backend, smollm2_hf_dir)
        res[backend] = {kind: llm.generate(prompts, params, use_tqdm=False) for kind, params in PARAMS.items()}
        llm.llm_engine.core.shutdown()
    return res


def describe(i: int, j: int | None, jax_out, torch_out) -> str:
    a, b = jax_out.outputs[0], torch_out.outputs[0]
    msg = f"request {i} ({TEXTS[i]!r}): jax {a.token_ids} vs torch {b.token_ids}"
    if j is not None:
        top = lambda lps: sorted(((t, round(v.logprob, 5)) for t, v in lps[j].items()), key=lambda x: -x[1])  # noqa: E731
        msg += f"; first divergence at token {j}: jax top logprobs {top(a.logprobs)}, torch {top(b.logprobs)}"
    return msg


@pytest.mark.parametrize("kind", list(PARAMS))
def test_jax_and_torch_give_identical_tokens(outputs, kind):
    problems = []
    for i, (x, y) in enumerate(zip(outputs["jax"][kind], outputs["torch"][kind])):
        a, b = x.outputs[0].token_ids, y.outputs[0].token_ids
        if a != b:
            j = next((j for j, (s, t) in enumerate(zip(a, b)) if s != t), None)
            problems.append(describe(i, j, x, y))
    assert not problems, "\n".join(problems)


def test_logprobs_are_the_same_bits(outputs):
    for x, y in zip(outputs["jax"]["greedy"], outputs["torch"]["greedy"]):
        if x.outputs[0].token_ids != y.outputs[0].token_ids:
            continue  # reported by the token test
        for s, t in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            for tok in s.keys() & t.keys():
                # the same bits on a CPU: one set of kernels for the logits and the samplers' log_softmax (was
                # 1e-3 while XLA computed the norms, RoPE and SiLU, ~2e-6 while each sampler had its own sums)
                if SAME_KERNELS:
                    assert s[tok].logprob == t[tok].logprob, (tok, s[tok].logprob, t[tok].logprob)
                else:  # each backend's own ops (no AVX2 here)
                    assert s[tok].logprob == pytest.approx(t[tok].logprob, abs=1e-3)


@pytest.mark.skipif(not SAME_KERNELS, reason="the AVX2 kernels do not run here")
def test_a_16bit_kv_cache_gives_the_same_bits_on_both_backends(smollm2_hf_dir):
    """--kv-cache-dtype bfloat16 under float32 weights: both backends round K and V the same way and attend
    over them with the same kernels (float32 queries), so tokens and logprobs are still the same bits."""
    prompts = [{"prompt": t} for t in TEXTS[:3]]
    res = {}
    for backend in ("jax", "torch"):
        llm = engine(backend, smollm2_hf_dir, kv_cache_dtype="bfloat16")
        res[backend] = llm.generate(prompts, PARAMS["greedy"][:3], use_tqdm=False)
        llm.llm_engine.core.shutdown()
    assert_same_outputs(res["jax"], res["torch"])


@pytest.mark.skipif(not SAME_KERNELS, reason="the AVX2 kernels do not run here")
@pytest.mark.parametrize("model,cpu_layers", [("gguf", True), ("gguf", False), ("bf16", True), ("f16", True),
                                              ("mixed", True), ("iq4", True)])
def test_jax_from_the_weights_as_stored_gives_torchs_float32_bits(model, cpu_layers, tiny_bf16_llama_dir,
                                                                  tiny_f16_llama_dir, mixed_gguf, iq4_gguf,
                                                                  monkeypatch):
    """The jax backend's decode steps from the weights as stored (`jaxengine.loader.attach_cpu_qx`: the embedded
    GGUF's Q4_1 linears and Q8_0 LM head; a bfloat16 checkpoint's halves; a file of mixed types, `mixed_gguf`, a
    kind a linear; IQ4_NL and IQ4_XS linears, `iq4_gguf`), in the one-call layers and in the scan
    over layers (`cpu_layers` off: a custom call per linear), give the torch backend's float32-only bits
    (`XLASERVE_Q4X=off`): the same tokens and logprobs, greedy (the head's argmax) and with logprobs (the
    logits). Three requests, then five (a bucket of 8 rows: the Q4 panels' limit)."""
    from cpu_kernels import layout as qx

    path = {"gguf": None, "bf16": tiny_bf16_llama_dir, "f16": tiny_f16_llama_dir, "mixed": mixed_gguf,
            "iq4": iq4_gguf}[model]
    prompts = [{"prompt_token_ids": list(range(300 + 9 * i, 330 + 14 * i))} for i in range(5)]
    runs = [(prompts[:3], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)),
            (prompts[:3], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)),
            (prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))]
    res = {}
    for backend in ("jax", "torch"):
        monkeypatch.setenv("XLASERVE_Q4X", "on" if backend == "jax" else "off")
        llm = engine(backend, path, **({} if cpu_layers or backend == "torch" else
                                       {"compilation_config": {"cpu_layers": False}}))
        try:
            if backend == "jax":
                p = llm.llm_engine.core.runner.params.panels
                K = qx.QX_KINDS
                # mixed: qkv, gate_up and down of other types in some layers (stacked: the wide form), o Q5_0
                # (Q8_0's)
                assert (*p.qx_kinds, p.head_qx_kind) == {
                    "gguf": (K["Q4_1"],) * 4 + (K["Q8_0"],), "bf16": (K["BF16"],) * 5, "f16": (K["F16"],) * 5,
                    "mixed": (K["I8"], K["Q8_0"], K["I8"], K["I8"], K["Q8_0"]),
                    "iq4": (K["Q4_1"], K["Q4_1"], K["IQ4"], K["IQ4"], K["Q8_0"])}[model]
                assert all(getattr(p, f"{g}_qx") is not None for g in ("qkv", "o", "gate_up", "down", "head"))
            res[backend] = [llm.generate(ps, sp, use_tqdm=False) for ps, sp in runs]
        finally:
            llm.llm_engine.core.shutdown()
    for a, b in zip(res["jax"], res["torch"]):
        assert_same_outputs(a, b)
