"""Triton kernels against their pure-torch references, and the CPU attention path.

Without a GPU the kernels run in the Triton interpreter on CPU tensors. Triton
decides between compiling and interpreting once, when it is first imported, so
TRITON_INTERPRET=1 must be set before that (conftest does it too; this module
does it again for runs without conftest, and skips the CPU kernel tests if
triton was already imported compiling). With a GPU nothing is interpreted: the
same comparisons run compiled on CUDA (`gpu` marker). The interpreter cannot
multiply bfloat16 tiles, so bfloat16 attention is checked on GPU only.
"""

from __future__ import annotations

import math
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

INTERPRETED = tk.interpreted()

if not tk.HAS_TRITON:
    _CPU_SKIP = "triton is not installed"
elif not INTERPRETED:
    _CPU_SKIP = (
        "triton compiles for a GPU in this process ("
        + ("a GPU is present" if _CUDA else "triton was imported before TRITON_INTERPRET=1 was set")
        + "); CPU kernel runs need the interpreter"
    )
else:
    _CPU_SKIP = ""
_GPU_SKIP = "" if (_CUDA and tk.HAS_TRITON and not INTERPRETED) else "needs a CUDA GPU with compiled triton"
needs_cpu_kernels = pytest.mark.skipif(bool(_CPU_SKIP), reason=_CPU_SKIP or "-")
needs_gpu_kernels = pytest.mark.skipif(bool(_GPU_SKIP), reason=_GPU_SKIP or "-")

DEVICES = [
    pytest.param("cpu", marks=needs_cpu_kernels, id="interp"),
    pytest.param("cuda", marks=[pytest.mark.gpu, needs_gpu_kernels], id="cuda"),
]


# ---------------------------------------------------------------- batches


def make_batch(
    q_lens, kv_lens, *, num_kv_heads, group, head_dim, block_size, dtype, device,
    pad_tokens=0, pad_reqs=0, extra_blocks=2, seed=0,
):  # fmt: skip
    """A ragged batch whose cache is NaN everywhere except positions [0, kv_len) of each request.

    NaN in the null block, in block tails and in other requests' blocks makes any
    read the kernel should not do show up in the output.
    """
    gen = torch.Generator().manual_seed(seed)
    num_q_heads = num_kv_heads * group
    blocks_per_req = [-(-kv // block_size) for kv in kv_lens]
    max_blocks = max(blocks_per_req) + extra_blocks
    num_blocks = 1 + sum(blocks_per_req) + 3
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    num_slots = len(q_lens) + pad_reqs
    block_tables = torch.zeros(num_slots, max_blocks, dtype=torch.int32)
    for r, (n, kv) in enumerate(zip(blocks_per_req, kv_lens)):
        blocks = [order.pop() for _ in range(n)]
        block_tables[r, :n] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(kv):
            block, row = blocks[pos // block_size], pos % block_size
            key_cache[block, row] = torch.randn(num_kv_heads, head_dim, generator=gen)
            value_cache[block, row] = torch.randn(num_kv_heads, head_dim, generator=gen)
    num_tokens = sum(q_lens) + pad_tokens
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen)
    cu = [0]
    for n in list(q_lens) + [0] * pad_reqs:
        cu.append(cu[-1] + n)
    batch = dict(
        q=q.to(dtype),
        key_cache=key_cache.to(dtype),
        value_cache=value_cache.to(dtype),
        cu_q_lens=torch.tensor(cu, dtype=torch.int32),
        kv_lens=torch.tensor(list(kv_lens) + [0] * pad_reqs, dtype=torch.int32),
        block_tables=block_tables,
    )
    return {k: v.to(device) for k, v in batch.items()}


TOLERANCE = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}

# name: (q_lens, kv_lens, Hkv, group, D, block_size, extra kwargs)
CASES = {
    "decode": ([1, 1, 1, 1, 1], [1, 17, 33, 64, 100], 2, 4, 64, 16, {}),
    "prefill": ([13, 40], [13, 40], 2, 1, 128, 32, {}),
    "mixed_gqa3": ([1, 1, 9, 30], [20, 47, 9, 70], 2, 3, 128, 16, {}),
    "window": ([1, 12, 1, 25], [40, 12, 90, 61], 1, 4, 64, 16, dict(sliding_window=24)),
    "soft_cap": ([1, 7, 20], [50, 30, 20], 2, 2, 64, 32, dict(soft_cap=5.0, sm_scale=1.0)),
    "splits": ([1, 1, 6], [70, 130, 40], 1, 4, 64, 16, dict(num_kv_splits=4)),
    "splits_window": ([1, 5], [150, 77], 1, 4, 64, 32, dict(num_kv_splits=2, sliding_window=50)),
}


def _run_case(case, dtype, device, **over):
    q_lens, kv_lens, hkv, group, head_dim, block_size, kwargs = CASES[case]
    kwargs = dict(kwargs)
    batch = make_batch(q_lens, kv_lens, num_kv_heads=hkv, group=group, head_dim=head_dim,
                       block_size=block_size, dtype=dtype, device=device, **over)  # fmt: skip
    kwargs.setdefault("sm_scale", 1.0 / math.sqrt(head_dim))
    return batch, kwargs


def _reference(batch, kwargs):
    ref_kwargs = {k: v for k, v in kwargs.items() if k != "num_kv_splits"}
    cpu = {k: v.cpu() for k, v in batch.items()}
    return tk.ref_unified_attention(**cpu, **ref_kwargs)


def _assert_close(out, ref, dtype):
    out = out.float().cpu()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# ---------------------------------------------------------------- the reference itself


@pytest.mark.parametrize("sliding_window", [None, 7])
def test_reference_matches_dense_causal_attention(sliding_window):
    """A chunk of new tokens at the end of a sequence sees what dense causal attention gives those rows."""
    context, q_len, hkv, group, head_dim = 21, 11, 2, 3, 64
    batch = make_batch([q_len], [context + q_len], num_kv_heads=hkv, group=group, head_dim=head_dim,
                       block_size=16, dtype=torch.float32, device="cpu")  # fmt: skip
    got = tk.ref_unified_attention(**batch, sm_scale=0.125, sliding_window=sliding_window)
    blocks = batch["block_tables"][0, :2].long()
    k = batch["key_cache"][blocks].flatten(0, 1)[: context + q_len].transpose(0, 1)  # [Hkv, S, D]
    v = batch["value_cache"][blocks].flatten(0, 1)[: context + q_len].transpose(0, 1)
    pos = torch.arange(context + q_len)
    allowed = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        allowed &= pos[:, None] - pos[None, :] < sliding_window
    q_full = torch.zeros(hkv * group, context + q_len, head_dim)
    q_full[:, context:] = batch["q"].transpose(0, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(
        q_full, k, v, attn_mask=allowed, scale=0.125, enable_gqa=True
    )  # [Hq, S, D]
    torch.testing.assert_close(got, dense[:, context:].transpose(0, 1), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- reshape_and_cache


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype,block_size,hkv,head_dim,slot_dtype",
    [
        (torch.float32, 16, 1, 64, torch.int32),
        (torch.float16, 32, 3, 128, torch.int64),
        (torch.bfloat16, 16, 2, 128, torch.int32),
    ],
)
def test_reshape_and_cache_matches_reference(device, dtype, block_size, hkv, head_dim, slot_dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 6, 11
    # K and V as strided views of one fused projection, like a qkv split.
    kv = torch.randn(num_tokens, 2 * hkv * head_dim + 8, generator=gen).to(dtype)
    key = kv[:, : hkv * head_dim].view(num_tokens, hkv, head_dim)
    value = kv[:, hkv * head_dim : 2 * hkv * head_dim].view(num_tokens, hkv, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens: skipped
    key_cache = torch.randn(num_blocks, block_size, hkv, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn_like(key_cache.float()).to(dtype)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    tk.ref_reshape_and_cache(key, value, want_k, want_v, slots.to(slot_dtype))
    assert not torch.equal(want_k, key_cache)

    got_k, got_v = key_cache.to(device), value_cache.to(device)
    tk.reshape_and_cache(key.to(device), value.to(device), got_k, got_v, slots.to(slot_dtype).to(device))
    assert torch.equal(got_k.cpu(), want_k)
    assert torch.equal(got_v.cpu(), want_v)


# ---------------------------------------------------------------- unified_attention


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case,dtype",
    [
        ("decode", torch.float32),
        ("prefill", torch.float16),
        ("mixed_gqa3", torch.float32),
        ("window", torch.float16),
        ("soft_cap", torch.float32),
        ("splits", torch.float16),
        ("splits_window", torch.float32),
    ],
)
def test_unified_attention_matches_reference(device, case, dtype):
    batch, kwargs = _run_case(case, dtype, device)
    out = tk.unified_attention(**batch, **kwargs)
    _assert_close(out, _reference(batch, kwargs), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pass_num_reqs", [False, True])
def test_unified_attention_padding_rows_and_slots(device, pass_num_reqs):
    """Padded tokens and request slots: padded rows come back zero, even in a NaN-filled `out`."""
    batch, kwargs = _run_case("mixed_gqa3", torch.float32, device, pad_tokens=5, pad_reqs=3)
    if pass_num_reqs:
        kwargs["num_reqs"] = 4
    out = torch.full_like(batch["q"], float("nan"))
    got = tk.unified_attention(**batch, **kwargs, out=out)
    assert got is out
    ref = _reference(batch, kwargs)
    _assert_close(out, ref, torch.float32)
    assert torch.equal(out[-5:].cpu(), torch.zeros_like(out[-5:].cpu()))


@pytest.mark.gpu
@needs_gpu_kernels
@pytest.mark.parametrize("case", ["decode", "mixed_gqa3", "window", "soft_cap", "splits_window"])
def test_unified_attention_bf16_cuda(case):
    batch, kwargs = _run_case(case, torch.bfloat16, "cuda")
    _assert_close(tk.unified_attention(**batch, **kwargs), _reference(batch, kwargs), torch.bfloat16)


@pytest.mark.gpu
@needs_gpu_kernels
@pytest.mark.parametrize("num_kv_splits", [None, 1, 8])
def test_unified_attention_serving_shapes_cuda(num_kv_splits):
    """Llama-8B-like heads (32/8, D=128), bf16: a decode batch plus a few prefill chunks."""
    gen = torch.Generator().manual_seed(3)
    kv_lens = torch.randint(300, 1200, (20,), generator=gen).tolist()
    q_lens = [1] * 16 + [64, 128, 200, 37]
    kv_lens[16:] = [kv_lens[16] + 64, 128, 600, 37]
    batch = make_batch(q_lens, kv_lens, num_kv_heads=8, group=4, head_dim=128, block_size=16,
                       dtype=torch.bfloat16, device="cuda", pad_tokens=7)  # fmt: skip
    kwargs = dict(sm_scale=128**-0.5, num_kv_splits=num_kv_splits)
    _assert_close(tk.unified_attention(**batch, **kwargs), _reference(batch, kwargs), torch.bfloat16)


@pytest.mark.gpu
@needs_gpu_kernels
def test_cache_write_and_attention_replay_in_cuda_graph():
    """Capture once with bucket-sized buffers, replay with other lengths written into them."""
    hkv, group, head_dim, block_size = 2, 4, 128, 16
    num_tokens, num_slots, max_blocks = 16, 8, 8
    num_blocks = 1 + num_slots * max_blocks
    dev, dtype = "cuda", torch.bfloat16
    key_cache = torch.randn(num_blocks, block_size, hkv, head_dim, device=dev, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    q = torch.zeros(num_tokens, hkv * group, head_dim, device=dev, dtype=dtype)
    k_new = torch.zeros(num_tokens, hkv, head_dim, device=dev, dtype=dtype)
    v_new = torch.zeros_like(k_new)
    slot_mapping = torch.full((num_tokens,), -1, device=dev, dtype=torch.int64)
    cu_q_lens = torch.zeros(num_slots + 1, device=dev, dtype=torch.int32)
    kv_lens = torch.zeros(num_slots, device=dev, dtype=torch.int32)
    block_tables = torch.zeros(num_slots, max_blocks, device=dev, dtype=torch.int32)
    out = torch.empty_like(q)

    def step():
        tk.reshape_and_cache(k_new, v_new, key_cache, value_cache, slot_mapping)
        tk.unified_attention(q, key_cache, value_cache, cu_q_lens, kv_lens, block_tables,
                             sm_scale=head_dim**-0.5, out=out)  # fmt: skip

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    gen = torch.Generator().manual_seed(4)
    for q_lens, lens in [([1, 1, 1], [5, 40, 100]), ([1, 9, 3], [77, 9, 30])]:
        blocks = torch.randperm(num_blocks - 1, generator=gen)[: num_slots * max_blocks] + 1
        tables = blocks.view(num_slots, max_blocks).to(torch.int32)
        cu = [0]
        for n in q_lens + [0] * (num_slots - len(q_lens)):
            cu.append(cu[-1] + n)
        slots = [-1] * num_tokens  # padding tokens are skipped
        for r, (n, kv) in enumerate(zip(q_lens, lens)):
            for j in range(n):
                pos = kv - n + j
                slots[cu[r] + j] = int(tables[r, pos // block_size]) * block_size + pos % block_size
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        k_new.copy_(torch.randn(k_new.shape, generator=gen).to(dtype))
        v_new.copy_(torch.randn(v_new.shape, generator=gen).to(dtype))
        slot_mapping.copy_(torch.tensor(slots))
        cu_q_lens.copy_(torch.tensor(cu, dtype=torch.int32))
        kv_lens.copy_(torch.tensor(lens + [0] * (num_slots - len(lens)), dtype=torch.int32))
        block_tables.copy_(tables)
        want_k, want_v = key_cache.clone(), value_cache.clone()
        tk.ref_reshape_and_cache(k_new, v_new, want_k, want_v, slot_mapping)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)
        ref = tk.ref_unified_attention(q, want_k, want_v, cu_q_lens, kv_lens, block_tables, sm_scale=head_dim**-0.5)
        _assert_close(out, ref.cpu(), dtype)


def test_unified_attention_rejects_bad_shapes():
    batch = make_batch([1, 3], [4, 3], num_kv_heads=2, group=2, head_dim=64, block_size=16,
                       dtype=torch.float32, device="cpu")  # fmt: skip
    with pytest.raises(ValueError, match="not a multiple of Hkv"):
        tk.ref_unified_attention(**{**batch, "q": batch["q"][:, :3]}, sm_scale=1.0)
    with pytest.raises(ValueError, match="num_reqs=3"):
        tk.ref_unified_attention(**batch, sm_scale=1.0, num_reqs=3)
    if tk.HAS_TRITON:
        with pytest.raises(ValueError, match="cu_q_lens"):
            tk.unified_attention(**{**batch, "cu_q_lens": batch["cu_q_lens"][:2]}, sm_scale=1.0)
        with pytest.raises(ValueError, match="sliding_window=0"):
            tk.unified_attention(**batch, sm_scale=1.0, sliding_window=0)
        with pytest.raises(ValueError, match="num_kv_splits=3"):
            tk.unified_attention(**batch, sm_scale=1.0, num_kv_splits=3)


# ---------------------------------------------------------------- packaging and compilation


_HIDE_TRITON = """
    import sys
    import torch

    class HideTriton:
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError("hidden")

    sys.meta_path.insert(0, HideTriton())
    import triton_kernels as tk

    assert tk.HAS_TRITON is False
    q, cache = torch.zeros(2, 2, 16), torch.zeros(3, 16, 1, 16)
    cu, kv_lens, tables = torch.tensor([0, 2]), torch.tensor([2]), torch.tensor([[1]])
    tk.ref_unified_attention(q, cache, cache, cu, kv_lens, tables, sm_scale=1.0)
    try:
        tk.unified_attention(q, cache, cache, cu, kv_lens, tables, sm_scale=1.0)
    except ImportError as e:
        assert "needs triton" in str(e)
    else:
        raise AssertionError("no ImportError")
"""


def test_package_imports_without_triton():
    """With triton hidden, the references and HAS_TRITON still import; the kernels say what is missing."""
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(_HIDE_TRITON)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]


_COMPILE_FOR_HOPPER = """
    import os
    import re
    import subprocess
    import tempfile

    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton_kernels.reshape_and_cache import _reshape_and_cache_kernel
    from triton_kernels.unified_attention import _merge_splits_kernel, _unified_attention_kernel, pick_config

    def compile(kernel, pointers, constants, num_warps, num_stages=2):
        def arg_type(name):
            if name in constants:
                return "constexpr"
            return pointers.get(name, "fp32" if name in ("sm_scale", "soft_cap") else "i32")

        signature = {name: arg_type(name) for name in kernel.arg_names}
        # As the JIT specialises serving shapes: 16-aligned pointers and strides.
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
                 if name.endswith("_ptr") or name.startswith("stride")}
        src = ASTSource(kernel, signature, constexprs=constants, attrs=attrs)
        options = dict(num_warps=num_warps, num_stages=num_stages)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        check_no_spills(compiled, f"{kernel.__name__} {constants}")
        return compiled

    def check_no_spills(compiled, what):
        cuobjdump = os.path.join(triton.__path__[0], "backends", "nvidia", "bin", "cuobjdump")
        if not os.path.exists(cuobjdump):
            return
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        stack = [int(x) for x in re.findall(r"STACK:(\\d+)", usage)]
        assert stack and max(stack) == 0, f"register spills ({usage.strip()}) in {what}"

    for dt, tokens, slots, group, head_dim, window, cap in [
        ("bf16", 128, 128, 4, 128, 0, False),  # decode
        ("fp16", 4096, 16, 4, 128, 0, False),  # prefill
        ("bf16", 64, 64, 3, 64, 512, True),  # window + soft-cap + splits, GQA 3
        ("fp32", 4096, 16, 1, 128, 0, False),  # float32 (ieee dots), prefill-like
    ]:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
        cfg = pick_config(tokens, slots, 8 * group, 8, head_dim, dtype, torch.device("cpu"),
                          num_kv_splits=4 if window else 1)
        t = "*" + dt
        pointers = dict(q_ptr=t, k_cache_ptr=t, v_cache_ptr=t, out_ptr=t, part_m_ptr="*fp32", part_l_ptr="*fp32",
                        part_acc_ptr="*fp32", cu_q_lens_ptr="*i32", kv_lens_ptr="*i32", block_tables_ptr="*i32")
        constants = dict(NUM_Q_HEADS=8 * group, QUERIES_PER_KV=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim,
                         CACHE_BLOCK_SIZE=16, BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m, TILE_N=cfg.tile_n,
                         SLIDING_WINDOW=window, USE_SOFT_CAP=cap, NUM_SPLITS=cfg.num_splits,
                         DOT_PRECISION="ieee" if dt == "fp32" else "tf32")
        compile(_unified_attention_kernel, pointers, constants, cfg.num_warps, cfg.num_stages)
    compile(_merge_splits_kernel, dict(part_m_ptr="*fp32", part_l_ptr="*fp32", part_acc_ptr="*fp32", out_ptr="*bf16"),
            dict(NUM_Q_HEADS=32, NUM_SPLITS=4, HEAD_DIM=128, HEAD_DIM_PAD=128), 4)
    compile(_reshape_and_cache_kernel, dict(key_ptr="*bf16", value_ptr="*bf16", key_cache_ptr="*bf16",
                                            value_cache_ptr="*bf16", slot_mapping_ptr="*i64"),
            dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, HEAD_DIM_PAD=128, CACHE_BLOCK_SIZE=16), 4)
    print("compiled")
"""


@pytest.mark.skipif(not tk.HAS_TRITON, reason="triton is not installed")
def test_kernels_compile_for_hopper_without_a_gpu(tmp_path):
    """Compile ahead of time to sm_90 cubin (triton's bundled ptxas), no GPU needed.

    The interpreter runs the kernels as numpy code, so the real compiler's
    rules (types, layouts, tl.dot shapes) are only checked here or on a GPU.
    """
    compile_for_hopper(_COMPILE_FOR_HOPPER, tmp_path)


def compile_for_hopper(script: str, cache_dir) -> None:
    """Run `script` (which compiles kernels for sm_90 and prints "compiled") compiled, not interpreted."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    if res.returncode != 0 and "ptxas" in res.stderr and "No such file" in res.stderr:
        pytest.skip("triton's bundled ptxas is missing")
    assert res.returncode == 0, res.stderr[-4000:]
    assert "compiled" in res.stdout
