"""The torch runner's CUDA path, exercised on CPU: Triton attention in the interpreter and CUDA-graph buffers.

On a GPU, `tests/test_torch_gpu.py` runs the real thing. Without one, the
runner can still drive the same Triton kernels through triton's interpreter
(`--attention-backend triton` is allowed on CPU when TRITON_INTERPRET=1), and
the decode graphs' bookkeeping (static buffers sized for the largest bucket,
padded requests with no queries, block tables wider than the batch, logits
gathered inside the graph) runs with an eager stand-in for the capture: the
"graph" re-runs the captured forward on its static buffers at replay. Only
the recording itself and the Triton compiler are left to the GPU tests.
"""

from __future__ import annotations

import pytest
import torch

import triton_kernels as tk

from enginecore import LLM, SamplingParams  # noqa: E402
from torchengine.cuda_graph import CUDAGraphs  # noqa: E402

pytestmark = pytest.mark.skipif(not tk.interpreted(), reason="needs triton in interpreter mode (no GPU)")

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=77, max_tokens=6, ignore_eos=True)
# lengths that cross block boundaries (block 16) and, with a 32-token budget, get chunked
PROMPTS = [[100 + (7 * i + j) % 900 for j in range(n)] for i, n in enumerate((3, 17, 40, 9, 1))]


class EagerGraphs(CUDAGraphs):
    """CUDAGraphs with the capture replaced by re-running the forward on the static buffers."""

    replays = 0

    def _new_pool(self):
        return None

    def _synchronize(self) -> None:
        pass

    def _capture_one(self, forward, pool):
        owner = self
        out = forward()

        class Replay:
            def replay(self):
                owner.replays += 1
                out.copy_(forward())

        return Replay(), out


def llm_for(model_dir: str, **kw) -> LLM:
    args = dict(backend="torch", platform="cpu", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
                kv_cache_memory_bytes=1 << 20, enable_prefix_caching=False)
    args.update(kw)
    return LLM(model_dir, **args)


def run(llm: LLM, params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny_llama(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def torch_attention(tiny_llama):
    llm = llm_for(tiny_llama, attention_backend="torch")
    return {"greedy": run(llm, GREEDY), "seeded": run(llm, SEEDED)}


@pytest.fixture(scope="module")
def triton_llm(tiny_llama):
    llm = llm_for(tiny_llama, attention_backend="triton")
    assert llm.llm_engine.core.warmup_stats["attention_backend"] == "triton"
    return llm


def test_triton_attention_in_the_runner_matches_torch_attention(triton_llm, torch_attention):
    """Mixed chunked-prefill + decode steps through the Triton kernels give the torch attention's tokens."""
    assert run(triton_llm, GREEDY) == torch_attention["greedy"]
    assert run(triton_llm, SEEDED) == torch_attention["seeded"]


def test_decode_graph_buffers_match_eager(triton_llm, torch_attention):
    runner = triton_llm.llm_engine.core.runner
    shapes = runner.buckets.decode_shapes([1, 2, 3, 5, 8])
    assert shapes == [(8, 8), (4, 4), (2, 2), (1, 1)]  # CPU buckets start at 1: each decode size has its own
    graphs = EagerGraphs(runner.model, runner.attn_backend, runner.kv_caches, runner.input_batch.max_blocks_per_req,
                         shapes, runner.device)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    assert graphs.capture() == 4
    # the dummy steps of the capture write no cache slot
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(runner.kv_caches, before))
    runner.cuda_graphs = graphs
    try:
        assert run(triton_llm, GREEDY) == torch_attention["greedy"]
        assert run(triton_llm, SEEDED) == torch_attention["seeded"]
    finally:
        runner.cuda_graphs = None
    # 5 requests x 6 tokens: every step after the prefills is a pure decode that replays
    assert graphs.replays >= 2 * 4


def test_capture_sizes_are_validated(triton_llm):
    buckets = triton_llm.llm_engine.core.runner.buckets
    with pytest.raises(ValueError, match="capture sizes"):
        buckets.decode_shapes([0, 4])
    with pytest.raises(ValueError, match="capture sizes"):
        buckets.decode_shapes([9])
    assert buckets.decode_shapes() == [(8, 8), (4, 4), (2, 2), (1, 1)]


def test_triton_on_cpu_without_the_interpreter_is_a_config_error():
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from enginecore.config import ConfigError\n"
        "from torchengine.attention import make_attention_backend\n"
        "try:\n"
        "    make_attention_backend('triton', torch.device('cpu'), num_heads=4, num_kv_heads=2, head_dim=16,\n"
        "                           sliding_window=None)\n"
        "except ConfigError as e:\n"
        "    print('ConfigError:', e)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert "ConfigError: --attention-backend triton needs --platform cuda" in out.stdout, out.stderr
