"""torch backend vs transformers (fp32, CPU): greedy tokens, logprobs and prompt logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from enginecore import LLM, SamplingParams  # noqa: E402

NEW_TOKENS = 32
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time there was a little robot who",
    # long enough to be split in chunks by a 64-token budget on its own
    "Here is a list of the planets of the solar system, with one fact about each of them, written for "
    "children who are learning astronomy at school for the first time and who want to remember them: "
    "Mercury is the closest to the Sun, Venus is the hottest, Earth is our home, Mars is red, Jupiter is "
    "the largest, Saturn has rings, Uranus rolls on its side, and Neptune",
]


def hf_model(model_dir: str):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_logprobs(model, ids: list[int]) -> np.ndarray:
    """log_softmax of transformers' logits at every position of `ids`: [len(ids), V]."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1).numpy()


def check_greedy(model, prompt: list[int], got: list[int], what: str) -> None:
    """`got` is transformers' greedy continuation: each token is its argmax given the tokens before it.

    (One teacher-forced forward instead of a token-by-token generate: the same check, much cheaper.)
    """
    lp = hf_logprobs(model, prompt + got[:-1])[len(prompt) - 1 :]
    want = lp.argmax(-1)
    bad = np.nonzero(want != np.array(got))[0]
    if len(bad):
        j = int(bad[0])
        top = np.argsort(-lp[j])[:3]
        raise AssertionError(
            f"{what}: first divergence from transformers at generated token {j}: got {got[j]} "
            f"(hf logprob {lp[j, got[j]]:.5f}), transformers' top-3 {[(int(t), round(float(lp[j, t]), 5)) for t in top]}"
        )


def torch_llm(model_dir: str, **kw) -> LLM:
    args = dict(backend="torch", platform="cpu", max_model_len=256, max_num_seqs=8,
                max_num_batched_tokens=64, kv_cache_memory_bytes=16 << 20)
    args.update(kw)
    return LLM(model_dir, **args)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return [smollm2_tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_hf_dir):
    return hf_model(smollm2_hf_dir)


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_hf_dir):
    return torch_llm(smollm2_hf_dir)


def test_smollm2_greedy_matches_transformers(smollm2_llm, smollm2_hf, prompts):
    assert len(prompts[-1]) > 64, "the long prompt must be prefilled in several chunks"
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = smollm2_llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for i, (o, p) in enumerate(zip(outs, prompts)):
        assert len(o.outputs[0].token_ids) == NEW_TOKENS
        check_greedy(smollm2_hf, p, o.outputs[0].token_ids, f"prompt {i}")


def test_smollm2_logprobs_match_transformers(smollm2_llm, smollm2_hf, prompts):
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3, prompt_logprobs=2)
    outs = smollm2_llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    for o, p in zip(outs, prompts):
        lp = hf_logprobs(smollm2_hf, p)
        tok = o.outputs[0].token_ids[0]
        assert tok == int(lp[-1].argmax())
        # the sampled token with its rank, and the top 3
        step = o.outputs[0].logprobs[0]
        assert step[tok].rank == 1
        np.testing.assert_allclose(step[tok].logprob, lp[-1, tok], atol=2e-4)
        assert set(step) == {int(t) for t in np.argsort(-lp[-1], kind="stable")[:3]}
        # prompt logprobs: none for the first token, then each prompt token given its prefix
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p)
        for j in range(1, len(p)):
            entry = o.prompt_logprobs[j]
            np.testing.assert_allclose(entry[p[j]].logprob, lp[j - 1, p[j]], atol=2e-4)
            assert entry[p[j]].rank == int((lp[j - 1] > lp[j - 1, p[j]]).sum()) + 1
            assert len(entry) in (2, 3)  # the prompt token and the top 2 (it may be one of them)


@pytest.mark.parametrize("arch,kernels", [("llama", "avx2"), ("mistral", "avx2"), ("qwen2", "avx2"), ("qwen3", "avx2"),
                                          ("qwen2", "torch"), ("qwen3", "torch")])
def test_tiny_arch_greedy_matches_transformers(arch, kernels, tiny_model_dir, prompts, monkeypatch):
    """With the AVX2 CPU kernels where they run (the default), and with torch's ops only."""
    if kernels == "torch":
        from cpu_kernels import torch_ops

        monkeypatch.setattr(torch_ops, "lib", lambda: None)
    d = tiny_model_dir(arch)
    llm = torch_llm(d, max_num_batched_tokens=32, block_size=8)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    model = hf_model(d)
    for i, (o, p) in enumerate(zip(outs, prompts)):
        check_greedy(model, p, o.outputs[0].token_ids, f"{arch} prompt {i}")


def test_bfloat16_checkpoint_weights_load_exactly():
    """safetensors bf16 arrays arrive as ml_dtypes.bfloat16; they must become the same torch bf16 values."""
    import ml_dtypes

    from torchengine.model import to_tensor

    x = np.array([1.0, -2.5, 3.140625, 1e-3, 65280.0], np.float32)
    t = to_tensor(x.astype(ml_dtypes.bfloat16))
    assert t.dtype == torch.bfloat16
    assert torch.equal(t, torch.from_numpy(x).to(torch.bfloat16))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # an untied LM head, a tied one (the embedding in the panels)
def test_lm_head_in_panels(arch, tiny_model_dir):
    """On a CPU with the kernels the LM head is packed in panels at load: the embedding and the logits are
    transformers', and greedy_tokens is the argmax of compute_logits at every row count (one arithmetic)."""
    from cpu_kernels import torch_ops
    from torchengine.cpu_transform import CpuLMHead, apply_cpu_kernels

    if torch_ops.lib() is None:
        pytest.skip("the AVX2 kernels do not run here")
    d = tiny_model_dir(arch)
    model = torch_llm(d).llm_engine.core.runner.model
    hf = hf_model(d)
    assert type(model.lm_head) is CpuLMHead and model.lm_head.panels is not None  # the [V, H] matrix freed
    ids = torch.tensor([0, 5, 49151, 1234, 16, 15])
    assert torch.equal(model.embed(ids), hf.model.embed_tokens.weight[ids])
    h = torch.randn(70, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = model.compute_logits(h)
        want = hf.lm_head(hf.model.norm(h))
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        for n in (1, 2, 6, 7, 64, 70):
            assert torch.equal(model.greedy_tokens(h[:n]), logits[:n].argmax(-1)), n
            assert torch.equal(model.compute_logits(h[:n]), logits[:n]), n
        assert model.compute_logits(h[:0]).shape == (0, 49152) and model.greedy_tokens(h[:0]) is None
    assert apply_cpu_kernels(model).packed == 0  # packed once
    # every linear and the head in one buffer (on huge pages where the OS gives them)
    storages = {m.panels.untyped_storage().data_ptr() for m in model.modules() if getattr(m, "panels", None) is not None}
    assert storages == {model.lm_head.panels.untyped_storage().data_ptr()}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_decode_layers_in_one_call_are_bit_identical(arch, tiny_model_dir, prompts, one_call_vs_python_layers):
    """Decode steps run every layer in one C call (cpu_layers.DecodeLayers) where the model is on the float32
    kernels' path: the same tokens and the same logprobs, to the bit, as the Python layers (a bias on q/k/v:
    qwen2; q/k norms: qwen3), whether the rows are plain greedy, want logprobs or draw with a penalty."""
    from cpu_kernels import torch_ops

    if torch_ops.lib() is None:
        pytest.skip("the AVX2 kernels do not run here")
    llm = torch_llm(tiny_model_dir(arch), max_num_batched_tokens=32, block_size=8)
    if arch == "qwen2":  # the checkpoint's biases are zeros: give them values (in place, both paths read them)
        with torch.inference_mode():
            for i, layer in enumerate(llm.llm_engine.core.runner.model.layers):
                b = layer.attn.qkv_proj.bias
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(i)))
    reqs = [{"prompt_token_ids": p} for p in prompts]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    ran = one_call_vs_python_layers(llm, reqs, sp)
    assert ran
    # plain greedy (the LM head's argmax without logits), and seeded draws with a penalty (the sampler's tensors)
    for sp in (SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
               SamplingParams(temperature=0.9, seed=3, presence_penalty=0.5, max_tokens=12, ignore_eos=True)):
        assert one_call_vs_python_layers(llm, reqs, sp) == ran
    if ran:  # a position past the RoPE tables is refused, not read
        runner = llm.llm_engine.core.runner
        layers = runner._decode_layers()
        x = torch.zeros(1, 64)
        slots = torch.zeros(1, dtype=torch.int64)
        kv, bt = np.ones(1, np.int32), np.ones((1, 4), np.int32)
        with pytest.raises(ValueError):
            layers(x, torch.tensor([runner.model.rope_cos.shape[0]]), slots, kv, bt)


def test_steps_with_prompt_tokens_run_the_layers_in_one_call_too(tiny_model_dir, one_call_vs_python_layers,
                                                                  monkeypatch):
    """Prefill steps, and steps where prompt chunks sit beside decodes, run every layer in one C call as well
    (`DecodeLayers.step`: the attention's decode and prefill groups, the last layer's o linear and MLP on the sampled
    rows alone): the Python layers' tokens and logprobs to the bit. A step with prompt logprobs keeps the Python
    layers; groups that do not hold each of the step's tokens once are refused, not read past."""
    from cpu_kernels import torch_ops
    from torchengine.cpu_layers import DecodeLayers

    if torch_ops.lib() is None:
        pytest.skip("the AVX2 kernels do not run here")
    llm = torch_llm(tiny_model_dir("llama"), max_num_batched_tokens=16, block_size=8)
    seen, real = [], DecodeLayers.step

    def spy(self, x, positions, slots, decode, prefill, keep):
        seen.append((0 if decode is None else len(decode.tokens), 0 if prefill is None else len(prefill.q_lens),
                     x.shape[0], None if keep is None else len(keep)))
        return real(self, x, positions, slots, decode, prefill, keep)

    monkeypatch.setattr(DecodeLayers, "step", spy)
    reqs = [{"prompt_token_ids": list(range(100 + 7 * i, 100 + 7 * i + n))} for i, n in enumerate((5, 23, 41, 9))]
    for sp in (SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2),
               SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)):
        assert one_call_vs_python_layers(llm, reqs, sp)
    assert any(d > 0 and p > 0 for d, p, _, _ in seen)  # decodes beside prompt chunks
    assert all(k is not None and k == d + p and k < t for d, p, t, k in seen)  # the sampled rows alone
    seen.clear()
    llm.generate(reqs[:2], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    assert seen == []
    from torchengine.attention import DecodeGroup, PrefillGroup

    layers = llm.llm_engine.core.runner._decode_layers()
    x, pos, slots = torch.zeros(3, 64), torch.arange(3), torch.arange(3)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    table = torch.zeros((1, 1), dtype=torch.int32)
    with pytest.raises(ValueError):  # tokens 1 and 2 in no group
        real(layers, x, pos, slots, DecodeGroup(torch.tensor([0]), i32(1), table), None, None)
    with pytest.raises(ValueError):  # a kept row past the tokens
        real(layers, x, pos, slots, None, PrefillGroup(i32(0), i32(3), i32(3), table), np.array([3]))


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_a_16bit_kv_cache_runs_on_the_kernels(kv_dtype, tiny_model_dir, prompts, one_call_vs_python_layers):
    """--kv-cache-dtype float16 / bfloat16 with float32 weights stays on the CPU kernels, which write and read
    the 16-bit cache themselves: the one-call decode layers give the Python layers' bits, the cache holds twice
    a float32 cache's blocks in the same memory, and the outputs are the float32 cache's within its rounding."""
    from cpu_kernels import torch_ops

    if torch_ops.lib() is None:
        pytest.skip("the AVX2 kernels do not run here")
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    kw = dict(max_num_batched_tokens=32, block_size=8, kv_cache_memory_bytes=1 << 18)  # memory bounds the blocks
    ref = torch_llm(tiny_model_dir("llama"), **kw)
    want = ref.generate(reqs, sp, use_tqdm=False)
    blocks32 = ref.llm_engine.core.runner.kv_caches[0][0].shape[0]
    del ref
    llm = torch_llm(tiny_model_dir("llama"), kv_cache_dtype=kv_dtype, **kw)
    runner = llm.llm_engine.core.runner
    assert runner.kv_caches[0][0].dtype == getattr(torch, kv_dtype) and runner.attn_backend.lib is not None
    assert runner.kv_caches[0][0].shape[0] == 2 * blocks32  # the same bytes
    assert one_call_vs_python_layers(llm, reqs, sp)
    got = llm.generate(reqs, sp, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            if list(x) != list(y):
                break  # a near-tie flipped: the continuations differ from here
            for t in x:
                assert abs(x[t].logprob - y[t].logprob) < 0.05, (t, x[t].logprob, y[t].logprob)


def test_linear_packed_in_panels():
    """A packed Linear (every float32 linear on a CPU with the kernels): its matrix unpacks exactly, its
    outputs are the float64 product's (+ bias) at any row count, rows the same alone as together; no rows."""
    from cpu_kernels import torch_ops
    from torchengine.cpu_transform import CpuLinear
    from torchengine.model import Linear

    if torch_ops.lib() is None:
        pytest.skip("the AVX2 kernels do not run here")
    g = torch.Generator().manual_seed(0)
    dense = Linear(70, 37, bias=True).requires_grad_(False)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(37, 70, generator=g))
        dense.bias.copy_(torch.randn(37, generator=g))
    w = dense.weight.clone()
    lin = CpuLinear.pack(dense, torch_ops.lib())
    assert lin.panels is not None and not hasattr(lin, "weight")
    assert torch.equal(lin.matrix(), w)
    x = torch.randn(13, 70, generator=g)
    with torch.inference_mode():
        y = lin(x)
        torch.testing.assert_close(y, (x.double() @ w.double().t() + lin.bias.double()).float(), rtol=1e-5, atol=1e-4)
        assert torch.equal(torch.cat([lin(x[i : i + 1]) for i in range(13)]), y)
        assert lin(x[:0]).shape == (0, 37)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # an untied head, a tied one, q/k norms
def test_cpu_transform_swaps_in_the_kernels_modules(arch, tiny_model_dir, caplog, monkeypatch):
    """`apply_cpu_kernels` swaps every linear, the hidden-size norms, RoPE, the MLP activation and the LM head (a
    tied embedding too) for the kernels' modules, which give the plain torch model's hidden states and logits up
    to float32 rounding; q/k norms stay torch's, and say so in the log; without the kernels nothing is swapped."""
    import logging

    from cpu_kernels import torch_ops
    from enginecore.model_loader import resolve_model
    from torchengine import cpu_transform as ct
    from torchengine.model import Linear, apply_rope, build_model, load_weights, silu_and_mul

    if torch_ops.lib() is None:
        pytest.skip("the AVX2 kernels do not run here")
    src = resolve_model(tiny_model_dir(arch))

    def model():
        m = build_model(src.config, 64, torch.device("cpu"), torch.float32)
        load_weights(m, src.iter_weights())
        return m

    plain, cpu = model(), model()
    with caplog.at_level(logging.INFO, logger="xlaserve.torchengine"):
        got = ct.apply_cpu_kernels(cpu)
    assert got.packed == 4 * len(cpu.layers) + 1 and got.arena is not None
    types = {type(m) for m in cpu.modules()}
    assert Linear not in types and ct.CpuLinear in types and type(cpu.lm_head) is ct.CpuLMHead
    assert (type(cpu.embed) is ct.PanelEmbedding) == src.config.tie_word_embeddings
    assert all(type(n) is ct.CpuRMSNorm for ly in cpu.layers for n in (ly.attn_norm, ly.mlp_norm))
    assert type(cpu.final_norm) is ct.CpuRMSNorm
    assert all(isinstance(ly.attn.rope_fn, ct.CpuRope) and isinstance(ly.mlp.act_fn, ct.CpuSiluAndMul)
               for ly in cpu.layers)
    qk_norms = [ly.attn.q_norm for ly in cpu.layers if ly.attn.q_norm is not None]
    # Qwen3's per-head q/k norms: the C norm on rows of head_dim, as the one-call layers normalise them
    assert all(type(n) is ct.CpuRMSNorm for n in qk_norms) and len(qk_norms) == (2 if arch == "qwen3" else 0)
    assert all(type(ly.attn.k_norm) is ct.CpuRMSNorm for ly in cpu.layers if ly.attn.k_norm is not None)
    ids, pos = torch.tensor([5, 900, 17, 49151, 3]), torch.arange(5)
    attn = lambda i, q, k, v: q  # noqa: E731 (no cache: the layers' own arithmetic)
    with torch.inference_mode():
        want, h = plain(ids, pos, attn), cpu(ids, pos, attn)
        torch.testing.assert_close(h, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cpu.compute_logits(h), plain.compute_logits(h), rtol=1e-4, atol=1e-5)
        assert torch.equal(cpu.greedy_tokens(h), cpu.compute_logits(h).argmax(-1))
        assert plain.greedy_tokens(h) is None
    monkeypatch.setattr(torch_ops, "load", lambda: (None, "XLASERVE_CPU_KERNELS=off"))
    off = model()
    assert ct.apply_cpu_kernels(off).packed == 0
    assert {type(m) for m in off.modules()} == {type(m) for m in plain.modules()}
    assert all(ly.attn.rope_fn is apply_rope and ly.mlp.act_fn is silu_and_mul for ly in off.layers)
