"""Frontend pieces without a model backend: the wire format, the engine client in thread mode over a
deterministic fake runner (tests/fake_runner.py), and the FastAPI app in-process (httpx ASGI transport).

These cover what a real server cannot show deterministically: overload exactly at
--max-waiting-requests, an engine step that raises, chunked bodies over the limit.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from enginecore.config import EngineArgs
from enginecore.engine import EngineCore, build_engine_parts
from enginecore.outputs import EngineCoreOutput, LogprobsLists
from enginecore.request import Request
from enginecore.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError
from enginecore.scheduler import SchedulerOverloadedError
from enginecore import wire
from frontend.api_server import HTTPOptions, ServerState, build_app
from frontend.engine_client import AsyncEngineClient, EngineDeadError
from frontend.metrics import ServerMetrics, StatsLogger
from frontend.serving_common import FrontendOptions, detect_content_format, resolve_chat_template
from tests.fake_runner import FakeRunner

NUM_BLOCKS = 64


class ControlledRunner(FakeRunner):
    """FakeRunner that can be held inside a step (`gate`) or made to fail (`fail`)."""

    def __init__(self, config, vocab_size: int):
        super().__init__(config, vocab_size=vocab_size, num_blocks=NUM_BLOCKS)
        self.gate = threading.Event()
        self.gate.set()
        self.in_step = threading.Event()
        self.fail = False

    def execute(self, so):
        if so.total_num_scheduled_tokens:
            self.in_step.set()
            assert self.gate.wait(30), "test forgot to open the gate"
            if self.fail:
                raise RuntimeError("injected runner failure")
        return super().execute(so)


@pytest.fixture(scope="module")
def parts():
    args = EngineArgs(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, max_waiting_requests=2,
                      num_gpu_blocks_override=NUM_BLOCKS, platform="cpu")
    return build_engine_parts(args)


async def start_client(parts, metrics: ServerMetrics | None = None):
    config, model, tokenizer = parts
    holder = {}

    def factory(cfg, mdl):
        holder["runner"] = ControlledRunner(cfg, vocab_size=model.config.vocab_size)
        return EngineCore(cfg, mdl, runner=holder["runner"])

    client = AsyncEngineClient(config, model, tokenizer, observer=metrics)
    await client.start(multiprocess=False, core_factory=factory)
    return client, holder["runner"]


def params(**kw) -> SamplingParams:
    kw.setdefault("output_kind", RequestOutputKind.FINAL_ONLY)
    return SamplingParams(**kw)


async def final_output(stream):
    out = None
    async for out in stream:
        pass
    return out


async def until(cond, what: str, timeout: float = 10.0, every: float = 0.01) -> None:
    """Wait, without blocking the event loop, until `cond()` holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(every)


def idle(client) -> bool:
    """The client has read the engine's stats of an idle engine: no request running, no block used."""
    return client.stats.num_used_blocks == 0 and client.stats.num_running_reqs == 0


def test_wire_roundtrip():
    sp = SamplingParams(n=2, temperature=0.7, top_k=5, stop=["x"], stop_token_ids=[3], logit_bias={7: -1.0},
                        seed=2**63 + 5, logprobs=2, output_kind=RequestOutputKind.DELTA)
    sp._bad_words_token_ids = [[1, 2]]
    sp._all_stop_token_ids = {2, 3}
    req = Request("r-1", [1, 2, 3], sp, eos_token_ids=(2,), arrival_time=12.5, priority=1, seed=99, sample_index=1,
                  max_tokens=9)
    back = wire.decode_request(wire.unpack(wire.pack(wire.encode_request(req))))
    assert (back.request_id, back.prompt_token_ids, back.eos_token_ids, back.arrival_time, back.priority,
            back.seed, back.sample_index, back.max_tokens) == ("r-1", [1, 2, 3], (2,), 12.5, 1, 99, 1, 9)
    bsp = back.sampling_params
    assert (bsp.n, bsp.temperature, bsp.top_k, bsp.stop, bsp.logit_bias, bsp.seed, bsp.output_kind) == \
        (2, 0.7, 5, ["x"], {7: -1.0}, 2**63 + 5, RequestOutputKind.DELTA)
    assert bsp._bad_words_token_ids == [[1, 2]] and bsp._all_stop_token_ids == {2, 3}
    out = EngineCoreOutput("r-1", [5], [LogprobsLists([5, 6], [-0.1, -2.0], 1)], [None, LogprobsLists([2], [-1.0], 3)],
                           "stop", "x", 4)
    assert wire.decode_output(wire.unpack(wire.pack(wire.encode_output(out)))) == out


def test_generate_stop_string_aborts_and_frees_blocks(parts):
    async def main():
        metrics = ServerMetrics("m", 256)
        client, runner = await start_client(parts, metrics)
        try:
            s = await client.add_request("a", "Hello there", params(max_tokens=12, ignore_eos=True))
            ref = await final_output(s)
            text = ref.outputs[0].text
            assert len(ref.outputs[0].token_ids) == 12 and ref.finished
            stop = text[len(text) // 2: len(text) // 2 + 2]
            assert stop.strip(), text
            s = await client.add_request("b", "Hello there", params(max_tokens=12, ignore_eos=True, stop=[stop]))
            out = (await final_output(s)).outputs[0]
            assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == text[:text.index(stop)]
            await until(lambda: idle(client), "the engine's stats after both requests ended")
            assert await client.call("check_invariants")
            assert client.stats.num_used_blocks == 0 and client.stats.num_running_reqs == 0
            assert metrics.success["stop"]._value.get() == 1 and metrics.success["length"]._value.get() == 1
            with pytest.raises(SamplingParamsError, match="priority"):
                await client.add_request("c", "x", params(), priority=2)
            with pytest.raises(SamplingParamsError, match="--max-waiting-requests"):  # 3 > 2: never admissible
                await client.add_request("d", "x", params(n=3))
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_stats_sent_only_when_changed(parts):
    """The engine sends its scheduler stats only when they changed (most decode steps' messages carry outputs
    alone), and the client's copy still ends equal to the engine's own."""
    async def main():
        client, runner = await start_client(parts)
        seen = []
        handle = client._handle

        def record(msg, outputs):
            seen.append(("outputs" in msg, "stats" in msg))
            handle(msg, outputs)

        client._handle = record
        try:
            await final_output(await client.add_request("a", "Hello there", params(max_tokens=12, ignore_eos=True)))
            await until(lambda: idle(client), "the engine's stats after the request ended")
            outputs_only = sum(1 for has_out, has_stats in seen if has_out and not has_stats)
            assert outputs_only >= 5, seen  # 12 decode steps, the stats changing in few of them
            assert any(has_stats for _, has_stats in seen)
            engine = wire.decode_stats(await client.call("get_stats"))
            assert client.stats == engine and engine.num_running_reqs == 0 and engine.num_used_blocks == 0
        finally:
            await client.shutdown()

    asyncio.run(main())


def delta(**kw) -> SamplingParams:
    return params(output_kind=RequestOutputKind.DELTA, ignore_eos=True, **kw)


def test_one_output_for_the_tokens_that_come_together(parts):
    """OutputProcessor: a call with several outputs of a child (the engine client passes it all the messages of
    one read) gives one output with all their tokens; --stream-interval N holds a stream's tokens until N are new
    (the first token and the end go out at once). Whatever the grouping, a stream's deltas add up to the same
    tokens and text, and the latencies go by the engine's timestamps: one inter-token latency a step."""
    from enginecore.processor import OutputProcessor

    tok = parts[2]
    ids = tok.encode(" one two three four five six seven eight nine ten", add_special_tokens=False)[:10]
    assert len(ids) == 10
    want = tok.decode(ids, skip_special_tokens=True)
    for interval, groups, sizes in (
            (1, [[t] for t in ids], [1] * 10),
            (1, [ids[:1], ids[1:4], ids[4:5], ids[5:]], [1, 3, 1, 5]),
            (3, [[t] for t in ids], [1, 3, 3, 3]),
            (4, [[t] for t in ids], [1, 4, 4, 1]),
            (4, [ids[:2], ids[2:4], ids[4:]], [2, 8]),
            (20, [[t] for t in ids], [1, 9])):
        metrics = ServerMetrics("m", 256)
        proc = OutputProcessor(tok, metrics, stream_interval=interval)
        start = time.monotonic()
        proc.add_request("r", "p", [1], delta(), ["r"], arrival_time=start - 0.5)
        got = []
        pos = 0
        for g, group in enumerate(groups):
            last = g == len(groups) - 1
            outs = [EngineCoreOutput("r", [t], finish_reason="length" if last and i == len(group) - 1 else None,
                                     timestamp=start + 0.25 * (pos + i)) for i, t in enumerate(group)]
            pos += len(group)
            for st, ro in proc.process_outputs(outs)[0]:
                got.append(ro.outputs[0])
        case = (interval, [len(g) for g in groups])
        assert [len(o.token_ids) for o in got] == sizes, case
        assert sum((o.token_ids for o in got), []) == ids and "".join(o.text for o in got) == want, case
        assert got[-1].finish_reason == "length" and not proc.has("r"), case
        assert metrics.generation_tokens._value.get() == 10, case
        assert metrics.ttft._sum.get() == pytest.approx(0.5) and sum(b.get() for b in metrics.ttft._buckets) == 1, case
        assert metrics.itl._sum.get() == pytest.approx(0.25 * 9) and sum(b.get() for b in metrics.itl._buckets) == 9, case
    # n = 2: each child keeps its own interval; the request ends with its last child
    proc = OutputProcessor(tok, stream_interval=3)
    proc.add_request("q", "p", [1], delta(n=2), ["q-0", "q-1"])
    got = {0: [], 1: []}
    for i, t in enumerate(ids):
        for c, length in ((0, 10), (1, 7)):
            if i < length:
                out = EngineCoreOutput(f"q-{c}", [t], finish_reason="length" if i == length - 1 else None)
                for st, ro in proc.process_outputs([out])[0]:
                    for o in ro.outputs:
                        got[o.index].append(len(o.token_ids))
    assert got == {0: [1, 3, 3, 3], 1: [1, 3, 3]} and not proc.has("q")


def test_engine_messages_read_together_become_one_output(parts):
    """The engine client reads every queued message at once: a stream whose steps came while the event loop was
    busy gets one output for all their tokens, the same tokens and text as one a token."""
    async def main():
        metrics = ServerMetrics("m", 256)
        client, runner = await start_client(parts, metrics)
        try:
            ref = await final_output(await client.add_request("a", "Hello there", params(max_tokens=12,
                                                                                         ignore_eos=True)))
            await until(lambda: idle(client), "the engine's stats after the first request ended")
            itl_count, itl_sum = sum(b.get() for b in metrics.itl._buckets), metrics.itl._sum.get()
            s = await client.add_request("b", "Hello there", delta(max_tokens=12))
            deadline = time.monotonic() + 30
            while runner.steps < 2 * 12 and time.monotonic() < deadline:  # the loop blocked: no message is read
                time.sleep(0.01)
            time.sleep(0.2)  # still blocked: the last step's message is queued with the others
            outs = [o.outputs[0] async for o in s]
            assert 1 <= len(outs) < 12, [len(o.token_ids) for o in outs]
            assert sum((o.token_ids for o in outs), []) == ref.outputs[0].token_ids
            assert "".join(o.text for o in outs) == ref.outputs[0].text
            assert metrics.generation_tokens._value.get() == 24 and outs[-1].finish_reason == "length"
            # a latency a step, by the engine's clock (its messages' times) though they were read at once
            assert sum(b.get() for b in metrics.itl._buckets) == itl_count + 11 and metrics.itl._sum.get() > itl_sum
            await until(lambda: idle(client), "the engine's stats after the second request ended")
            assert client.stats.num_used_blocks == 0 and client.stats.num_running_reqs == 0
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_stream_interval_flag_reaches_the_client(parts):
    """--stream-interval: validated, in the scheduler config, and what the engine client's outputs follow."""
    import dataclasses

    import argparse

    from enginecore.config import ConfigError
    from frontend.args import build_serve_parser, engine_args_from_namespace, parse_serve_args

    ns = parse_serve_args(build_serve_parser(argparse.ArgumentParser()), ["--stream-interval", "4"])
    assert engine_args_from_namespace(ns).stream_interval == 4
    with pytest.raises(ConfigError, match="--stream-interval"):
        EngineArgs(stream_interval=0, platform="cpu").create_engine_config()

    async def main():
        config, model, tokenizer = parts
        config = dataclasses.replace(config, scheduler_config=dataclasses.replace(config.scheduler_config,
                                                                                  stream_interval=4))
        client, runner = await start_client((config, model, tokenizer))
        try:
            assert client.output_processor.stream_interval == 4
            ref = await final_output(await client.add_request("a", "Hello there", params(max_tokens=10,
                                                                                         ignore_eos=True)))
            execute = runner.execute

            def slow(so):  # a message at a time: the reader sees each step's token alone
                time.sleep(0.03)
                return execute(so)

            runner.execute = slow
            outs = [o.outputs[0] async for o in await client.add_request("b", "Hello there", delta(max_tokens=10))]
            sizes = [len(o.token_ids) for o in outs]
            assert sizes[0] == 1 and len(sizes) >= 3 and all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 10, sizes
            assert "".join(o.text for o in outs) == ref.outputs[0].text
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_overload_exactly_at_max_waiting_requests(parts):
    """2 running (--max-num-seqs 2), 2 waiting (--max-waiting-requests 2), the 5th and 6th get 503."""

    async def main():
        client, runner = await start_client(parts)
        try:
            first = [await client.add_request(f"r{i}", "Hello", params(max_tokens=50, ignore_eos=True))
                     for i in range(2)]
            runner.gate.clear()
            runner.in_step.clear()
            await asyncio.to_thread(runner.in_step.wait, 10)  # the engine is inside a step with both running
            # these arrive while the engine is busy: drained together before the next schedule
            adds = [asyncio.create_task(client.add_request(f"w{i}", "Hi", params(max_tokens=1))) for i in range(4)]
            # each add registers its pending answer and sends in one go: 4 pending, all 4 are in the engine's queue
            await until(lambda: len(client._pending_adds) == 4, "the 4 adds to be sent")
            runner.gate.set()
            results = await asyncio.gather(*adds, return_exceptions=True)
            kinds = [type(r).__name__ for r in results]
            assert kinds == ["RequestStream", "RequestStream", "SchedulerOverloadedError", "SchedulerOverloadedError"]
            assert "--max-waiting-requests=2" in str(results[2])
            for s in first:
                s.abort()
            for s in results[:2]:
                assert (await final_output(s)).finished
            await until(lambda: idle(client), "the engine's stats after every request ended")
            assert client.stats.num_used_blocks == 0 and await client.call("check_invariants")
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_engine_step_failure_is_503_everywhere(parts):
    async def main():
        config, model, tokenizer = parts
        client, runner = await start_client(parts)
        state = ServerState(client, ServerMetrics("m", 256), ["m"], FrontendOptions())
        app = build_app(state, HTTPOptions())
        deaths = []
        client.on_dead.append(deaths.append)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
                assert (await http.get("/health")).status_code == 200
                runner.gate.clear()
                inflight = asyncio.create_task(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 5}))
                await asyncio.to_thread(runner.in_step.wait, 10)
                runner.fail = True
                runner.gate.set()
                r = await inflight
                assert r.status_code == 503 and "injected runner failure" in r.json()["error"]["message"]
                assert (await http.get("/health")).status_code == 503
                assert (await http.get("/ping")).status_code == 503
                r = await http.post("/v1/completions", json={"prompt": "Hi"})
                assert r.status_code == 503 and r.json()["error"]["code"] == 503
                r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                   "stream": True})
                assert r.status_code == 503
            assert len(deaths) == 1 and "injected" in deaths[0]
            with pytest.raises(EngineDeadError):
                await client.add_request("late", "x", params())
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_app_auth_cors_body_limit_and_load(parts):
    async def main():
        client, _ = await start_client(parts)
        state = ServerState(client, ServerMetrics("m", 256), ["m", "alias"], FrontendOptions())
        app = build_app(state, HTTPOptions(api_keys=["k1", "k2"], max_request_body_bytes=1000,
                                           enable_server_load_tracking=True, disable_fastapi_docs=True))
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
                assert (await http.get("/v1/models")).status_code == 401
                r = await http.get("/v1/models", headers={"Authorization": "Bearer k2"})
                assert [m["id"] for m in r.json()["data"]] == ["m", "alias"]
                dense = parts[1].config.num_params()  # SmolLM2: every parameter is active
                assert dense > 100e6 and {(m["num_params"], m["num_active_params"]) for m in r.json()["data"]} == {
                    (dense, dense)}
                assert (await http.get("/health")).status_code == 200
                assert (await http.get("/metrics")).status_code == 200
                pre = await http.options("/v1/completions", headers={"Origin": "http://x",
                                                                     "Access-Control-Request-Method": "POST"})
                assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] in ("*", "http://x")
                auth = {"Authorization": "Bearer k1"}

                async def chunked():
                    for _ in range(20):
                        yield b"x" * 100

                r = await http.post("/v1/completions", content=chunked(), headers=auth)
                assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]
                r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "model": "alias"},
                                    headers=auth)
                assert r.status_code == 200 and r.json()["model"] == "alias"
                assert (await http.get("/load")).json() == {"server_load": 0}
                assert (await http.get("/docs")).status_code == 404
                assert (await http.post("/reset_prefix_cache")).status_code == 404  # dev mode is off
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_chat_template_resolution(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert resolve_chat_template(str(f)) == f.read_text()
    assert resolve_chat_template("{{ messages[0]['content'] }}\\n") == "{{ messages[0]['content'] }}\n"
    from enginecore.config import ConfigError

    with pytest.raises(ConfigError, match="no such file"):
        resolve_chat_template("/no/such/template.jinja")
    with pytest.raises(ConfigError, match="not a valid Jinja"):
        resolve_chat_template("{% for %}")
    assert detect_content_format("{% for part in message['content'] %}{{ part['text'] }}{% endfor %}") == "openai"
    assert detect_content_format("{{ message['content'] }}") == "string"


def test_stats_logger_line():
    m = ServerMetrics("m", 256)
    from enginecore.scheduler import SchedulerStats

    m.on_engine_stats(SchedulerStats(num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25, num_free_blocks=30,
                                     num_used_blocks=10, num_total_blocks=40, prefix_cache_queries=100,
                                     prefix_cache_hits=40))
    m.on_first_token(0.1, 50)
    m.on_generation_tokens(20)
    line = StatsLogger(m, 10).log_once()
    for part in ("Avg prompt throughput", "Avg generation throughput", "Running: 2 reqs", "Waiting: 1 reqs",
                 "KV cache usage: 25.0% (10/40 blocks)", "Prefix cache hit rate: 40.0%"):
        assert part in line
    assert b'vllm:prefix_cache_hits_total{model_name="m"} 40.0' in m.render()


def test_overloaded_error_type_is_exported():
    assert issubclass(SchedulerOverloadedError, RuntimeError)


def test_chat_template_override_and_content_formats(parts):
    """--chat-template replaces the model's; content parts reach it joined ('string') or as a list ('openai')."""
    from frontend.serving_chat import ServingChat
    from frontend.protocol import ChatMessage

    async def main():
        client, _ = await start_client(parts)
        try:
            msgs = [ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])]
            string_tpl = "{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
            chat = ServingChat(client, ["m"], FrontendOptions(chat_template=string_tpl))
            assert chat.render_prompt(msgs) == "[user:a\nb]"
            parts_tpl = ("{% for m in messages %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}"
                         "{% endfor %}")
            chat = ServingChat(client, ["m"], FrontendOptions(chat_template=parts_tpl))
            assert chat.render_prompt(msgs) == "<a><b>"  # auto-detected 'openai' format
            chat = ServingChat(client, ["m"], FrontendOptions(chat_template=string_tpl,
                                                              chat_template_content_format="openai"))
            assert "'type': 'text'" in chat.render_prompt(msgs)
            state = ServerState(client, ServerMetrics("m", 256), ["m"], FrontendOptions(chat_template=string_tpl))
            app = build_app(state, HTTPOptions())
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
                tok = (await http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})).json()
                text = (await http.post("/detokenize", json={"tokens": tok["tokens"]})).json()["prompt"]
                assert text == "[user:hi]"
                r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                   "max_tokens": 2})
                assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == tok["count"]
        finally:
            await client.shutdown()

    asyncio.run(main())


QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
             "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
             "moe_intermediate_size": 768, "norm_topk_prob": True}  # Qwen3-30B-A3B's sizes


def test_models_card_gives_a_moe_models_total_and_active_params(parts):
    """/v1/models reads the served model's counts: a Mixture-of-Experts model's active ones are its top-k
    experts' (Qwen3-30B-A3B: 30.5B, 3.3B active)."""
    import dataclasses

    from enginecore.arch import ArchConfig

    async def main():
        client, _ = await start_client(parts)
        arch = ArchConfig.from_hf_dict(QWEN3_MOE)
        client.model = dataclasses.replace(client.model, config=arch)  # what the card reads; no weights needed
        app = build_app(ServerState(client, ServerMetrics("m", 256), ["m"], FrontendOptions()), HTTPOptions())
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
                card = (await http.get("/v1/models")).json()["data"][0]
        finally:
            await client.shutdown()
        assert card["num_params"] == arch.num_params() and card["num_active_params"] == arch.num_params(active=True)
        assert 30.4e9 < card["num_params"] < 30.6e9 and 3.2e9 < card["num_active_params"] < 3.4e9

    asyncio.run(main())
