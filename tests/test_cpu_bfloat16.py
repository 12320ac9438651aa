"""`--dtype bfloat16` on a CPU with AVX512-BF16: the float32 model with its linears and LM head in bfloat16,
multiplied by their inputs rounded to bfloat16 (`cpu_kernels/csrc`'s QX_BDOT: VDPBF16PS), on both backends.

- `cpu_kernels.layout.bdot_panels` rounds the weights as torch's `.to(torch.bfloat16)` does (ties to even, NaN, overflow)
  and pairs them as the instruction pairs them;
- the kernel computes its definition to the bit: the activations rounded to bfloat16, each output one chain over
  the pairs of k in ascending order, adding the odd k's exact product and then the even one's, each sum rounded
  to float32 (the instruction's documented order, which this CPU follows); any row count, the threads, the parts a
  caller splits, and the greedy argmax agree;
- the engine: every linear and the LM head in QX_BDOT, no float32 panels kept; the one-call decode layers give the
  Python layers' bits; the tokens are the greedy ones of transformers' model with the same roundings (a bfloat16
  checkpoint, every linear's input rounded to bfloat16), the logprobs close; not float32's;
- where the kernel cannot run, `--dtype bfloat16` is torch's own bfloat16 ops, with the warning;
- the jax backend gives the torch backend's tokens and logprobs to the bit, in its one-call layers and its scan.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from cpu_kernels import layout as qx
from cpu_kernels import torch_ops
from enginecore import LLM, SamplingParams
from tests.outputs import assert_same_outputs
from torchengine.cpu_transform import CpuLinear

BDOT = qx.QX_KINDS["BDOT"]


def bdot_runs() -> bool:
    lib = torch_ops.lib()
    return lib is not None and bool(lib.bdot_supported())


needs_bdot = pytest.mark.skipif(not bdot_runs(), reason="no AVX512-BF16 (or no kernels) here")


@pytest.mark.skipif(torch_ops.lib() is None, reason="the kernels do not run here")
def test_bdot_panels_round_as_torch_does_and_pair_k():
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.standard_normal(4096).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 4096),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4028235e38, -3.4028235e38, 1e-40, -1e-45], np.float32),
        # ties: exactly halfway between two bfloat16s, both parities
        (np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80C000, 0x3F807FFF], np.uint32)).view(np.float32),
    ]).astype(np.float32)
    x = np.concatenate([x, np.zeros(-len(x) % 512, np.float32)])
    panels = x.reshape(-1, 32, 16)  # K = 32: one group, 16 pairs of k
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    packed = qx.bdot_panels(torch_ops.lib(), panels)
    assert packed.shape == (len(panels), 1, 1024)
    got = packed.view(np.uint16).reshape(-1, 16, 16, 2).transpose(0, 1, 3, 2).reshape(-1)  # back to [NP, K, 16]
    nan = np.isnan(x)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.isnan(torch.from_numpy(got.view(np.int16)).view(torch.bfloat16).float().numpy()[nan]).all()


def reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """What QX_BDOT computes, in numpy: x [M, K], w [N, K] float32 -> [M, N] float32."""
    xb = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    wb = torch.from_numpy(w).to(torch.bfloat16).float().numpy()
    acc = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for j in range(x.shape[1] // 2):  # products of two bfloat16s are exact in float32
        acc = acc + np.outer(xb[:, 2 * j + 1], wb[:, 2 * j + 1]).astype(np.float32)
        acc = acc + np.outer(xb[:, 2 * j], wb[:, 2 * j]).astype(np.float32)
    return acc


@needs_bdot
@pytest.mark.parametrize("N,K", [(1003, 576), (37, 64), (16, 32), (200, 1536)])
def test_bdot_gemm_is_its_definition_to_the_bit(N, K):
    lib = torch_ops.lib()
    rng = np.random.default_rng(N + K)
    w = (rng.standard_normal((N, K)) / K**0.5).astype(np.float32)
    panels = qx.bdot_panels(lib, torch_ops.pack_panels(torch.from_numpy(w)).numpy())
    assert panels.shape == qx.qx_shape(N, K, BDOT)
    bd = torch.from_numpy(panels)
    x = rng.standard_normal((120, K)).astype(np.float32)
    x[3, :5] = 0.0
    want = reference(x, w)
    for M in (1, 2, 5, 12, 13, 25, 40, 120):  # (120 x 576 values and more: each thread rounds its share of the rows)
        xt = torch.from_numpy(x[:M])
        y = torch_ops.qx_gemm(lib, xt, bd, N, BDOT)
        assert np.array_equal(y.numpy().view(np.uint32), want[:M].view(np.uint32)), M
        tokens = torch_ops.qx_gemm(lib, xt, bd, N, BDOT, greedy=True)
        assert torch.equal(tokens, torch.from_numpy(want[:M]).argmax(-1)), M
    # one thread, and a caller's own split of the panels (jaxengine's custom calls), give the same bits
    y1 = torch.empty(120, N)
    assert lib.qx_gemm(x.ctypes.data, 120, K, bd.data_ptr(), N, y1.data_ptr(), None, BDOT, 1) == 0
    assert np.array_equal(y1.numpy().view(np.uint32), want.view(np.uint32))
    NP, y2 = -(-N // 16), torch.empty(120, N)
    for p0, p1 in ((0, NP // 3), (NP // 3, NP)):
        assert lib.qx_gemm_part(x.ctypes.data, 120, K, bd.data_ptr(), N, y2.data_ptr(), None, BDOT, p0, p1) == 0
    assert np.array_equal(y2.numpy().view(np.uint32), want.view(np.uint32))


@needs_bdot
def test_the_engine_runs_bfloat16_on_the_kernels(tiny_bf16_llama_dir, one_call_vs_python_layers):
    import transformers as tf

    # (a float32 KV cache: transformers' keeps K and V unrounded)
    llm = LLM(model=tiny_bf16_llama_dir, backend="torch", platform="cpu", dtype="bfloat16", kv_cache_dtype="float32",
              max_model_len=128, max_num_seqs=4, enable_prefix_caching=False)
    prompts = [list(range(300 + i, 320 + 7 * i)) for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    try:
        runner = llm.llm_engine.core.runner
        assert runner.bdot and runner.compute_dtype == torch.float32
        lins = [m for m in runner.model.modules() if isinstance(m, CpuLinear) and m.qx is not None]
        assert len(lins) == 4 * runner.model.arch.num_hidden_layers
        assert all(m.qx_kind == BDOT and m.panels is None for m in lins)
        head = runner.model.lm_head  # (the checkpoint's untied head: in its qx panels, the matrix freed)
        assert type(head).__name__ == "CpuLMHead" and head.qx_kind == BDOT and head.panels is None
        arena = runner.cpu_arena  # all of them in one buffer (on huge pages where the OS gives them)
        lo = arena.data_ptr()
        assert all(lo <= q.data_ptr() and q.data_ptr() + q.nbytes <= lo + arena.nbytes
                   for q in [m.qx for m in lins] + [head.qx])
        assert sum(m.qx.nbytes for m in lins) + head.qx.nbytes == arena.nbytes
        ps = [{"prompt_token_ids": p} for p in prompts]
        assert one_call_vs_python_layers(llm, ps, sp)
        out = llm.generate(ps, sp, use_tqdm=False)
        greedy = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in out]  # argmax mode
    finally:
        llm.llm_engine.core.shutdown()
    # transformers' model of the same checkpoint in float32, every linear's input rounded to bfloat16
    hf = tf.AutoModelForCausalLM.from_pretrained(tiny_bf16_llama_dir, dtype=torch.float32).eval()
    for m in hf.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda mod, args: (args[0].to(torch.bfloat16).float(),))
    float32 = LLM(model=tiny_bf16_llama_dir, backend="torch", platform="cpu", dtype="float32", max_model_len=128,
                  max_num_seqs=4, enable_prefix_caching=False)
    try:
        f32 = float32.generate(ps, sp, use_tqdm=False)
    finally:
        float32.llm_engine.core.shutdown()
    # Rounding to bfloat16 is a step function: where transformers' float32 sums (another order) put an activation
    # on the other side of a rounding boundary, that value moves by 2^-9 of itself, and what follows by up to
    # ~1e-2 (a tiny random model's logits are steep); elsewhere the two agree to float32's noise
    diffs, differs = [], False
    for p, o, f in zip(prompts, out, f32):
        got = o.outputs[0].token_ids
        with torch.inference_mode():
            lp = torch.log_softmax(hf(torch.tensor([p + got[:-1]])).logits[0].double(), -1)[len(p) - 1 :]
        for j, (t, d) in enumerate(zip(got, o.outputs[0].logprobs)):
            top2 = lp[j].topk(2).values
            assert t == int(lp[j].argmax()) or top2[0] - top2[1] < 0.05, (p, j)
            diffs.append(abs(d[t].logprob - float(lp[j, t])))
        differs |= any(a[t].logprob != b[t].logprob for t, a, b in zip(got, o.outputs[0].logprobs,
                                                                       f.outputs[0].logprobs) if t in b)
    assert max(diffs) < 0.05 and np.median(diffs) < 1e-4, sorted(diffs)
    assert differs  # the activations were rounded: not float32's bits


def test_without_the_kernel_bfloat16_is_torchs_own(tiny_bf16_llama_dir, monkeypatch, caplog):
    monkeypatch.setattr(qx, "bdot_runs", lambda *args: False)
    with caplog.at_level(logging.WARNING, logger="xlaserve.torchengine"):
        llm = LLM(model=tiny_bf16_llama_dir, backend="torch", platform="cpu", dtype="bfloat16", max_model_len=64,
                  max_num_seqs=2)
    try:
        runner = llm.llm_engine.core.runner
        assert not runner.bdot and runner.compute_dtype == torch.bfloat16
        assert runner.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
        out = llm.generate([{"prompt_token_ids": [300, 301, 302]}], SamplingParams(temperature=0.0, max_tokens=3),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.llm_engine.core.shutdown()
    assert "runs the framework's own bfloat16 ops" in caplog.text


@needs_bdot
@pytest.mark.parametrize("model,cpu_layers", [("llama", True), ("llama", False), ("qwen2", True)])
def test_jax_gives_torchs_bfloat16_bits(model, cpu_layers, tiny_bf16_llama_dir, tiny_model_dir):
    """The jax backend runs `--dtype bfloat16` the same way (`jaxengine.cpu_wing.pack_cpu_panels(bdot=True)`: QX_BDOT's
    panels only, no float32 ones), in its one-call layers and in the scan over layers (a custom call per linear):
    the torch backend's tokens and logprobs to the bit, greedy (the head's argmax and the logits) and seeded
    sampling, a bfloat16 KV cache (the dtype's default) on both; a bfloat16 checkpoint (the llama) and a float32
    one with a tied embedding and q/k/v biases (the qwen2: its embedding stays float32 on both backends, not the
    LM head's rounded panels)."""
    import jaxengine.runner  # noqa: F401 - a broken jax backend fails this test, never skips it
    path = tiny_bf16_llama_dir if model == "llama" else tiny_model_dir(model)
    prompts = [{"prompt_token_ids": list(range(300 + 9 * i, 330 + 14 * i))} for i in range(5)]
    runs = [(prompts[:3], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)),
            (prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)),
            (prompts, [SamplingParams(temperature=0.9, top_p=0.9, seed=7 + i, max_tokens=8, ignore_eos=True,
                                      logprobs=1) for i in range(5)])]
    res = {}
    for backend in ("jax", "torch"):
        kw = {} if cpu_layers or backend == "torch" else {"compilation_config": {"cpu_layers": False}}
        llm = LLM(model=path, backend=backend, platform="cpu", dtype="bfloat16", max_model_len=128,
                  max_num_seqs=8, max_num_batched_tokens=64, seed=0, **kw)
        try:
            runner = llm.llm_engine.core.runner
            assert runner.bdot
            if backend == "jax":
                p = runner.params.panels
                assert runner.dtype == "float32" and runner.kv_dtype == "bfloat16"
                assert (*p.qx_kinds, p.head_qx_kind) == (BDOT,) * 5
                assert (p.qkv, p.o, p.gate_up, p.down, p.head) == (None,) * 5  # no float32 panels kept
                assert p.head_qx.dtype == np.uint8 and p.head_qx.nbytes == 2 * 49152 * 64
                if model == "qwen2":  # tied: the float32 embedding, as the torch backend keeps it
                    assert runner.params.embed.dtype == np.float32 and runner.params.embed.shape == (49152, 64)
            res[backend] = [llm.generate(ps, sp, use_tqdm=False) for ps, sp in runs]
        finally:
            llm.llm_engine.core.shutdown()
    for a, b in zip(res["jax"], res["torch"]):
        assert_same_outputs(a, b)
