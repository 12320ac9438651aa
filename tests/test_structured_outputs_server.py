"""Structured outputs through a real `xlaserve serve` (embedded SmolLM2, engine in its own process) and the
openai client: response_format json_schema / json_object, structured_outputs regex / choice, the deprecated
guided_* fields, streaming and n > 1, 400s naming the field, and the metrics.

The torch backend starts in seconds on a CPU (the jax one compiles every program first); both backends'
engines are checked in tests/test_structured_outputs.py.
"""

from __future__ import annotations

import json
import os
import re

import httpx
import jsonschema
import openai
import pytest

from tests.test_api_server import MODEL, ServerProcess, assert_error, metrics  # noqa: E402
from tests.test_structured_outputs import CHOICES, PERSON, PHONE  # noqa: E402

pytestmark = pytest.mark.slow

BACKEND = os.environ.get("XLASERVE_TEST_BACKEND", "torch")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("so_server") / "server.log")
    srv = ServerProcess(["--backend", BACKEND, "--platform", "cpu", "--max-model-len", "512", "--max-num-seqs", "4",
                         "--max-num-batched-tokens", "256", "--seed", "0"], log)
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def ask(text):
    return [{"role": "user", "content": text}]


def test_response_format_json_schema_greedy_and_seeded_n2(client):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=ask("Describe a person as JSON."), temperature=0,
                                       max_tokens=80, response_format=rf)
    outs = [r.choices[0]]
    r = client.chat.completions.create(model=MODEL, messages=ask("Describe a person as JSON."), temperature=1.0,
                                       seed=7, n=2, max_tokens=80, response_format=rf)
    outs += r.choices
    for ch in outs:
        assert ch.finish_reason == "stop", ch.message.content
        jsonschema.validate(json.loads(ch.message.content), PERSON)


def test_json_object_streamed_chat(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=ask("Reply with a JSON object saying hello."), temperature=0, max_tokens=60,
        stream=True, response_format={"type": "json_object"})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # a small model may write a long object: it must still be a JSON object's beginning
        assert text.lstrip().startswith("{")


def test_completions_regex_streamed_and_choice(client):
    stream = client.completions.create(model=MODEL, prompt="My phone number is ", temperature=0.7, seed=3,
                                       max_tokens=20, stream=True,
                                       extra_body={"structured_outputs": {"regex": PHONE}})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert re.fullmatch(PHONE, text), text
    r = client.completions.create(model=MODEL, prompt="The capital of Germany is", max_tokens=10, temperature=0.9,
                                  seed=1, n=2, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in r.choices)


def test_deprecated_guided_fields(client, server):
    r = client.chat.completions.create(model=MODEL, messages=ask("Capital of France?"), temperature=0, max_tokens=10,
                                       extra_body={"guided_choice": CHOICES})
    assert r.choices[0].message.content in CHOICES
    r = client.completions.create(model=MODEL, prompt="Call me at ", temperature=0, max_tokens=20,
                                  extra_body={"guided_regex": PHONE})
    assert re.fullmatch(PHONE, r.choices[0].text)
    assert "guided_choice are deprecated" in server.log_tail(100000)


def test_invalid_constraints_are_400_and_the_server_keeps_serving(client, http):
    msgs = ask("hi")
    assert_error(http.post("/v1/chat/completions", json={
        "messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objekt"}}}}), 400, "response_format", "objekt")
    assert_error(http.post("/v1/chat/completions", json={
        "messages": msgs, "structured_outputs": {"regex": "[0-9"}}), 400, "structured_outputs", "regex")
    assert_error(http.post("/v1/completions", json={
        "prompt": "x", "guided_grammar": "start: nothing_here"}), 400, "guided_grammar", "nothing_here")
    assert_error(http.post("/v1/completions", json={
        "prompt": "x", "structured_outputs": {"choice": ["a"], "regex": "b"}}), 400, "structured_outputs")
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length"


def test_metrics_count_constrained_requests(http):
    m = metrics(http)
    assert m["xlaserve:structured_output_requests_total"] >= 8
    assert m["xlaserve:grammar_compiles_total"] >= 1
    assert m["xlaserve:grammar_compile_seconds_total"] > 0
