"""Scheduler + block pool driven by a deterministic fake runner (no model, fast)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from enginecore.config import EngineArgs
from enginecore.engine import EngineCore
from enginecore.request import Request
from enginecore.sampling_params import SamplingParams
from tests.fake_runner import FakeRunner


def make_core(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
              policy="fcfs", prefix=True, chunked=True, threshold=0, partial=4, async_scheduling=True, shared=None):
    args = EngineArgs(platform="cpu", backend="jax", block_size=block_size, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                      scheduling_policy=policy, enable_prefix_caching=prefix, enable_chunked_prefill=chunked,
                      long_prefill_token_threshold=threshold, num_gpu_blocks_override=num_blocks,
                      max_num_partial_prefills=partial, async_scheduling=async_scheduling,
                      max_shared_prefill_tokens=shared)
    cfg = args.create_engine_config()
    return EngineCore(cfg, model=None, runner=FakeRunner(cfg, num_blocks=num_blocks))


def req(rid, prompt, max_tokens=8, priority=0, arrival=None, **kw):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    r = Request(rid, list(prompt), sp, eos_token_ids=(), priority=priority, max_tokens=max_tokens)
    if arrival is not None:
        r.arrival_time = arrival
    return r


def run_to_end(core, max_steps=2000, check=True):
    out: dict[str, list[int]] = {}
    budgets = []
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            break
        res = core.step()
        budgets.append(core.scheduler._last_num_scheduled)
        for o in res:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        if check:
            core.scheduler.check_invariants()
    assert not core.has_unfinished_requests(), "did not finish"
    return out, budgets


PROMPTS = [[(7 * i + j) % 97 + 3 for j in range(n)] for i, n in enumerate([5, 17, 33, 9, 40, 3, 26, 12])]


def reference_tokens():
    core = make_core(num_blocks=512, max_num_seqs=16, max_num_batched_tokens=1024, prefix=False,
                     async_scheduling=False)
    for i, p in enumerate(PROMPTS):
        core.add_request(req(f"r{i}", p))
    out, _ = run_to_end(core)
    return out


def test_budget_and_max_num_seqs_respected():
    core = make_core(max_num_seqs=3, max_num_batched_tokens=16)
    for i, p in enumerate(PROMPTS):
        core.add_request(req(f"r{i}", p))
    for _ in range(500):
        if not core.has_unfinished_requests():
            break
        core.step()
        assert core.scheduler._last_num_scheduled <= 16
        assert len(core.scheduler.running) <= 3
    assert not core.has_unfinished_requests()


def test_chunked_prefill_splits_long_prompt():
    core = make_core(max_num_batched_tokens=16, block_size=4)
    core.add_request(req("a", PROMPTS[4]))  # 40 tokens
    so = core.scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 16}
    assert core.scheduler.requests["a"].num_computed_tokens == 16


def test_long_prefill_threshold_caps_chunks():
    core = make_core(max_num_batched_tokens=32, threshold=8)
    core.add_request(req("a", PROMPTS[4]))
    core.add_request(req("b", PROMPTS[2]))
    so = core.scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 8, "b": 8}


def test_shared_steps_cap_their_prompt_tokens():
    """max_shared_prefill_tokens: a request alone gets the whole budget; while more than one could share the
    step, prompt tokens (of requests with more than one token to compute) are capped, first come first, and the
    decode tokens are not; one token left is a decode's, and waiting requests that cannot be admitted
    (max_num_seqs) do not count."""
    core = make_core(max_num_batched_tokens=32, shared=8, partial=4)
    core.add_request(req("a", PROMPTS[4]))  # 40 tokens, alone
    assert core.scheduler.schedule().num_scheduled_tokens == {"a": 32}
    core.add_request(req("b", PROMPTS[2]))  # 33 tokens
    core.add_request(req("c", PROMPTS[0]))  # 5
    assert core.scheduler.schedule().num_scheduled_tokens == {"a": 8}  # a's rest first, b and c wait
    assert core.scheduler.schedule().num_scheduled_tokens == {"a": 1, "b": 8}  # (async: a's next token)
    run = make_core(max_num_batched_tokens=32, shared=8, async_scheduling=False)
    run.add_request(req("a", PROMPTS[3], max_tokens=20))  # 9 tokens
    run.step()
    run.add_request(req("b", PROMPTS[2]))
    run.add_request(req("c", PROMPTS[1]))
    so = run.scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 8}  # the decode beside 8 prompt tokens
    one = make_core(max_num_batched_tokens=32, shared=8, max_num_seqs=1, async_scheduling=False)
    one.add_request(req("a", PROMPTS[4]))
    one.add_request(req("b", PROMPTS[2]))  # cannot be admitted beside a: a is alone
    assert one.scheduler.schedule().num_scheduled_tokens == {"a": 32}


def test_shared_prefill_cap_is_a_cpu_servers_default():
    from enginecore.config import SERVE_CPU_SHARED_PREFILL_TOKENS, ConfigError

    args = EngineArgs(platform="cpu", backend="torch")
    args.apply_serving_defaults()
    assert args.create_engine_config().scheduler_config.max_shared_prefill_tokens == SERVE_CPU_SHARED_PREFILL_TOKENS
    args = EngineArgs(platform="cpu", backend="torch", max_num_batched_tokens=1024, max_shared_prefill_tokens=0)
    args.apply_serving_defaults()  # (given: kept; 0 turns it off)
    sc = args.create_engine_config().scheduler_config
    assert (sc.max_num_batched_tokens, sc.max_shared_prefill_tokens) == (1024, 0)
    assert EngineArgs(platform="cpu", backend="torch").create_engine_config().scheduler_config \
        .max_shared_prefill_tokens == 0  # offline (`LLM`): off
    with pytest.raises(ConfigError, match="needs chunked prefill"):
        EngineArgs(platform="cpu", backend="torch", enable_chunked_prefill=False, max_num_batched_tokens=8192,
                   max_shared_prefill_tokens=64).create_engine_config()


@pytest.mark.parametrize("kw", [
    dict(max_num_batched_tokens=8),  # heavy chunking
    dict(shared=3, max_num_batched_tokens=20),  # shared steps' prompt tokens capped
    dict(num_blocks=24, max_num_seqs=8),  # forces preemption
    dict(prefix=True, max_num_batched_tokens=64),
    dict(threshold=5, max_num_batched_tokens=20),
    dict(policy="priority", num_blocks=24, max_num_seqs=8),
])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_schedules_give_same_tokens_as_plain_run(kw, async_scheduling):
    ref = reference_tokens()
    core = make_core(**kw, async_scheduling=async_scheduling)
    for i, p in enumerate(PROMPTS):
        core.add_request(req(f"r{i}", p, priority=i % 3))
    out, _ = run_to_end(core)
    assert out == ref


def test_preemption_happens_and_is_counted():
    core = make_core(num_blocks=20, max_num_seqs=8, block_size=4)
    for i, p in enumerate(PROMPTS):
        core.add_request(req(f"r{i}", p, max_tokens=20))
    run_to_end(core)
    assert core.scheduler.num_preemptions > 0
    assert core.scheduler.kv.pool.num_used_blocks == 0


def test_prefix_cache_hits_and_same_tokens():
    shared = list(range(10, 42))  # 32 tokens = 8 full blocks of 4
    core = make_core(num_blocks=128)
    core.add_request(req("a", shared + [1, 2, 3]))
    out_a, _ = run_to_end(core)
    hits0 = core.scheduler.kv.stats.hits
    core.add_request(req("b", shared + [1, 2, 3]))
    out_b, _ = run_to_end(core)
    assert out_a["a"] == out_b["b"]
    assert core.scheduler.kv.stats.hits - hits0 == 32
    # hits are capped at num_tokens - 1: a fully cached prompt still computes one token
    core.add_request(req("c", shared))
    so = core.scheduler.schedule()
    assert so.num_scheduled_tokens["c"] >= 1
    assert so.scheduled_new_reqs[0].num_computed_tokens == 28


def test_blocks_are_published_only_after_the_step_that_computes_them():
    """No request of a step reads a block another request of that step is writing, and an unrun step caches nothing."""
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks of 4
    core = make_core(num_blocks=64)
    core.add_request(req("a", prompt))
    core.add_request(req("b", prompt))
    so = core.scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 13, "b": 13}
    assert [n.num_computed_tokens for n in so.scheduled_new_reqs] == [0, 0]
    # the step is dropped (its requests aborted before it ran): nothing it would have written is published
    core.abort_requests(["a", "b"])
    core.add_request(req("c", prompt))
    so = core.scheduler.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    # once a step has run, its full blocks serve the next request
    core.scheduler.update_from_output(so, core.runner.execute(so).result())
    core.add_request(req("d", prompt))
    so = core.scheduler.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12


def test_prefix_cache_skipped_for_prompt_logprobs():
    core = make_core(num_blocks=128)
    p = list(range(10, 30))
    core.add_request(req("a", p))
    run_to_end(core)
    q0 = core.scheduler.kv.stats.queries
    core.add_request(req("b", p, prompt_logprobs=1))
    so = core.scheduler.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert core.scheduler.kv.stats.queries == q0


def test_abort_frees_everything_at_any_time():
    core = make_core(num_blocks=64)
    for i, p in enumerate(PROMPTS):
        core.add_request(req(f"r{i}", p, max_tokens=30))
    for step in range(6):
        core.step()
        core.scheduler.check_invariants()
    core.abort_requests([f"r{i}" for i in range(len(PROMPTS))])
    assert not core.has_unfinished_requests()
    assert core.scheduler.kv.pool.num_used_blocks == 0
    core.scheduler.check_invariants()
    core.step()  # runner drops the finished rows
    assert len(core.runner.input_batch) == 0


def test_max_num_partial_prefills():
    core = make_core(max_num_batched_tokens=32, threshold=8, partial=1)
    core.add_request(req("a", PROMPTS[4]))
    core.add_request(req("b", PROMPTS[2]))
    so = core.scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 8}


def test_priority_order():
    core = make_core(max_num_seqs=1, policy="priority")
    core.add_request(req("low", [1, 2, 3], priority=5, arrival=1.0))
    core.add_request(req("high", [1, 2, 4], priority=-1, arrival=2.0))
    so = core.scheduler.schedule()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["high"]


def test_stop_conditions():
    core = make_core()
    r = req("a", [5, 6, 7], max_tokens=3)
    core.add_request(r)
    out, _ = run_to_end(core)
    assert len(out["a"]) == 3
    # stop_token_ids: stop at the first generated token by declaring it a stop token
    first = out["a"][0]
    core.add_request(req("b", [5, 6, 7], max_tokens=10, stop_token_ids=[first]))
    res = []
    while core.has_unfinished_requests():
        res += core.step()
    assert res[-1].finish_reason == "stop" and res[-1].stop_reason == first
    # min_tokens suppresses the stop check
    core.add_request(req("c", [5, 6, 7], max_tokens=10, min_tokens=10, stop_token_ids=[first]))
    out, _ = run_to_end(core)
    assert len(out["c"]) == 10


def test_eos_and_ignore_eos():
    core = make_core()
    core.add_request(req("a", [9, 9, 9], max_tokens=4))
    out, _ = run_to_end(core)
    eos = out["a"][1]
    r = req("b", [9, 9, 9], max_tokens=4)
    r.eos_token_ids = (eos,)
    core.add_request(r)
    out2, _ = run_to_end(core)
    assert out2["b"] == out["a"][:2]
    r = req("c", [9, 9, 9], max_tokens=4, ignore_eos=True)
    r.eos_token_ids = (eos,)
    core.add_request(r)
    out3, _ = run_to_end(core)
    assert out3["c"] == out["a"]


def test_rejects_requests_that_cannot_run():
    from enginecore.scheduler import RequestRejectedError, SchedulerOverloadedError

    core = make_core(num_blocks=8, block_size=4, max_model_len=128)
    with pytest.raises(RequestRejectedError, match="does not fit --max-model-len 128"):
        core.add_request(req("a", list(range(200))))
    with pytest.raises(RequestRejectedError, match="blocks"):
        core.add_request(req("b", list(range(100))))
    args = EngineArgs(platform="cpu", max_waiting_requests=2, num_gpu_blocks_override=16, max_model_len=64)
    cfg = args.create_engine_config()
    core = EngineCore(cfg, None, runner=FakeRunner(cfg, num_blocks=16))
    core.add_request(req("x", [1]))
    core.add_request(req("y", [1]))
    with pytest.raises(SchedulerOverloadedError, match="--max-waiting-requests"):
        core.add_request(req("z", [1]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["add", "step", "step", "abort"]), st.integers(0, 10**6)),
                min_size=1, max_size=60),
       st.sampled_from(["fcfs", "priority"]), st.booleans())
@example(ops=[("add", 34), ("add", 34)], policy="fcfs", async_scheduling=True)  # same prompt, same step
def test_property_random_add_step_abort_keeps_block_invariants(ops, policy, async_scheduling):
    core = make_core(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, policy=policy,
                     async_scheduling=async_scheduling, shared=6)
    rng = random.Random(0)
    n = 0
    for op, x in ops:
        if op == "add":
            plen = 1 + x % 30
            core.add_request(req(f"q{n}", [(x + j) % 50 for j in range(plen)], max_tokens=1 + x % 12,
                                 priority=x % 3))
            n += 1
        elif op == "step":
            core.step()
        else:
            live = list(core.scheduler.requests)
            if live:
                core.abort_requests([rng.choice(live)])
        core.scheduler.check_invariants()
        pool = core.scheduler.kv.pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_usable_blocks
    run_to_end(core)
    assert core.scheduler.kv.pool.num_used_blocks == 0


def test_kv_blocks_for_is_one_policy_for_every_backend(monkeypatch):
    """enginecore.kv_cache.kv_blocks_for (both runners' determine_num_blocks): --kv-cache-memory-bytes first,
    else the device's budget, else on a CPU min(1 GiB, MemAvailable / 4); capped at what max_num_seqs sequences
    of max_model_len can use; too little for one sequence is an error naming what set the budget."""
    from enginecore import kv_cache
    from enginecore.config import ConfigError

    def config(**kw):
        return EngineArgs(platform="cpu", max_model_len=64, max_num_seqs=4, block_size=16, **kw).create_engine_config()

    device = lambda: (100 * 1000, "--gpu-memory-utilization 0.9 (test)")  # noqa: E731
    assert kv_cache.kv_blocks_for(config(kv_cache_memory_bytes=10 * 1000), 1000, 16, device) == 10
    assert kv_cache.kv_blocks_for(config(), 1000, 16, device) == 4 * 4 + 1  # capped: 4 sequences of 4 blocks
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda: 4 * 7 * 1000)
    assert kv_cache.kv_blocks_for(config(), 1000, 16) == 7
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda: None)
    assert kv_cache.kv_blocks_for(config(), 1 << 20, 16) == 4 * 4 + 1  # 1 GiB: 1024 blocks, capped
    with pytest.raises(ConfigError, match=r"--kv-cache-memory-bytes 4000 holds 4 KV blocks .* fewer than the 5"):
        kv_cache.kv_blocks_for(config(kv_cache_memory_bytes=4000), 1000, 16, device)
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization 0.9 \(test\) holds 3 KV blocks"):
        kv_cache.kv_blocks_for(config(), 1000, 16, lambda: (3000, "--gpu-memory-utilization 0.9 (test)"))
