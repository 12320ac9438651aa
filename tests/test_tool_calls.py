"""Tool calling: the parsers (non-streamed, and streamed with every split point of a sample), tool_choice
validation and the schemas that enforce named / required choices; the chat endpoint in-process over
a scripted engine (auto, named, required, streaming, 400s); and a real server with the embedded model
where named and required choices are enforced by a grammar (both backends)."""

from __future__ import annotations

import json

import pytest

from frontend.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolCallStreamer,
    ToolChoiceError,
    check_parameter_schemas,
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
    pytest.importorskip("llguidance")
    check_parameter_schemas(TOOLS)
    with pytest.raises(ToolChoiceError, match=r"tools\[0\] \(bad\)") as e:
        check_parameter_schemas([{"type": "function", "function": {"name": "bad", "parameters": {"type": "objectx"}}}])
    assert e.value.param == "tools"
