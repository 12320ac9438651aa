"""Tensor parallelism on the CPU with gloo: 2 ranks give TP=1's greedy logits and tokens."""

from __future__ import annotations

import multiprocessing
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from enginecore import LLM, SamplingParams  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")]

PROMPT = [101, 2045, 318, 257, 1332, 286, 262, 6946, 1080, 13, 632, 1625, 7, 19, 4, 88, 301, 77, 5, 9]
STEPS = 8
ARCHS = ("llama", "qwen2")  # GQA + llama3 rope; q/k/v biases


def greedy_logits(model, prompt: list[int], steps: int, block_size: int = 8, num_blocks: int = 16):
    """Prefill then decode one request through the paged torch attention: logits [steps, V] and tokens."""
    from torchengine.attention import AttentionMetadata, PagedAttention, TorchAttention

    a = model.layers[0].attn
    backend = TorchAttention(num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                             sliding_window=None)
    shape = (num_blocks, block_size, a.num_kv_heads, a.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.layers]
    table = np.arange(1, num_blocks, dtype=np.int32)[None]
    tokens, done, logits = list(prompt), 0, []
    with torch.inference_mode():
        for _ in range(steps):
            q, kv = len(tokens) - done, len(tokens)
            pos = np.arange(done, kv)
            cu, kv_lens = np.array([0, q], np.int32), np.array([kv], np.int32)
            batch = SimpleNamespace(num_reqs=1, num_tokens=q, cu_q_lens=cu, kv_lens=kv_lens, block_tables=table,
                                    distribution=np.array([int(q == 1), 1, 1], np.int32))
            slots = table[0, pos // block_size].astype(np.int64) * block_size + pos % block_size
            meta = AttentionMetadata(torch.from_numpy(slots), torch.from_numpy(cu), torch.from_numpy(kv_lens),
                                     torch.from_numpy(table), num_reqs=1, num_tokens=q)
            meta.groups = backend.plan(batch, torch.device("cpu"), block_size)
            hidden = model(torch.tensor(tokens[done:]), torch.from_numpy(pos), PagedAttention(backend, caches, meta))
            step = model.compute_logits(hidden[-1:])[0]
            logits.append(step)
            tokens.append(int(step.argmax()))
            done = kv
    return torch.stack(logits), tokens[len(prompt):]


def load(model_dir: str):
    from enginecore.model_loader import resolve_model
    from torchengine.model import build_model, load_weights

    src = resolve_model(model_dir)
    model = build_model(src.config, 256, torch.device("cpu"), torch.float32)
    load_weights(model, src.iter_weights())
    return model


def _rank_main(rank: int, world_size: int, init_method: str, model_dirs: list[str], out_path: str) -> None:
    from torchengine.tensor_parallel import apply_tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    results = {}
    for d in model_dirs:
        model = apply_tensor_parallel(load(d), rank, world_size)
        assert model.layers[0].attn.num_kv_heads == 2 // world_size
        results[d] = greedy_logits(model, PROMPT, STEPS)
    if rank == 0:
        torch.save(results, out_path)
    dist.destroy_process_group()


def run_ranks(target, world_size: int, dirs: list[str], tmp_path, timeout: float):
    """target(rank, world_size, init_method, dirs, out_path) in `world_size` spawned processes (a file rendezvous
    under tmp_path); every one must exit 0; returns what they saved at out_path."""
    ctx = multiprocessing.get_context("spawn")
    out_path, init = str(tmp_path / "tp.pt"), f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=target, args=(r, world_size, init, dirs, out_path)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    assert [p.exitcode for p in procs] == [0] * world_size
    return torch.load(out_path)


def test_tp2_model_transform_matches_tp1(tiny_model_dir, tmp_path):
    dirs = [tiny_model_dir(a) for a in ARCHS]
    want = {d: greedy_logits(load(d), PROMPT, STEPS) for d in dirs}
    got = run_ranks(_rank_main, 2, dirs, tmp_path, timeout=240)
    for d, arch in zip(dirs, ARCHS):
        (lw, tw), (lg, tg) = want[d], got[d]
        assert tg == tw, f"{arch}: TP=2 tokens {tg} != TP=1 tokens {tw}"
        torch.testing.assert_close(lg, lw, rtol=1e-4, atol=1e-4)


def test_tp2_engine_matches_tp1(tiny_model_dir):
    """LLM(tensor_parallel_size=2): rank 0 in this process, rank 1 a worker process, gloo between them."""
    d = tiny_model_dir("qwen2")
    prompts = [{"prompt_token_ids": PROMPT[:n]} for n in (3, 11, 20)]
    kw = dict(backend="torch", platform="cpu", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
              kv_cache_memory_bytes=1 << 20)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # a peaked distribution: over a flat one (a random model at temperature 1) float-level differences between
    # TP=1 and TP=2 logits move the inverse-CDF boundaries enough to flip draws now and then
    seeded = SamplingParams(temperature=0.5, top_k=20, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    tp1 = LLM(d, **kw)
    want = [o.outputs[0].token_ids for o in tp1.generate(prompts, greedy, use_tqdm=False)]
    want += [o.outputs[0].token_ids for o in tp1.generate(prompts, seeded, use_tqdm=False)]
    tp2 = LLM(d, tensor_parallel_size=2, **kw)
    try:
        runner = tp2.llm_engine.core.runner
        assert runner.kv_caches[0][0].shape[2] == 1  # one of the two KV heads per rank
        # the model was sharded before loading: rank 0 holds its share of q/k/v and gate/up, nothing more
        full = tp1.llm_engine.core.runner.model.layers[0]
        mine = runner.model.layers[0]
        q, kv = 4 * 16, 2 * 16
        w = full.attn.qkv_proj.matrix()  # (packed in panels on a CPU with the kernels)
        want_qkv = torch.cat([w[: q // 2], w[q : q + kv // 2], w[q + kv : q + kv + kv // 2]])
        assert torch.equal(mine.attn.qkv_proj.matrix(), want_qkv)
        assert torch.equal(mine.mlp.down_proj.matrix(), full.mlp.down_proj.matrix()[:, :64])
        got = [o.outputs[0].token_ids for o in tp2.generate(prompts, greedy, use_tqdm=False)]
        got += [o.outputs[0].token_ids for o in tp2.generate(prompts, seeded, use_tqdm=False)]
    finally:
        tp2.llm_engine.core.shutdown()
    assert got == want
    assert os.environ.get("MASTER_ADDR") is None  # nothing leaked into this process's environment
