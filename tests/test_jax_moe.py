"""Mixture-of-Experts in the JAX backend (CPU, fp32): tiny random Mixtral, Qwen2-MoE and Qwen3-MoE.

- greedy tokens equal transformers' `generate` (32 tokens, several prompts, one chunked);
- every routed-experts method (`jaxengine.moe.METHODS`) equals `moe_reference`, whole and split by experts;
- tensor parallelism on 8 fake CPU devices, experts' columns split and (--enable-expert-parallel) whole experts
  split, gives one device's tokens;
- a checkpoint missing an expert's tensor fails to load, naming it; stacked expert tensors load as per-expert ones;
- chunked prefill, prefix caching, async scheduling and an unscanned forward leave the tokens unchanged.
"""

from __future__ import annotations

import functools
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from enginecore import SamplingParams
from enginecore.arch import ModelLoadError, MoEConfig
from jaxengine import cpu_wing
from tests.test_jax_model import hf_greedy, jax_llm, token_ids

PROMPTS = [[1, 450, 4996, 17354, 1701], [1, 306, 763, 304],
           [1] + [(37 * j) % 3000 + 100 for j in range(40)]]  # longer than the 32-token budget: chunked
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def generate(llm, prompts=PROMPTS, params=GREEDY):
    try:
        return token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    finally:
        llm.llm_engine.core.shutdown()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_greedy_matches_transformers(arch, tiny_moe_dir):
    d = tiny_moe_dir(arch)
    llm = jax_llm(d, max_num_batched_tokens=32, enable_prefix_caching=False)
    runner = llm.llm_engine.core.runner
    lp, panels = runner.params.layers, runner.params.panels
    sparse, E = (2, 16) if arch == "qwen3_moe" else (3, 8)
    # the C kernels but for the routing: each expert a panel linear, the dense layer's MLP on its own panels
    assert runner.cpu_linears and not runner.cpu_layers and cpu_wing.uncovered(runner.arch) == []
    assert panels.experts_gate_up.shape[0] == panels.experts_down.shape[0] == sparse * E
    assert lp.experts_gate is None and lp.router.shape[0] == sparse
    assert (panels.gate_up is None) == (arch != "qwen3_moe")  # only Qwen3-MoE's layer 1 is dense
    assert (lp.shared_gate_proj is not None) == (lp.shared_expert_gate is not None) == (arch == "qwen2_moe")
    got = generate(llm)
    assert got == hf_greedy(d, PROMPTS, 32)
    assert all(len(set(t)) > 4 for t in got), "degenerate tokens would hide a wrong MLP"


# -- the routed experts against the reference ---------------------------------------------------------------


def _random_layer(rng, H, E, Ie, Is):
    from jaxengine.model import LayerParams

    def r(*s):
        return jnp.asarray(rng.normal(0, 0.3, s).astype(np.float32))

    lp = LayerParams(attn_norm=None, q_proj=None, k_proj=None, v_proj=None, o_proj=None, mlp_norm=None,
                     router=r(E, H), experts_gate=r(E, Ie, H), experts_up=r(E, Ie, H), experts_down=r(E, Ie, H))
    if Is:
        lp.shared_gate_proj, lp.shared_up_proj, lp.shared_down_proj = r(Is, H), r(Is, H), r(H, Is)
        lp.shared_expert_gate = r(1, H)
    return lp


@pytest.mark.parametrize("tokens", [1, 3, 16, 37])
@pytest.mark.parametrize("norm,shared", [(True, 0), (False, 24)])
def test_every_method_matches_the_reference(tokens, norm, shared):
    from jaxengine.moe import METHODS, moe_mlp, moe_reference, pick_method, routed_experts, route

    rng = np.random.default_rng(tokens)
    H, E, k, Ie = 32, 8, 3, 16
    moe = MoEConfig(num_experts=E, top_k=k, intermediate_size=Ie, sparse_layers=(True,), norm_topk_prob=norm,
                    shared_expert_intermediate_size=shared, shared_expert_gate=bool(shared))
    lp = _random_layer(rng, H, E, Ie, shared)
    h = jnp.asarray(rng.normal(0, 1, (tokens, H)).astype(np.float32))
    want = np.asarray(moe_reference(h, lp, moe))
    ids, w = route(h, lp.router, moe)
    assert len(set(np.asarray(ids).ravel())) > min(3, tokens)
    for method in METHODS:
        got = jax.jit(functools.partial(moe_mlp, moe=moe, experts=functools.partial(routed_experts, method=method)))(
            h, lp)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=method)
        # an expert-parallel device's share: experts [4, 8) then [0, 4), added up
        halves = sum(routed_experts(h, ids, w, lp.experts_gate[a:a + 4], lp.experts_up[a:a + 4],
                                    lp.experts_down[a:a + 4], first_expert=a, method=method) for a in (4, 0))
        whole = routed_experts(h, ids, w, lp.experts_gate, lp.experts_up, lp.experts_down, method=method)
        np.testing.assert_allclose(np.asarray(halves), np.asarray(whole), rtol=1e-5, atol=1e-5, err_msg=method)
    assert pick_method(tokens * k, E) == ("gather" if tokens * k <= E else "dense")
    assert pick_method(tokens * k, E, "tpu") == "ragged"


@pytest.mark.parametrize("tokens", [1, 37])
def test_sorted_in_chunks_and_on_the_cpu_panels_match_the_reference(tokens):
    """The sorted method with several chunks per expert (XLA's dots), and as the CPU kernels run it (each expert a
    panel linear of `cpu_wing.pack_cpu_panels`, `cpu_wing._moe`), against `moe_reference`."""
    from cpu_kernels import jax_ops
    from enginecore.arch import ArchConfig
    from jaxengine.model import ModelParams
    from jaxengine.moe import _xla_expert_mlp, moe_mlp, moe_reference, sorted_experts

    rng = np.random.default_rng(tokens + 1)
    H, E, k, Ie = 32, 8, 3, 16
    moe = MoEConfig(num_experts=E, top_k=k, intermediate_size=Ie, sparse_layers=(True, True), norm_topk_prob=True)
    lps = [_random_layer(rng, H, E, Ie, 0) for _ in range(2)]
    h = jnp.asarray(rng.normal(0, 1, (tokens, H)).astype(np.float32))
    act = lambda g, u: jax.nn.silu(g) * u  # noqa: E731
    for l, lp in enumerate(lps):
        want = np.asarray(moe_reference(h, lp, moe))
        experts = functools.partial(lambda h, ids, w, g, u, d: sorted_experts(
            h, ids, w, E, _xla_expert_mlp(g, u, d, act), chunk_rows=2))
        got = jax.jit(functools.partial(moe_mlp, moe=moe, experts=experts))(h, lp)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    if jax_ops.available():
        pytest.skip(f"the CPU kernels do not run here: {jax_ops.available()}")
    arch = ArchConfig(architecture="MixtralForCausalLM", model_type="mixtral", vocab_size=64, hidden_size=H,
                      intermediate_size=Ie, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, moe=moe)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *lps)
    stacked.q_proj = jnp.asarray(rng.normal(0, 0.3, (2, 2, 16, H)).astype(np.float32))
    stacked.k_proj = stacked.v_proj = jnp.asarray(rng.normal(0, 0.3, (2, 1, 16, H)).astype(np.float32))
    stacked.o_proj = jnp.asarray(rng.normal(0, 0.3, (2, H, 2, 16)).astype(np.float32))
    params = cpu_wing.pack_cpu_panels(ModelParams(embed=jnp.zeros((64, H)), layers=stacked,
                                                  final_norm=jnp.ones(H), lm_head=jnp.zeros((64, H))))
    assert params.layers.experts_gate is None and params.panels.experts_gate_up.shape[0] == 2 * E
    kernels = cpu_wing.model_kernels(arch)
    for l, lp in enumerate(lps):
        got = jax.jit(lambda h, lp, l: kernels.moe(params, lp, l, h, moe))(h, jax.tree.map(lambda a: a[l], params.layers), l)
        np.testing.assert_allclose(np.asarray(got), np.asarray(moe_reference(h, lp, moe)), rtol=1e-5, atol=1e-5)


# -- expert parallelism on 8 fake CPU devices --------------------------------------------------------------


@pytest.fixture(scope="module")
def mixtral_one_device(tiny_moe_dir):
    d = tiny_moe_dir("mixtral")
    return d, generate(jax_llm(d, max_num_batched_tokens=32, enable_prefix_caching=False))


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_parallel_8_with_and_without_expert_parallel(mixtral_one_device, expert_parallel):
    d, want = mixtral_one_device
    assert len(jax.devices()) >= 8, "tests/conftest.py makes 8 fake CPU devices"
    llm = jax_llm(d, max_num_batched_tokens=32, enable_prefix_caching=False, tensor_parallel_size=8,
                  enable_expert_parallel=expert_parallel)
    lp = llm.llm_engine.core.runner.params.layers
    # [Ls, E, Ie, H]: whole experts (8 / 8) or each expert's 96 columns (12 per device) on 'model'
    spec = ("model", None) if expert_parallel else (None, "model")
    assert tuple(lp.experts_gate.sharding.spec)[1:3] == spec
    assert tuple(lp.experts_down.sharding.spec)[1:3] == spec
    assert lp.experts_gate.addressable_shards[0].data.shape[1:3] == ((1, 96) if expert_parallel else (8, 12))
    assert generate(llm) == want


def test_expert_parallel_that_does_not_divide_is_refused(tiny_moe_dir):
    from enginecore.config import ConfigError

    with pytest.raises(ConfigError, match=r"--enable-expert-parallel.*8 experts.*--tensor-parallel-size 3"):
        jax_llm(tiny_moe_dir("mixtral"), tensor_parallel_size=3, enable_expert_parallel=True)


# -- loading ----------------------------------------------------------------------------------------------


def _load(src, n_devices: int):
    from jaxengine.loader import load_params
    from jaxengine.model import abstract_params
    from jaxengine.sharding import ShardingRules, make_mesh, param_shardings

    arch = src.config
    mesh = make_mesh(n_devices, 1, jax.devices()[:n_devices])
    shardings = param_shardings(abstract_params(arch, "float32"), ShardingRules.for_model(arch, mesh), mesh)
    return load_params(src, arch, "float32", shardings)


@pytest.mark.parametrize("n_devices", [1, 2])
def test_a_missing_expert_tensor_fails_the_load_naming_it(tiny_moe_dir, tmp_path, n_devices):
    """On one CPU device (host arrays) and on two (per-layer slices placed sharded); at resolve time too, from
    the file headers."""
    from dataclasses import replace

    from safetensors.numpy import load_file, save_file

    from enginecore.model_loader import resolve_model

    d = tiny_moe_dir("qwen3_moe")
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    src = resolve_model(d)
    missing = replace(src)
    missing.iter_lazy_weights = lambda: ((k, w) for k, w in src.iter_lazy_weights() if k != gone)
    with pytest.raises(ModelLoadError, match=rf"{gone}.*expert 5 of layer 2"):
        _load(missing, n_devices)
    if n_devices == 1:
        broken = shutil.copytree(d, tmp_path / "broken")
        f = broken / "model.safetensors"
        t = load_file(f)
        del t[gone]
        save_file(t, f, metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match=gone):
            resolve_model(str(broken))


def test_stacked_expert_tensors_load_as_per_expert_ones(tiny_moe_dir, tmp_path):
    """transformers 5's fused `mlp.experts.gate_up_proj` [E, 2 Ie, H] and stacked `down_proj` [E, H, Ie] (the
    loader's `expert=None` path) give the per-expert checkpoint's params, on one device and on two."""
    from safetensors.numpy import load_file, save_file

    from enginecore.model_loader import resolve_model

    d = tiny_moe_dir("qwen3_moe")
    fused = shutil.copytree(d, tmp_path / "fused")
    f = fused / "model.safetensors"
    t = load_file(f)
    E = 16
    for layer in (0, 2):
        pre = f"model.layers.{layer}.mlp.experts"
        gate = [t.pop(f"{pre}.{e}.gate_proj.weight") for e in range(E)]
        up = [t.pop(f"{pre}.{e}.up_proj.weight") for e in range(E)]
        t[f"{pre}.gate_up_proj"] = np.concatenate([np.stack(gate), np.stack(up)], axis=1)
        t[f"{pre}.down_proj"] = np.stack([t.pop(f"{pre}.{e}.down_proj.weight") for e in range(E)])
    save_file(t, f, metadata={"format": "pt"})
    per_expert = _load(resolve_model(d), 1)
    for n in (1, 2):
        got = _load(resolve_model(str(fused)), n)
        for a, b in zip(jax.tree.leaves(per_expert), jax.tree.leaves(got)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    down = np.asarray(per_expert.layers.experts_down[1, 3])  # sparse layer 1 = decoder layer 2, expert 3
    np.testing.assert_array_equal(down, load_file(os.path.join(d, "model.safetensors"))[
        "model.layers.2.mlp.experts.3.down_proj.weight"].T)


# -- scheduling and the forward's forms leave the tokens unchanged -----------------------------------------


def test_chunked_prefix_cached_async_and_unscanned_runs_give_the_plain_tokens(tiny_moe_dir):
    """Qwen3-MoE (sparse, dense, sparse: two scans and a one-layer run). Plain: synchronous, every prompt in one
    step, no prefix caching. Then a 16-token budget (every long prompt chunked), prefix caching (a second
    pass hits it) and async scheduling; then the layers unrolled (compilation_config scan_layers False)."""
    d = tiny_moe_dir("qwen3_moe")
    prompts = [[1] + [(29 * i + 7 * j) % 900 + 50 for j in range(n)] for i, n in enumerate([45, 6, 19, 70, 33])]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = generate(jax_llm(d, max_num_batched_tokens=128, enable_prefix_caching=False, async_scheduling=False),
                     prompts, params)
    llm = jax_llm(d, max_num_batched_tokens=16, enable_prefix_caching=True, async_scheduling=True)
    try:
        first = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
        second = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
        assert llm.llm_engine.core.get_stats().prefix_cache_hits > 0
    finally:
        llm.llm_engine.core.shutdown()
    unscanned = generate(jax_llm(d, max_num_batched_tokens=32, enable_prefix_caching=False,
                                 compilation_config={"scan_layers": False}), prompts, params)
    assert first == plain and second == plain and unscanned == plain
