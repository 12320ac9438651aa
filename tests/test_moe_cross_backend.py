"""Mixture-of-Experts models give the same tokens on LLM(backend="jax") and LLM(backend="torch") (CPU, fp32):
greedy and seeded sampled requests, the tiny random Mixtral, Qwen2-MoE and Qwen3-MoE of `tests.moe_models`.

The sampled draw is the host's counter-based uniform on both backends, so only float-level differences between
the two models (XLA's dots and the torch path's per-expert matmuls) could move a token; the tiny models' scaled
weights keep logits and routing decided. A mismatch names the request, the first diverging position and both
backends' top logprobs there.
"""

from __future__ import annotations

import pytest

import jaxengine.runner  # noqa: F401 - a broken jax backend fails this file, never skips it
from enginecore import LLM, SamplingParams
from tests.moe_models import MOE_ARCHS

pytestmark = pytest.mark.slow

PROMPTS = [[1, 450, 4996, 17354, 1701], [1, 306, 763, 304, 29871], [1] + [(37 * j) % 3000 + 100 for j in range(40)],
           [1, 15043, 29892, 920]]
MAX_TOKENS = 32
PARAMS = {
    "greedy": [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)] * len(PROMPTS),
    "seeded": [SamplingParams(temperature=t, top_p=p, top_k=k, seed=1000 + i, max_tokens=MAX_TOKENS,
                              ignore_eos=True, logprobs=2)
               for i, (t, p, k) in enumerate([(0.7, 0.9, 50), (1.0, 0.95, 0), (0.8, 1.0, 20), (1.0, 1.0, 0)])],
}


@pytest.fixture(scope="module")
def outputs(tiny_moe_dir):
    res = {}
    for arch in MOE_ARCHS:
        for backend in ("jax", "torch"):
            llm = LLM(tiny_moe_dir(arch), backend=backend, platform="cpu", dtype="float32", max_model_len=256,
                      max_num_seqs=8, max_num_batched_tokens=32, kv_cache_memory_bytes=16 << 20, seed=0)
            prompts = [{"prompt_token_ids": p} for p in PROMPTS]
            res[arch, backend] = {kind: llm.generate(prompts, params, use_tqdm=False) for kind, params in PARAMS.items()}
            llm.llm_engine.core.shutdown()
    return res


@pytest.mark.parametrize("kind", list(PARAMS))
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_jax_and_torch_give_identical_moe_tokens(outputs, arch, kind):
    problems = []
    for i, (x, y) in enumerate(zip(outputs[arch, "jax"][kind], outputs[arch, "torch"][kind])):
        a, b = x.outputs[0].token_ids, y.outputs[0].token_ids
        assert len(a) == MAX_TOKENS
        if a != b:
            j = next(j for j, (s, t) in enumerate(zip(a, b)) if s != t)
            top = lambda lps: sorted(((t, round(v.logprob, 5)) for t, v in lps[j].items()), key=lambda x: -x[1])  # noqa: E731
            problems.append(f"request {i}: jax {a} vs torch {b}; first divergence at {j}: jax top logprobs "
                            f"{top(x.outputs[0].logprobs)}, torch {top(y.outputs[0].logprobs)}")
    assert not problems, "\n".join(problems)


def test_moe_logprobs_agree(outputs):
    for arch in MOE_ARCHS:
        for x, y in zip(outputs[arch, "jax"]["greedy"], outputs[arch, "torch"]["greedy"]):
            for s, t in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
                for tok in s.keys() & t.keys():
                    assert s[tok].logprob == pytest.approx(t[tok].logprob, abs=1e-3), (arch, tok)
