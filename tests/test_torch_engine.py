"""The torch runner inside the engine: chunked, prefix-cached and preempted runs equal plain ones."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from enginecore import LLM, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234, max_tokens=24, ignore_eos=True)


def make_prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(100, 20000, 48).tolist()  # three full 16-token blocks shared by the first four
    out = [shared + rng.integers(100, 20000, n).tolist() for n in (5, 17, 30, 41)]
    out += [rng.integers(100, 20000, n).tolist() for n in (3, 70)]
    return out


PROMPTS = make_prompts()


def llm_for(model_dir: str, **kw) -> LLM:
    args = dict(backend="torch", platform="cpu", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=1024,
                kv_cache_memory_bytes=4 << 20, enable_prefix_caching=False)
    args.update(kw)
    return LLM(model_dir, **args)


def tokens(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def plain(tiny_llama):
    llm = llm_for(tiny_llama)
    return {"greedy": tokens(llm, GREEDY), "seeded": tokens(llm, SEEDED)}


def test_kv_blocks_from_memory_budget(tiny_llama, monkeypatch):
    llm = llm_for(tiny_llama, kv_cache_memory_bytes=1 << 20)
    core = llm.llm_engine.core
    per_block = core.runner.kv_bytes_per_block()
    assert per_block == 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, block 16, 2 KV heads, head dim 16, f32
    assert core.num_blocks == (1 << 20) // per_block
    assert core.runner.kv_caches[0][0].shape == (core.num_blocks, 16, 2, 16)
    assert core.warmup_stats["attention_backend"] == "torch"
    # a fresh CPU cache (an anonymous mapping, not torch.zeros): zero, the cache dtype, one block of memory with
    # every layer's K and V apart, 16-bit too
    for dtype in (torch.float32, torch.bfloat16):
        core.runner.kv_dtype = dtype
        core.runner._allocate_kv_cache(5)
        caches = core.runner.kv_caches
        assert len(caches) == 2 and all(c.dtype == dtype and c.shape == (5, 16, 2, 16) for kv in caches for c in kv)
        assert all(not c.any() for kv in caches for c in kv)
        ptrs = sorted(c.data_ptr() for kv in caches for c in kv)
        assert all(b - a == 5 * 16 * 2 * 16 * caches[0][0].element_size() for a, b in zip(ptrs, ptrs[1:]))
        caches[1][1][4, 15] = 1.0
        assert not caches[1][0].any() and not caches[0][1].any() and caches[1][1].sum() == 2 * 16
    # one that the host's available memory cannot hold fails at start, saying which flag to lower
    from enginecore import kv_cache
    from enginecore.config import ConfigError

    need = 7 * core.runner.kv_bytes_per_block()  # bfloat16 now
    assert need == 2 * 2 * 7 * 16 * 2 * 16 * 2
    assert kv_cache.available_memory_bytes() > 0
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda: need - 1)
    with pytest.raises(ConfigError, match="--kv-cache-memory-bytes"):
        core.runner._allocate_kv_cache(7)
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda: need)
    core.runner._allocate_kv_cache(7)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_chunked_prefill_equals_plain(tiny_llama, plain, kind):
    llm = llm_for(tiny_llama, max_num_batched_tokens=16)
    assert tokens(llm, GREEDY if kind == "greedy" else SEEDED) == plain[kind]


def test_prefix_cache_hits_equal_plain(tiny_llama, plain):
    llm = llm_for(tiny_llama, enable_prefix_caching=True)
    assert tokens(llm, GREEDY) == plain["greedy"]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain["greedy"]
    assert all(o.num_cached_tokens >= 48 for o in outs[:4]), [o.num_cached_tokens for o in outs]


def test_preempted_run_equals_plain(tiny_llama, plain):
    # 6 requests of up to 118 tokens need ~40 blocks of 16 together; 12 force preemption by recompute
    llm = llm_for(tiny_llama, num_gpu_blocks_override=12, enable_prefix_caching=True)
    assert tokens(llm, GREEDY) == plain["greedy"]
    assert llm.llm_engine.core.scheduler.num_preemptions > 0
    assert tokens(llm, SEEDED) == plain["seeded"]


def test_short_max_model_len(tiny_llama, plain):
    """max_model_len 64 = 4 blocks: fewer columns than the smallest block-table bucket (8)."""
    llm = llm_for(tiny_llama, max_model_len=64)
    short = [p for p in PROMPTS if len(p) + 24 <= 64]
    want = [t for p, t in zip(PROMPTS, plain["greedy"]) if len(p) + 24 <= 64]
    assert short and tokens(llm, GREEDY, short) == want


def test_seeded_request_alone_equals_batched(tiny_llama, plain):
    llm = llm_for(tiny_llama, max_num_seqs=1, max_num_batched_tokens=32)
    assert tokens(llm, SEEDED, PROMPTS[4:5]) == plain["seeded"][4:5]


def test_logprobs_agree_across_batch_shapes(tiny_llama, monkeypatch):
    """Decode-batch logprobs equal, bit for bit, those of the same request prefilled in small chunks.

    The second run also computes prompt logprobs 5 positions at a time (PROMPT_LOGPROBS_ROWS).
    """
    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    a = llm_for(tiny_llama).generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    monkeypatch.setattr("torchengine.runner.PROMPT_LOGPROBS_ROWS", 5)
    b = llm_for(tiny_llama, max_num_batched_tokens=16).generate([{"prompt_token_ids": p} for p in PROMPTS], sp,
                                                                  use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for s, t in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert s.keys() == t.keys()
            np.testing.assert_array_equal([v.logprob for v in s.values()], [v.logprob for v in t.values()])
        for s, t in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert s.keys() == t.keys()
            np.testing.assert_array_equal([v.logprob for v in s.values()], [v.logprob for v in t.values()])


def test_decoded_logprobs_equal_prompt_logprobs(tiny_llama):
    """A token's logprob has the same bits whether the engine decoded it (alone in its step, one row of
    logits) or scored it as part of a prompt (prefill attention, many rows): on a CPU the torch backend's kernels
    and the sampler's row sums compute a row the same way whatever else is in the step."""
    llm = llm_for(tiny_llama)
    prompt = PROMPTS[5][:40]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12, logprobs=0,
                                                                      ignore_eos=True), use_tqdm=False)[0].outputs[0]
    toks = list(out.token_ids)
    rescored = llm.generate([{"prompt_token_ids": prompt + toks}],
                            SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    decoded = [d[t].logprob for d, t in zip(out.logprobs, toks)]
    as_prompt = [d[t].logprob for d, t in zip(rescored.prompt_logprobs[len(prompt):], toks)]
    assert decoded == as_prompt


def test_the_sampled_rows_alone_through_the_last_layer_give_every_rows_bits(tiny_llama, monkeypatch):
    """A prefill step runs the last layer's o linear and MLP on the rows it samples from alone (the CPU panels
    give a row the same bits whatever the row count); asking for prompt logprobs computes every row. The same
    tokens and logprob bits either way, through chunked prefill and mixed steps. (The Python layers here; the
    one-call layers' steps give their bits: test_torch_model.py.)"""
    from torchengine.model import Transformer
    from torchengine.runner import TorchModelRunner

    monkeypatch.setattr(TorchModelRunner, "_decode_layers", lambda self: None)
    kept = []
    forward = Transformer.forward

    def spy(self, input_ids, positions, attn, keep=None):
        out = forward(self, input_ids, positions, attn, keep)
        kept.append(None if keep is None else (len(keep), len(input_ids), out.shape[0]))
        return out

    monkeypatch.setattr(Transformer, "forward", spy)
    llm = llm_for(tiny_llama, max_num_batched_tokens=64)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    pruned = llm.generate(prompts, sp, use_tqdm=False)
    assert any(k is not None and k[0] < k[1] and k[2] == k[0] for k in kept), kept
    kept.clear()
    every = llm.generate(prompts, dataclasses.replace(sp, prompt_logprobs=0), use_tqdm=False)
    assert kept and all(k is None for k in kept), kept
    for x, y in zip(pruned, every):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for s, t in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert s.keys() == t.keys()
            np.testing.assert_array_equal([v.logprob for v in s.values()], [v.logprob for v in t.values()])


def test_log_softmax_row_alone_equals_in_batch():
    """torch splits a lone row's sum between threads (another order than a row among several);
    sampler.row_sums does not."""
    from torchengine.sampler import log_softmax

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(5, 49152, generator=torch.Generator().manual_seed(0)) * 4
        e = torch.exp(x)
        assert any(not torch.equal(e[i : i + 1].sum(-1), e[i : i + 2].sum(-1)[:1]) for i in range(4))  # the pitfall
        batch = log_softmax(x)
        for i in range(5):
            assert torch.equal(log_softmax(x[i : i + 1])[0], batch[i])
    finally:
        torch.set_num_threads(threads)


def test_request_bucket_larger_than_max_num_seqs(tiny_llama):
    """GPU-style buckets (8 requests at least) with --max-num-seqs 4: warm-up and serving pad to the bucket
    instead of asking the input batch for rows it does not have (a GPU warm-up crash, issue 13)."""
    llm = llm_for(tiny_llama, max_num_seqs=4, min_seq_bucket=8, min_token_bucket=16, warmup="all")
    batch = llm.llm_engine.core.runner._dummy_batch(8, 1)
    assert batch.num_reqs == 4 and batch.padded_num_reqs == 8 and batch.padded_num_tokens == 16
    assert tokens(llm, GREEDY, PROMPTS[:5]) == tokens(llm_for(tiny_llama), GREEDY, PROMPTS[:5])
