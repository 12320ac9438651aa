"""Asynchronous scheduling (step N+1 launched before step N is applied) gives exactly the outputs of
synchronous scheduling, on both backends: greedy, seeded, n > 1, logprobs, penalties and bad words (which
make a step wait for the previous one's tokens), stop tokens and min_tokens (a stop discovered one step
late), and preemption while a step is in flight."""

from __future__ import annotations

import pytest

from enginecore import LLM, SamplingParams

PROMPTS = [[100 + (13 * i + 7 * j) % 2000 for j in range(n)] for i, n in enumerate((3, 17, 40, 9, 25, 5, 33, 12))]


def params_mix(stop_tok: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=30, seed=5, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=10, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.7, seed=11, presence_penalty=0.5, frequency_penalty=0.3,
                       repetition_penalty=1.2, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_tok], ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=6, stop_token_ids=[stop_tok], ignore_eos=True),
        SamplingParams(temperature=0.9, seed=3, max_tokens=12, bad_words=["the"], logit_bias={stop_tok: 2.0}),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=1),
    ]


def run(llm: LLM, params) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    res = []
    for o in outs:
        for c in o.outputs:
            lps = None if c.logprobs is None else [[(t, round(v.logprob, 4)) for t, v in d.items()] for d in c.logprobs]
            res.append((c.token_ids, c.text, c.finish_reason, c.stop_reason, lps))
    return res


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_async_equals_sync(tiny, backend):
    kw = dict(backend=backend, platform="cpu", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
              enable_prefix_caching=True, seed=0)
    sync = LLM(tiny, async_scheduling=False, **kw)
    first = sync.generate([{"prompt_token_ids": PROMPTS[4]}], SamplingParams(temperature=0.0, max_tokens=3),
                          use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = first[2]  # the greedy request on prompt 4 stops at its third token
    params = params_mix(stop_tok)
    want = run(sync, params)
    assert any(r[2] == "stop" for r in want), "the stop-token requests must stop early"
    got = run(LLM(tiny, async_scheduling=True, **kw), params)
    assert got == want
    # preemption by recompute while a step is in flight (12 blocks of 16 for ~8 x 50 tokens). A recomputed
    # request runs in steps of other sizes, whose matmuls may round the last bit differently (on a CPU the
    # LM head and linears of 2-32 rows run weights first, jaxengine.model.dense): same tokens, same texts,
    # logprobs equal to 1e-3.
    tight = LLM(tiny, async_scheduling=True, num_gpu_blocks_override=12, **{**kw, "enable_prefix_caching": False})
    got = run(tight, params)
    assert [r[:4] for r in got] == [r[:4] for r in want]
    for g, w in zip(got, want):
        assert (g[4] is None) == (w[4] is None)
        for gd, wd in zip(g[4] or [], w[4] or []):
            assert [t for t, _ in gd] == [t for t, _ in wd]
            assert [v for _, v in gd] == pytest.approx([v for _, v in wd], abs=1e-3)
    assert tight.llm_engine.core.scheduler.num_preemptions > 0
