"""torchengine's attention backends against the pure-torch reference of the kernels' contract."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from torchengine.attention import AttentionMetadata, DecodeGroup, TorchAttention  # noqa: E402
from triton_kernels import reference


def ragged_step(rng, q_lens, kv_lens, block_size, num_blocks, Hq, Hkv, D, pad_tokens=3, pad_reqs=2):
    """A step in StepBatch layout (decode requests first), its tensors and a random cache."""
    R = len(q_lens)
    q_lens, kv_lens = np.array(q_lens), np.array(kv_lens)
    T = int(q_lens.sum())
    Tp, Rp = T + pad_tokens, R + pad_reqs
    B = int(-(-kv_lens.max() // block_size)) + 1
    cu = np.zeros(Rp + 1, np.int32)
    cu[1 : R + 1] = np.cumsum(q_lens)
    cu[R + 1 :] = T
    kv = np.zeros(Rp, np.int32)
    kv[:R] = kv_lens
    perm = rng.permutation(np.arange(1, num_blocks))  # distinct blocks, never the null block
    tables = np.zeros((Rp, B), np.int32)
    tables[:R] = perm[: R * B].reshape(R, B)
    slots = np.full(Tp, -1, np.int64)
    for r in range(R):
        pos = np.arange(kv_lens[r] - q_lens[r], kv_lens[r])
        slots[cu[r] : cu[r + 1]] = tables[r, pos // block_size] * block_size + pos % block_size
    batch = SimpleNamespace(num_reqs=R, num_tokens=T, cu_q_lens=cu, kv_lens=kv, block_tables=tables,
                            distribution=np.array([int((q_lens == 1).sum()), R, R], np.int32))
    t = lambda a: torch.from_numpy(a)  # noqa: E731
    meta = AttentionMetadata(slot_mapping=t(slots[:T]), cu_q_lens=t(cu), kv_lens=t(kv), block_tables=t(tables),
                             num_reqs=R, num_tokens=T)
    g = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    q = torch.randn(T, Hq, D, generator=g)
    k = torch.randn(T, Hkv, D, generator=g)
    v = torch.randn(T, Hkv, D, generator=g)
    kc = torch.randn(num_blocks, block_size, Hkv, D, generator=g)
    vc = torch.randn(num_blocks, block_size, Hkv, D, generator=g)
    return batch, meta, q, k, v, kc, vc


def reference_out(meta, q, k, v, kc, vc, sm_scale, sliding_window):
    kc, vc = kc.clone(), vc.clone()
    reference.ref_reshape_and_cache(k, v, kc, vc, meta.slot_mapping)
    out = reference.ref_unified_attention(q, kc, vc, meta.cu_q_lens, meta.kv_lens, meta.block_tables,
                                          sm_scale=sm_scale, sliding_window=sliding_window, num_reqs=meta.num_reqs)
    return out, kc, vc


CASES = {
    # (q_lens, kv_lens): decode requests first, then prefills (q == kv), then chunks with context (q < kv)
    "decode": ([1, 1, 1, 1], [1, 17, 40, 5]),
    "prefill": ([7, 33], [7, 33]),
    "mixed": ([1, 1, 12, 5, 20], [9, 50, 12, 21, 64]),
    # lengths far apart: several groups per kind
    "spread": ([1, 1, 1, 40, 3, 2], [90, 2, 30, 40, 10, 2]),
    # one group holding the whole batch in order (no gather, no scatter)
    "decode-alike": ([1, 1, 1], [20, 30, 25]),
    "one-prefill": ([9], [9]),
}


def cpu_lib():
    from cpu_kernels import torch_ops

    lib, why = torch_ops.load()
    if lib is None:
        pytest.skip(f"the AVX2 kernels do not run here: {why}")
    return lib


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("pad_tokens", [0, 3])
@pytest.mark.parametrize("kernels", ["torch", "avx2"])
def test_torch_attention_matches_reference(case, heads, window, pad_tokens, kernels):
    """Both ways: torch's ops only, and the AVX2 kernels' (cache writes, decodes straight from the cache)."""
    Hq, Hkv = heads
    D, bs = 16, 8
    rng = np.random.default_rng(0)
    batch, meta, q, k, v, kc, vc = ragged_step(rng, *CASES[case], bs, 128, Hq, Hkv, D, pad_tokens=pad_tokens)
    backend = TorchAttention(num_heads=Hq, num_kv_heads=Hkv, head_dim=D, sliding_window=window,
                             cpu_lib=cpu_lib() if kernels == "avx2" else None)
    meta.groups = backend.plan(batch, torch.device("cpu"), bs)
    decodes = int((np.diff(batch.cu_q_lens[: batch.num_reqs + 1]) == 1).sum())
    if kernels == "avx2":  # all decodes in one group, attended by the kernel
        assert sum(isinstance(g, DecodeGroup) for g in meta.groups) == (decodes > 0)
        assert all(g.tokens.shape[0] == decodes for g in meta.groups if isinstance(g, DecodeGroup))
    elif case in ("decode-alike", "one-prefill"):
        assert len(meta.groups) == 1 and meta.groups[0].whole_batch
    want, want_kc, want_vc = reference_out(meta, q, k, v, kc, vc, backend.sm_scale, window)
    got = backend.forward(q, k, v, kc, vc, meta)
    torch.testing.assert_close(kc, want_kc, rtol=0, atol=0)
    torch.testing.assert_close(vc, want_vc, rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_triton_attention_wrapper():
    """TritonAttention passes the metadata the kernels expect: on a GPU, or in the Triton interpreter on CPU."""
    import triton_kernels as tk

    if not tk.HAS_TRITON:
        pytest.skip("triton is not installed")
    if tk.interpreted():
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        pytest.skip("needs a GPU or TRITON_INTERPRET=1")
    from torchengine.attention import TritonAttention

    Hq, Hkv, D, bs = 4, 2, 16, 8
    rng = np.random.default_rng(1)
    batch, meta, q, k, v, kc, vc = ragged_step(rng, [1, 6], [10, 6], bs, 16, Hq, Hkv, D, pad_tokens=0, pad_reqs=0)
    meta.cu_q_lens, meta.kv_lens, meta.block_tables = (meta.cu_q_lens.int(), meta.kv_lens.int(),
                                                       meta.block_tables.int())
    backend = TritonAttention(num_heads=Hq, num_kv_heads=Hkv, head_dim=D, sliding_window=None)
    want, want_kc, _ = reference_out(meta, q, k, v, kc, vc, backend.sm_scale, None)
    for name in ("slot_mapping", "cu_q_lens", "kv_lens", "block_tables"):
        setattr(meta, name, getattr(meta, name).to(device))
    q, k, v, kc, vc = (t.to(device) for t in (q, k, v, kc, vc))
    got = backend.forward(q, k, v, kc, vc, meta)
    torch.testing.assert_close(kc.cpu(), want_kc, rtol=0, atol=0)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_lens", [[1500], [1500, 900, 1200]])
@pytest.mark.parametrize("window", [None, 700])
def test_cpu_decode_attention_long_contexts(kv_lens, window):
    """Contexts long enough for the AVX2 decode attention to use its threads: one request (a task per query
    head) and three (a task per kv head) against the reference."""
    Hq, Hkv, D, bs = 8, 2, 32, 16
    rng = np.random.default_rng(2)
    batch, meta, q, k, v, kc, vc = ragged_step(rng, [1] * len(kv_lens), kv_lens, bs, 400, Hq, Hkv, D, pad_tokens=0)
    backend = TorchAttention(num_heads=Hq, num_kv_heads=Hkv, head_dim=D, sliding_window=window, cpu_lib=cpu_lib())
    meta.groups = backend.plan(batch, torch.device("cpu"), bs)
    assert len(meta.groups) == 1 and isinstance(meta.groups[0], DecodeGroup)
    want, _, _ = reference_out(meta, q, k, v, kc, vc, backend.sm_scale, window)
    torch.testing.assert_close(backend.forward(q, k, v, kc, vc, meta), want, rtol=1e-5, atol=1e-5)
