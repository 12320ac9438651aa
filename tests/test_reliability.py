"""Issue 15, without a model backend: the API app in-process over the engine loop in a thread and the
deterministic fake runner (tests/fake_runner.py). Bad inputs are 400, overload is 503 with Retry-After,
the drain of a shutdown, the KV admission limit, and requests failing alone through the test-only fault
hook (enginecore/faults.py) while a failing model step stays an engine death.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from benchmarks._server import parse_metrics, sse_events
from enginecore.config import EngineArgs
from enginecore.faults import ENV, FaultInjector, InjectedFault
from frontend.api_server import HTTPOptions, ServerState, build_app
from frontend.metrics import ServerMetrics
from frontend.serve import drain
from frontend.serving_common import FrontendOptions
from tests.test_frontend_inprocess import ControlledRunner, start_client

BLOCK = 16
SMALL_NUM_BLOCKS = 12  # 11 usable blocks of 16 tokens: 176 tokens of KV cache for 4 sequences of up to 256


@pytest.fixture(scope="module")
def engine_parts(smollm2_source, smollm2_tokenizer):
    """(config, model, tokenizer) for these flags; the model and tokenizer are read once."""

    def make(**kw):
        args = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, max_waiting_requests=16,
                    platform="cpu")
        config = EngineArgs(**{**args, **kw}).create_engine_config(
            model_max_len=smollm2_source.config.max_position_embeddings)
        return config, smollm2_source, smollm2_tokenizer

    return make


@pytest.fixture(scope="module")
def parts(engine_parts):
    """63 usable blocks (the fake runner's 64): room for the whole batch."""
    return engine_parts()


@pytest.fixture(scope="module")
def small_parts(engine_parts):
    return engine_parts(num_gpu_blocks_override=SMALL_NUM_BLOCKS)


class App:
    """The client, its fake runner, the app and an httpx client on it, for one test."""

    def __init__(self, client, runner, state, http):
        self.client, self.runner, self.state, self.http = client, runner, state, http

    def metric(self, name: str) -> float:
        return parse_metrics(self.state.metrics.render().decode()).get(name, 0.0)

    async def settled(self) -> None:
        """Every request gone from the engine, its blocks back in the pool, the pool's invariants true."""
        for _ in range(100):
            st = self.client.stats
            if st.num_used_blocks == 0 and st.num_running_reqs == 0 and st.num_waiting_reqs == 0:
                break
            await asyncio.sleep(0.05)
        assert await self.client.call("check_invariants")
        st = self.client.stats
        assert (st.num_used_blocks, st.num_running_reqs, st.num_waiting_reqs) == (0, 0, 0), st


def run_app(parts, body, faults: str | None = None, monkeypatch=None):
    """Run `await body(app)` against a fresh client + app; `faults` sets XLASERVE_FAULT_INJECTION."""
    if faults is not None:
        monkeypatch.setenv(ENV, faults)

    async def main():
        metrics = ServerMetrics("m", 256)
        client, runner = await start_client(parts, metrics)
        state = ServerState(client, metrics, ["m"], FrontendOptions())
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state, HTTPOptions())),
                                         base_url="http://t", timeout=60) as http:
                await body(App(client, runner, state, http))
        finally:
            await client.shutdown()

    asyncio.run(main())


async def until(cond, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def hold_until_queued(app: App) -> None:
    """With the runner's gate closed: wait until the first request's step is held and the other requests'
    adds wait in the engine's socket; the step after this one then schedules them all together."""
    assert await asyncio.to_thread(app.runner.in_step.wait, 10)
    await asyncio.sleep(1.0)


def completion(i: int = 0, **kw) -> dict:
    return {"prompt": f"Hello number {i}", "max_tokens": 6, "ignore_eos": True, **kw}


# ---- 1. bad inputs -----------------------------------------------------------------------------------------


def test_stream_options_need_stream(parts):
    async def body(app: App):
        for path, extra in (("/v1/completions", {"prompt": "Hi"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
            r = await app.http.post(path, json={**extra, "max_tokens": 2, "stream_options": {"include_usage": True}})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "stream_options" and "stream" in err["message"] and err["code"] == 400
            r = await app.http.post(path, json={**extra, "max_tokens": 2, "stream": True,
                                                "stream_options": {"include_usage": True}})
            assert r.status_code == 200 and sse_events(r.text)[-1]["usage"]["completion_tokens"] == 2
            # as vLLM: an empty or null stream_options is not an error
            for so in ({}, None):
                assert (await app.http.post(path, json={**extra, "max_tokens": 1, "stream_options": so})
                        ).status_code == 200

    run_app(parts, body)


BAD_RAW_BODIES = [
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', "temperature"),  # Python's JSON takes NaN
    ("/v1/completions", b'{"prompt": "x", "top_p": Infinity}', "top_p"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"1": NaN}}', "logit_bias"),
    ("/v1/completions", b'{"prompt": "\\ud800 x"}', "prompt"),  # a lone surrogate: tokenizers raises TypeError
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages"),
    ("/v1/completions", b'{"prompt": "x", "bad_words": ["\\ud800"]}', None),
    ("/tokenize", b'{"prompt": "\\ud800"}', None),
]


def test_non_finite_numbers_and_invalid_unicode_are_400(parts):
    async def body(app: App):
        for path, raw, param in BAD_RAW_BODIES:
            r = await app.http.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (raw, r.text)

    run_app(parts, body)


# ---- 2. KV capacity at admission ------------------------------------------------------------------------


def test_request_that_can_never_fit_the_cache_is_400(small_parts):
    usable_tokens = (SMALL_NUM_BLOCKS - 1) * BLOCK

    async def body(app: App):
        long_ids = list(range(1000, 1200))  # 200 > 176 tokens: the prompt alone does not fit
        r = await app.http.post("/v1/completions", json={"prompt": long_ids, "max_tokens": 1})
        assert r.status_code == 400 and "KV-cache blocks" in r.json()["error"]["message"], r.text
        # fits alone, but prompt + max_tokens would need more than the whole cache: it would preempt itself
        # forever; refused at admission instead, naming both numbers and the cache size
        r = await app.http.post("/v1/completions", json={"prompt": long_ids[:100], "max_tokens": 100})
        err = r.json()["error"]
        assert r.status_code == 400 and "max_tokens (100)" in err["message"], r.text
        assert f"holds {usable_tokens}" in err["message"]
        r = await app.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400 and "lower max_tokens" in r.json()["error"]["message"]  # max_tokens unset
        ok = await app.http.post("/v1/completions", json={"prompt": long_ids[:100], "max_tokens": 70})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 70
        await app.settled()

    run_app(small_parts, body)


def test_kv_pressure_preempts_and_recomputes_identically(small_parts):
    """Four long requests on 11 blocks: they preempt each other; each output equals the request served
    alone (the fake runner's token is a hash of the whole history read back through the block table)."""

    async def body(app: App):
        reqs = [completion(i, max_tokens=40, temperature=0.8 if i % 2 else 0.0, seed=i) for i in range(4)]
        alone = [(await app.http.post("/v1/completions", json=r)).json()["choices"][0]["text"] for r in reqs]
        before = app.client.stats.num_preemptions
        app.runner.gate.clear()
        app.runner.in_step.clear()
        pending = [asyncio.create_task(app.http.post("/v1/completions", json=r)) for r in reqs]
        await hold_until_queued(app)
        app.runner.gate.set()
        together = await asyncio.gather(*pending)
        assert [r.status_code for r in together] == [200] * 4
        assert [r.json()["choices"][0]["text"] for r in together] == alone
        assert app.client.stats.num_preemptions > before
        await app.settled()

    run_app(small_parts, body)


# ---- 3. overload ----------------------------------------------------------------------------------------


def test_overload_is_503_with_retry_after_counted_and_drains(engine_parts):
    async def body(app: App):
        runner: ControlledRunner = app.runner
        runner.gate.clear()
        runner.in_step.clear()
        # --max-num-seqs 4: the batch is full. The first alone until its step is held: sent together, all four
        # adds could reach the engine before its first step, and the fourth found 3 waiting (a rejection)
        long = [asyncio.create_task(app.http.post("/v1/completions", json=completion(0, max_tokens=200)))]
        assert await asyncio.to_thread(runner.in_step.wait, 10)
        long += [asyncio.create_task(app.http.post("/v1/completions", json=completion(i, max_tokens=200)))
                 for i in range(1, 4)]
        await hold_until_queued(app)
        runner.in_step.clear()
        runner.gate.set()  # release that step only: the next one schedules all four, and is held
        runner.gate.clear()
        await asyncio.to_thread(runner.in_step.wait, 10)
        quick = [asyncio.create_task(app.http.post("/v1/completions", json=completion(10 + i, max_tokens=1)))
                 for i in range(5)]
        await asyncio.sleep(0.3)
        runner.gate.set()
        results = await asyncio.gather(*quick)
        codes = sorted(r.status_code for r in results)
        assert codes == [200] * 3 + [503] * 2, codes  # --max-waiting-requests 3
        for r in results:
            if r.status_code == 503:
                assert r.headers["retry-after"] == "1"
                assert "--max-waiting-requests=3" in r.json()["error"]["message"]
        assert app.metric('xlaserve:num_requests_rejected_total{reason="overloaded"}') == 2
        assert [r.status_code for r in await asyncio.gather(*long)] == [200] * 4
        await app.settled()  # the queue drained
        assert app.metric("vllm:num_requests_waiting") == 0

    run_app(engine_parts(max_waiting_requests=3), body)


# ---- 4. the drain of a shutdown --------------------------------------------------------------------------


@pytest.mark.parametrize("grace", [30.0, 0.0])
def test_drain_refuses_new_requests_and_lets_in_flight_finish(parts, grace):
    async def body(app: App):
        runner: ControlledRunner = app.runner
        runner.gate.clear()
        inflight = asyncio.create_task(app.http.post("/v1/completions", json=completion(1, max_tokens=8)))
        stream = asyncio.create_task(app.http.post("/v1/completions", json=completion(2, max_tokens=8,
                                                                                          stream=True)))
        await asyncio.to_thread(runner.in_step.wait, 10)
        await until(lambda: app.client.num_in_flight >= 2)
        draining = asyncio.create_task(drain(app.state, app.client, grace))
        await asyncio.sleep(0.1)
        r = await app.http.post("/v1/completions", json=completion(3))
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert (await app.http.get("/health")).status_code == 503
        assert (await app.http.get("/metrics")).status_code == 200  # everything else still answers
        assert app.metric('xlaserve:num_requests_rejected_total{reason="shutting_down"}') == 1
        runner.gate.set()
        await asyncio.wait_for(draining, 20)
        done, streamed = await inflight, await stream
        if grace:
            assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 8
            events = sse_events(streamed.text)
            assert events[-1]["choices"][0]["finish_reason"] == "length"
        else:  # --shutdown-timeout 0: aborted at once, with a 503 (an error event for the stream)
            assert done.status_code == 503 and "shutting down" in done.json()["error"]["message"]
            if streamed.status_code == 200:  # the stream had started: an error event ends it
                assert sse_events(streamed.text)[-1]["error"]["code"] == 503
            else:  # aborted while its add was still unacknowledged
                assert streamed.status_code == 503 and "shutting down" in streamed.json()["error"]["message"]
        await app.settled()

    run_app(parts, body)


# ---- 5. a failing request fails alone; a failing model step kills the engine -------------------------------


def test_fault_injector_is_off_by_default_and_validated():
    assert FaultInjector.from_env({}) is None and FaultInjector.from_env({ENV: " "}) is None
    f = FaultInjector.from_env({ENV: "output:^cmpl-boom,update:x"})
    f.check("output", "cmpl-fine-0-1")
    with pytest.raises(InjectedFault, match="output"):
        f.check("output", "cmpl-boom-0-1")
    f.check("step", "cmpl-boom-0-1")
    for bad in ("output", "nowhere:x", "step:(", "update:"):
        with pytest.raises(ValueError, match=ENV):
            FaultInjector.parse(bad)


@pytest.mark.parametrize("site", ["output", "update"])
def test_request_failure_is_500_for_it_alone_and_frees_its_blocks(parts, monkeypatch, site):
    async def body(app: App):
        others = [asyncio.create_task(app.http.post("/v1/completions", json=completion(i, max_tokens=12)))
                  for i in range(2)]
        bad = app.http.post("/v1/completions", json=completion(5, max_tokens=12, n=2),
                            headers={"X-Request-Id": "boom-1"})
        bad_stream = app.http.post("/v1/chat/completions", headers={"X-Request-Id": "boom-2"},
                                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12,
                                         "stream": True})
        bad, bad_stream = await asyncio.gather(bad, bad_stream)
        assert bad.status_code == 500, bad.text
        err = bad.json()["error"]
        assert err["code"] == 500 and err["type"] == "InternalServerError" and "boom-1" in err["message"]
        assert "InjectedFault" in err["message"]
        assert bad_stream.status_code == 200  # the stream had started: the error is its last event
        events = sse_events(bad_stream.text)
        assert events[-1]["error"]["code"] == 500 and "boom-2" in events[-1]["error"]["message"]
        assert bad_stream.text.rstrip().endswith("data: [DONE]")
        for r in await asyncio.gather(*others):
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
        await app.settled()
        assert app.metric('vllm:request_success_total{finished_reason="error"}') == 3  # n=2 and the chat
        assert not app.client.is_dead and (await app.http.get("/health")).status_code == 200
        ok = await app.http.post("/v1/completions", json=completion(9))
        assert ok.status_code == 200

    run_app(parts, body, faults=f"{site}:boom", monkeypatch=monkeypatch)


def test_failing_model_step_is_an_engine_death(parts, monkeypatch):
    async def body(app: App):
        other = asyncio.create_task(app.http.post("/v1/completions", json=completion(1, max_tokens=200)))
        await until(lambda: app.client.num_in_flight >= 1)
        bad = await app.http.post("/v1/completions", json=completion(2), headers={"X-Request-Id": "boom"})
        assert bad.status_code == 503 and "InjectedFault" in bad.json()["error"]["message"]
        r = await other
        assert r.status_code == 503 and "engine is dead" in r.json()["error"]["message"]
        assert app.client.is_dead and (await app.http.get("/health")).status_code == 503
        assert (await app.http.post("/v1/completions", json=completion(3))).status_code == 503

    run_app(parts, body, faults="step:boom", monkeypatch=monkeypatch)


def test_negative_shutdown_timeout_is_refused(caplog):
    import argparse

    from frontend.args import build_serve_parser, parse_serve_args
    from frontend.serve import run_server

    ns = parse_serve_args(build_serve_parser(argparse.ArgumentParser()), ["--shutdown-timeout", "-1"])
    assert run_server(ns) == 2
    assert "--shutdown-timeout must be 0" in caplog.text
