"""Enforced tool choices with the embedded model (SmolLM2-135M): a real `xlaserve serve` on the jax backend
with the openai client, and the torch backend's engine in-process behind the same app. Named choices
give one call whose arguments validate against the schema (greedy and seeded), required ones at least
one (at most one with parallel_tool_calls false), streamed deltas add up to the non-streamed answer;
auto with a model that writes no calls, tool history through SmolLM2's template, and the 400s."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.test_tool_calls import comparable, reassemble

STRICT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 24},
                                          "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                                          "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
                                      "parameters": {"type": "object", "properties": {
                                          "tz": {"type": "string", "maxLength": 24}},
                                          "required": ["tz"], "additionalProperties": False}}},
]
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
STRICT = {t["function"]["name"]: t["function"]["parameters"] for t in STRICT_TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def assert_valid_call(name: str, arguments: str) -> dict:
    """The arguments parse and validate against the tool's parameters schema."""
    import jsonschema

    args = json.loads(arguments)
    jsonschema.validate(args, STRICT[name])
    return args


def check_enforced_choices(chat) -> None:
    """`chat(**kw)` -> (message dict, finish_reason) non-streamed; with stream=True, reassembled chunks."""
    answers = {}
    for seed in (None, 1):
        kw = {"tool_choice": NAMED, "max_tokens": 60, **({"temperature": 0} if seed is None else
                                                          {"temperature": 0.8, "seed": seed})}
        msg, finish = chat(tools=STRICT_TOOLS, **kw)
        answers["named", seed] = (msg, finish), kw
        assert finish == "stop" and not msg["content"] and len(msg["tool_calls"]) == 1, (seed, msg)
        call = msg["tool_calls"][0]
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        assert call["function"]["name"] == "get_weather"
        assert_valid_call("get_weather", call["function"]["arguments"])
    # required: one call at most (parallel_tool_calls false), and free (seeded: several calls)
    for key, extra in (("single", {"parallel_tool_calls": False, "temperature": 0}),
                       ("seeded", {"temperature": 0.8, "seed": 1})):
        kw = {"tool_choice": "required", "max_tokens": 160, **extra}
        msg, finish = chat(tools=STRICT_TOOLS, **kw)
        answers["required", key] = (msg, finish), kw
        assert finish == "tool_calls" and not msg["content"] and msg["tool_calls"], (extra, msg)
        if key == "single":
            assert len(msg["tool_calls"]) == 1
        for call in msg["tool_calls"]:
            assert_valid_call(call["function"]["name"], call["function"]["arguments"])
    # streamed deltas add up to the non-streamed answer (greedy, and seeded)
    for key in (("named", None), ("required", "seeded")):
        (ref, ref_finish), kw = answers[key]
        got, finish = chat(tools=STRICT_TOOLS, stream=True, **kw)
        assert comparable(got, finish) == comparable(ref, ref_finish), key


def openai_message(resp) -> tuple[dict, str]:
    m = resp.choices[0].message
    calls = [{"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": c.function.arguments}}
             for c in m.tool_calls or []]
    return {"content": m.content, "reasoning": getattr(m, "reasoning", None), "tool_calls": calls}, \
        resp.choices[0].finish_reason


def openai_stream_message(chunks) -> tuple[dict, str]:
    as_dicts = [c.model_dump(exclude_none=True) for c in chunks]
    for c in as_dicts:
        for ch in c["choices"]:
            ch.setdefault("finish_reason", None)
    m = reassemble(as_dicts)[0]
    return m, m["finish_reason"]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    from tests.test_api_server import ENGINE_FLAGS, ServerProcess

    srv = ServerProcess([*ENGINE_FLAGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--seed", "0"],
                        str(tmp_path_factory.mktemp("tool_server") / "server.log"))
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.mark.slow
def test_server_enforced_tool_choices(tool_server):
    import openai

    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="none", max_retries=0, timeout=300)

    def chat(stream=False, **kw):
        if stream:
            return openai_stream_message(list(client.chat.completions.create(
                model=MODEL, messages=QUESTION, stream=True, **kw)))
        return openai_message(client.chat.completions.create(model=MODEL, messages=QUESTION, **kw))

    check_enforced_choices(chat)


@pytest.mark.slow
def test_server_auto_choice_history_and_400s(tool_server):
    import openai

    client = openai.OpenAI(base_url=tool_server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    # auto (the default with tools): SmolLM2 does not write <tool_call>, so its text comes back as content
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=STRICT_TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason in ("stop", "length")
    # a conversation with a call and its result renders through SmolLM2's template
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 22 C"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=STRICT_TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].message.content
    bad = [({"tool_choice": "required"}, "tool_choice"),
           ({"tools": STRICT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
           ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
             "tool_choice": "required"}, "tools")]
    for kw, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert r.choices[0].message.content is not None


@pytest.mark.slow
def test_torch_backend_enforced_tool_choices():
    """The same checks on the torch backend: its engine in-process, the app over an ASGI transport."""
    import openai

    from enginecore.config import EngineArgs
    from enginecore.engine import build_engine_parts
    from frontend.api_server import HTTPOptions, ServerState, build_app
    from frontend.engine_client import AsyncEngineClient
    from frontend.metrics import ServerMetrics
    from frontend.serving_common import FrontendOptions

    async def main():
        config, model, tokenizer = build_engine_parts(EngineArgs(
            backend="torch", platform="cpu", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256))
        engine = AsyncEngineClient(config, model, tokenizer)
        await engine.start(multiprocess=False)
        try:
            app = build_app(ServerState(engine, ServerMetrics("m", 512), [MODEL], FrontendOptions()), HTTPOptions())
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t/v1")
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="none", http_client=http, max_retries=0)
            loop = asyncio.get_running_loop()

            async def ask(stream, kw):
                if stream:
                    it = await client.chat.completions.create(model=MODEL, messages=QUESTION, stream=True, **kw)
                    return openai_stream_message([c async for c in it])
                return openai_message(await client.chat.completions.create(model=MODEL, messages=QUESTION, **kw))

            def chat(stream=False, **kw):  # called from a worker thread; the engine runs on this loop
                return asyncio.run_coroutine_threadsafe(ask(stream, kw), loop).result(600)

            await asyncio.to_thread(check_enforced_choices, chat)
            await http.aclose()
        finally:
            await engine.shutdown()

    asyncio.run(main())
