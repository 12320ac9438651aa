"""The fused-MoE Triton kernel against its pure-torch reference: in the interpreter on CPU tensors
(TRITON_INTERPRET=1), compiled on a GPU (`gpu` marker), and compiled ahead of time for sm_90 without one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton_kernels imports triton

import triton_kernels as tk  # noqa: E402
from tests.test_triton_kernels import DEVICES, ROOT, compile_for_hopper, needs_gpu_kernels  # noqa: E402

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def make_moe(T, E, K, H, I, dtype, device, *, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    w13 = torch.randn(E, 2 * I, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, I, generator=gen) / I**0.5
    probs = torch.softmax(torch.randn(T, E, generator=gen), -1)
    weights, ids = torch.topk(probs, K, dim=-1)
    out = dict(x=x, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids)
    if bias:
        out.update(w13_bias=torch.randn(E, 2 * I, generator=gen), w2_bias=torch.randn(E, H, generator=gen))
    return {k: (v.to(dtype) if v.is_floating_point() else v).to(device) for k, v in out.items()}


def _check(args, dtype, **kw):
    got = tk.fused_moe(**args, **kw)
    ref = tk.ref_fused_moe(**{k: v.cpu() for k, v in args.items()}, expert_map=kw.get("expert_map"))
    assert got.dtype == args["x"].dtype and got.shape == ref.shape
    torch.testing.assert_close(got.float().cpu(), ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# name: (T, E, K, H, I, block_m)
CASES = {
    "decode": (1, 8, 2, 32, 48, None),
    "few": (5, 4, 4, 40, 24, None),  # every expert of every token; H, I not multiples of the tiles
    "batch": (37, 16, 3, 64, 64, 16),
    "prefill_blocks": (70, 4, 2, 48, 80, 64),  # 64-row blocks, several per expert
    "one_expert": (9, 1, 1, 32, 32, None),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,dtype", [(c, torch.float32) for c in CASES] + [("batch", torch.float16)])
def test_fused_moe_matches_reference(device, case, dtype):
    T, E, K, H, I, block_m = CASES[case]
    _check(make_moe(T, E, K, H, I, dtype, device), dtype, block_m=block_m)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_moe_biases(device):
    _check(make_moe(11, 4, 2, 32, 32, torch.float32, device, bias=True), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_moe_expert_parallel_shares_sum_to_the_whole(device):
    """Rank r of 2 holds experts 4r..4r+3: its result leaves the others' out; the two sum to the whole."""
    args = make_moe(13, 8, 3, 32, 32, torch.float32, device)
    whole = tk.fused_moe(**args)
    parts = []
    for r in range(2):
        emap = torch.full((8,), -1, dtype=torch.int64)
        emap[4 * r : 4 * r + 4] = torch.arange(4)
        local = dict(args, w13=args["w13"][4 * r : 4 * r + 4], w2=args["w2"][4 * r : 4 * r + 4])
        emap = emap.to(device)
        _check(local, torch.float32, expert_map=emap)
        parts.append(tk.fused_moe(**local, expert_map=emap))
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)


def test_align_block_size_groups_pairs_by_expert():
    from triton_kernels.fused_moe import moe_align_block_size

    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 1]])  # pairs 0..7; expert 1 once, 2 three times
    emap = torch.tensor([0, 1, 2, -1])  # expert 3 on another rank
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, 4, 3, emap)
    assert sorted_ids.shape == (8 + 3 * 3 + 3,) and expert_ids.shape == (sorted_ids.shape[0] // 4,)
    assert int(num_post) == 12  # three experts' groups, one block each
    assert sorted_ids[:12].tolist() == [1, 4, 8, 8, 7, 8, 8, 8, 0, 2, 5, 8]  # 8: padding
    assert expert_ids.tolist() == [0, 1, 2, -1, -1]


def test_fused_moe_rejects_bad_arguments():
    args = make_moe(3, 4, 2, 32, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match="do not agree"):
        tk.fused_moe(**dict(args, w2=args["w2"][:, :, :16]))
    if tk.HAS_TRITON:
        with pytest.raises(ValueError, match="block_m=24"):
            tk.fused_moe(**args, block_m=24)
        with pytest.raises(ValueError, match="activation 'gelu'"):
            tk.fused_moe(**args, activation="gelu")


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@needs_gpu_kernels
@pytest.mark.parametrize("T", [1, 7, 64, 513])
def test_fused_moe_bf16_serving_shapes_cuda(T):
    """Qwen3-30B-A3B-like experts (128 of I=768, top 8, H=2048) in bfloat16."""
    _check(make_moe(T, 128, 8, 2048, 768, torch.bfloat16, "cuda", seed=T), torch.bfloat16)


@pytest.mark.gpu
@needs_gpu_kernels
def test_fused_moe_replays_in_a_cuda_graph():
    """No host syncs: captured once, replayed with other routings written into the same buffers."""
    args = make_moe(16, 8, 2, 256, 128, torch.bfloat16, "cuda")
    out = tk.fused_moe(**args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tk.fused_moe(**args)
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        probs = torch.softmax(torch.randn(16, 8, generator=gen), -1)
        w, ids = torch.topk(probs, 2, dim=-1)
        args["topk_weights"].copy_(w.to(torch.bfloat16))
        args["topk_ids"].copy_(ids)
        args["x"].copy_(torch.randn(16, 256, generator=gen).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        ref = tk.ref_fused_moe(**{k: v.cpu() for k, v in args.items()})
        torch.testing.assert_close(out.float().cpu(), ref, atol=3e-2, rtol=3e-2)


_COMPILE_FOR_HOPPER = """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton_kernels.fused_moe import _fused_moe_kernel

    for dt, gated, bias, block_m in [("bf16", True, False, 16), ("bf16", False, False, 64), ("fp16", True, True, 64),
                                     ("fp32", True, False, 16), ("fp32", False, True, 16)]:
        constants = dict(TOP_K=8 if gated else 1, GATED=gated, ACTIVATION=0, HAS_BIAS=bias,
                         MUL_ROUTED_WEIGHT=not gated, DOT_PRECISION="ieee" if dt == "fp32" else "tf32",
                         BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64)
        pointers = dict(a_ptr=f"*{dt}", w_ptr=f"*{dt}", bias_ptr=f"*{dt}", topk_weights_ptr=f"*{dt}",
                        out_ptr="*fp32" if not gated else f"*{dt}", sorted_ids_ptr="*i32", expert_ids_ptr="*i32",
                        num_post_padded_ptr="*i32")
        signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in _fused_moe_kernel.arg_names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(_fused_moe_kernel.arg_names)
                 if n.endswith("_ptr") or n.startswith("stride")}
        src = ASTSource(_fused_moe_kernel, signature, constexprs=constants, attrs=attrs)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    print("compiled")
"""


@pytest.mark.skipif(not tk.HAS_TRITON, reason="triton is not installed")
def test_fused_moe_compiles_for_hopper_without_a_gpu(tmp_path):
    """The interpreter runs the kernel as numpy code; the real compiler's rules (types, tl.dot shapes) are
    checked here."""
    compile_for_hopper(_COMPILE_FOR_HOPPER, tmp_path)


# ---------------------------------------------------------------- inside the model


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory):
    from tests.moe_models import save_tiny_moe

    return save_tiny_moe("qwen2_moe", str(tmp_path_factory.mktemp("tiny_qwen2_moe")))


@pytest.mark.parametrize("device", DEVICES)
def test_model_block_runs_the_kernel_as_the_cpu_path(device, qwen2_moe_dir, monkeypatch):
    """A loaded SparseMoeBlock (router, stacked experts, shared expert) with the kernel in place of the CPU
    path (on CUDA the model's own choice): the same output."""
    import torchengine.model as tm
    from enginecore.model_loader import resolve_model

    src = resolve_model(qwen2_moe_dir)
    model = tm.build_model(src.config, 64, torch.device("cpu"), torch.float32)
    tm.load_weights(model, src.iter_weights())
    block = model.layers[1].mlp
    x = torch.randn(21, src.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = block(x)
        if device == "cpu":
            monkeypatch.setattr(tm, "fused_moe", tk.fused_moe)
        got = block.to(device)(x.to(device)).cpu()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@needs_gpu_kernels
def test_moe_engine_on_cuda_matches_cpu(qwen2_moe_dir):
    """The engine on CUDA (float32, CUDA graphs for decode) gives the CPU engine's greedy tokens."""
    from enginecore import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [100 + (7 * i + j) % 900 for j in range(n)]} for i, n in enumerate((3, 17, 40))]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw = dict(backend="torch", dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)
    cpu = LLM(qwen2_moe_dir, platform="cpu", kv_cache_memory_bytes=1 << 20, **kw)
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, sp, use_tqdm=False)]
    cuda = LLM(qwen2_moe_dir, platform="cuda", gpu_memory_utilization=0.3, **kw)
    assert cuda.llm_engine.core.warmup_stats.get("cuda_graphs")
    assert [o.outputs[0].token_ids for o in cuda.generate(prompts, sp, use_tqdm=False)] == want
