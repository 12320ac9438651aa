"""`--quantization gguf`: the embedded GGUF's Q4_1 linears kept 4-bit (torch on CPU).

- the 4-bit groups read from the file's blocks dequantize to exactly what the
  `gguf` package's dequantizer gives (so the f32 path and the 4-bit path hold the same weights);
- Q4_0's form (offset -8 d) too, on a block written by hand;
- the AVX2 kernel (`cpu_kernels/csrc`) computes exactly its numpy definition;
- without the flag, the float32 model's decode steps of few rows multiply the file's blocks as stored
  (`qx_gemm`: Q4_1, Q4_0, the LM head's Q8_0) to the bits of the float32 weights, kernel and engine;
- an Int4Linear equals the dense float32 linear of the dequantized weight up to the kernels' rounding
  (either kernel), on the 4-bit path (few rows) and the dense path (many rows);
- the engine with the flag answers like the dequantized model: same first greedy tokens on chat
  prompts, logprobs close;
- the flag is refused where it cannot run (jax, a Hugging Face folder, tensor parallelism).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from enginecore import LLM, SamplingParams  # noqa: E402
from enginecore.config import ConfigError, EngineArgs  # noqa: E402
from enginecore.model_loader import Int4Groups, resolve_model  # noqa: E402
from tests.outputs import assert_same_outputs  # noqa: E402
from torchengine.cpu_transform import CpuLinear  # noqa: E402


@pytest.fixture(scope="module")
def source():
    return resolve_model(None)


@pytest.fixture(params=["avx512", "avx2"])
def qx_tiles(request):
    """qx_gemm multiplying with its AVX-512 tiles (where the CPU has them) or its 256-bit ones: the same bits."""
    from cpu_kernels import torch_ops

    lib = torch_ops.lib()
    if lib is None:
        pytest.skip("the AVX2 kernels do not run here")
    wide = request.param == "avx512"
    if wide and not lib.qx512_use(-1):
        pytest.skip("no AVX-512 here (or built without it)")
    before = lib.qx512_use(int(wide))
    yield request.param
    lib.qx512_use(before)


def test_int4_groups_equal_the_gguf_dequantizer(source):
    groups = dict(source.iter_quantized_weights(("Q4_0", "Q4_1")))
    assert len(groups) == 7 * source.config.num_hidden_layers  # q k v o gate up down, all Q4_1
    wanted = {n for n in groups if ".0." in n or ".29." in n}
    dense = {n: a for n, a in source.iter_weights() if n in wanted}
    for n in wanted:
        g = groups[n]
        assert g.q.dtype == np.uint8 and g.q.max() <= 15
        np.testing.assert_array_equal(g.dequantize(), dense[n])  # bit for bit, rows unpermuted alike


def _gguf_tensor(ty: str, N: int, K: int, data=None, name: str = "blk.0.ffn_down.weight"):
    """The attributes the groups' `from_gguf` read from a GGUFTensor: an [N, K] weight of GGUF type `ty`."""
    from types import SimpleNamespace

    return SimpleNamespace(name=name, shape=(K, N), data=data, tensor_type=SimpleNamespace(name=ty))


def test_q4_0_block_form():
    T = _gguf_tensor("Q4_0", 2, 32)
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, (2, 32)).astype(np.uint8)
    d = np.array([0.5, -0.25], np.float16)
    blocks = [np.concatenate([np.frombuffer(d[i].tobytes(), np.uint8), q[i, :16] | (q[i, 16:] << 4)])
              for i in range(2)]
    T.data = np.concatenate(blocks)
    g = Int4Groups.from_gguf("x.gguf", T)
    np.testing.assert_array_equal(g.q, q)
    np.testing.assert_array_equal(g.dequantize(), (q.astype(np.float32) - 8) * d.astype(np.float32)[:, None])


def test_q4_kernel_matches_its_reference():
    """The AVX2 kernel computes exactly its definition (8-bit activations per block of 32, integer block
    dot products, float16 scales): against `cpu_kernels.reference` in float64, at every row count it takes."""
    from cpu_kernels import torch_ops

    lib, why = torch_ops.load()
    if lib is None:
        pytest.skip(f"the AVX2 kernel cannot run here: {why}")
    rng = np.random.default_rng(7)
    for N, K in ((96, 128), (200, 64), (80, 1536)):
        G = K // 32
        q = rng.integers(0, 16, (N, K)).astype(np.uint8)
        scale = rng.uniform(0.002, 0.05, (N, G)).astype(np.float16).astype(np.float32)
        offset = rng.uniform(-0.4, 0.1, (N, G)).astype(np.float16).astype(np.float32)
        blocks = torch_ops.pack(q, scale, offset)
        for M in (1, 2, 3, 4, 5, 9, 32):
            x = rng.standard_normal((M, K)).astype(np.float32)
            x[0, :32] = 0  # an all-zero block (scale 0) is exact too
            got = torch_ops.gemm(lib, torch.from_numpy(x), blocks).numpy()
            want = torch_ops.reference(x, q, scale, offset)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
            # and it is the dequantized linear up to the 8-bit activations
            dense = x @ (q.reshape(N, G, 32) * scale[..., None] + offset[..., None]).reshape(N, K).T
            assert np.abs(got - dense).max() < 0.02 * np.abs(dense).max()
    # Q8_0 blocks (the LM head): int8 weights, no offset
    q8 = rng.integers(-128, 128, (72, 96)).astype(np.int8)
    s8 = rng.uniform(0.001, 0.01, (72, 3)).astype(np.float16).astype(np.float32)
    blocks8 = torch_ops.pack8(q8, s8)
    for M in (1, 4, 7):
        x = rng.standard_normal((M, 96)).astype(np.float32)
        got = torch_ops.gemm(lib, torch.from_numpy(x), blocks8).numpy()
        want = torch_ops.reference(x, q8, s8)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with pytest.raises(ValueError, match="bad arguments"):
        torch_ops.gemm(lib, torch.zeros(33, 128), torch_ops.pack(np.zeros((4, 128), np.uint8), *np.ones((2, 4, 4), np.float32)))


@pytest.mark.parametrize("kernel", ["auto", "torch"])
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
def test_int4_linear_matches_dense(rows, kernel):
    from torchengine.quant import Int4Linear

    rng = np.random.default_rng(rows)
    N, K = 96, 128
    g = Int4Groups(rng.integers(0, 16, (N, K)).astype(np.uint8),
                   rng.uniform(0.01, 0.05, (N, K // 32)).astype(np.float32),
                   rng.uniform(-0.4, 0.0, (N, K // 32)).astype(np.float32))
    dense = torch.nn.Linear(K, N, bias=True)
    with torch.no_grad():
        dense.weight.copy_(torch.from_numpy(g.dequantize()))
        dense.bias.copy_(torch.from_numpy(rng.standard_normal(N).astype(np.float32)))
    lin = Int4Linear(dense, g, kernel=kernel)
    x = torch.from_numpy(rng.standard_normal((rows, K)).astype(np.float32))
    with torch.inference_mode():
        want = dense(x)
        got = lin(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    if rows > lin.max_rows:
        assert torch.equal(got, want)  # the dense path
    else:
        # bf16 activations and scales (torch's kernel) or 8-bit activations (cpu_kernels): ~2-3 significant digits
        torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-2)
        assert not torch.equal(got, want), "the 4-bit path was expected to run"


def _loader_weights(kind: str, q: np.ndarray, d: np.ndarray, m: np.ndarray | None = None) -> np.ndarray:
    """What the loader serves for a GGUF tensor of `kind` holding q [N, K] and d (m) [N, K / 32]: the raw blocks
    written as the file stores them, dequantized by `enginecore/gguf_dequant.c` (model_loader._dequantize)."""
    from enginecore.model_loader import _dequantize

    N, K = q.shape
    f16 = lambda a: a.astype(np.float16).reshape(N, K // 32, 1).view(np.uint8)  # noqa: E731
    qb = q.reshape(N, K // 32, 32)
    if kind == "Q8_0":
        raw = np.concatenate([f16(d), qb.view(np.uint8)], axis=2)
    else:
        nib = (qb[..., :16] | (qb[..., 16:] << 4)).astype(np.uint8)
        raw = np.concatenate([f16(d)] + ([f16(m)] if kind == "Q4_1" else []) + [nib], axis=2)
    w = _dequantize(raw.reshape(-1), {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}[kind])
    if w is None:
        pytest.skip("the GGUF dequantizer cannot be built here")
    return w.reshape(N, K)


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0"])
@pytest.mark.parametrize("N,K", [(960, 576), (37, 64), (16, 32), (200, 1536)])
def test_q4x_gemm_gives_panel_gemms_bits(N, K, kind, qx_tiles):
    """A GGUF file's Q4_1 / Q4_0 blocks multiplied as they are stored (qx_gemm) give the bits of panel_gemm
    over the weights the loader serves (enginecore/gguf_dequant.c from the same raw blocks; Int4Groups'
    numpy form agrees with it): every row count of the kernel's tiles (256-bit: 4-row tiles, 1-3-row tails, two
    of them; AVX-512: one to three tiles of up to 16 rows), a partial last panel, one group of 32 and many, negative scales (Q4_0's zeros then signed)."""
    from cpu_kernels import torch_ops

    lib, why = torch_ops.load()
    if lib is None:
        pytest.skip(f"the AVX2 kernels cannot run here: {why}")
    rng = np.random.default_rng(N + K)
    G = K // 32
    q = rng.integers(0, 16, (N, K)).astype(np.uint8)
    d = (rng.standard_normal((N, G)) * 0.02).astype(np.float16).astype(np.float32)
    m = -8 * d if kind == "Q4_0" else (rng.standard_normal((N, G)) * 0.1).astype(np.float16).astype(np.float32)
    w = _loader_weights(kind, q, d, m)
    if kind == "Q4_1":
        np.testing.assert_array_equal(Int4Groups(q, d, m).dequantize(), w)
    panels = torch_ops.pack_panels(torch.from_numpy(w))
    blocks = torch_ops.pack_q4x(q, d, None if kind == "Q4_0" else m)
    for M in (1, 2, 3, 4, 5, 6, 7, 8, 9, 15, 16, 17, 33):
        x = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32))
        assert torch.equal(torch_ops.qx_gemm(lib, x, blocks, N, torch_ops.QX_KINDS[kind]),
                           torch_ops.panel_gemm(lib, x, panels, N))
    with pytest.raises(ValueError, match="bad arguments"):  # panels of another kind are refused, not overread
        torch_ops.qx_gemm(lib, x, blocks, N, torch_ops.QX_KINDS["Q8_0"])


@pytest.mark.parametrize("N,K", [(1003, 576), (40, 64)])
def test_q8x_gemm_gives_panel_gemms_bits_and_tokens(N, K, qx_tiles):
    """An LM head stored as Q8_0 (the embedded model's), multiplied as stored: panel_gemm's logits over the
    weights the loader serves to the bit, and its greedy tokens, ties included (the lowest index, as
    torch.argmax), with a vocabulary that is not a multiple of 16 or 8."""
    from enginecore.model_loader import Int8Groups
    from cpu_kernels import torch_ops

    lib, why = torch_ops.load()
    if lib is None:
        pytest.skip(f"the AVX2 kernels cannot run here: {why}")
    rng = np.random.default_rng(N)
    G = K // 32
    g = Int8Groups(rng.integers(-128, 128, (N, K)).astype(np.int8),
                   (rng.standard_normal((N, G)) * 0.01).astype(np.float16).astype(np.float32))
    g.q[N // 2] = g.q[3]  # rows 3 and N / 2: the same logits, a tie
    g.scale[N // 2] = g.scale[3]
    w = _loader_weights("Q8_0", g.q, g.scale)
    np.testing.assert_array_equal(g.dequantize(), w)
    panels = torch_ops.pack_panels(torch.from_numpy(w))
    blocks = torch_ops.pack_q8x(g.q, g.scale)
    for M in (1, 3, 4, 7, 8, 16, 20):
        x = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32))
        logits = torch_ops.panel_gemm(lib, x, panels, N)
        assert torch.equal(torch_ops.qx_gemm(lib, x, blocks, N, torch_ops.QX_KINDS["Q8_0"]), logits)
        assert torch.equal(torch_ops.qx_gemm(lib, x, blocks, N, torch_ops.QX_KINDS["Q8_0"], greedy=True),
                           torch_ops.panel_gemm(lib, x, panels, N, greedy=True))
        x[0] = 0  # every logit 0: the first index
        assert torch_ops.qx_gemm(lib, x, blocks, N, torch_ops.QX_KINDS["Q8_0"], greedy=True)[0] == 0


@pytest.mark.parametrize("N,K", [(960, 576), (37, 64), (16, 32), (1003, 1536)])
def test_f16x_gemm_gives_panel_gemms_bits_and_tokens(N, K, qx_tiles):
    """A float16-exact float32 weight multiplied as its float16s (qx_gemm's QX_F16 panels: a float16 checkpoint or
    a GGUF file's F16 tensor served in float32) gives panel_gemm's bits, every tile row count, signed zeros and
    subnormal float16s among the weights, and its greedy tokens; half_kind prefers BF16 where both hold."""
    from cpu_kernels import layout as qx
    from cpu_kernels import torch_ops

    lib = torch_ops.lib()
    if lib is None:
        pytest.skip("the AVX2 kernels do not run here")
    rng = np.random.default_rng(N * K)
    w = (rng.standard_normal((N, K)) / K ** 0.5).astype(np.float16)
    w[0, :4] = np.array([0.0, -0.0, 6e-8, -3e-5], np.float16)  # zeros and subnormal float16s, kept exactly
    w = torch.from_numpy(w.astype(np.float32))
    panels = torch_ops.pack_panels(w)
    f16 = torch_ops.QX_KINDS["F16"]
    assert qx.half_kind(panels.numpy()) == f16 and qx.half_kind((panels + 1e-3).numpy()) == -1
    assert qx.half_kind(torch_ops.pack_panels(w.bfloat16().float()).numpy()) == torch_ops.QX_KINDS["BF16"]
    halves = torch.from_numpy(qx.half_panels(lib, "w", panels.numpy(), f16))
    assert lib.qx_mismatches(halves.numpy().ctypes.data, f16, K, N, panels.numpy().ctypes.data) == 0
    for M in (1, 2, 5, 6, 7, 12, 13, 16, 24):
        x = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32))
        assert torch.equal(torch_ops.qx_gemm(lib, x, halves, N, f16), torch_ops.panel_gemm(lib, x, panels, N))
        assert torch.equal(torch_ops.qx_gemm(lib, x, halves, N, f16, greedy=True),
                           torch_ops.panel_gemm(lib, x, panels, N, greedy=True))


@pytest.mark.parametrize("N,K", [(960, 576), (37, 64), (16, 32), (1003, 1536)])
def test_bf16x_gemm_gives_panel_gemms_bits_and_tokens(N, K, qx_tiles):
    """A bfloat16-exact float32 weight multiplied as its high halves (qx_gemm's QX_BF16 panels: a bfloat16
    checkpoint served in float32) gives panel_gemm's bits: every row count of the kernel's tiles (6-row tiles,
    1-5-row tails, two and three tiles), a partial last panel, one group of 32 and many, signed zeros and
    subnormals among the weights; and its greedy tokens, ties included (the lowest index)."""
    from cpu_kernels import layout as qx
    from cpu_kernels import torch_ops

    lib, why = torch_ops.load()
    if lib is None:
        pytest.skip(f"the AVX2 kernels cannot run here: {why}")
    rng = np.random.default_rng(N + K)
    w = torch.from_numpy(rng.standard_normal((N, K)).astype(np.float32) / K ** 0.5).bfloat16().float()
    w[0, :4] = torch.tensor([0.0, -0.0, 1e-40, -3e-39]).bfloat16().float()  # zeros and subnormals, kept exactly
    w[N // 2] = w[N - 1 if N // 2 != N - 1 else 0]  # a tie: two rows of the same weights
    assert qx.bf16_exact(w.numpy()) and not qx.bf16_exact((w + 1e-4).numpy())
    panels = torch_ops.pack_panels(w)
    halves = torch.from_numpy(qx.half_panels(lib, "w", panels.numpy(), torch_ops.QX_KINDS["BF16"]))
    bf16 = torch_ops.QX_KINDS["BF16"]
    for M in (1, 2, 3, 4, 5, 6, 7, 11, 12, 13, 16, 18, 24):
        x = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32))
        assert torch.equal(torch_ops.qx_gemm(lib, x, halves, N, bf16), torch_ops.panel_gemm(lib, x, panels, N))
        assert torch.equal(torch_ops.qx_gemm(lib, x, halves, N, bf16, greedy=True),
                           torch_ops.panel_gemm(lib, x, panels, N, greedy=True))
    x[0] = 0  # every logit 0: the first index
    assert torch_ops.qx_gemm(lib, x, halves, N, bf16, greedy=True)[0] == 0
    with pytest.raises(ValueError, match="bad arguments"):  # panels of another kind are refused, not overread
        torch_ops.qx_gemm(lib, x, halves, N, torch_ops.QX_KINDS["Q4_1"])


def test_attach_qx_keeps_float32_only_where_the_blocks_differ(monkeypatch, caplog):
    """attach_qx checks every weight against the loaded one bit for bit: a Q4_1 linear and a Q4_0 one (its
    own arithmetic, d * (q - 8)) and a Q8_0 LM head get their blocks, of their kinds; a linear whose loaded
    weight differs from its blocks by one ulp in one place, or by the sign of its zeros, keeps float32 only,
    with a warning."""
    from types import SimpleNamespace

    from enginecore.model_loader import Int8Groups
    from cpu_kernels import torch_ops
    from torchengine import quant
    from torchengine.cpu_transform import CpuLMHead
    from torchengine.model import Linear

    if torch_ops.lib() is None:
        pytest.skip("the AVX2 kernels do not run here")
    rng = np.random.default_rng(3)
    N, K = 40, 64

    def f16(shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float16).astype(np.float32)

    g1 = Int4Groups(rng.integers(0, 16, (N, K)).astype(np.uint8), f16((N, 2)), f16((N, 2)))
    d0 = f16((N, 2))
    g0 = Int4Groups(rng.integers(0, 16, (N, K)).astype(np.uint8), d0, -8 * d0)
    w0 = (d0[..., None] * (g0.q.reshape(N, 2, 32).astype(np.float32) - 8)).reshape(N, K)
    head = Int8Groups(rng.integers(-128, 128, (N, K)).astype(np.int8), f16((N, 2)))

    def linear(w):
        lin = Linear(K, N, bias=False)
        lin.weight = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(w)), requires_grad=False)
        return CpuLinear.pack(lin, torch_ops.lib())  # attach_qx reads the panels apply_cpu_kernels leaves

    nudged = g1.dequantize()
    nudged[7, 9] = np.nextafter(nudged[7, 9], np.float32(1))
    signed = w0.copy()  # -0.0 where the loader wrote 0.0: another bit pattern, caught too
    signed[signed == 0] = -signed[signed == 0]
    assert (signed == 0).any()
    good, q40, bad, zeros = linear(g1.dequantize()), linear(w0), linear(nudged), linear(signed)
    model = SimpleNamespace(lm_head=CpuLMHead(torch_ops.pack_panels(torch.from_numpy(head.dequantize())), N,
                                              torch_ops.lib()),
                            named_modules=lambda: enumerate((good, q40, bad, zeros)))
    monkeypatch.setattr(quant, "_stored_linears", lambda m, s, types=None, wide=True: (
        {"a": (good, g1), "b": (bad, g1), "c": (q40, g0), "d": (zeros, g0)}, head))
    assert quant.attach_qx(model, SimpleNamespace(kind="gguf")) == 3
    assert bad.qx is None and "b: its Q4_1 panels do not give" in caplog.text
    assert zeros.qx is None and "d: its Q4_0 panels do not give" in caplog.text
    assert (good.qx_kind, q40.qx_kind) == (torch_ops.QX_KINDS["Q4_1"], torch_ops.QX_KINDS["Q4_0"])
    lib, x = torch_ops.lib(), torch.from_numpy(rng.standard_normal((3, K)).astype(np.float32))
    for lin in (good, q40):
        assert torch.equal(torch_ops.qx_gemm(lib, x, lin.qx, N, lin.qx_kind),
                           torch_ops.panel_gemm(lib, x, lin.panels, N))
    assert torch.equal(torch_ops.qx_gemm(lib, x, model.lm_head.qx, N, torch_ops.QX_KINDS["Q8_0"]),
                       torch_ops.panel_gemm(lib, x, model.lm_head.panels, N))
    assert quant.attach_qx(model, SimpleNamespace(kind="hf")) == 0  # a Hugging Face folder has no blocks


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_0", "Q8_0", "BF16", "IQ4"])
def test_qx_mismatches_counts_the_weights_the_panels_rebuild_otherwise(kind):
    """The loaders' check (`qx_mismatches`, through `cpu_kernels.layout.rebuilds`): a weight's qx panels of every kind
    against its float32 panels, 0 for the loader's own arithmetic; each weight off by one ulp, or a zero of the
    other sign, counted once, wherever it sits in a panel; the padding rows of a partial last panel not counted
    (qx's Q4_0 padding rebuilds -0.0); a bad kind or K refused (-1)."""
    from cpu_kernels import layout as qx
    from enginecore.model_loader import Int8Groups, Iq4Groups
    from cpu_kernels import torch_ops

    lib = torch_ops.lib()
    if lib is None:
        pytest.skip("the AVX2 kernels do not run here")
    rng = np.random.default_rng(11)
    N, K = 37, 96
    f16 = lambda *s: (rng.standard_normal(s) * 0.05).astype(np.float16).astype(np.float32)  # noqa: E731
    if kind == "BF16":
        w = torch.randn(N, K).bfloat16().float()
        w[3, :5], w[20, 7] = 0.0, -0.0  # zeros of both signs
        packed = qx.half_panels(lib, "w", torch_ops.pack_panels(w).numpy(), qx.QX_KINDS["BF16"])
    elif kind == "Q8_0":
        g = Int8Groups(rng.integers(-128, 128, (N, K)).astype(np.int8), f16(N, K // 32))
        w, packed = torch.from_numpy(g.dequantize()), qx.pack_q8x(g.q, g.scale)
    elif kind == "IQ4":  # IQ4_XS's float32 scales d * (sc - 32), some zero
        g = Iq4Groups(rng.integers(0, 16, (N, K)).astype(np.uint8), f16(N, K // 32) * rng.integers(-32, 32, (
            N, K // 32)).astype(np.float32))
        g.scale[0, 0], g.scale[20, 1] = 0.0, -0.0
        w, packed = torch.from_numpy(g.dequantize()), qx.pack_q4x(g.q, g.scale, None, qx.QX_KINDS["IQ4"])
    else:
        d = f16(N, K // 32)
        g = Int4Groups(rng.integers(0, 16, (N, K)).astype(np.uint8), d, -8 * d if kind == "Q4_0" else f16(N, K // 32))
        if kind == "Q4_1":
            g.q[0, :8], g.offset[0, 0] = 0, 0.0  # zeros
        w, packed = torch.from_numpy(g.dequantize()), qx.pack_q4x(g.q, g.scale, None if kind == "Q4_0" else g.offset)
    k = torch_ops.QX_KINDS[kind]

    def count(w):
        panels = torch_ops.pack_panels(w).numpy()
        return lib.qx_mismatches(packed.ctypes.data, k, K, N, panels.ctypes.data)

    assert count(w) == 0 and qx.rebuilds(lib, "w", packed, k, N, torch_ops.pack_panels(w).numpy())
    off = w.clone()
    for n, c in ((0, 0), (15, 95), (16, 31), (36, 64)):  # first and last row of a panel, the partial panel
        off[n, c] = torch.nextafter(off[n, c], torch.tensor(1.0))
    assert count(off) == 4 and not qx.rebuilds(lib, "w", packed, k, N, torch_ops.pack_panels(off).numpy())
    signed = w.clone()
    signed[signed == 0] = -signed[signed == 0]  # -0.0 where the loader wrote 0.0 (+0.0 where -0.0)
    assert (w == 0).any() and count(signed) == int((w == 0).sum())
    panels = torch_ops.pack_panels(w).numpy()
    bad = max(torch_ops.QX_KINDS.values()) + 1
    assert lib.qx_mismatches(packed.ctypes.data, bad, K, N, panels.ctypes.data) == -1
    assert lib.qx_mismatches(packed.ctypes.data, k, 48, N, panels.ctypes.data) == -1
    assert not qx.rebuilds(lib, "w", packed, k, N + 16, panels)  # another shape: refused before the call


def _q4_k_blocks(rng, N: int, K: int) -> np.ndarray:
    """Random GGUF Q4_K super-blocks for an [N, K] weight (K a multiple of 256): float16 d and dmin, 12 bytes of
    six-bit scales and mins, 128 bytes of nibbles each, flat uint8."""
    nb = N * K // 256
    dd = (rng.standard_normal((nb, 2)) * 0.01).astype(np.float16)
    dd[:3, 1] = 0  # zero mins' scale: offsets -0.0
    rest = rng.integers(0, 256, (nb, 140)).astype(np.uint8)
    return np.concatenate([dd.view(np.uint8), rest], axis=1).reshape(-1)


def test_q4_k_groups_rebuild_the_loaders_weights_and_multiply_to_panel_gemms_bits(qx_tiles):
    """A GGUF file's Q4_K weight (llama.cpp's Q4_K_M files store most linears so): its groups (Int4Groups.from_gguf:
    scale d * sc, offset -(dmin * mn), float32, not float16s) give the loader's float32 weights (the gguf
    package's dequantization) bit for bit; the qx panels of kind Q4_K (`q4_kind`) rebuild them (qx_mismatches 0)
    and multiply to panel_gemm's bits, logits and greedy tokens, every tile row count; and a weight's float16-exact
    groups keep Q4_1's smaller panels."""
    import gguf

    from cpu_kernels import layout as qx
    from cpu_kernels import torch_ops

    lib = torch_ops.lib()
    if lib is None:
        pytest.skip("the AVX2 kernels do not run here")
    rng = np.random.default_rng(4)
    N, K = 40, 512

    T = _gguf_tensor("Q4_K", N, K, _q4_k_blocks(rng, N, K))

    want = gguf.quants.dequantize(T.data, gguf.GGMLQuantizationType.Q4_K).reshape(N, K)  # the loader's values
    g = Int4Groups.from_gguf("x.gguf", T)
    assert g.q.max() <= 15 and g.scale.dtype == np.float32
    np.testing.assert_array_equal(g.dequantize().view(np.uint32), want.view(np.uint32))
    kind = qx.q4_kind(g)
    assert kind == qx.QX_KINDS["Q4_K"] and (g.offset == 0).any()
    w = torch.from_numpy(want)
    panels = torch_ops.pack_panels(w)
    packed, k = qx.gguf_panels(lib, "w", g, panels.numpy())
    assert k == kind and packed.shape == qx.qx_shape(N, K, kind)
    blocks = torch.from_numpy(packed)
    for M in (1, 2, 3, 4, 5, 8, 9, 16, 17):
        x = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32))
        assert torch.equal(torch_ops.qx_gemm(lib, x, blocks, N, kind), torch_ops.panel_gemm(lib, x, panels, N))
        assert torch.equal(torch_ops.qx_gemm(lib, x, blocks, N, kind, greedy=True),
                           torch_ops.panel_gemm(lib, x, panels, N, greedy=True))
    off = w.clone()
    off[N - 1, K - 1] = torch.nextafter(off[N - 1, K - 1], torch.tensor(1.0))
    assert qx.gguf_panels(lib, "w", g, torch_ops.pack_panels(off).numpy()) is None
    f16 = Int4Groups(g.q, g.scale.astype(np.float16).astype(np.float32), g.offset.astype(np.float16).astype(np.float32))
    assert qx.q4_kind(f16) == qx.QX_KINDS["Q4_1"]


def test_q5_0_groups_are_q8_0s_form():
    """A GGUF file's Q5_0 weight (d * (q - 16), q five bits; llama.cpp's K-quant files store it where a row is
    not whole super-blocks of 256, as SmolLM2's 576 are not): Int8Groups with q - 16 in [-16, 15] give the
    loader's float32 weights (the gguf package's) bit for bit, and Q8_0's panels rebuild them."""
    import gguf

    from cpu_kernels import layout as qx
    from enginecore.model_loader import Int8Groups
    from cpu_kernels import torch_ops

    lib = torch_ops.lib()
    if lib is None:
        pytest.skip("the AVX2 kernels do not run here")
    rng = np.random.default_rng(6)
    N, K = 19, 96
    d = (rng.standard_normal((N * K // 32, 1)) * 0.02).astype(np.float16)

    T = _gguf_tensor("Q5_0", N, K, np.concatenate([d.view(np.uint8), rng.integers(0, 256, (N * K // 32, 20)).astype(
        np.uint8)], axis=1), "blk.0.ffn_up.weight")

    want = gguf.quants.dequantize(T.data, gguf.GGMLQuantizationType.Q5_0).reshape(N, K)
    g = Int8Groups.from_gguf("x.gguf", T)
    assert g.q.min() >= -16 and g.q.max() <= 15 and g.q.min() < 0 < g.q.max()
    np.testing.assert_array_equal(g.dequantize().view(np.uint32), want.view(np.uint32))
    panels = torch_ops.pack_panels(torch.from_numpy(want))
    packed, kind = qx.gguf_panels(lib, "w", g, panels.numpy())
    assert kind == qx.QX_KINDS["Q8_0"]
    x = torch.from_numpy(rng.standard_normal((3, K)).astype(np.float32))
    assert torch.equal(torch_ops.qx_gemm(lib, x, torch.from_numpy(packed), N, kind),
                       torch_ops.panel_gemm(lib, x, panels, N))


# IQ4 types: (block bytes, values a block, where each block's float16 is)
IQ4_BLOCKS = {"IQ4_NL": (18, 32, (0,)), "IQ4_XS": (136, 256, (0,))}


@pytest.mark.parametrize("ty", IQ4_BLOCKS)
def test_iq4_groups_rebuild_the_loaders_weights_and_multiply_to_panel_gemms_bits(ty, qx_tiles):
    """llama.cpp's IQ4_NL (d * one of 16 int8 values a nibble indexes; its IQ4_XS files store it where a row is
    not whole super-blocks of 256, as SmolLM2's 576 are not) and IQ4_XS ((d * (sc - 32)) * value, six-bit sc a
    sub-block of 32), read as Iq4Groups from random bytes (every index and scale pattern; d of both signs, some
    zero, some with all 11 significant bits: products of 24): the gguf package's dequantization bit for bit, the
    QX_IQ4 panels (float32 scales, 4-bit indices) rebuild the loader's weights (qx_mismatches 0, and 2 with two
    weights an ulp off) and multiply to panel_gemm's bits and greedy tokens, and the wide form holds them too."""
    import gguf

    from cpu_kernels import layout as qx
    from enginecore.model_loader import Iq4Groups
    from cpu_kernels import torch_ops

    lib = torch_ops.lib()
    if lib is None:
        pytest.skip("the AVX2 kernels do not run here")
    assert Iq4Groups.VALUES.tolist() == list(gguf.quants.IQ4_NL.kvalues)
    rng = np.random.default_rng(10)
    N, K = 37, 512
    size, per, _ = IQ4_BLOCKS[ty]
    raw = rng.integers(0, 256, (N * K // per, size)).astype(np.uint8)
    f = (rng.standard_normal(len(raw)) * 0.01).astype(np.float16)
    f[::7], f[3::7], f[5::7] = 0, -0.0, np.float16(-2047 * 2.0**-17)  # the last: 11 significant bits
    raw[:, :2] = f.view(np.uint8).reshape(-1, 2)
    T = _gguf_tensor(ty, N, K, raw.reshape(-1))

    want = gguf.quants.dequantize(T.data, getattr(gguf.GGMLQuantizationType, ty)).reshape(N, K)
    g = Iq4Groups.from_gguf("x.gguf", T)
    assert qx.kind_of(g) == qx.QX_KINDS["IQ4"] and set(np.unique(g.q).tolist()) == set(range(16))
    np.testing.assert_array_equal(g.dequantize().view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(qx.to_wide(g).dequantize().view(np.uint32), want.view(np.uint32))
    _check_gguf_panels(lib, g, want, "IQ4", rng)


# GGUF types read as the wide form: (block bytes, values a block, where each block's float16s are)
WIDE_BLOCKS = {"Q6_K": (210, 256, (208,)), "Q5_K": (176, 256, (0, 2)), "Q3_K": (110, 256, (108,)),
               "Q2_K": (84, 256, (80, 82)), "Q5_1": (24, 32, (0, 2))}


@pytest.mark.parametrize("ty", [*WIDE_BLOCKS, "Q4_1", "Q4_0", "Q8_0"])
def test_wide_groups_rebuild_the_loaders_weights_and_multiply_to_panel_gemms_bits(ty, qx_tiles):
    """The wide form (WideGroups, QX_I8 panels: int8 weights, float32 scales and offsets per 16): a GGUF file's
    Q6_K, Q5_K, Q3_K, Q2_K and Q5_1 read as it (the gguf package's dequantization bit for bit, random bytes but
    for the float16s: every scale, mask and nibble pattern), and the other forms converted to it
    (`to_wide`: Q4_0's zeros keep their scale's sign, -0.0 offsets where a form has none) rebuild the loader's
    weights (qx_mismatches 0) and multiply to panel_gemm's bits, logits and greedy tokens."""
    import gguf

    from cpu_kernels import layout as qx
    from enginecore.model_loader import Int8Groups, WideGroups
    from cpu_kernels import torch_ops

    lib = torch_ops.lib()
    if lib is None:
        pytest.skip("the AVX2 kernels do not run here")
    rng = np.random.default_rng(8)
    N, K = 37, 512
    if ty in WIDE_BLOCKS:
        size, per, at = WIDE_BLOCKS[ty]
        raw = rng.integers(0, 256, (N * K // per, size)).astype(np.uint8)
        for a in at:  # d (and dmin or m): small float16s of both signs, some zero
            f = (rng.standard_normal(len(raw)) * 0.01).astype(np.float16)
            f[::7], f[3::7] = 0, -0.0
            raw[:, a : a + 2] = f.view(np.uint8).reshape(-1, 2)

        T = _gguf_tensor(ty, N, K, raw.reshape(-1))

        want = gguf.quants.dequantize(T.data, getattr(gguf.GGMLQuantizationType, ty)).reshape(N, K)
        g = WideGroups.from_gguf("x.gguf", T)
    else:
        d = (rng.standard_normal((N, K // 32)) * 0.02).astype(np.float16).astype(np.float32)
        if ty == "Q8_0":
            src = Int8Groups(rng.integers(-128, 128, (N, K)).astype(np.int8), d)
        else:
            m = -8 * d if ty == "Q4_0" else (rng.standard_normal(d.shape) * 0.02).astype(np.float16).astype(np.float32)
            src = Int4Groups(rng.integers(0, 16, (N, K)).astype(np.uint8), d, m)
            src.q[:, :4] = 8  # Q4_0's zeros: -0.0 where the scale is negative
        want = src.dequantize()
        if ty == "Q4_0":
            assert (np.signbit(want) & (want == 0)).any()
        g = qx.to_wide(src)
    assert qx.kind_of(g) == qx.QX_KINDS["I8"] and g.q.dtype == np.int8
    np.testing.assert_array_equal(g.dequantize().view(np.uint32), want.view(np.uint32))
    _check_gguf_panels(lib, g, want, "I8", rng)


def _check_gguf_panels(lib, g, want: np.ndarray, kind_name: str, rng) -> None:
    """A GGUF weight's groups `g` pack into qx panels of `kind_name` (`gguf_panels`' check passes against the
    loaded float32 weights `want`) that multiply to panel_gemm's bits, logits and greedy tokens, 1 to 17 rows; two
    weights one ulp off (k 5 and K - 3: in the wide form under a group's first scale and its second) are
    counted."""
    from cpu_kernels import layout as qx
    from cpu_kernels import torch_ops

    N, K = want.shape
    panels = torch_ops.pack_panels(torch.from_numpy(want))
    packed, kind = qx.gguf_panels(lib, "w", g, panels.numpy())
    assert kind == qx.QX_KINDS[kind_name] and packed.shape == qx.qx_shape(N, K, kind)
    blocks = torch.from_numpy(packed)
    for M in (1, 2, 3, 4, 5, 9, 16, 17):
        x = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32))
        assert torch.equal(torch_ops.qx_gemm(lib, x, blocks, N, kind), torch_ops.panel_gemm(lib, x, panels, N))
        assert torch.equal(torch_ops.qx_gemm(lib, x, blocks, N, kind, greedy=True),
                           torch_ops.panel_gemm(lib, x, panels, N, greedy=True))
    off = want.copy()
    off[N - 1, 5] = np.nextafter(off[N - 1, 5], np.float32(1))
    off[0, K - 3] = np.nextafter(off[0, K - 3], np.float32(-1))
    assert lib.qx_mismatches(packed.ctypes.data, kind, K, N, torch_ops.pack_panels(torch.from_numpy(off)).numpy(
        ).ctypes.data) == 2


def test_a_fused_linears_parts_of_several_forms_assemble_wide_for_the_panels_only():
    """`gguf_linear_groups`' assembly of a fused linear (`_assemble`): a lone part as it is; Q4_0 and Q4_1 parts
    as one Int4Groups for `--quantization gguf`'s 4-bit linears (wide=False), as WideGroups for the qx panels,
    each part's weights to the bit (Q4_0's zeros their scale's sign); 4- and 8-bit parts wide, or not at all."""
    from cpu_kernels import layout as qx
    from enginecore.model_loader import Int8Groups, WideGroups

    rng = np.random.default_rng(9)
    d = -np.abs(rng.standard_normal((8, 2)).astype(np.float16).astype(np.float32))  # negative: -0.0 zeros
    q40 = Int4Groups(rng.integers(0, 16, (8, 64)).astype(np.uint8), d, -8 * d)
    q41 = Int4Groups(rng.integers(0, 16, (4, 64)).astype(np.uint8), d[:4], d[:4] * 3)
    q8 = Int8Groups(rng.integers(-128, 128, (4, 64)).astype(np.int8), d[:4])
    parts = [(slice(0, 8), q40), (slice(8, 12), q41)]
    assert qx._assemble(8, [(slice(0, 8), q40)], True) is q40
    four = qx._assemble(12, parts, wide=False)
    assert type(four) is Int4Groups and np.array_equal(four.q[8:], q41.q)
    wide = qx._assemble(12, parts, wide=True)
    assert type(wide) is WideGroups
    want = np.concatenate([q40.dequantize(), q41.dequantize()])
    assert (np.signbit(want) & (want == 0)).any()
    assert np.array_equal(wide.dequantize().view(np.uint32), want.view(np.uint32))
    mixed = [(slice(0, 8), q40), (slice(8, 12), q8)]
    assert qx._assemble(12, mixed, wide=False) is None and type(qx._assemble(12, mixed, wide=True)) is WideGroups


def test_a_q4_k_gguf_files_linears_get_q4_k_panels(tmp_path):
    """A small llama GGUF file whose linears are Q4_K (q and k rows interleaved as llama.cpp stores them, q, k and
    v fused, gate and up fused) and, in one layer, Q5_0 (v and o), Q6_K (down) and IQ4_NL (gate and up), in the
    other Q2_K (o), Q3_K (down), Q5_1 (gate) and IQ4_XS (up): every linear's groups rebuild the loaded float32
    weights (the gguf package's dequantization for the random-byte ones) bit for bit, as packed panels, in the
    fused order (`gguf_linear_groups`): Q4_K's, Q8_0's and IQ4's kinds, the wide one (I8) for Q6_K, Q2_K, Q3_K and
    fused linears with parts of two forms; `--quantization gguf`'s 4-bit linears take none of them (their blocks hold
    float16 scales)."""
    import gguf

    from cpu_kernels import layout as qx
    from enginecore.arch import fused_slices
    from cpu_kernels import torch_ops

    lib = torch_ops.lib()
    if lib is None:
        pytest.skip("the AVX2 kernels do not run here")
    H, I, V, nh, nkv, L = 256, 512, 64, 4, 2, 2
    path = str(tmp_path / "q4k.gguf")
    wr = gguf.GGUFWriter(path, "llama")
    wr.add_block_count(L), wr.add_embedding_length(H), wr.add_feed_forward_length(I), wr.add_head_count(nh)
    wr.add_head_count_kv(nkv), wr.add_context_length(64), wr.add_vocab_size(V)
    rng = np.random.default_rng(1)
    wr.add_tensor("token_embd.weight", rng.standard_normal((V, H)).astype(np.float32))
    wr.add_tensor("output_norm.weight", np.ones(H, np.float32))
    hd = H // nh
    for i in range(L):
        wr.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(H, np.float32))
        wr.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(H, np.float32))
        for n, (rows, cols) in {"attn_q": (H, H), "attn_k": (nkv * hd, H), "attn_v": (nkv * hd, H),
                                "attn_output": (H, H), "ffn_gate": (I, H), "ffn_up": (I, H), "ffn_down": (H, I)}.items():
            # Q2_K, Q3_K, Q5_1, IQ4_XS, IQ4_NL: random bytes
            ty = {(0, "attn_output"): "Q2_K", (0, "ffn_down"): "Q3_K", (0, "ffn_gate"): "Q5_1",
                  (0, "ffn_up"): "IQ4_XS", (1, "ffn_gate"): "IQ4_NL", (1, "ffn_up"): "IQ4_NL"}.get((i, n))
            if ty is not None:
                size, per, at = {**WIDE_BLOCKS, **IQ4_BLOCKS}[ty]
                blocks = rng.integers(0, 256, (rows * cols // per, size)).astype(np.uint8)
                for a in at:
                    blocks[:, a : a + 2] = (rng.standard_normal((len(blocks), 1)) * 0.01).astype(np.float16).view(
                        np.uint8)
                wr.add_tensor(f"blk.{i}.{n}.weight", blocks.reshape(-1), raw_shape=(rows, cols * size // per),
                              raw_dtype=getattr(gguf.GGMLQuantizationType, ty))
                continue
            if i == 1 and n == "ffn_down":  # Q6_K, as llama.cpp's Q4_K_M stores half the layers' down
                blocks = np.concatenate([rng.integers(0, 256, (rows * cols // 256, 208)).astype(np.uint8),
                                         (rng.standard_normal((rows * cols // 256, 1)) * 1e-3).astype(np.float16).view(
                                             np.uint8)], 1)
                wr.add_tensor(f"blk.{i}.{n}.weight", blocks.reshape(-1), raw_shape=(rows, cols * 210 // 256),
                              raw_dtype=gguf.GGMLQuantizationType.Q6_K)
                continue
            if i == 1 and n in ("attn_v", "attn_output"):  # Q5_0: q and k Q4_K, so qkv has both forms
                d = (rng.standard_normal((rows * cols // 32, 1)) * 0.02).astype(np.float16)
                blocks = np.concatenate([d.view(np.uint8), rng.integers(0, 256, (len(d), 20)).astype(np.uint8)], 1)
                wr.add_tensor(f"blk.{i}.{n}.weight", blocks.reshape(-1), raw_shape=(rows, cols * 22 // 32),
                              raw_dtype=gguf.GGMLQuantizationType.Q5_0)
                continue
            wr.add_tensor(f"blk.{i}.{n}.weight", _q4_k_blocks(rng, rows, cols), raw_shape=(rows, cols * 144 // 256),
                          raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    wr.write_header_to_file(), wr.write_kv_data_to_file(), wr.write_tensors_to_file(), wr.close()

    src = resolve_model(path)
    dense = dict(src.iter_weights())
    groups, head = qx.gguf_linear_groups(src, src.config)
    assert len(groups) == 4 * L and head is None
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for (layer, stored), g in groups.items():
        mod = "self_attn" if stored in ("qkv_proj", "o_proj") else "mlp"
        names = parts.get(stored, (stored,))
        w = np.concatenate([dense[f"model.layers.{layer}.{mod}.{n}.weight"] for n in names])
        if len(names) > 1:
            assert [s.stop - s.start for s in fused_slices(src.config, stored, 1).values()] == [
                dense[f"model.layers.{layer}.{mod}.{n}.weight"].shape[0] for n in names]
        got = qx.gguf_panels(lib, stored, g, torch_ops.pack_panels(torch.from_numpy(w)).numpy())
        # Q5_0 in Q8_0's form, IQ4_NL in IQ4's; layer 1's qkv (Q4_K and Q5_0 parts) and Q6_K down wide, and layer
        # 0's o, down and gate_up (Q5_1 and IQ4_XS parts)
        kind = {(1, "o_proj"): "Q8_0", (1, "gate_up_proj"): "IQ4", (1, "qkv_proj"): "I8", (1, "down_proj"): "I8",
                (0, "o_proj"): "I8", (0, "down_proj"): "I8", (0, "gate_up_proj"): "I8"}.get((layer, stored), "Q4_K")
        assert got is not None and got[1] == qx.QX_KINDS[kind], (layer, stored)
    assert not qx.gguf_linear_groups(src, src.config, ("Q4_0", "Q4_1", "Q8_0"))[0]


@pytest.fixture(scope="module")
def engines():
    kw = dict(backend="torch", platform="cpu", max_model_len=256, max_num_seqs=4, enable_prefix_caching=False)
    q = LLM(quantization="gguf", **kw)
    f = LLM(**kw)
    yield q, f
    for e in (q, f):
        e.llm_engine.core.shutdown()


def test_engine_answers_like_the_dequantized_model(engines):
    q, f = engines
    tok = q.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
               for c in ("What is the capital of France?", "Name three colours.")]
    sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)
    got, want = q.generate(prompts, sp, use_tqdm=False), f.generate(prompts, sp, use_tqdm=False)
    mods = q.llm_engine.core.runner.model
    assert type(mods.layers[0].mlp.down_proj).__name__ == "Int4Linear"
    for a, b in zip(got, want):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids[:3] == cb.token_ids[:3], (ca.text, cb.text)
        for la, lb, t in zip(ca.logprobs[:3], cb.logprobs[:3], ca.token_ids[:3]):
            assert abs(la[t].logprob - lb[t].logprob) < 0.15


def test_decode_layers_in_one_call_run_the_4_bit_linears_bit_identically(engines, one_call_vs_python_layers):
    """A gguf decode step's layers in one C call (cpu_layers.DecodeLayers): the Q4 kernel for steps of up to
    its row limit, the float32 weights beyond, as Int4Linear chooses; the same tokens and logprobs, to the bit,
    as the Python layers."""
    from cpu_kernels import torch_ops

    q, _ = engines
    if torch_ops.lib() is None:
        pytest.skip("the AVX2 kernels do not run here")
    layers = q.llm_engine.core.runner._decode_layers()
    assert layers is not None and layers.layers[0].down_q4 is not None and layers.layers[0].down_rows > 0
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": list(range(100 + i, 140 + 3 * i))} for i in range(3)]
    assert one_call_vs_python_layers(q, prompts, sp)
    # greedy steps take the logits path with a small-rows LM head: a row's token must not depend on whether
    # its neighbours need logits (the logits path gives chunks of few rows to the Q8 head)
    assert q.llm_engine.core.runner.model.greedy_tokens(torch.zeros(40, 576)) is None


def test_float32_decode_multiplies_the_files_4_bit_blocks_to_the_same_bits(engines, one_call_vs_python_layers):
    """Without the flag, the dequantized model's linears also keep the file's Q4_1 blocks and its LM head its
    Q8_0 ones (torchengine.quant.attach_qx), which decode steps of few rows multiply instead of the float32
    weights: the same tokens and logprobs, to the bit, as with the float32 weights alone, in the one-call layers
    and the Python ones (greedy tokens and logits: logprobs=2 takes the logits path, a greedy step the argmax)."""
    from cpu_kernels import torch_ops

    _, f = engines
    if torch_ops.lib() is None:
        pytest.skip("the AVX2 kernels do not run here")
    runner = f.llm_engine.core.runner
    lins = [m for m in runner.model.modules() if isinstance(m, CpuLinear) and m.qx is not None]
    assert len(lins) == 4 * runner.model.arch.num_hidden_layers
    assert all(m.qx_kind == torch_ops.QX_KINDS["Q4_1"] for m in lins) and runner.model.lm_head.qx is not None
    layers = runner._decode_layers()
    assert layers is not None and layers.layers[0].down_qx is not None
    assert layers.layers[0].qx_rows == torch_ops.qx_max_rows()[torch_ops.QX_KINDS["Q4_1"]]
    prompts = [{"prompt_token_ids": list(range(200 + i, 230 + 5 * i))} for i in range(3)]
    _same_with_and_without_qx(f, lins, prompts, one_call_vs_python_layers)


def _same_with_and_without_qx(llm, lins, prompts, one_call_vs_python_layers) -> None:
    """`llm`'s outputs with its linears' (`lins`) and LM head's qx panels are those without them: the same tokens
    and logprobs, to the bit, in the one-call layers and the Python ones (greedy tokens and logits: logprobs=2
    takes the logits path, a greedy step the argmax)."""
    runner = llm.llm_engine.core.runner
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)  # the head's argmax, no logits
    assert one_call_vs_python_layers(llm, prompts, sp)
    with_qx, tokens = llm.generate(prompts, sp, use_tqdm=False), llm.generate(prompts, greedy, use_tqdm=False)
    saved, head = [(m, m.qx) for m in lins], runner.model.lm_head.qx
    try:
        runner.model.lm_head.qx = None
        for m in lins:
            m.qx = None
        runner._decode_layers_bound = None  # bound again, without them
        assert runner._decode_layers().layers[0].down_qx is None
        float32 = llm.generate(prompts, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == \
            [o.outputs[0].token_ids for o in tokens]
    finally:
        runner.model.lm_head.qx = head
        for m, t in saved:
            m.qx = t
        runner._decode_layers_bound = None
    assert_same_outputs(with_qx, float32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_float32_decode_multiplies_a_16_bit_checkpoints_values_to_the_same_bits(
        dtype, tiny_bf16_llama_dir, tiny_f16_llama_dir, one_call_vs_python_layers):
    """A bfloat16 (or float16) checkpoint served in float32 (the CPU's default): every linear and the LM head also
    keep their weights in those 16 bits (attach_qx), which decode steps of up to qx_max_rows()[kind] rows multiply:
    the same tokens and logprobs, to the bit, as the float32 weights alone."""
    from cpu_kernels import torch_ops

    if torch_ops.lib() is None:
        pytest.skip("the AVX2 kernels do not run here")
    path = tiny_bf16_llama_dir if dtype == "bfloat16" else tiny_f16_llama_dir
    llm = LLM(model=path, backend="torch", platform="cpu", dtype="float32", max_model_len=128,
              max_num_seqs=4, enable_prefix_caching=False)
    try:
        runner = llm.llm_engine.core.runner
        lins = [m for m in runner.model.modules() if isinstance(m, CpuLinear) and m.qx is not None]
        assert len(lins) == 4 * runner.model.arch.num_hidden_layers
        kind = torch_ops.QX_KINDS["BF16" if dtype == "bfloat16" else "F16"]
        assert all(m.qx_kind == kind for m in lins) and runner.model.lm_head.qx_kind == kind
        assert runner._decode_layers().layers[0].qx_rows == torch_ops.qx_max_rows()[kind]
        prompts = [{"prompt_token_ids": list(range(300 + i, 320 + 7 * i))} for i in range(3)]
        _same_with_and_without_qx(llm, lins, prompts, one_call_vs_python_layers)
    finally:
        llm.llm_engine.core.shutdown()


def test_float32_decode_multiplies_a_mixed_gguf_files_types_to_the_same_bits(mixed_gguf, one_call_vs_python_layers):
    """A GGUF file whose linears mix llama.cpp's types as its K-quant and IQ4_XS files do (`mixed_gguf`: Q4_1,
    Q8_0, Q5_0, Q4_K, Q6_K, IQ4_XS and IQ4_NL; q, k and v of both forms in half the layers): every linear and the
    LM head keep their weights as stored, each layer's linears in their own kinds (Q4_1, the wide form, Q8_0's,
    Q4_K, IQ4), and decode steps multiply them to the float32 weights' tokens and logprobs, to the bit, in the one-call
    and Python layers."""
    from cpu_kernels import torch_ops

    if torch_ops.lib() is None:
        pytest.skip("the AVX2 kernels do not run here")
    llm = LLM(model=mixed_gguf, backend="torch", platform="cpu", dtype="float32", max_model_len=128,
              max_num_seqs=4, enable_prefix_caching=False)
    try:
        runner = llm.llm_engine.core.runner
        K = torch_ops.QX_KINDS
        kinds = [(l.attn.qkv_proj.qx_kind, l.attn.o_proj.qx_kind, l.mlp.gate_up_proj.qx_kind, l.mlp.down_proj.qx_kind)
                 for l in runner.model.layers]
        assert all(getattr(m, "qx", None) is not None for l in runner.model.layers
                   for m in (l.attn.qkv_proj, l.attn.o_proj, l.mlp.gate_up_proj, l.mlp.down_proj))
        assert kinds[0] == (K["I8"], K["Q8_0"], K["Q4_1"], K["Q4_K"])  # v Q8_0 with q, k Q4_1: the wide form
        assert kinds[1] == (K["Q4_1"], K["Q8_0"], K["Q4_1"], K["Q4_K"])
        assert kinds[11] == (K["Q4_1"], K["Q8_0"], K["Q4_1"], K["IQ4"])  # IQ4_XS
        assert kinds[15] == (K["Q4_1"], K["Q8_0"], K["Q4_1"], K["Q4_K"])
        assert kinds[21] == (K["Q4_1"], K["Q8_0"], K["IQ4"], K["I8"])  # IQ4_NL, Q6_K
        assert runner.model.lm_head.qx_kind == K["Q8_0"]
        lins = [m for m in runner.model.modules() if isinstance(m, CpuLinear) and m.qx is not None]
        prompts = [{"prompt_token_ids": list(range(300 + i, 320 + 7 * i))} for i in range(3)]
        _same_with_and_without_qx(llm, lins, prompts, one_call_vs_python_layers)
    finally:
        llm.llm_engine.core.shutdown()


def test_attach_qx_gives_bfloat16_panels_only_to_bfloat16_weights_that_fit(monkeypatch):
    """attach_qx's 16-bit part: a weight every value of which is a bfloat16 gets QX_BF16 panels, and so does
    the LM head (the embedding, tied), one of float16s QX_F16 ones; one value off, or an input width the panels'
    groups of 32 do not divide, keeps float32 only; and nothing where the copies would take more than a quarter
    of the memory available."""
    from types import SimpleNamespace

    from cpu_kernels import torch_ops
    from torchengine import quant
    from torchengine.cpu_transform import CpuLMHead
    from torchengine.model import Linear

    if torch_ops.lib() is None:
        pytest.skip("the AVX2 kernels do not run here")

    def linear(n, k, off=False):
        w = torch.randn(n, k).bfloat16().float()
        if off:
            w[n - 1, k - 1] = torch.nextafter(w[n - 1, k - 1], torch.tensor(2.0))  # one ulp: not a bfloat16
        lin = Linear(k, n, bias=False)
        lin.weight = torch.nn.Parameter(w, requires_grad=False)
        return CpuLinear.pack(lin, torch_ops.lib())  # attach_qx reads the panels apply_cpu_kernels leaves

    def model():
        f16 = linear(40, 64)
        f16.panels = torch_ops.pack_panels(torch.randn(40, 64).half().float())  # float16s, not bfloat16s
        lins = (linear(40, 64), linear(40, 64, off=True), linear(40, 48), f16)
        head = torch_ops.pack_panels(torch.randn(100, 64).bfloat16().float())  # the embedding, tied
        return lins, SimpleNamespace(lm_head=CpuLMHead(head, 100, torch_ops.lib()),
                                     named_modules=lambda: enumerate(lins))

    (good, off, narrow, f16), m = model()
    assert quant.attach_qx(m, SimpleNamespace(kind="hf")) == 3
    assert good.qx_kind == m.lm_head.qx_kind == torch_ops.QX_KINDS["BF16"] and off.qx is None and narrow.qx is None
    assert f16.qx_kind == torch_ops.QX_KINDS["F16"]
    x = torch.randn(3, 64)
    assert torch.equal(torch_ops.qx_gemm(torch_ops.lib(), x, m.lm_head.qx, 100, m.lm_head.qx_kind),
                       torch_ops.panel_gemm(torch_ops.lib(), x, m.lm_head.panels, 100))
    monkeypatch.setattr("enginecore.kv_cache.available_memory_bytes", lambda: 4 * 2 * 40 * 64)  # too little
    (good, _, _, f16), m = model()
    assert quant.attach_qx(m, SimpleNamespace(kind="hf")) == 0 and good.qx is None and m.lm_head.qx is None
    assert f16.qx is None


def test_flag_refused_where_it_cannot_run(tiny_model_dir):
    with pytest.raises(ConfigError, match="torch --platform cpu only"):
        EngineArgs(quantization="gguf", backend="jax", platform="cpu").create_engine_config()
    with pytest.raises(ConfigError, match="tensor-parallel"):
        EngineArgs(quantization="gguf", platform="cpu", tensor_parallel_size=2).create_engine_config()
    cfg = EngineArgs(quantization="gguf", platform="cpu").create_engine_config()
    assert cfg.device_config.backend == "torch"  # auto picks the backend that has the kernel
    with pytest.raises(ConfigError, match="must be gguf"):
        EngineArgs(quantization="awq").create_engine_config()
    with pytest.raises(ConfigError, match="no Q4_0/Q4_1"):
        LLM(tiny_model_dir("llama"), quantization="gguf", platform="cpu", max_model_len=64)
