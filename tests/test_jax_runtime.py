"""The JAX runner's machinery on the tiny llama: recompilation guard, warmup + persistent cache,
tensor parallelism on 8 fake CPU devices, orbax round trip, and the Pallas kernel end to end."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from enginecore import LLM, SamplingParams
from enginecore.config import EngineArgs

PROMPTS = [{"prompt_token_ids": [1, 450, 4996, 17354, 1701, 975]}, {"prompt_token_ids": [1, 306, 763]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def small(model_dir, **kw) -> LLM:
    args = dict(backend="jax", platform="cpu", dtype="float32", max_model_len=128, max_num_seqs=8,
                max_num_batched_tokens=32, enable_prefix_caching=False, seed=0)
    args.update(kw)
    return LLM(model_dir, **args)


def generate(llm, prompts=PROMPTS, params=GREEDY):
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.core.shutdown()


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference_tokens(tiny):
    return generate(small(tiny))


def test_recompilation_guard_passes_after_full_warmup(tiny, monkeypatch):
    from jaxengine.compilation import RecompilationError
    from jaxengine.programs import ProgramKey

    monkeypatch.setenv("XLASERVE_CHECK_RECOMPILATION", "1")
    llm = small(tiny, warmup="all")
    runner = llm.llm_engine.core.runner
    stats = llm.llm_engine.core.warmup_stats
    assert stats["level"] == "all" and stats["recompilation_guard"]
    keys = {p["key"] for p in stats["programs"]}
    # CPU buckets start at 1 token / 1 request; one model program per token bucket
    assert {ProgramKey("model", t) for t in (1, 2, 4, 8, 16, 32)} <= keys
    assert {ProgramKey("sample", 8, m) for m in ("greedy", "sample", "full", "processed")} <= keys
    assert any(k.kind == "prompt_logprobs" for k in keys)
    mixed = [
        SamplingParams(temperature=0.0, max_tokens=5),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=5, logprobs=2),
        SamplingParams(temperature=1.0, repetition_penalty=1.2, logit_bias={5: 1.0}, max_tokens=5),
        SamplingParams(temperature=0.0, prompt_logprobs=1, max_tokens=3),
    ]
    prompts = [{"prompt_token_ids": [1] + list(range(100, 100 + n))} for n in (3, 20, 40, 7)]
    try:
        outs = llm.generate(prompts, mixed, use_tqdm=False)  # any compile here would raise
        assert outs[3].prompt_logprobs is not None
        # a program nobody warmed: the guard names the bucket instead of compiling
        with pytest.raises(RecompilationError, match="was not compiled during warmup"):
            runner.guard.check_key(ProgramKey("model", 4096))
    finally:
        llm.llm_engine.core.shutdown()


def test_recompilation_guard_rejects_lazy_compile(tiny, monkeypatch):
    from jaxengine.compilation import RecompilationError

    monkeypatch.setenv("XLASERVE_CHECK_RECOMPILATION", "1")
    llm = small(tiny, warmup="none")
    with pytest.raises(RecompilationError):
        generate(llm)


def test_warmup_second_run_is_all_cache_hits(tiny, tmp_path):
    from jaxengine.warmup import format_table, run_warmup

    args = EngineArgs(model=tiny, backend="jax", platform="cpu", max_model_len=128, max_num_seqs=8,
                      max_num_batched_tokens=32, compilation_cache_dir=str(tmp_path / "xla"))
    first = run_warmup(args, level="decode")
    second = run_warmup(args, level="decode")  # run_warmup clears the in-process caches: hits come from disk
    buckets = [r for r in second if r["bucket"] != "TOTAL"]
    assert buckets and len(buckets) == len(first) - 1
    assert all(r["status"] == "hit" for r in buckets), format_table(second)
    assert any(r["cache_misses"] or r["compiles"] for r in first[:-1])
    assert "model tokens=1" in format_table(second)  # CPU buckets start at 1 (--min-token-bucket)


def test_stored_executables_load_without_compiling_and_give_the_same_tokens(tiny, reference_tokens, tmp_path):
    """A second engine with the same config loads every program from the executable store (no tracing,
    lowering or XLA compile) and generates the same tokens; an unreadable entry is compiled and rewritten; a
    different config misses. JAX's persistent cache, which an earlier runner in the process may have turned on
    (a TPU target's), is off: compiles it served could not be stored."""
    from jaxengine.compilation import use_persistent_cache

    cache = str(tmp_path / "xla")
    params = [GREEDY, SamplingParams(temperature=0.9, top_p=0.8, seed=3, max_tokens=6, ignore_eos=True)]
    # an earlier runner in this process left JAX's persistent cache on (as a TPU target's does), and it holds
    # these very programs (a runner without an executable store compiled them into it)
    jax_cache = str(tmp_path / "jax")
    small(tiny, warmup="decode", compilation_cache_dir=jax_cache,
          compilation_config={"store_executables": False}).llm_engine.core.shutdown()
    assert jax.config.jax_compilation_cache_dir == jax_cache and os.listdir(jax_cache)
    jax.clear_caches()
    first = small(tiny, warmup="decode", compilation_cache_dir=cache)
    assert jax.config.jax_compilation_cache_dir is None
    assert first.llm_engine.core.runner._store.stores == len(first.llm_engine.core.warmup_stats["programs"]) > 0
    use_persistent_cache(jax_cache)
    small(tiny, warmup="none", compilation_cache_dir="none").llm_engine.core.shutdown()  # caching off: JAX's too
    assert jax.config.jax_compilation_cache_dir is None
    want = generate(first, params=params)
    second = small(tiny, warmup="decode", compilation_cache_dir=cache)
    stats = second.llm_engine.core.warmup_stats
    runner = second.llm_engine.core.runner
    assert stats["compiles"] == 0 and stats["cache_misses"] == 0
    assert runner._store.hits == len(stats["programs"]) > 0
    assert generate(second, params=params) == want
    assert want[0] == reference_tokens[0]
    store_dir = os.path.join(cache, "executables")
    for fn in os.listdir(store_dir):  # truncated entries: a miss each, compiled and stored again
        with open(os.path.join(store_dir, fn), "r+b") as f:
            f.truncate(100)
    third = small(tiny, warmup="decode", compilation_cache_dir=cache)
    assert third.llm_engine.core.runner._store.hits == 0
    assert generate(third, params=params) == want
    other = small(tiny, warmup="decode", compilation_cache_dir=cache, max_num_seqs=4)
    try:
        assert other.llm_engine.core.runner._store.hits == 0
    finally:
        other.llm_engine.core.shutdown()


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_greedy_tokens_identical(tiny, reference_tokens, tp):
    llm = small(tiny, tensor_parallel_size=tp)
    runner = llm.llm_engine.core.runner
    # tiny llama: 4 q heads, 2 kv heads -> heads sharded at tp 2; at tp 4 each kv head is repeated twice so
    # that heads still shard (one q head and one kv head per device); at tp 8 (more devices than q heads)
    # attention is replicated. MLP/vocab always sharded.
    lp = runner.params.layers
    assert runner.mesh.shape["model"] == tp
    assert lp.gate_proj.sharding.spec[1] == "model"
    assert runner.params.embed.sharding.spec[0] == "model"
    heads = lp.q_proj.sharding.spec[1]
    assert heads == ("model" if tp in (2, 4) else None)
    assert runner.kv_repeats == (2 if tp == 4 else 1)
    assert runner.arch.num_key_value_heads == 2 * runner.kv_repeats
    assert runner.kv_cache.sharding.spec[2] == heads
    assert len(runner.params.embed.sharding.device_set) == tp
    assert generate(llm) == reference_tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_params_on_host_and_on_devices(tiny, dtype, caplog):
    # one CPU device: stacked params filled in numpy, placed once; two devices: zeros + a donated update-slice
    # a layer, on the devices. The same arrays either way, the checkpoint's values cast to the dtype; a
    # layer missing from the checkpoint is named either way.
    import logging
    from dataclasses import replace

    from enginecore.arch import ModelLoadError
    from enginecore.model_loader import resolve_model
    from jaxengine.loader import load_params
    from jaxengine.model import abstract_params
    from jaxengine.sharding import ShardingRules, make_mesh, param_shardings

    src = resolve_model(tiny)
    arch = src.config
    hf = dict(src.iter_weights())
    loaded, compiles = [], []
    for n in (1, 2):
        mesh = make_mesh(n, 1, jax.devices()[:n])
        shardings = param_shardings(abstract_params(arch, dtype), ShardingRules.for_model(arch, mesh), mesh)
        caplog.clear()
        with caplog.at_level(logging.WARNING), jax.log_compiles(True):
            params = load_params(src, arch, dtype, shardings)
        compiles.append([r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()])
        assert len(params.layers.gate_proj.sharding.device_set) == n
        if n == 1:  # the host arrays themselves, not copies (`_host_array`: 2 MiB-aligned)
            assert params.layers.gate_proj.unsafe_buffer_pointer() % 2**21 == 0
        loaded.append(params)
        missing = replace(src)
        missing.iter_lazy_weights = lambda: ((k, w) for k, w in src.iter_lazy_weights()
                                             if k != "model.layers.1.mlp.up_proj.weight")
        with pytest.raises(ModelLoadError, match=r"up_proj of layer\(s\) \[1\]"):
            load_params(missing, arch, dtype, shardings)
    assert compiles[0] == [] and compiles[1] != []  # the host path compiles nothing
    for a, b in zip(jax.tree.leaves(loaded[0]), jax.tree.leaves(loaded[1])):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    want = np.asarray(hf["model.layers.1.mlp.gate_proj.weight"]).astype(loaded[0].layers.gate_proj.dtype)
    np.testing.assert_array_equal(np.asarray(loaded[0].layers.gate_proj[1]).reshape(want.shape), want)


def test_orbax_round_trip(tiny, reference_tokens, tmp_path):
    from enginecore.model_loader import resolve_model
    from jaxengine.checkpoint import convert_to_orbax, is_orbax_checkpoint

    out = convert_to_orbax(resolve_model(tiny), str(tmp_path / "ckpt"), dtype="float32")
    assert is_orbax_checkpoint(out)
    llm = small(out, load_format="orbax")
    a = llm.llm_engine.core.runner.params
    b = small(tiny).llm_engine.core.runner.params
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert generate(llm) == reference_tokens


def test_pallas_attention_backend_end_to_end(tiny, reference_tokens):
    # on CPU the TPU kernel runs in the Pallas interpreter
    assert generate(small(tiny, attention_backend="pallas")) == reference_tokens


def test_max_model_len_of_a_few_blocks(tiny, reference_tokens):
    # 40 tokens = 3 blocks of 16: the block tables are 3 columns wide
    llm = small(tiny, max_model_len=40)
    assert llm.llm_engine.core.runner.input_batch.max_blocks_per_req == 3
    assert generate(llm) == reference_tokens


def test_cpu_kv_cache_takes_memory_as_steps_write_it(tiny, reference_tokens, monkeypatch):
    """On a CPU the KV cache must fit the memory available (else a ConfigError naming the flag, not an OOM kill
    later); with the kernels on it is zero without being written at start (`cpu_kernels.zeros`): after warmup
    (its steps write the null blocks) most of the 16 MiB cache holds no memory, and the tokens are the same. (A
    server then commits it in the background, `populate_in_background`: off here, to see what steps write.)"""
    from enginecore import kv_cache
    from enginecore.config import ConfigError
    from tests.memory import resident_bytes
    from cpu_kernels import jax_ops

    monkeypatch.setenv("XLASERVE_KV_POPULATE", "off")
    llm = small(tiny, kv_cache_memory_bytes=16 << 20, max_model_len=512, max_num_seqs=64, max_num_batched_tokens=64)
    runner = llm.llm_engine.core.runner
    assert runner.num_blocks == (16 << 20) // runner.kv_bytes_per_block() and runner.kv_cache.nbytes == 16 << 20
    with monkeypatch.context() as m:
        m.setattr(kv_cache, "available_memory_bytes", lambda: 8 << 20)
        with pytest.raises(ConfigError, match="available; lower --kv-cache-memory-bytes"):
            runner.init_kv_cache(runner.num_blocks)
    if not jax_ops.available():
        assert runner.cpu_decode_attention
        resident = resident_bytes(runner.kv_cache.unsafe_buffer_pointer(), runner.kv_cache.nbytes)
        assert resident < runner.kv_cache.nbytes // 2, resident  # (a few 4 KiB pages; 2 MiB ones under THP "always")
        assert not np.asarray(runner.kv_cache).any()
    assert generate(llm) == reference_tokens
    llm.llm_engine.core.shutdown()


def test_cpu_kv_cache_is_committed_in_the_background(tiny, reference_tokens):
    """With the kernels on, a new engine's KV cache is committed by a background thread
    (`cpu_kernels.memory.populate_in_background`), not by its steps' first writes; the tokens are the same."""
    import time

    from cpu_kernels import jax_ops
    from tests.memory import resident_bytes

    if jax_ops.available():
        pytest.skip("the CPU kernels do not run here (the cache is XLA's zeros)")
    llm = small(tiny, kv_cache_memory_bytes=16 << 20, max_model_len=512, max_num_seqs=64, max_num_batched_tokens=64)
    runner = llm.llm_engine.core.runner
    ptr, nbytes = runner.kv_cache.unsafe_buffer_pointer(), runner.kv_cache.nbytes
    deadline = time.monotonic() + 30
    while resident_bytes(ptr, nbytes) < nbytes and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resident_bytes(ptr, nbytes) >= nbytes - 4096  # (a partial page at either end may be left)
    assert generate(llm) == reference_tokens
    llm.llm_engine.core.shutdown()


def test_the_lm_heads_padded_rows_change_no_token(tiny):
    """Five requests in a bucket of 8: the sample program's LM head multiplies the rows up to the last sampling
    one (`live`), whole or in chunks of 2 (`logits_chunk_rows`: chunks wholly, partly and not at all live), greedy
    and seeded: the tokens of one request at a time."""
    prompts = [{"prompt_token_ids": [1, 450 + 7 * i, 4996 - 3 * i, 17354, 975][: 3 + i % 3]} for i in range(5)]
    params = {"greedy": GREEDY,
              "seeded": [SamplingParams(temperature=0.8, top_p=0.9, seed=7 + i, max_tokens=6, ignore_eos=True)
                         for i in range(5)]}
    llm = small(tiny)
    tokens = sum(len(p["prompt_token_ids"]) for p in prompts)  # all five prefill in one step, then decode together
    assert tokens <= 32 and llm.llm_engine.core.runner.buckets.shape(tokens, 5).reqs == 8  # rows 5-7 padding
    try:
        alone = {kind: [llm.generate([q], p if kind == "greedy" else [p[i]], use_tqdm=False)[0].outputs[0].token_ids
                        for i, q in enumerate(prompts)] for kind, p in params.items()}
    finally:
        llm.llm_engine.core.shutdown()
    for cc in (None, {"logits_chunk_rows": 2}):
        llm = small(tiny, compilation_config=cc)
        try:
            for kind, p in params.items():
                got = [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
                assert got == alone[kind], (kind, cc)
        finally:
            llm.llm_engine.core.shutdown()
