"""Tool calling: the parsers (non-streamed, and streamed with every split point of a sample), tool_choice
validation and the schemas that enforce named / required choices; the chat endpoint in-process over
a scripted engine (auto, named, required, streaming, reasoning, 400s, tool history through templates).
The embedded model's enforced choices on both backends: tests/test_tool_calls_engine.py."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolCallStreamer,
    ToolChoiceError,
    invalid_tool_schema,
    resolve_tool_choice,
    tool_choice_schema,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "metric": {"type": "boolean"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                                       "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]

CALL1 = ("get_weather", {"city": "Paris", "days": 3})
CALL2 = ("get_time", {"tz": "Europe/Paris"})

SAMPLES = {
    "hermes": 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                   '{"name": "get_time", "parameters": {"tz": "Europe/Paris"}}',
    "mistral": 'Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
               '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}]',
    "qwen3_xml": "Let me check. <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                 "<parameter=tz>\nEurope/Paris\n</parameter>\n</function>\n</tool_call>",
}
CONTENT = {"hermes": "Let me check. ", "llama3_json": None, "mistral": "Let me check. ", "qwen3_xml": "Let me check. "}


def stream_all(parser, text: str, splits: list[int]):
    """Feed `text` cut at `splits`; returns (content, calls as [(name, args)], ids, header chunks)."""
    s = ToolCallStreamer(parser)
    content, calls, ids = "", {}, {}
    bounds = [0, *splits, len(text)]
    for k in range(len(bounds) - 1):
        c, deltas = s.feed(text[bounds[k]:bounds[k + 1]], final=k == len(bounds) - 2)
        content += c
        for d in deltas:
            i = d["index"]
            if "id" in d:
                assert i not in ids and d["type"] == "function" and d["function"]["arguments"] == ""
                ids[i] = d["id"]
                calls[i] = [d["function"]["name"], ""]
            else:
                assert i in ids and set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[i][1] += d["function"]["arguments"]
    return content or None, [tuple(calls[i]) for i in sorted(calls)], ids


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_parser_extracts_calls_and_content(name):
    parser = TOOL_PARSERS[name](TOOLS)
    content, calls = parser.extract_tool_calls(SAMPLES[name])
    assert content == CONTENT[name]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [CALL1, CALL2]
    assert all(c.id.startswith("chatcmpl-tool-") for c in calls) and calls[0].id != calls[1].id
    # plain text passes through
    assert parser.extract_tool_calls("Just text, <b>no</b> calls.") == ("Just text, <b>no</b> calls.", [])


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_parser_streaming_every_split_point(name):
    text = SAMPLES[name]
    parser = TOOL_PARSERS[name](TOOLS)
    ref_content, ref_calls = parser.extract_tool_calls(text)
    ref = [(c.name, c.arguments) for c in ref_calls]
    for cut in range(1, len(text)):
        assert stream_all(parser, text, [cut])[:2] == (ref_content, ref), cut
    # one character at a time: every marker is split, arguments arrive in many fragments
    content, calls, ids = stream_all(parser, text, list(range(1, len(text))))
    assert (content, calls) == (ref_content, ref) and len(ids) == 2


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_parser_malformed_call_is_content(name):
    bad = {"hermes": 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>',
           "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some text',
           "mistral": 'Hi [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',
           "qwen3_xml": "Hi <tool_call>\n<function=get_weather>\n<parameter=city>\nPar"}[name]
    parser = TOOL_PARSERS[name](TOOLS)
    assert parser.extract_tool_calls(bad) == (bad, [])


def test_hermes_unclosed_last_call_and_string_arguments():
    p = TOOL_PARSERS["hermes"](TOOLS)
    content, calls = p.extract_tool_calls('<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "UTC"})]


def test_llama3_json_without_tag_and_plain_json_content():
    p = TOOL_PARSERS["llama3_json"](TOOLS)
    _, calls = p.extract_tool_calls(' {"name": "get_time", "arguments": {"tz": "UTC"}}')
    assert [(c.name, c.arguments) for c in calls] == [("get_time", '{"tz": "UTC"}')]
    # JSON that is not a call is content, streamed or not
    text = '{"answer": 42}'
    assert p.extract_tool_calls(text) == (text, [])
    assert stream_all(p, text, [1, 5, 9]) == (text, [], {})


def test_mistral_v11_format():
    p = TOOL_PARSERS["mistral"](TOOLS)
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}'
    _, calls = p.extract_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"tz": "UTC"}')]
    for cut in range(1, len(text)):
        assert stream_all(p, text, [cut])[1] == [(c.name, c.arguments) for c in calls]


def test_qwen3_xml_types_follow_the_schema():
    p = TOOL_PARSERS["qwen3_xml"](TOOLS)
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n2\n"
            "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=other>\n[1]\n</parameter>\n"
            "</function>\n</tool_call>")
    _, calls = p.extract_tool_calls(text)
    assert json.loads(calls[0].arguments) == {"city": "42", "days": 2, "metric": True, "other": "[1]"}


def test_named_and_required_output_parsers_stream_like_they_parse():
    named = NamedToolParser("get_weather")
    text = ' {"city": "Paris", "days": 3}\n'
    _, calls = named.extract_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris", "days": 3}')]
    for cut in range(0, len(text)):
        assert stream_all(named, text, [cut] if cut else [])[1] == [("get_weather", calls[0].arguments)]
    req = RequiredToolParser()
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"tz": "UTC"}}]'
    _, calls = req.extract_tool_calls(text)
    ref = [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "UTC"}')]
    assert [(c.name, c.arguments) for c in calls] == ref
    for cut in range(1, len(text)):
        assert stream_all(req, text, [cut]) [:2] == (None, ref)


def test_resolve_tool_choice_rules():
    assert resolve_tool_choice(None, None, auto_enabled=False).mode == "none"
    assert resolve_tool_choice(TOOLS, "none", auto_enabled=False).mode == "none"
    assert resolve_tool_choice(TOOLS, None, auto_enabled=True).mode == "auto"
    assert resolve_tool_choice([], "required", auto_enabled=False).mode == "none"
    named = resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_time"}}, auto_enabled=False)
    assert (named.mode, named.name) == ("named", "get_time")
    cases = [
        (TOOLS, None, "--enable-auto-tool-choice", "tool_choice"),  # tools default to auto
        (TOOLS, "auto", "--enable-auto-tool-choice", "tool_choice"),
        (None, "required", "`tools` must be set", "tool_choice"),
        (None, {"type": "function", "function": {"name": "x"}}, "`tools` must be set", "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope'", "tool_choice"),
        (TOOLS, {"type": "function"}, "invalid tool_choice", "tool_choice"),
        (TOOLS, "sometimes", "invalid tool_choice", "tool_choice"),
        ([{"type": "function", "function": {"description": "no name"}}], "required", "name", "tools"),
        ([{"type": "retrieval"}], "required", "function", "tools"),
        ([WEATHER, WEATHER], "required", "unique", "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], "required", "parameters", "tools"),
    ]
    for tools, choice, msg, param in cases:
        with pytest.raises(ToolChoiceError, match=msg) as e:
            resolve_tool_choice(tools, choice, auto_enabled=False)
        assert e.value.param == param, (tools, choice)


def test_schemas_for_enforced_choices():
    named = resolve_tool_choice(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, auto_enabled=False)
    assert tool_choice_schema(named, None) == WEATHER["function"]["parameters"]
    req = resolve_tool_choice(TOOLS, "required", auto_enabled=False)
    s = tool_choice_schema(req, None)
    assert s["type"] == "array" and s["minItems"] == 1 and "maxItems" not in s
    assert [a["properties"]["name"]["enum"] for a in s["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert tool_choice_schema(req, False)["maxItems"] == 1
    with_defs = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}}
    s = tool_choice_schema(resolve_tool_choice([with_defs, TIME], "required", auto_enabled=False), None)
    assert s["$defs"] == {"P": {"type": "integer"}} and "$defs" not in s["items"]["anyOf"][0]["properties"]["parameters"]
    check_parameter_schemas(TOOLS)
    with pytest.raises(ToolChoiceError, match=r"tools\[0\] \(bad\)") as e:
        check_parameter_schemas([{"type": "function", "function": {"name": "bad", "parameters": {"type": "objectx"}}}])
    assert e.value.param == "tools"


def check_parameter_schemas(tools: list[dict]) -> None:
    """The server's path for an enforced choice's schema: the input processor compiles it (a 400 naming
    "tools"), then `invalid_tool_schema` names the tools[i] at fault."""
    from enginecore.sampling_params import SamplingParamsError, StructuredOutputsParams

    choice = resolve_tool_choice(tools, "required", auto_enabled=False)
    try:
        scripted_input_processor(100).validate_structured_outputs(
            StructuredOutputsParams(json=tool_choice_schema(choice, None), param="tools"))
    except SamplingParamsError as e:
        assert e.param == "tools"
        raise invalid_tool_schema(choice, None, e) from None


def scripted_input_processor(vocab_size: int):
    """The real client's InputProcessor (its structured-output check), on a minimal config."""
    from enginecore.config import StructuredOutputsConfig
    from enginecore.processor import InputProcessor

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_model_len=4096), model_config=SimpleNamespace(seed=0),
                             structured_outputs_config=StructuredOutputsConfig())
    return InputProcessor(config, None, vocab_size)


# ---- the chat endpoint in-process, over a scripted engine ----------------------------------------------

import asyncio  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import httpx  # noqa: E402

from enginecore.outputs import CompletionOutput, RequestOutput  # noqa: E402
from enginecore.sampling_params import RequestOutputKind  # noqa: E402


class ScriptedClient:
    """Stands in for AsyncEngineClient: every request 'generates' `script` (text deltas), n times over;
    the SamplingParams the server built are kept for inspection."""

    def __init__(self, tokenizer, script: list[str], finish: str = "stop"):
        self.tokenizer = tokenizer
        self.config = SimpleNamespace(scheduler_config=SimpleNamespace(max_model_len=4096))
        self.input_processor = scripted_input_processor(tokenizer.vocab_size)
        self.script = script
        self.finish = finish
        self.requests: list[tuple[dict, object]] = []

    async def add_request(self, rid, prompt, params, priority=0):
        if params.structured_outputs is not None:  # as AsyncEngineClient's InputProcessor does
            self.input_processor.validate_structured_outputs(params.structured_outputs)
        self.requests.append((prompt, params))
        ids = prompt["prompt_token_ids"]

        def out(texts, finished):
            return RequestOutput(rid, prompt["prompt"], ids, None, [
                CompletionOutput(i, t, [7], None, None, self.finish if finished else None) for i, t in enumerate(texts)
            ], finished=finished)

        if params.output_kind == RequestOutputKind.DELTA:
            outs = [out([c] * params.n, k == len(self.script) - 1) for k, c in enumerate(self.script)]
        else:
            outs = [out(["".join(self.script)] * params.n, True)]
        return ScriptedStream(outs)


class ScriptedStream:
    def __init__(self, outs):
        self.outs = outs

    async def __aiter__(self):
        for o in self.outs:
            await asyncio.sleep(0)
            yield o

    def abort(self):
        pass


def chat_app(tokenizer, script, finish="stop", **options):
    from frontend.api_server import HTTPOptions, ServerState, build_app
    from frontend.metrics import ServerMetrics
    from frontend.serving_common import FrontendOptions

    client = ScriptedClient(tokenizer, script, finish)
    state = ServerState(client, ServerMetrics("m", 4096), ["m"], FrontendOptions(**options))
    return client, build_app(state, HTTPOptions())


def run_chat(app, body: dict):
    """(status, JSON) for a non-streamed request; (status, [chunks]) for a streamed one."""

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **body})
            if not body.get("stream") or r.status_code != 200:
                return r.status_code, r.json()
            chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            return r.status_code, chunks

    return asyncio.run(go())


def reassemble(chunks: list[dict], n: int = 1) -> list[dict]:
    """Streamed chunks -> one message per choice, the way OpenAI's clients accumulate them."""
    msgs = [{"content": None, "reasoning": None, "tool_calls": {}, "finish_reason": None} for _ in range(n)]
    for ch in chunks:
        for c in ch["choices"]:
            m, d = msgs[c["index"]], c["delta"]
            for k in ("content", "reasoning"):
                if d.get(k):
                    m[k] = (m[k] or "") + d[k]
            assert d.get("reasoning") == d.get("reasoning_content")
            for tc in d.get("tool_calls") or []:
                if "id" in tc:
                    assert tc["index"] not in m["tool_calls"] and tc["function"]["arguments"] == ""
                    m["tool_calls"][tc["index"]] = {"id": tc["id"], "type": tc["type"],
                                                   "function": {"name": tc["function"]["name"], "arguments": ""}}
                else:
                    m["tool_calls"][tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
            if c["finish_reason"]:
                m["finish_reason"] = c["finish_reason"]
    for m in msgs:
        m["tool_calls"] = [m["tool_calls"][i] for i in sorted(m["tool_calls"])]
    return msgs


def comparable(message: dict, finish: str) -> dict:
    calls = [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in message.get("tool_calls") or [])
    return {"content": message.get("content"), "reasoning": message.get("reasoning"), "calls": calls, "finish": finish}


def check_stream_matches(app, body: dict, n: int = 1) -> dict:
    status, resp = run_chat(app, body)
    assert status == 200, resp
    status, chunks = run_chat(app, {**body, "stream": True})
    assert status == 200, chunks
    streamed = reassemble(chunks, n)
    for i in range(n):
        ref = comparable(resp["choices"][i]["message"], resp["choices"][i]["finish_reason"])
        assert comparable(streamed[i], streamed[i]["finish_reason"]) == ref
    return resp


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


HERMES_SCRIPT = ["Let me ", "check. <tool", "_call>\n{\"name\": \"get_", "weather\", \"arguments\": {\"ci",
                 "ty\": \"Paris\", \"days\": 3}}\n</tool_call>\n<tool_call>{\"name\": \"get_time\", ",
                 "\"arguments\": {\"tz\": \"UTC\"}}</tool", "_call>"]


def test_chat_auto_tool_choice_hermes(tok):
    _, app = chat_app(tok, HERMES_SCRIPT, enable_auto_tool_choice=True, tool_call_parser="hermes")
    resp = check_stream_matches(app, {"tools": TOOLS, "n": 2}, n=2)
    for ch in resp["choices"]:
        msg = ch["message"]
        assert ch["finish_reason"] == "tool_calls" and msg["content"] == "Let me check. "
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
            [CALL1, ("get_time", {"tz": "UTC"})]
    # parallel_tool_calls: false keeps the first call
    resp = check_stream_matches(app, {"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False})
    assert [c["function"]["name"] for c in resp["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    # tool_choice none: the text as it is, no parsing
    status, resp = run_chat(app, {"tools": TOOLS, "tool_choice": "none"})
    assert resp["choices"][0]["message"]["content"] == "".join(HERMES_SCRIPT)
    assert resp["choices"][0]["message"]["tool_calls"] == [] and resp["choices"][0]["finish_reason"] == "stop"


def test_chat_auto_without_calls_is_plain_content(tok):
    _, app = chat_app(tok, ["Paris is ", "the capital", " <b>of</b> France."],
                      enable_auto_tool_choice=True, tool_call_parser="hermes")
    resp = check_stream_matches(app, {"tools": TOOLS})
    ch = resp["choices"][0]
    assert ch["message"]["content"] == "Paris is the capital <b>of</b> France." and ch["finish_reason"] == "stop"


def test_chat_named_tool_choice_is_enforced_and_parsed(tok):
    client, app = chat_app(tok, ['{"city": ', '"Paris", "days"', ': 3}'])
    body = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    resp = check_stream_matches(app, body)
    ch = resp["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["message"]["content"] is None  # vLLM: named keeps "stop"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in ch["message"]["tool_calls"]] == \
        [CALL1]
    so = client.requests[-1][1].structured_outputs
    assert so.json == WEATHER["function"]["parameters"] and so.start_after_token_ids is None


def test_chat_required_tool_choice_is_enforced_and_parsed(tok):
    script = ['[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', ', {"name": "get_time", ',
              '"parameters": {"tz": "UTC"}}]']
    client, app = chat_app(tok, script)
    resp = check_stream_matches(app, {"tools": TOOLS, "tool_choice": "required"})
    ch = resp["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] is None
    assert [c["function"]["name"] for c in ch["message"]["tool_calls"]] == ["get_weather", "get_time"]
    so = client.requests[-1][1].structured_outputs
    assert so.json["type"] == "array" and so.json["minItems"] == 1
    # cut off by max_tokens inside a call: no calls, the text is content, finish_reason length
    _, app = chat_app(tok, [script[0][:40]], finish="length")
    status, resp = run_chat(app, {"tools": TOOLS, "tool_choice": "required"})
    ch = resp["choices"][0]
    assert (ch["finish_reason"], ch["message"]["tool_calls"], ch["message"]["content"]) == ("length", [], script[0][:40])
    # cut off between calls: the finished ones are kept
    _, app = chat_app(tok, script[:1], finish="length")
    status, resp = run_chat(app, {"tools": TOOLS, "tool_choice": "required"})
    ch = resp["choices"][0]
    assert ch["finish_reason"] == "length" and [c["function"]["name"] for c in ch["message"]["tool_calls"]] == \
        ["get_weather"]


def test_chat_enforced_choice_after_reasoning(tok):
    script = ["<think>The user wants", " weather.</think>", '{"city": "Paris"}']
    client, app = chat_app(tok, script, reasoning_parser="qwen3")
    body = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    resp = check_stream_matches(app, body)
    msg = resp["choices"][0]["message"]
    assert msg["reasoning"] == msg["reasoning_content"] == "The user wants weather."
    assert msg["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    so = client.requests[-1][1].structured_outputs
    assert so.start_after_token_ids == tok.encode("</think>", add_special_tokens=False)  # no such token in SmolLM2
    # thinking off: the constraint applies from the first token
    run_chat(app, {**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert client.requests[-1][1].structured_outputs.start_after_token_ids is None


def test_chat_tool_errors_are_400_and_the_server_goes_on(tok):
    _, app = chat_app(tok, ["ok"])
    named = {"type": "function", "function": {"name": "get_weather"}}
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]
    cases = [
        ({"tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"tool_choice": named}, "tool_choice", "tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice", "invalid"),
        ({"tools": bad_schema, "tool_choice": "required"}, "tools", "JSON schema"),
        ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"}, "tools", "name"),
        ({"tools": TOOLS, "tool_choice": named, "response_format": {"type": "json_object"}}, "tool_choice",
         "cannot be combined"),
    ]
    for body, param, msg in cases:
        status, resp = run_chat(app, body)
        assert status == 400, (body, resp)
        err = resp["error"]
        assert err["param"] == param and msg in err["message"] and err["type"] == "BadRequestError", (body, err)
        status, _ = run_chat(app, {**body, "stream": True})
        assert status == 400
    status, resp = run_chat(app, {"tools": TOOLS, "tool_choice": "none"})
    assert status == 200 and resp["choices"][0]["message"]["content"] == "ok"


def test_chat_tool_messages_render_through_the_template(tok):
    """Assistant tool calls and tool results reach the template; SmolLM2's own template (no tool support)
    renders them as plain turns without crashing, a template that reads the arguments gets an object."""
    from frontend.protocol import ChatMessage
    from frontend.serving_chat import ServingChat
    from frontend.serving_common import FrontendOptions

    msgs = [ChatMessage(role="user", content="Weather in Paris?"),
            ChatMessage(role="assistant", content=None, tool_calls=[
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]),
            ChatMessage(role="tool", tool_call_id="call_1", content="22 C")]
    client = ScriptedClient(tok, ["It is 22 C."])
    text = ServingChat(client, ["m"], FrontendOptions()).render_prompt(msgs, tools=TOOLS)
    assert "<|im_start|>tool\n22 C<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    tpl = ("{% for m in messages %}{% for tc in m.tool_calls or [] %}[{{ tc.function.name }}({{ "
           "tc.function.arguments.city }})]{% endfor %}{% if m.role == 'tool' %}<{{ m.tool_call_id }}:{{ m.content }}>"
           "{% endif %}{% endfor %}{% for t in tools or [] %}{{ t.function.name }};{% endfor %}")
    text = ServingChat(client, ["m"], FrontendOptions(chat_template=tpl)).render_prompt(msgs, tools=TOOLS)
    assert text == "[get_weather(Paris)]<call_1:22 C>get_weather;get_time;"
    # /tokenize renders the same prompt (tools included)
    _, app = chat_app(tok, ["It is 22 C."], chat_template=tpl)

    async def tokenize():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            ids = (await http.post("/tokenize", json={"messages": [m.model_dump(exclude_none=True) for m in msgs],
                                                      "tools": TOOLS})).json()["tokens"]
            return (await http.post("/detokenize", json={"tokens": ids})).json()["prompt"]

    assert asyncio.run(tokenize()) == "[get_weather(Paris)]<call_1:22 C>get_weather;get_time;"
    # tool_choice none shows the tools too, unless --exclude-tools-when-tool-choice-none
    for exclude, shown in ((False, "get_weather;get_time;"), (True, "")):
        client, app = chat_app(tok, ["ok"], chat_template=tpl, exclude_tools_when_tool_choice_none=exclude)
        run_chat(app, {"messages": [m.model_dump(exclude_none=True) for m in msgs], "tools": TOOLS, "tool_choice": "none"})
        assert client.requests[-1][0]["prompt"] == "[get_weather(Paris)]<call_1:22 C>" + shown
    # and through the endpoint
    _, app = chat_app(tok, ["It is 22 C."])
    status, resp = run_chat(app, {"messages": [m.model_dump(exclude_none=True) for m in msgs], "tools": TOOLS,
                                  "tool_choice": "none"})
    assert status == 200 and resp["choices"][0]["message"]["content"] == "It is 22 C."


def test_serve_flags():
    from enginecore.config import ConfigError
    from frontend.serve import frontend_options
    from tests.test_cli_args import parse

    ns = parse("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
               "--exclude-tools-when-tool-choice-none")
    assert (ns.enable_auto_tool_choice, ns.tool_call_parser, ns.reasoning_parser) == (True, "hermes", "qwen3")
    assert ns.exclude_tools_when_tool_choice_none
    ns = parse()
    assert (ns.enable_auto_tool_choice, ns.tool_call_parser, ns.reasoning_parser) == (False, None, None)
    with pytest.raises(ConfigError, match="--tool-call-parser"):
        frontend_options(parse("--enable-auto-tool-choice"), None, None)
    with pytest.raises(SystemExit):
        parse("--tool-call-parser", "nonesuch")
    # --structured-outputs-config's reasoning_parser (vLLM's other spelling) must agree and exist
    for flag, so_value, msg in (("qwen3", "deepseek_r1", "differ"), (None, "granite", "not one of")):
        config = SimpleNamespace(structured_outputs_config=SimpleNamespace(reasoning_parser=so_value))
        with pytest.raises(ConfigError, match=msg):
            frontend_options(parse(*(["--reasoning-parser", flag] if flag else [])), config, None)


def test_stop_token_is_not_in_the_text(tok):
    """The EOS / stop token that ends a request is not part of its text, as in vLLM, also with
    skip_special_tokens=false (which the mistral parser needs for [TOOL_CALLS]); other special tokens stay."""
    from enginecore.outputs import EngineCoreOutput
    from enginecore.processor import OutputProcessor
    from enginecore.sampling_params import SamplingParams

    eos = tok.eos_token_ids[0]
    body = tok.encode("[x]<|im_start|> done", add_special_tokens=False)
    for skip, stop_ids, last, finish, include, want in (
            (False, None, eos, "stop", False, "[x]<|im_start|> done"),
            (True, None, eos, "stop", False, "[x] done"),
            (False, None, eos, "stop", True, "[x]<|im_start|> done" + tok.decode([eos], skip_special_tokens=False)),
            (True, [body[0]], body[0], "stop", False, "[x] done"),
            (True, None, body[0], "length", False, "[x] done" + tok.decode([body[0]]))):
        params = SamplingParams(skip_special_tokens=skip, stop_token_ids=stop_ids, include_stop_str_in_output=include,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        params._all_stop_token_ids = set(stop_ids or []) | {eos}
        proc = OutputProcessor(tok)
        proc.add_request("r", "p", [1], params, ["r"])
        got, _ = proc.process_outputs([EngineCoreOutput("r", body), EngineCoreOutput("r", [last], finish_reason=finish)])
        assert got[-1][1].outputs[0].text == want, (skip, stop_ids, finish)


def test_mistral_keeps_special_tokens_when_its_marker_is_one(tok):
    import copy

    mistral_tok = copy.deepcopy(tok)
    mistral_tok.hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    script = ['[TOOL_CALLS][{"name": "get_time", ', '"arguments": {"tz": "UTC"}}]']
    for t, keep in ((mistral_tok, False), (tok, True)):
        client, app = chat_app(t, script, enable_auto_tool_choice=True, tool_call_parser="mistral")
        resp = check_stream_matches(app, {"tools": TOOLS})
        assert client.requests[-1][1].skip_special_tokens is keep
        assert [c["function"]["name"] for c in resp["choices"][0]["message"]["tool_calls"]] == ["get_time"]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from('ab"\\\n/{}[]é'), max_size=40),
       st.sampled_from(["", "x", '"', "\\", ', "k": 1}']))
def test_scan_string_ends_a_json_string_exactly_where_json_does(value, tail):
    """frontend.tool_parsers.base.scan_string (quote to quote, counting the backslashes before each): a whole JSON
    string ends where json.dumps' text ends whatever follows it, and no proper prefix of it is finished."""
    from frontend.tool_parsers.base import scan_string

    for ensure_ascii in (True, False):
        enc = json.dumps(value, ensure_ascii=ensure_ascii)
        assert scan_string("k" + enc + tail, 1) == 1 + len(enc)
        assert all(scan_string(enc[:n], 0) is None for n in range(1, len(enc)))


def reference_scan_string(s: str, i: int) -> int | None:
    """The closing quote found from escape to escape, from the start: what scan_string must return."""
    j = i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
        elif s[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def test_scan_string_resumes_an_open_string_only_in_a_text_that_extends_the_one_it_saw(monkeypatch):
    """In a stream (its own memo set in base._OPEN_STRINGS), a string still open at the end of a text resumes
    where that text ended when the next text extends it: random growing texts of quotes, backslashes (runs cut
    anywhere, at the resume point too) and letters, several streams at the same index interleaved, forks of one
    stream's text, texts that do not extend the memo's: always the answer of a scan from the start; the memo is
    used, and holds one text of its own stream. Unset (a non-streamed parse), nothing is kept."""
    import random

    from frontend.tool_parsers import base

    monkeypatch.setattr(base, "_OPEN_MIN", 2)
    rng = random.Random(7)
    resumed = 0
    for _ in range(300):
        streams = [['k"', {}] for _ in range(rng.randint(1, 3))]
        for _ in range(rng.randint(1, 30)):
            st = rng.choice(streams)
            if rng.random() < 0.05:  # a fork of this stream's text, with its own memo
                streams.append([st[0], {}])
            if rng.random() < 0.05 and len(st[0]) > 3:  # a text that does not extend the one seen
                k = rng.randrange(2, len(st[0]))
                st[0] = st[0][:k] + rng.choice('a"\\') + st[0][k + 1:]
            st[0] += "".join(rng.choice('aa\\\\""') for _ in range(rng.randint(0, 5)))
            seen = st[1].get(1)
            resumed += seen is not None and st[0].startswith(seen)
            token = base._OPEN_STRINGS.set(st[1])
            try:
                got = base.scan_string(st[0], 1)
            finally:
                base._OPEN_STRINGS.reset(token)
            assert got == reference_scan_string(st[0], 1), st[0]
            assert got is not None or len(st[0]) - 1 < base._OPEN_MIN or st[1] == {1: st[0]}
            if got is not None:
                st[0] = 'k"'  # a new string
    assert resumed > 500
    long_open = "k" + json.dumps("x" * 3000)[:-1]
    assert base.scan_string(long_open, 1) is None and base._OPEN_STRINGS.get() is None


def test_two_interleaved_streams_keep_their_own_open_strings():
    """Two streamed calls with long code in their arguments, fed in turn (two choices, or two requests): each
    stream's memo holds its own text (they would throw each other's away in a shared one), and each streams
    exactly the arguments the non-streamed parse finds."""
    parser = TOOL_PARSERS["hermes"](TOOLS)
    texts = ['<tool_call>\n' + json.dumps({"name": "get_time", "arguments": {"tz": f"zone {k} \\ \"q\"\n" * 150}})
             + "\n</tool_call>" for k in range(2)]
    streamers, got = [ToolCallStreamer(parser) for _ in texts], ["", ""]
    for i in range(0, max(map(len, texts)), 7):
        for k, (st, text) in enumerate(zip(streamers, texts)):
            got[k] += "".join(d["function"]["arguments"] for d in st.feed(text[i:i + 7], False)[1])
            if 1500 < i < len(text) - 200:  # inside the long string: this stream's own text is the memo's
                assert list(st.open_strings.values()) == [st.text]
    for k, (st, text) in enumerate(zip(streamers, texts)):
        got[k] += "".join(d["function"]["arguments"] for d in st.feed("", True)[1])
        assert json.loads(got[k]) == json.loads(parser.extract_tool_calls(text)[1][0].arguments)
