"""Mixture-of-Experts in the torch backend: tiny random Mixtral, Qwen2-MoE and Qwen3-MoE (a dense layer among the
sparse ones) against transformers in float32; loading, the CPU path's pieces, tensor and expert parallelism."""

from __future__ import annotations


import numpy as np
import pytest
import torch
import torch.distributed as dist

from enginecore import LLM, SamplingParams  # noqa: E402
from enginecore.arch import ModelLoadError
from tests.moe_models import MOE_ARCHS
from tests.test_torch_model import check_greedy, hf_model, torch_llm

NEW_TOKENS = 32


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [rng.integers(100, 40000, n).tolist() for n in (4, 11, 27, 75)]  # the last one: several chunks


PROMPTS = _prompts()
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_dir(tiny_moe_dir):
    return tiny_moe_dir


def _tokens(llm: LLM, prompts=PROMPTS, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _load(model_dir: str, transform=None):
    from enginecore.model_loader import resolve_model
    from torchengine.model import build_model, load_weights

    src = resolve_model(model_dir)
    model = build_model(src.config, 256, torch.device("cpu"), torch.float32, transform=transform)
    load_weights(model, src.iter_weights())
    return model, src


# ---------------------------------------------------------------- the engine against transformers


@pytest.mark.parametrize("arch,kernels", [(a, "avx2") for a in MOE_ARCHS] + [("qwen2_moe", "torch")])
def test_moe_greedy_matches_transformers(arch, kernels, moe_dir, monkeypatch):
    """32 greedy tokens of 4 prompts (one prefilled in 3 chunks), with the CPU kernels where they run (the
    attention, router and shared expert on them) and with torch's ops only."""
    if kernels == "torch":
        from cpu_kernels import torch_ops

        monkeypatch.setattr(torch_ops, "lib", lambda: None)
    d = moe_dir(arch)
    llm = torch_llm(d, max_num_batched_tokens=32, block_size=8)
    assert llm.llm_engine.core.runner._decode_layers() is None  # the one-call C layers refuse a MoE model
    model = hf_model(d)
    for i, (p, got) in enumerate(zip(PROMPTS, _tokens(llm))):
        assert len(got) == NEW_TOKENS
        check_greedy(model, p, got, f"{arch} prompt {i}")


def test_moe_preempted_run_equals_plain(moe_dir):
    """A KV cache too small for the batch: requests are preempted and recomputed, the tokens unchanged."""
    d = moe_dir("qwen3_moe")
    kw = dict(max_num_batched_tokens=64, block_size=8, enable_prefix_caching=False)
    plain = _tokens(torch_llm(d, **kw))
    llm = torch_llm(d, num_gpu_blocks_override=16, **kw)  # 4 requests need ~30 blocks of 8 together
    assert _tokens(llm) == plain
    assert llm.llm_engine.core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_moe_sampled_rows_alone_give_every_rows_bits(arch, moe_dir, monkeypatch):
    """With the experts in panels (`CpuExperts`: a row's bits whatever rows share its experts) a prefill runs the
    last layer's o linear and MoE on its sampled rows alone; asking for prompt logprobs computes every row: the
    same tokens and logprob bits either way, through chunked prefill and mixed steps."""
    import dataclasses

    from cpu_kernels import torch_ops
    from torchengine.model import Transformer

    if torch_ops.lib() is None:
        pytest.skip("the AVX2 kernels do not run here")
    kept = []
    forward = Transformer.forward

    def spy(self, input_ids, positions, attn, keep=None):
        out = forward(self, input_ids, positions, attn, keep)
        kept.append(None if keep is None else (len(keep), len(input_ids)))
        return out

    monkeypatch.setattr(Transformer, "forward", spy)
    llm = torch_llm(moe_dir(arch), max_num_batched_tokens=32, block_size=8)
    assert llm.llm_engine.core.runner.sampled_rows_alone
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True)
    pruned = llm.generate(prompts, sp, use_tqdm=False)
    assert any(k is not None and k[0] < k[1] for k in kept), kept
    kept.clear()
    every = llm.generate(prompts, dataclasses.replace(sp, prompt_logprobs=0), use_tqdm=False)
    assert kept and all(k is None for k in kept), kept
    for x, y in zip(pruned, every):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for a, b in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert a.keys() == b.keys()
            np.testing.assert_array_equal([v.logprob for v in a.values()], [v.logprob for v in b.values()])


# ---------------------------------------------------------------- loading


def test_cpu_kernels_swap_the_dense_parts_of_a_moe_model(moe_dir):
    from cpu_kernels import torch_ops
    from torchengine.cpu_layers import DecodeLayers
    from torchengine.cpu_transform import CpuExperts, CpuLinear, CpuRMSNorm, CpuSiluAndMul, apply_cpu_kernels
    from torchengine.model import SparseMoeBlock

    if torch_ops.lib() is None:
        pytest.skip("the AVX2 kernels do not run here")
    model, _ = _load(moe_dir("qwen2_moe"))
    w13, w2 = model.layers[0].mlp.w13.clone(), model.layers[0].mlp.w2.clone()
    assert apply_cpu_kernels(model).packed > 0
    for ly in model.layers:
        block = ly.mlp
        assert isinstance(block, SparseMoeBlock) and isinstance(ly.mlp_norm, CpuRMSNorm)
        assert type(ly.attn.qkv_proj) is CpuLinear and type(block.router) is CpuLinear
        assert type(block.shared_expert.gate_up_proj) is CpuLinear and type(block.shared_expert_gate) is CpuLinear
        assert isinstance(block.shared_expert.act_fn, CpuSiluAndMul)
    experts = model.layers[0].mlp.experts  # each expert's pair in panels, the stacks freed
    assert isinstance(experts, CpuExperts) and len(experts) == len(w13) and model.layers[0].mlp.w13 is None
    for e in range(len(w13)):
        assert all(torch.equal(a, b) for a, b in zip(experts.matrices(e), (w13[e], w2[e])))
    assert DecodeLayers.bind(model, None, []) is None


def _stacked(weights):
    """HF's per-expert tensors as stacked [E, out, in] ones (GGUF's and transformers 5's form, after the loader
    splits gate_up_proj), the rest unchanged."""
    import re

    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, arr in weights:
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight", name)
        if m is None:
            yield name, arr
        else:
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = arr
    for (layer, kind), per in experts.items():
        yield f"model.layers.{layer}.mlp.experts.{kind}", np.stack([per[e] for e in sorted(per)])


def test_stacked_expert_tensors_load_as_the_per_expert_ones(moe_dir):
    from torchengine.model import build_model, load_weights

    model, src = _load(moe_dir("qwen3_moe"))
    stacked = build_model(src.config, 256, torch.device("cpu"), torch.float32)
    load_weights(stacked, _stacked(src.iter_weights()))
    want = dict(model.named_parameters())
    for name, p in stacked.named_parameters():
        assert torch.equal(p, want[name]), name
    assert not hasattr(model.layers[1].mlp, "w13")  # the dense layer (mlp_only_layers)
    # gate rows, then up rows, of each expert
    hf = {n: a for n, a in src.iter_weights() if ".experts.5." in n and n.startswith("model.layers.2.")}
    w13 = model.layers[2].mlp.w13[5]
    assert torch.equal(w13[:32], torch.tensor(hf["model.layers.2.mlp.experts.5.gate_proj.weight"]))
    assert torch.equal(w13[32:], torch.tensor(hf["model.layers.2.mlp.experts.5.up_proj.weight"]))


@pytest.mark.parametrize("arch,dropped", [("mixtral", "model.layers.1.block_sparse_moe.experts.3.w3.weight"),
                                          ("qwen2_moe", "model.layers.0.mlp.experts.6.down_proj.weight")])
def test_a_missing_expert_tensor_is_named(arch, dropped, moe_dir):
    from enginecore.model_loader import resolve_model
    from torchengine.model import build_model, load_weights

    src = resolve_model(moe_dir(arch))
    model = build_model(src.config, 256, torch.device("cpu"), torch.float32)
    with pytest.raises(ModelLoadError, match=dropped.replace(".", r"\.")):
        load_weights(model, ((n, a) for n, a in src.iter_weights() if n != dropped))


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tp_shards_of_the_experts(moe_dir, expert_parallel):
    """Sharded on the meta device, rank 1 of 2 loads its share only: each expert's I halves (gate rows and up
    rows each), or experts 4-7 whole; the router and the rest as plain TP's."""
    from torchengine.tensor_parallel import apply_tensor_parallel

    d = moe_dir("qwen2_moe")
    full, _ = _load(d)
    shard = lambda m: apply_tensor_parallel(m, 1, 2, None, enable_expert_parallel=expert_parallel)  # noqa: E731
    mine, _ = _load(d, transform=shard)
    f, m = full.layers[1].mlp, mine.layers[1].mlp
    if expert_parallel:
        assert torch.equal(m.w13, f.w13[4:]) and torch.equal(m.w2, f.w2[4:])
        assert m.expert_map.tolist() == [-1, -1, -1, -1, 0, 1, 2, 3]
    else:
        assert torch.equal(m.w13, torch.cat([f.w13[:, 16:32], f.w13[:, 48:]], dim=1))
        assert torch.equal(m.w2, f.w2[:, :, 16:]) and m.expert_map is None
    assert torch.equal(m.router.weight, f.router.weight)
    assert torch.equal(m.shared_expert.down_proj.weight, f.shared_expert.down_proj.weight[:, 24:])
    assert not m.shared_expert.down_proj._forward_hooks and len(m._forward_hooks) == 1  # one all-reduce


def test_tp_refuses_sizes_it_cannot_split(moe_dir):
    import dataclasses

    from enginecore.model_loader import resolve_model
    from torchengine.model import build_model
    from torchengine.tensor_parallel import apply_tensor_parallel

    arch = resolve_model(moe_dir("mixtral")).config
    odd = dataclasses.replace(arch, moe=dataclasses.replace(arch.moe, num_experts=7, intermediate_size=33))
    for ep, what in ((True, r"expert count \(7\)"), (False, r"moe_intermediate_size\) \(33\).*--enable-expert")):
        with pytest.raises(ValueError, match=what):
            build_model(odd, 64, torch.device("cpu"), torch.float32,
                        transform=lambda m: apply_tensor_parallel(m, 0, 2, None, enable_expert_parallel=ep))


# ---------------------------------------------------------------- the CPU expert compute


def _naive_moe(x, w13, w2, weights, ids, w13_bias=None, w2_bias=None):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = w13[e] @ x[t] + (0 if w13_bias is None else w13_bias[e])
            g, u = h.chunk(2)
            y = w2[e] @ (torch.nn.functional.silu(g) * u) + (0 if w2_bias is None else w2_bias[e])
            out[t] += weights[t, k] * y
    return out


@pytest.mark.parametrize("T,E,K", [(1, 8, 2), (7, 4, 4), (33, 16, 3)])
def test_sorted_fused_moe_matches_naive(T, E, K):
    from torchengine.moe import fused_moe, select_experts

    g = torch.Generator().manual_seed(T)
    H, I = 24, 40
    x = torch.randn(T, H, generator=g)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    weights, ids = select_experts(torch.randn(T, E, generator=g), K, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(T))
    want = _naive_moe(x, w13, w2, weights, ids, b13, b2)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2), want,
                               rtol=1e-4, atol=1e-4)
    # expert parallelism over 2 ranks: each one's local experts, summed, give the whole
    half = E // 2
    parts = []
    for r in range(2):
        emap = torch.full((E,), -1, dtype=torch.int64)
        emap[r * half : (r + 1) * half] = torch.arange(half)
        sl = slice(r * half, (r + 1) * half)
        parts.append(fused_moe(x, w13[sl], w2[sl], weights, ids, expert_map=emap, w13_bias=b13[sl], w2_bias=b2[sl]))
    torch.testing.assert_close(parts[0] + parts[1], want, rtol=1e-4, atol=1e-4)


def test_fused_moe_rejects_bad_shapes():
    from torchengine.moe import fused_moe

    x, w13, w2 = torch.zeros(3, 8), torch.zeros(4, 10, 8), torch.zeros(4, 8, 5)
    ids, w = torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="do not agree"):
        fused_moe(x, w13, w2[:, :, :4], w, ids)
    with pytest.raises(ValueError, match=r"\[T=3, K\]"):
        fused_moe(x, w13, w2, w[:2], ids[:2])
    with pytest.raises(ValueError, match="activation 'gelu'"):
        fused_moe(x, w13, w2, w, ids, activation="gelu")


# ---------------------------------------------------------------- tensor and expert parallelism, 2 processes

TP_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe")
TP_STEPS = 8


def _tp_rank_main(rank: int, world_size: int, init_method: str, model_dirs: list[str], out_path: str) -> None:
    from tests.test_torch_tp import greedy_logits, run_ranks
    from torchengine.tensor_parallel import apply_tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    results = {}
    for d in model_dirs:
        for ep in (False, True):
            model = apply_tensor_parallel(_load(d)[0], rank, world_size, enable_expert_parallel=ep)
            results[d, ep] = greedy_logits(model, PROMPTS[2], TP_STEPS)
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_tp2_with_and_without_expert_parallel_matches_tp1(moe_dir, tmp_path):
    from tests.test_torch_tp import greedy_logits, run_ranks

    dirs = [moe_dir(a) for a in TP_ARCHS]
    want = {d: greedy_logits(_load(d)[0], PROMPTS[2], TP_STEPS) for d in dirs}
    got = run_ranks(_tp_rank_main, 2, dirs, tmp_path, timeout=300)
    for d, arch in zip(dirs, TP_ARCHS):
        lw, tw = want[d]
        for ep in (False, True):
            lg, tg = got[d, ep]
            assert tg == tw, f"{arch} (expert parallel {ep}): TP=2 tokens {tg} != TP=1 tokens {tw}"
            torch.testing.assert_close(lg, lw, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
def test_tp2_engine_with_expert_parallel_matches_tp1(moe_dir):
    """LLM(tensor_parallel_size=2, enable_expert_parallel=True): the runner shards on the meta device, each rank
    loading its 4 experts of 8."""
    d = moe_dir("qwen2_moe")
    kw = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, kv_cache_memory_bytes=1 << 20)
    want = _tokens(torch_llm(d, **kw), PROMPTS[:3])
    tp2 = torch_llm(d, tensor_parallel_size=2, enable_expert_parallel=True, **kw)
    try:
        block = tp2.llm_engine.core.runner.model.layers[0].mlp
        assert len(block.experts) == 4 and block.expert_map.tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
        got = _tokens(tp2, PROMPTS[:3])
    finally:
        tp2.llm_engine.core.shutdown()
    assert got == want
