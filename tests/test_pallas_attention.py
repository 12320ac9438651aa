"""Ragged paged attention: the Pallas kernel (TPU interpret mode, race detection on)
against the pure-JAX reference, and the reference against a naive numpy loop.

Interpret mode compiles slowly (seconds per configuration), so each kernel
case covers many features at once and compiled kernels are reused.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import (
    estimate_vmem_bytes,
    ragged_paged_attention,
    ref_ragged_paged_attention,
    sharded_ragged_paged_attention,
    validate_inputs_dynamic,
)
from pallas_kernels.ragged_paged_attention import kv_load_mode, load_kv_head

# random_seed shuffles the "parallel" q-block axis: a hidden dependency between
# q blocks (the kernel claims none) would show up as a mismatch or a race.
INTERPRET = pltpu.InterpretParams(detect_races=True, random_seed=0)


# The interpreted kernel is a large XLA program; its CPU code speed hardly matters.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def _run_fast(fn, *args):
    return fn.lower(*args).compile(_FAST_COMPILE)(*args)


@functools.cache
def _compiled_kernel(kw_items, avals):
    fn = jax.jit(functools.partial(ragged_paged_attention, interpret=INTERPRET, **dict(kw_items)), donate_argnums=3)
    return fn.lower(*avals).compile(_FAST_COMPILE)


def _reference(args, **kw):
    return jax.jit(functools.partial(ref_ragged_paged_attention, **kw))(*args)


def _races_found() -> bool:
    # jax 0.10 keeps the race-detector state of the last interpreted kernel here.
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    return ipc.races is not None and ipc.races.races_found


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    # A kernel that raised leaves the interpreter's shared state behind.
    yield
    pltpu.reset_tpu_interpret_mode_state()


def make_batch(seed, reqs, *, T, R, block_size, blocks_per_seq, num_blocks, Hq, Hkv, D, dtype, pad_head_dim=None):
    """A ragged batch: reqs = [(q_len, kv_len)] already ordered decode, prefill, mixed.

    Blocks are distinct, random and never the null block 0. With pad_head_dim the
    data has D real dims and is zero-padded to pad_head_dim (what the TPU caller does).
    """
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, Hq, D), np.float32)
    k = rng.standard_normal((T, Hkv, D), np.float32)
    v = rng.standard_normal((T, Hkv, D), np.float32)
    cache = rng.standard_normal((num_blocks, block_size, 2 * Hkv, D), np.float32)
    if pad_head_dim:
        widen = lambda x: np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad_head_dim - D)])  # noqa: E731
        q, k, v, cache = (widen(x) for x in (q, k, v, cache))
    kv_lens = np.zeros(R, np.int32)
    cu = np.zeros(R + 1, np.int32)
    tables = np.zeros(R * blocks_per_seq, np.int32)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    for r, (ql, kl) in enumerate(reqs):
        kv_lens[r], cu[r + 1] = kl, cu[r] + ql
        for j in range(-(-kl // block_size)):
            tables[r * blocks_per_seq + j] = free.pop()
    cu[len(reqs) + 1:] = cu[len(reqs)]
    # decode: leading q_len == 1; prefill: then q_len == kv_len (no cached context); the rest mixed.
    decode = next((i for i, (ql, _) in enumerate(reqs) if ql != 1), len(reqs))
    prefill = decode + next((i for i, (ql, kl) in enumerate(reqs[decode:]) if ql != kl), len(reqs) - decode)
    dist = np.array([decode, prefill, len(reqs)], np.int32)
    arrays = tuple(jnp.asarray(x, dtype) for x in (q, k, v, cache))
    return arrays + tuple(jnp.asarray(x) for x in (kv_lens, tables, cu, dist))


def naive_attention(q, k, v, cache, kv_lens, blocks, cu, dist, *, sm_scale, sliding_window=None, soft_cap=None):
    """Request by request, token by token, float64."""
    q, k, v, cache = (np.asarray(x, np.float64) for x in (q, k, v, cache))
    kv_lens, blocks, cu, dist = (np.asarray(x) for x in (kv_lens, blocks, cu, dist))
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    bs = cache.shape[1]
    bps = blocks.shape[0] // kv_lens.shape[0]
    cache, out = cache.copy(), np.zeros_like(q)
    for r in range(dist[2]):
        s, ql, kl = cu[r], cu[r + 1] - cu[r], kv_lens[r]
        for j in range(ql):
            pos = kl - ql + j
            cache[blocks[r * bps + pos // bs], pos % bs] = np.stack([k[s + j], v[s + j]], 1).reshape(2 * Hkv, D)
    for r in range(dist[2]):
        s, ql, kl = cu[r], cu[r + 1] - cu[r], kv_lens[r]
        kv = cache[blocks[r * bps: r * bps + -(-kl // bs)]].reshape(-1, 2 * Hkv, D)[:kl]
        for j in range(ql):
            pos, idx = kl - ql + j, np.arange(kl)
            visible = idx <= pos
            if sliding_window:
                visible &= idx > pos - sliding_window
            for h in range(Hq):
                kvh = h // (Hq // Hkv)
                logits = kv[:, 2 * kvh] @ q[s + j, h] * sm_scale
                if soft_cap:
                    logits = soft_cap * np.tanh(logits / soft_cap)
                p = np.exp(np.where(visible, logits, -np.inf) - logits[visible].max())
                out[s + j, h] = p @ kv[:, 2 * kvh + 1] / p.sum()
    return out, cache


def run_kernel(args, **kw):
    """Runs the kernel on a copy of the cache (it is donated) and checks for races."""
    q, k, v, cache, *meta = args
    avals = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args)
    kernel = _compiled_kernel(tuple(sorted(kw.items())), avals)
    out, new_cache = jax.block_until_ready(kernel(q, k, v, jnp.array(cache, copy=True), *meta))
    assert not _races_found(), "the race detector flagged the kernel"
    return out, new_cache


def check_against_reference(args, *, atol, rtol=0.0, **kw):
    attn_kw = {n: kw[n] for n in ("sm_scale", "sliding_window", "soft_cap") if n in kw}
    validate_inputs_dynamic(*args)
    ref_out, ref_cache = _reference(args, **attn_kw)
    out, cache = run_kernel(args, **kw)
    total = int(args[6][int(args[7][2])])
    np.testing.assert_allclose(np.asarray(out[:total], np.float32), np.asarray(ref_out[:total], np.float32),
                               atol=atol, rtol=rtol)
    assert np.all(np.asarray(out[total:], np.float32) == 0), "padding rows must be zero"
    # The fused write copies K/V bit for bit, and touches nothing else.
    np.testing.assert_array_equal(np.asarray(cache, np.float32), np.asarray(ref_cache, np.float32))
    check_kv_write(args, cache)
    return out, cache


def check_kv_write(args, new_cache):
    """Directly: each real token's K/V sit at (block, slot) of its position; every other slot is unchanged."""
    q, k, v, cache, kv_lens, blocks, cu, dist = (np.asarray(x, np.float32) if i < 4 else np.asarray(x)
                                                for i, x in enumerate(args))
    new_cache = np.asarray(new_cache, np.float32)
    bs, bps = cache.shape[1], blocks.shape[0] // kv_lens.shape[0]
    written = np.zeros(cache.shape[:2], bool)
    for r in range(dist[2]):
        ql = cu[r + 1] - cu[r]
        for j in range(ql):
            pos, t = kv_lens[r] - ql + j, cu[r] + j
            block, slot = blocks[r * bps + pos // bs], pos % bs
            np.testing.assert_array_equal(new_cache[block, slot, 0::2], k[t])
            np.testing.assert_array_equal(new_cache[block, slot, 1::2], v[t])
            written[block, slot] = True
    np.testing.assert_array_equal(new_cache[~written], cache[~written])


# ------------------------------------------------------------------------- reference


@pytest.mark.parametrize("kw", [
    dict(),
    dict(sliding_window=6, soft_cap=3.0),
])
def test_reference_matches_naive(kw):
    args = make_batch(0, [(1, 5), (1, 17), (7, 7), (9, 40), (3, 50)], T=32, R=8, block_size=16,
                      blocks_per_seq=4, num_blocks=24, Hq=6, Hkv=2, D=32, dtype=jnp.float32)
    want_out, want_cache = naive_attention(*args, sm_scale=0.2, **kw)
    out, cache = _reference(args, sm_scale=0.2, **kw)
    np.testing.assert_allclose(np.asarray(out), want_out, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache), want_cache.astype(np.float32))
    assert np.all(np.asarray(out[27:]) == 0)


# ------------------------------------------------------------------------- kernel


def test_kernel_mixed_batch_f32():
    """Decode + prefill + mixed, GQA 3, block 16, D 64, a padded request slot and
    padded tokens, kv lens off block boundaries, requests spanning q blocks and
    kv chunks, both the single-token tile and the full-block path."""
    reqs = [(1, 5), (1, 17), (1, 33), (7, 7), (5, 5), (9, 40), (3, 50)]  # 29 tokens
    args = make_batch(1, reqs, T=32, R=8, block_size=16, blocks_per_seq=4, num_blocks=32,
                      Hq=6, Hkv=2, D=64, dtype=jnp.float32)
    check_against_reference(args, atol=1e-5, sm_scale=0.125, num_queries_per_block=16, num_kv_blocks_per_chunk=2)


def test_kernel_prefill_bf16_window_softcap():
    """Prefill only, bf16, GQA 4, block 32, D 128, sliding window and soft cap, T
    not a multiple of the q block (the wrapper pads it)."""
    reqs = [(17, 17), (11, 11), (6, 6)]  # 34 tokens
    args = make_batch(2, reqs, T=40, R=4, block_size=32, blocks_per_seq=2, num_blocks=8,
                      Hq=4, Hkv=1, D=128, dtype=jnp.bfloat16)
    # Outputs of both are rounded to bf16: allow an ulp at any magnitude.
    check_against_reference(args, atol=2e-2, rtol=2e-2, sm_scale=0.09, sliding_window=9, soft_cap=5.0,
                            num_queries_per_block=16, num_kv_blocks_per_chunk=1)


def test_kernel_decode_mha_block64_and_padded_head_dim():
    """Decode only, MHA (GQA 1), block 64, D 128; then the same shapes carrying a
    head_dim of 64 zero-padded to 128, checked against the unpadded reference."""
    rng = np.random.default_rng(3)
    reqs = [(1, int(n)) for n in rng.integers(1, 190, size=10)]
    shape = dict(T=16, R=16, block_size=64, blocks_per_seq=3, num_blocks=40, Hq=2, Hkv=2, dtype=jnp.float32)
    kw = dict(sm_scale=0.125, num_queries_per_block=16, num_kv_blocks_per_chunk=2)
    check_against_reference(make_batch(3, reqs, D=128, **shape), atol=1e-5, **kw)

    padded = make_batch(4, reqs, D=64, pad_head_dim=128, **shape)
    plain = make_batch(4, reqs, D=64, **shape)
    out, cache = run_kernel(padded, **kw)
    ref_out, ref_cache = _reference(plain, sm_scale=0.125)
    np.testing.assert_allclose(np.asarray(out[:10, :, :64]), np.asarray(ref_out[:10]), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out[:, :, 64:]), 0)
    np.testing.assert_array_equal(np.asarray(cache[..., :64]), np.asarray(ref_cache))


def test_sharded_over_kv_heads():
    if jax.device_count() < 2:
        pytest.skip("needs >1 device (tests/conftest.py forces 8 fake CPU devices)")
    mesh = jax.make_mesh((2,), ("model",), devices=jax.devices()[:2])
    reqs = [(1, 9), (1, 20), (6, 6), (4, 30)]
    args = make_batch(5, reqs, T=16, R=4, block_size=16, blocks_per_seq=2, num_blocks=12,
                      Hq=4, Hkv=2, D=64, dtype=jnp.float32)
    ref_out, ref_cache = _reference(args, sm_scale=0.125)
    q, k, v, cache, *meta = args
    fn = jax.jit(functools.partial(sharded_ragged_paged_attention, mesh, sm_scale=0.125,
                                   num_queries_per_block=8, num_kv_blocks_per_chunk=1, interpret=INTERPRET))
    out, new_cache = jax.block_until_ready(_run_fast(fn, q, k, v, jnp.array(cache, copy=True), *meta))
    assert not _races_found()
    np.testing.assert_allclose(np.asarray(out[:12]), np.asarray(ref_out[:12]), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(new_cache), np.asarray(ref_cache))
    if jax.device_count() >= 4:
        with pytest.raises(ValueError, match="num_kv_heads=2 is not divisible"):
            sharded_ragged_paged_attention(jax.make_mesh((4,), ("model",), devices=jax.devices()[:4]),
                                           q, k, v, cache, *meta, sm_scale=0.125)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_to_mosaic_for_tpu(dtype):
    """The TPU paths (packed bf16 and strided f32 K/V loads, no interpreter) lower
    to Mosaic. This only runs jax's Pallas->Mosaic lowering (no libtpu needed);
    tests/test_tpu_aot.py compiles the Mosaic module for v5e/v6e with libtpu."""
    try:
        from jax._src import mesh as mesh_lib

        device = mesh_lib.AbstractDevice(device_kind="TPU v5 lite", num_cores=1, platform="tpu")
        mesh = mesh_lib.AbstractMesh((1,), ("x",), abstract_device=device)
    except (ImportError, AttributeError, TypeError) as e:  # private API moved
        pytest.skip(f"cannot fake a TPU device kind: {e}")
    sd, i32 = jax.ShapeDtypeStruct, jnp.int32
    T, R, Hq, Hkv, D, NB, bs, bps = 64, 8, 32, 8, 128, 64, 16, 8
    args = (sd((T, Hq, D), dtype), sd((T, Hkv, D), dtype), sd((T, Hkv, D), dtype),
            sd((NB, bs, 2 * Hkv, D), dtype), sd((R,), i32), sd((R * bps,), i32), sd((R + 1,), i32), sd((3,), i32))
    fn = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.1, sliding_window=64, soft_cap=30.0))
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.export.export(fn, platforms=("tpu",))(*args).mlir_module()
    assert "tpu_custom_call" in text
    assert kv_load_mode(dtype, Hkv, interpret=False) == ("packed" if dtype == jnp.bfloat16 else "strided")


@pytest.mark.parametrize("mode,dtype", [("index", jnp.float32), ("strided", jnp.float32),
                                        ("packed", jnp.bfloat16)])
def test_load_kv_head(mode, dtype):
    """Every way of pulling one head's K and V out of the block buffer agrees.
    "strided" and "packed" (the TPU ways) run under the generic interpreter
    (interpret=True), which unlike InterpretParams reads through Ref.reshape/bitcast."""
    heads = 8
    buf = jax.random.normal(jax.random.key(0), (2, 16, 2 * heads, 128), jnp.float32).astype(dtype)

    def kernel(buf_ref, k_ref, v_ref):
        for h in range(heads):
            k_ref[h], v_ref[h] = load_kv_head(buf_ref, 1, h, mode=mode)

    out_shape = [jax.ShapeDtypeStruct((heads, 16, 128), dtype)] * 2
    k, v = pl.pallas_call(kernel, out_shape=out_shape, interpret=INTERPRET if mode == "index" else True)(buf)
    want = np.asarray(buf[1], np.float32).transpose(1, 0, 2)
    np.testing.assert_array_equal(np.asarray(k, np.float32), want[0::2])
    np.testing.assert_array_equal(np.asarray(v, np.float32), want[1::2])
    assert kv_load_mode(dtype, heads, interpret=False) == mode or mode == "index"


# ------------------------------------------------------------------------- validation


def test_validation_errors():
    base = dict(T=16, R=4, block_size=16, blocks_per_seq=2, num_blocks=12, Hq=4, Hkv=2, D=64, dtype=jnp.float32)
    q, k, v, cache, kv_lens, tables, cu, dist = make_batch(6, [(1, 9), (4, 4)], **base)
    call = lambda *a, **kw: ragged_paged_attention(*a, **{"sm_scale": 1.0, **kw})  # noqa: E731

    with pytest.raises(ValueError, match="num_q_heads=4 is not divisible by num_kv_heads=3"):
        call(q, k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1), cache[:, :, :6], kv_lens, tables, cu, dist)
    with pytest.raises(ValueError, match="head_dim mismatch"):
        call(q[..., :32], k, v, cache, kv_lens, tables, cu, dist)
    with pytest.raises(ValueError, match="share one dtype"):
        call(q.astype(jnp.bfloat16), k, v, cache, kv_lens, tables, cu, dist)
    with pytest.raises(ValueError, match="not a positive multiple of R=4"):
        call(q, k, v, cache, kv_lens, tables[:7], cu, dist)
    with pytest.raises(ValueError, match="must be int32"):
        call(q, k, v, cache, kv_lens.astype(jnp.int16), tables, cu, dist)
    with pytest.raises(ValueError, match="2 \\* num_kv_heads"):
        call(q, k, v, cache[:, :, :2], kv_lens, tables, cu, dist)
    with pytest.raises(ValueError, match="num_queries_per_block=12"):
        call(q, k, v, cache, kv_lens, tables, cu, dist, num_queries_per_block=12)
    with pytest.raises(ValueError, match="vmem_limit_bytes=1024"):
        call(q, k, v, cache, kv_lens, tables, cu, dist, vmem_limit_bytes=1024)

    args = (q, k, v, cache)
    validate_inputs_dynamic(*args, kv_lens, tables, cu, dist)
    with pytest.raises(ValueError, match="out of range"):
        validate_inputs_dynamic(*args, kv_lens, tables.at[0].set(99), cu, dist)
    with pytest.raises(ValueError, match="non-decreasing"):
        validate_inputs_dynamic(*args, kv_lens, tables, jnp.array([0, 1, 0, 0, 0], jnp.int32), dist)
    with pytest.raises(ValueError, match="q_len \\(4\\) <= kv_len \\(3\\)"):
        validate_inputs_dynamic(*args, kv_lens.at[1].set(3), tables, cu, dist)
    with pytest.raises(ValueError, match="blocks_per_seq \\* block_size \\(32\\)"):
        validate_inputs_dynamic(*args, kv_lens.at[1].set(40), tables, cu, dist)
    with pytest.raises(ValueError, match="null block"):
        validate_inputs_dynamic(*args, kv_lens, tables.at[0].set(0), cu, dist)


def test_default_blocks_fit_v5e_scoped_vmem():
    # Llama-3-8B per device without TP: Hkv=8, G=4, D=128, bf16, block 16 and 64.
    for block_size in (16, 64):
        need = estimate_vmem_bytes(num_kv_heads=8, group=4, head_dim=128, block_size=block_size,
                                   dtype=jnp.bfloat16, num_kv_blocks_per_chunk=16, num_queries_per_block=32)
        assert need <= 16 * 2**20, (block_size, need)
    assert math.isclose(estimate_vmem_bytes(num_kv_heads=1, group=1, head_dim=128, block_size=16,
                                            dtype=jnp.float32, num_kv_blocks_per_chunk=1,
                                            num_queries_per_block=8),
                        2 * 16 * 8 * 128 * 4 + 4 * 8 * 128 * 4 + 8 * 128 * 4 + 2 * 8 * 128 * 4)
