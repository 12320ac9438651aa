"""The torch backend's CUDA path: Triton attention, CUDA graphs, the profiled KV cache (skipped without a GPU)."""

from __future__ import annotations

import gc

import pytest
import torch

from enginecore import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,", "Hello, my name is"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=3, max_tokens=24, ignore_eos=True)


def cuda_llm(model_dir: str, **kw) -> LLM:
    args = dict(backend="torch", platform="cuda", dtype="float32", max_model_len=512, max_num_seqs=32,
                max_num_batched_tokens=256, gpu_memory_utilization=0.3)
    args.update(kw)
    return LLM(model_dir, **args)


def run(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(TEXTS, params, use_tqdm=False)]


@pytest.fixture(autouse=True)
def release_gpu_memory():
    """Engines of earlier tests must not count against the next one's memory profile."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def eager(smollm2_hf_dir):
    llm = cuda_llm(smollm2_hf_dir, enforce_eager=True)
    out = {"greedy": run(llm, GREEDY), "seeded": run(llm, SEEDED)}
    assert llm.llm_engine.core.runner.cuda_graphs is None
    llm.llm_engine.core.shutdown()
    return out


def test_cuda_graphs_match_eager(smollm2_hf_dir, eager):
    llm = cuda_llm(smollm2_hf_dir, compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16]})
    graphs = llm.llm_engine.core.runner.cuda_graphs
    assert graphs is not None and set(graphs.graphs) == {(16, 8), (16, 16)}
    assert llm.llm_engine.core.warmup_stats["cuda_graphs"] == 2
    assert run(llm, GREEDY) == eager["greedy"]
    assert run(llm, SEEDED) == eager["seeded"]
    llm.llm_engine.core.shutdown()


def test_triton_attention_matches_torch_attention(smollm2_hf_dir, eager):
    llm = cuda_llm(smollm2_hf_dir, attention_backend="torch")  # host-planned attention: runs eagerly
    assert llm.llm_engine.core.runner.cuda_graphs is None
    assert run(llm, GREEDY) == eager["greedy"]
    llm.llm_engine.core.shutdown()


def test_cuda_greedy_matches_transformers(smollm2_hf_dir, smollm2_tokenizer, eager):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).cuda().eval()
    for text, got in zip(TEXTS, eager["greedy"]):
        ids = smollm2_tokenizer.encode(text)
        with torch.inference_mode():
            logits = model(torch.tensor([ids + got[:-1]], device="cuda")).logits[0, len(ids) - 1 :]
        assert logits.argmax(-1).tolist() == got


def test_bf16_default_and_profiled_kv_cache(smollm2_hf_dir):
    llm = cuda_llm(smollm2_hf_dir, dtype="auto", gpu_memory_utilization=0.5)
    runner = llm.llm_engine.core.runner
    assert runner.dtype == torch.bfloat16 and runner.kv_caches[0][0].dtype == torch.bfloat16
    free, total = torch.cuda.mem_get_info()
    assert torch.cuda.memory_reserved() < 0.5 * total + (1 << 30)  # the budget was honoured (plus graphs)
    outs = llm.generate(TEXTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    llm.llm_engine.core.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_nccl_matches_tp1(tiny_model_dir):
    d = tiny_model_dir("llama")  # 2 KV heads: one per rank
    tp1 = cuda_llm(d)
    want = run(tp1, GREEDY)
    tp1.llm_engine.core.shutdown()
    llm = cuda_llm(d, tensor_parallel_size=2)  # NCCL all-reduces captured in the CUDA graphs
    try:
        assert run(llm, GREEDY) == want
    finally:
        llm.llm_engine.core.shutdown()
