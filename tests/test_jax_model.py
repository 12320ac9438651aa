"""The JAX backend end to end (CPU, fp32): greedy tokens equal `transformers`, and scheduling never changes them.

- SmolLM2 (the embedded model as an HF folder): 8 prompts x 32 tokens in one
  `LLM.generate`, chunked prefill forced small, against `transformers`
  `generate(do_sample=False)`.
- The tiny random model of each architecture against `transformers`.
- Prefix-cached, preempted-and-resumed, chunked and unchunked runs of the
  tiny llama give the tokens of a plain run; seeded sampling is reproducible
  alone and in a mixed batch of 16.
"""

from __future__ import annotations

import numpy as np
import pytest

from enginecore import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "Water boils at a temperature of",
    "The three primary colors are",
    # long enough to be chunked by max_num_batched_tokens=64
    "Here is a long story about a robot who learned to paint. " * 6,
    "Q: What is the largest planet in the solar system?\nA:",
]
SMOL_TOKENS = 32


def hf_greedy(model_dir: str, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers generate(do_sample=False), fp32, one padded batch; tokens after the first EOS dropped."""
    import torch
    import transformers as tf

    torch.set_num_threads(1)  # 2 OpenMP threads on a shared 2-core box spin-wait: 6x slower
    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    n = max(len(p) for p in prompt_ids)
    ids = torch.tensor([[0] * (n - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompt_ids])
    gc = tf.GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0,
                             eos_token_id=sorted(eos) or None)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, generation_config=gc)[:, n:].tolist()
    res = []
    for row in out:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        res.append(row[:cut])
    return res


def jax_llm(model_dir, **kw) -> LLM:
    args = dict(backend="jax", platform="cpu", dtype="float32", max_model_len=512, max_num_seqs=8,
                max_num_batched_tokens=64, seed=0)
    args.update(kw)
    return LLM(model_dir, **args)


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def smol(smollm2_hf_dir):
    llm = jax_llm(smollm2_hf_dir)
    yield llm
    llm.llm_engine.core.shutdown()


def test_smollm2_greedy_matches_transformers_chunked(smol, smollm2_hf_dir):
    tok = smol.get_tokenizer()
    ids = [tok.encode(p) for p in PROMPTS]
    assert max(map(len, ids)) > 64, "one prompt must be longer than the token budget (chunked prefill)"
    outs = smol.generate([{"prompt_token_ids": p} for p in ids],
                         SamplingParams(temperature=0.0, max_tokens=SMOL_TOKENS), use_tqdm=False)
    ref = hf_greedy(smollm2_hf_dir, ids, SMOL_TOKENS)
    got = token_ids(outs)
    bad = [(i, got[i], ref[i]) for i in range(len(ids)) if got[i] != ref[i]]
    assert not bad, f"jax vs transformers differ: {bad}"
    # prefix caching: the long prompt again (plus two short ones) hits the cache, same tokens
    again_ids = [ids[6], ids[0], ids[7]]
    before = smol.llm_engine.core.get_stats().prefix_cache_hits
    again = smol.generate([{"prompt_token_ids": p} for p in again_ids],
                          SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert smol.llm_engine.core.get_stats().prefix_cache_hits > before
    assert token_ids(again) == [got[6][:8], got[0][:8], got[7][:8]]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_tiny_archs_greedy_match_transformers(arch, tiny_model_dir):
    d = tiny_model_dir(arch)
    prompts = [[1, 450, 4996, 17354, 1701], [1, 306, 763, 304], [1, 29871, 13, 1576, 278, 3303, 338]]
    llm = jax_llm(d, max_num_batched_tokens=32, enable_prefix_caching=False)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    finally:
        llm.llm_engine.core.shutdown()
    assert token_ids(outs) == hf_greedy(d, prompts, 12)


def perturbed(model_dir: str, to, **config) -> str:
    """A copy of a tiny model with its 1-D weights (norms, q/k/v biases: the fixture leaves them at 1 and 0)
    made random, and `config` (None: unchanged) in its config.json."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    d = shutil.copytree(model_dir, to)
    rng = np.random.default_rng(0)
    for f in d.glob("*.safetensors"):
        t = load_file(f)
        save_file({k: (v + rng.normal(0, 0.2, v.shape)).astype(v.dtype) if v.ndim == 1 else v
                   for k, v in t.items()}, f, metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **{k: v for k, v in config.items() if v is not None}}))
    return str(d)


@pytest.mark.parametrize("arch,kv", [("llama", "auto"), ("llama", "bfloat16"), ("mistral", "auto"),
                                     ("qwen2", "float16"), ("qwen3", "auto")])
def test_layers_in_one_call_give_the_bits_of_a_call_per_kernel(arch, kv, tiny_model_dir, tmp_path):
    """On a CPU every decoder layer of a step runs in one custom call (`cpu_kernels.layers`, the default); with
    compilation_config={"cpu_layers": False} the scan over layers makes a custom call per kernel. Same kernels,
    same order: the same tokens and logprob bits through chunked prefill, mixed steps and padded buckets, for
    q/k/v biases (qwen2), q/k norms (qwen3), a sliding window (mistral: 24 tokens) and 16-bit caches; the
    norms and biases random (`perturbed`)."""
    from cpu_kernels import jax_ops

    if jax_ops.available():
        pytest.skip(jax_ops.available())
    d = perturbed(tiny_model_dir(arch), tmp_path / arch, sliding_window=24 if arch == "mistral" else None)
    prompts = [[1] + [(29 * i + 7 * j) % 900 + 50 for j in range(n)] for i, n in enumerate([45, 6, 19, 70, 2])]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
    res = {}
    for on in (True, False):
        llm = jax_llm(d, max_num_batched_tokens=32, enable_prefix_caching=False, kv_cache_dtype=kv,
                      compilation_config={"cpu_layers": on})
        try:
            runner = llm.llm_engine.core.runner
            assert runner.cpu_layers == on
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            hlo = [p.as_text() for k, p in runner.programs.items() if k.kind == "model"]
            assert hlo and all((jax_ops.LAYERS in t) == on for t in hlo)
        finally:
            llm.llm_engine.core.shutdown()
        res[on] = [(o.outputs[0].token_ids, [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
                   for o in outs]
    assert res[True] == res[False]


def test_a_feature_the_cpu_kernels_lack_runs_on_xlas_ops(tiny_model_dir, monkeypatch):
    """A model with a feature the CPU kernels do not implement (`cpu_wing.uncovered`: an ArchConfig field outside
    `COVERED_FIELDS` off its default, or a head_dim past the kernels' limit) runs on XLA's ops, logged once: here
    Qwen3's q/k norms with the kernels told they lack them. Its greedy tokens are transformers'."""
    import dataclasses
    import logging

    from cpu_kernels import jax_ops
    from enginecore.arch import ArchConfig
    from jaxengine import cpu_wing
    from jaxengine.model import ModelKernels

    @dataclasses.dataclass(frozen=True)
    class WithSoftCap(ArchConfig):
        attn_logit_softcapping: float | None = None  # a feature the kernels were not written for

    base = dict(architecture="LlamaForCausalLM", model_type="llama", vocab_size=64, hidden_size=32,
                intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    assert cpu_wing.uncovered(WithSoftCap(**base)) == []
    assert cpu_wing.uncovered(WithSoftCap(**base, attn_logit_softcapping=30.0)) == ["attn_logit_softcapping=30.0"]
    assert cpu_wing.uncovered(ArchConfig(**{**base, "head_dim": 2048}))[0].startswith("head_dim 2048")
    if jax_ops.available():
        pytest.skip(jax_ops.available())
    monkeypatch.setattr(cpu_wing, "COVERED_FIELDS", cpu_wing.COVERED_FIELDS - {"qk_norm"})
    d = tiny_model_dir("qwen3")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("xlaserve.jax")
    level = log.level
    log.setLevel(logging.INFO)
    log.addHandler(handler)
    prompts = [[1, 450, 4996, 17354, 1701], [1, 306, 763, 304]]
    try:
        llm = jax_llm(d, max_num_batched_tokens=32, enable_prefix_caching=False)
        try:
            runner = llm.llm_engine.core.runner
            assert not runner.cpu_linears and not runner.cpu_layers and runner.params.panels is None
            assert runner.kernels.layers is None and runner.kernels.norm is ModelKernels().norm
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
            hlo = [p.as_text() for k, p in runner.programs.items() if k.kind == "model"]
            assert hlo and not any(jax_ops.PANEL_LINEAR in t or jax_ops.LAYERS in t for t in hlo)
        finally:
            llm.llm_engine.core.shutdown()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    said = [r.getMessage() for r in records if "do not implement" in r.getMessage()]
    assert len(said) == 1 and "qk_norm=True" in said[0], said
    assert token_ids(outs) == hf_greedy(d, prompts, 8)


# -- scheduling invariance on the tiny llama ----------------------------------------------------

SCHED_PROMPTS = [[1] + [(37 * i + 11 * j) % 3000 + 100 for j in range(n)] for i, n in enumerate([40, 7, 75, 23, 55, 3])]
SCHED_PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def plain_engine(tiny_llama):
    llm = jax_llm(tiny_llama, max_num_seqs=16, max_num_batched_tokens=256, enable_prefix_caching=False)
    yield llm
    llm.llm_engine.core.shutdown()


@pytest.fixture(scope="module")
def plain_tokens(plain_engine):
    outs = plain_engine.generate([{"prompt_token_ids": p} for p in SCHED_PROMPTS], SCHED_PARAMS, use_tqdm=False)
    return token_ids(outs)


def test_unchunked_requests_one_by_one_match_batched(plain_engine, plain_tokens):
    for p, want in zip(SCHED_PROMPTS[:3], plain_tokens[:3]):
        assert token_ids(plain_engine.generate([{"prompt_token_ids": p}], SCHED_PARAMS, use_tqdm=False)) == [want]


def test_chunked_prefix_cached_and_preempted_runs_match_plain(tiny_llama, plain_tokens):
    # tiny token budget (every prompt chunked), prefix caching on, and a KV cache so small that
    # requests get preempted and resumed by recompute
    llm = jax_llm(tiny_llama, max_num_seqs=8, max_num_batched_tokens=16, num_gpu_blocks_override=14,
                  enable_prefix_caching=True)
    try:
        prompts = [{"prompt_token_ids": p} for p in SCHED_PROMPTS]
        first = token_ids(llm.generate(prompts, SCHED_PARAMS, use_tqdm=False))
        stats = llm.llm_engine.core.get_stats()
        assert stats.num_preemptions > 0, "the cache was meant to be too small to hold every request"
        second = token_ids(llm.generate(prompts, SCHED_PARAMS, use_tqdm=False))
        assert llm.llm_engine.core.get_stats().prefix_cache_hits > 0
    finally:
        llm.llm_engine.core.shutdown()
    assert first == plain_tokens
    assert second == plain_tokens


def test_cpu_custom_calls_give_the_tokens_of_xlas_ops(tiny_llama, plain_engine, plain_tokens):
    """On a CPU the decoder's linears and norms, the LM head (for greedy rows its argmax alone) and attention are
    cpu_kernels.jax_ops' custom calls (float32, one device; the linears on weights packed at load, the tied
    embedding looked up in the LM head's panels); with compilation_config={"cpu_linears": False, "cpu_decode_attention": False} XLA's ops
    run: same greedy tokens, logprobs within float32."""
    from cpu_kernels import jax_ops

    if jax_ops.available():
        pytest.skip(jax_ops.available())
    runner = plain_engine.llm_engine.core.runner
    assert runner.cpu_linears and runner.cpu_decode_attention
    p = runner.params
    assert p.panels is not None and p.layers.q_proj is None and p.lm_head is None
    assert (p.embed is None) == runner.arch.tie_word_embeddings
    hlo = {k: p.as_text() for k, p in runner.programs.items()}
    assert any(k.kind == "model" for k in hlo) and any(k.kind == "sample" for k in hlo)
    for k, t in hlo.items():
        if k.kind == "model":  # every layer in one call (test_layers_in_one_call_give_the_bits_of_a_call_per_kernel)
            assert jax_ops.LAYERS in t, k
        elif k.mode == "greedy":  # the LM head's argmax without logits
            assert jax_ops.PANEL_ARGMAX in t and jax_ops.PANEL_LINEAR not in t and jax_ops.RMS_NORM in t, k
        else:
            assert jax_ops.PANEL_LINEAR in t and jax_ops.RMS_NORM in t, k
    llm = jax_llm(tiny_llama, max_num_seqs=16, max_num_batched_tokens=256, enable_prefix_caching=False,
                  compilation_config={"cpu_linears": False, "cpu_decode_attention": False})
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in SCHED_PROMPTS]
    try:
        off = llm.llm_engine.core.runner
        assert not off.cpu_linears and not off.cpu_decode_attention and off.params.panels is None
        dots = llm.generate(prompts, SCHED_PARAMS, use_tqdm=False)
        assert not any("xlaserve_cpu" in p.as_text() for p in off.programs.values())
        dots_lp = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.core.shutdown()
    assert token_ids(dots) == plain_tokens
    calls_lp = plain_engine.generate(prompts, params, use_tqdm=False)
    for a, b in zip(calls_lp, dots_lp):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la = [next(iter(d.values())).logprob for d in a.outputs[0].logprobs]
        lb = [next(iter(d.values())).logprob for d in b.outputs[0].logprobs]
        np.testing.assert_allclose(la, lb, rtol=1e-4, atol=1e-4)


def test_decoded_logprobs_equal_prompt_logprobs(plain_engine):
    """A token's logprob has the same bits whether it was decoded (one row in its step) or scored as part of a
    prompt (56 rows of prefill): with the CPU custom calls a row's linears, norms and attention do not depend
    on the step's other rows (XLA's own RMSNorm does, below 8 rows)."""
    from cpu_kernels import jax_ops

    if jax_ops.available():
        pytest.skip(jax_ops.available())
    prompt = SCHED_PROMPTS[0][:40]
    out = plain_engine.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0.0, max_tokens=16, logprobs=0, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    toks = list(out.token_ids)
    rescored = plain_engine.generate([{"prompt_token_ids": prompt + toks}], SamplingParams(
        temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    decoded = [d[t].logprob for d, t in zip(out.logprobs, toks)]
    as_prompt = [d[t].logprob for d, t in zip(rescored.prompt_logprobs[len(prompt):], toks)]
    assert decoded == as_prompt


def test_seeded_sampling_same_alone_and_in_mixed_batch(plain_engine):
    prompt = {"prompt_token_ids": SCHED_PROMPTS[0]}
    seeded = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = token_ids(plain_engine.generate([prompt], seeded, use_tqdm=False))[0]
    others = []
    for i in range(15):
        kind = i % 5
        if kind == 0:
            sp = SamplingParams(temperature=0.0, max_tokens=10 + i)
        elif kind == 1:
            sp = SamplingParams(temperature=1.2, min_p=0.05, seed=i, max_tokens=12, logprobs=2)
        elif kind == 2:
            sp = SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, max_tokens=9)
        elif kind == 3:
            sp = SamplingParams(temperature=1.0, top_k=5, logit_bias={100: 5.0}, max_tokens=14)
        else:
            sp = SamplingParams(temperature=0.8, top_p=0.5, frequency_penalty=0.3, max_tokens=11)
        others.append(({"prompt_token_ids": SCHED_PROMPTS[i % len(SCHED_PROMPTS)][: 5 + i]}, sp))
    batch = [p for p, _ in others[:7]] + [prompt] + [p for p, _ in others[7:]]
    params = [s for _, s in others[:7]] + [seeded] + [s for _, s in others[7:]]
    outs = plain_engine.generate(batch, params, use_tqdm=False)
    assert outs[7].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=4321, max_tokens=16, ignore_eos=True)
    assert token_ids(plain_engine.generate([prompt], other_seed, use_tqdm=False))[0] != alone
    lp = outs[1].outputs[0].logprobs  # kind 1 asked for logprobs=2
    assert lp and all(len(d) >= 2 for d in lp)
