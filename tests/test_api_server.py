"""The OpenAI-compatible server, for real: `xlaserve serve` as a subprocess on a free port, the embedded
SmolLM2-135M model, the real backend (jax; torch while jaxengine.runner does not exist), the `openai`
client. One server for the whole module (small settings); the engine-death test runs last because it
kills it.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from benchmarks._server import ServerProcess as _ServerProcess
from benchmarks._server import parse_metrics

pytestmark = pytest.mark.slow

API_KEY = "sk-test-xlaserve"
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 4
MAX_WAITING = 4
BODY_LIMIT = 65536
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = float(os.environ.get("XLASERVE_TEST_STARTUP_TIMEOUT", "600"))


BACKEND = os.environ.get("XLASERVE_TEST_BACKEND") or "jax"
# shared by the server and run-batch, so run-batch finds the server's programs in the XLA cache
ENGINE_FLAGS = ["--backend", BACKEND, "--platform", "cpu", "--max-model-len", str(MAX_MODEL_LEN),
                "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", "256", "--max-logprobs", "5"]


class ServerProcess(_ServerProcess):
    """`xlaserve serve` for these tests: ready within XLASERVE_TEST_STARTUP_TIMEOUT seconds."""

    ready_timeout = STARTUP_TIMEOUT_S


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = str(tmp_path_factory.mktemp("api_server") / "server.log")
    srv = ServerProcess(
        [*ENGINE_FLAGS, "--max-waiting-requests", str(MAX_WAITING), "--api-key", API_KEY,
         "--max-request-body-bytes", str(BODY_LIMIT), "--enable-server-load-tracking",
         "--enable-request-id-headers", "--seed", "0"],
        log, env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOG_STATS_INTERVAL": "1"})
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300) as c:
        yield c


def metrics(http) -> dict[str, float]:
    """'name{labels}' and bare 'name' (summed over labels) -> value."""
    return parse_metrics(http.get("/metrics").text)


def wait_for(cond, timeout: float = 30.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def assert_error(resp: httpx.Response, status: int, param: str | None = None, needle: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["type"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if needle is not None:
        assert needle in err["message"], err
    return err


PROMPT = "The capital of France is"


# ---- info endpoints ----------------------------------------------------------------------


def test_models_health_version_load(server, client, http):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = http.get("/v1/models").json()["data"][0]
    assert card["object"] == "model" and card["owned_by"] and card["created"] > 0
    assert card["root"] and card["max_model_len"] == MAX_MODEL_LEN
    for path in ("/health", "/ping"):
        assert httpx.get(server.url + path).status_code == 200  # no API key needed outside /v1
    assert httpx.post(server.url + "/ping").status_code == 200
    assert http.get("/version").json()["version"]
    assert http.get("/load").json() == {"server_load": 0}
    info = http.get("/server_info").json()
    assert info["backend"] == BACKEND and info["multiprocess"] is True and info["engine_pid"] != server.proc.pid


def test_tokenize_detokenize(http):
    r = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == MAX_MODEL_LEN
    assert len(r["token_strs"]) == r["count"]
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": PROMPT}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3
    assert_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens", "out of vocabulary")


# ---- completions -------------------------------------------------------------------------------


def test_completion_greedy_usage_matches_tokenize(client, http):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    (choice,) = r.choices
    assert choice.text and choice.finish_reason == "length" and choice.index == 0
    n_prompt = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 6 and r.usage.total_tokens == n_prompt + 6
    # deterministic: the same again, and the same as the stream below
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert again.choices[0].text == choice.text


def test_completion_stream_matches_and_reports_usage(client):
    ref = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    with_choice = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in with_choice)  # continuous usage
    assert [c.usage.completion_tokens for c in with_choice] == sorted(c.usage.completion_tokens for c in with_choice)


def test_completion_raw_sse_ends_with_done(server, http):
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_completion_n2_logprobs_seed(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=1.0, n=2, logprobs=2, seed=1234)
    r = client.completions.create(**kw)
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
        assert all(v <= 0.0 for v in lp.token_logprobs)
        assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
        if "\ufffd" not in "".join(lp.tokens):  # byte-level tokens can split a character
            assert "".join(lp.tokens) == c.text
        assert lp.text_offset == sorted(lp.text_offset)
    assert r.usage.completion_tokens == 10
    again = client.completions.create(**kw)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    other = client.completions.create(**{**kw, "seed": 4321})
    assert [c.text for c in other.choices] != [c.text for c in r.choices]


def test_completion_echo_prompt_variants(client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text.startswith(PROMPT)
    assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.tokens) == len(ids) + 2
    r_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert r_ids.choices[0].text == c.text[len(PROMPT):]
    multi = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=2, temperature=0, n=2)
    assert sorted(ch.index for ch in multi.choices) == [0, 1, 2, 3]
    lists = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], max_tokens=1, temperature=0)
    assert len(lists.choices) == 2 and lists.usage.prompt_tokens == len(ids) + 2


def test_completion_vllm_extras(http):
    r = http.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 4, "temperature": 0.8, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
        "min_tokens": 4, "ignore_eos": True, "return_token_ids": True, "prompt_logprobs": 1, "seed": 3,
        "logit_bias": {"11": -100}, "bad_words": ["Paris"], "skip_special_tokens": False,
    })
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert len(c["token_ids"]) == 4 and 11 not in c["token_ids"]
    assert c["prompt_token_ids"] and c["prompt_logprobs"][0] is None
    assert len(c["prompt_logprobs"]) == len(c["prompt_token_ids"])
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "allowed_token_ids": [13, 28],
                                           "return_token_ids": True})
    assert set(r.json()["choices"][0]["token_ids"]) <= {13, 28}
    plain = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_logprobs" not in plain  # extensions only when asked for


def test_best_of_and_unsupported_fields(client, http):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=1.0, best_of=3, seed=5,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 1 and r.choices[0].logprobs is None and r.usage.completion_tokens == 9
    assert_error(http.post("/v1/completions", json={"prompt": PROMPT, "best_of": 2, "stream": True}), 400, "best_of")
    assert_error(http.post("/v1/completions", json={"prompt": PROMPT, "suffix": "x"}), 400, "suffix")
    assert_error(http.post("/v1/chat/completions", json={"messages": MESSAGES,
                                                          "response_format": {"type": "yaml"}}),
                 400, "response_format")


def test_stop_strings_and_max_tokens(client):
    ref = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    words = ref.split()
    assert len(words) >= 2, ref
    stop = words[1]
    cut = ref.index(stop)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    c = r.choices[0]
    assert c.text == ref[:cut] and c.finish_reason == "stop"
    assert c.model_extra.get("stop_reason") == stop
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=stop,
                                  extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == ref[:cut + len(stop)]
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], stream=True) if ch.choices)
    assert streamed == ref[:cut]


# ---- chat ------------------------------------------------------------------------------------------


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]


def test_chat_basic_usage_logprobs(client, http):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=2)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content and c.finish_reason in ("length", "stop")
    n_prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == len(c.logprobs.content) <= 5
    for item in c.logprobs.content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2 and item.bytes
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    if "\ufffd" not in "".join(t.token for t in c.logprobs.content):
        assert "".join(t.token for t in c.logprobs.content) == c.message.content


def test_chat_stream_role_first_n2(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0.7,
                                                 seed=7, n=2, stream=True, stream_options={"include_usage": True}))
    firsts = {}
    for ch in chunks:
        for c in ch.choices:
            firsts.setdefault(c.index, c.delta)
    assert set(firsts) == {0, 1} and all(d.role == "assistant" for d in firsts.values())
    texts = {i: "".join(c.delta.content or "" for ch in chunks for c in ch.choices if c.index == i) for i in (0, 1)}
    assert all(texts.values())
    assert chunks[-1].usage.completion_tokens <= 8 and chunks[-1].choices == []


def test_chat_template_options(client, http, tmp_path):
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Count:"}, {"type": "text", "text": "1 2"}]},
                     {"role": "assistant", "content": "3"}],
        "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 2, "temperature": 0,
        "chat_template_kwargs": {"unused_flag": True}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    bad = http.post("/v1/chat/completions", json={"messages": MESSAGES, "add_generation_prompt": True,
                                                   "continue_final_message": True})
    assert_error(bad, 400, needle="continue_final_message")
    refused = http.post("/v1/chat/completions", json={"messages": MESSAGES, "chat_template": "{{ 'x' }}"})
    assert_error(refused, 400, "chat_template", "--trust-request-chat-template")
    image = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]})
    assert_error(image, 400, "messages", "text-only")


# ---- errors: status, shape, and the server keeps serving ----------------------------------------


def test_errors_have_openai_shape_and_status(server, http):
    post = http.post
    assert_error(post("/v1/completions", json={"prompt": PROMPT, "max_tokens": "many"}), 400, "max_tokens")
    assert_error(post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400,
                 needle="not valid JSON")
    assert_error(post("/v1/completions", content=b"plain text", headers={"content-type": "text/plain"}), 400)
    assert_error(post("/v1/completions", json={}), 400, "prompt")
    assert_error(post("/v1/completions", json={"prompt": "word " * 600}), 400, "prompt", "maximum context length")
    assert_error(post("/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN}), 400, "max_tokens")
    assert_error(post("/v1/completions", json={"prompt": PROMPT, "logprobs": 6}), 400, "logprobs", "max allowed: 5")
    assert_error(post("/v1/chat/completions", json={"messages": MESSAGES, "logprobs": True, "top_logprobs": 9}),
                 400, "logprobs")
    assert_error(post("/v1/completions", json={"prompt": [1, 2, 10**7]}), 400, "prompt", "out of vocabulary")
    assert_error(post("/v1/completions", json={"prompt": PROMPT, "temperature": -1}), 400, "temperature")
    assert_error(post("/v1/completions", json={"prompt": PROMPT, "n": 0}), 400, "n")
    assert_error(post("/v1/completions", json={"prompt": PROMPT, "stop_token_ids": [10**7]}), 400, "stop_token_ids")
    assert_error(post("/v1/completions", json={"prompt": PROMPT, "priority": 3}), 400, "priority")
    assert_error(post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    assert_error(post("/v1/completions", json={"prompt": ["a"] * (MAX_WAITING + 1)}), 400, "prompt",
                 "--max-waiting-requests")
    assert_error(post("/v1/completions", json={"prompt": PROMPT, "model": "gpt-4"}), 404, "model", "gpt-4")
    assert_error(http.get("/v1/nothing-here"), 404)
    big = {"prompt": "x" * (BODY_LIMIT + 10)}
    assert_error(post("/v1/completions", json=big), 413, needle="--max-request-body-bytes")
    # the API key guards /v1/* only
    anon = httpx.Client(base_url=server.url, timeout=30)
    assert_error(anon.post("/v1/completions", json={"prompt": PROMPT}), 401)
    assert_error(anon.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
    assert anon.post("/tokenize", json={"prompt": "hi"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    # still serving
    ok = post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_request_id_header(http):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123" and r.json()["id"] == "cmpl-abc-123"
    assert http.get("/health").headers.get("x-request-id")


# ---- metrics, load, disconnects, overload ------------------------------------------------------------


def test_metrics_names_and_counters(http):
    before = metrics(http)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:request_prompt_tokens_count",
                 "vllm:request_generation_tokens_count", "xlaserve:kv_cache_free_blocks",
                 "xlaserve:kv_cache_used_blocks", "xlaserve:kv_cache_total_blocks"):
        assert name in before, name
    n_prompt = http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200
    after = wait_for(lambda: (m := metrics(http))['vllm:request_success_total{finished_reason="length"}'] >
                     before['vllm:request_success_total{finished_reason="length"}'] and m)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == n_prompt
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 3
    assert after["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"] + 1
    assert after["vllm:time_to_first_token_seconds_count"] == before["vllm:time_to_first_token_seconds_count"] + 1
    assert after["vllm:inter_token_latency_seconds_count"] == before["vllm:inter_token_latency_seconds_count"] + 2
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    assert after["xlaserve:kv_cache_free_blocks"] + after["xlaserve:kv_cache_used_blocks"] == \
        after["xlaserve:kv_cache_total_blocks"] > 0


def test_dev_mode_reset_prefix_cache(http):
    wait_for(lambda: metrics(http)["xlaserve:kv_cache_used_blocks"] == 0)
    assert http.post("/reset_prefix_cache").json() == {"success": True}


def _open_stream(url: str, body: dict):
    """A streaming request we can drop mid-way: (client, response, line iterator) after its first data line.

    Keep all three referenced: a garbage-collected line iterator closes the connection (= a disconnect).
    """
    c = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300)
    resp = c.send(c.build_request("POST", "/v1/completions", json=body), stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    while not next(lines).startswith("data: "):
        pass
    return c, resp, lines


def test_disconnect_frees_blocks_and_overload_is_503(server, http):
    long = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
    streams = []
    try:
        for _ in range(MAX_NUM_SEQS):
            streams.append(_open_stream(server.url, long))
        m = wait_for(lambda: (m := metrics(http))["vllm:num_requests_running"] == MAX_NUM_SEQS and m)
        assert m["xlaserve:kv_cache_used_blocks"] >= MAX_NUM_SEQS
        assert http.get("/load").json()["server_load"] == MAX_NUM_SEQS
        # the batch is full: new requests wait; beyond --max-waiting-requests they get 503
        quick = {"prompt": PROMPT, "max_tokens": 1}
        with cf.ThreadPoolExecutor(MAX_WAITING + 3) as pool:
            futs = [pool.submit(http.post, "/v1/completions", json=quick) for _ in range(MAX_WAITING + 3)]
            wait_for(lambda: sum(f.done() for f in futs) >= 3, timeout=60)
            time.sleep(0.5)
            done = [f.result() for f in futs if f.done()]
            assert len(done) == 3 and all(r.status_code == 503 for r in done), [r.text for r in done]
            assert_error(done[0], 503, needle="--max-waiting-requests")
            assert metrics(http)["vllm:num_requests_waiting"] == MAX_WAITING
            # drop the long streams: their requests are aborted at once, the waiting ones run
            for c, resp, _ in streams:
                resp.close()
                c.close()
            streams = []
            results = [f.result(timeout=120) for f in futs]
        assert sorted(r.status_code for r in results) == [200] * MAX_WAITING + [503] * 3
        m = wait_for(lambda: (m := metrics(http))["xlaserve:kv_cache_used_blocks"] == 0 and m, timeout=30)
        assert m["vllm:num_requests_running"] == 0 and m["xlaserve:kv_cache_free_blocks"] == \
            m["xlaserve:kv_cache_total_blocks"]
        assert m['vllm:request_success_total{finished_reason="abort"}'] >= MAX_NUM_SEQS
        assert http.get("/load").json()["server_load"] == 0
    finally:
        for c, resp, _ in streams:
            resp.close()
            c.close()


def test_non_streaming_disconnect_aborts(server, http):
    before = metrics(http)['vllm:request_success_total{finished_reason="abort"}']
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}, timeout=1.5)
    m = wait_for(lambda: (m := metrics(http))['vllm:request_success_total{finished_reason="abort"}'] > before
                 and m["xlaserve:kv_cache_used_blocks"] == 0 and m, timeout=30)
    assert m["vllm:num_requests_running"] == 0


# ---- the CLI clients and run-batch -------------------------------------------------------------------


def _cli(*argv, timeout=300, input=None):
    return subprocess.run([sys.executable, "-m", "frontend.cli", *argv], capture_output=True, text=True,
                          timeout=timeout, input=input)


def test_cli_chat_and_complete(server):
    common = ["--url", server.url + "/v1", "--api-key", API_KEY, "--max-tokens", "4", "--temperature", "0"]
    r = _cli("complete", *common, "-q", PROMPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    r = _cli("chat", *common, "--system-prompt", "Be brief.", "-q", "Say hello")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    r = _cli("chat", *common, input="Hi\nAnd again\n")
    assert r.returncode == 0 and len([ln for ln in r.stdout.splitlines() if ln.strip()]) >= 2
    r = _cli("complete", "--url", server.url + "/v1", "--api-key", "wrong", "-q", "x")
    assert r.returncode == 1 and "401" in r.stderr


def test_run_batch_resumable(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0}},
        {"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": MODEL, "messages": MESSAGES, "max_tokens": 3}},
        {"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": PROMPT, "logprobs": 99}},
        {"custom_id": "d", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
    ]
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out.write_text(json.dumps({"custom_id": "b", "response": {"status_code": 200}, "error": None}) + "\n")
    r = _cli("run-batch", "-i", str(inp), "-o", str(out), *ENGINE_FLAGS, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    results = {}
    for line in out.read_text().splitlines():
        item = json.loads(line)
        results.setdefault(item["custom_id"], []).append(item)
    assert sorted(results) == ["a", "b", "c", "d"] and len(results["b"]) == 1  # b was not redone
    a = results["a"][0]
    assert a["error"] is None and a["response"]["status_code"] == 200
    assert a["response"]["body"]["object"] == "text_completion" and a["response"]["body"]["choices"][0]["text"]
    assert results["c"][0]["response"]["status_code"] == 400 and "logprobs" in results["c"][0]["error"]
    assert results["d"][0]["response"]["status_code"] == 400 and "/v1/embeddings" in results["d"][0]["error"]
    # all done: a second run does nothing
    r = _cli("run-batch", "-i", str(inp), "-o", str(out), *ENGINE_FLAGS)
    assert r.returncode == 0 and len(out.read_text().splitlines()) == 4


# ---- last: kill the engine core under the running server ------------------------------------------------


def test_zz_engine_death_gives_503_and_server_exits(server, http):
    engine_pid = http.get("/server_info").json()["engine_pid"]
    result: dict = {}

    def inflight():
        result["resp"] = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True})

    t = threading.Thread(target=inflight)
    t.start()
    wait_for(lambda: metrics(http)["vllm:num_requests_running"] == 1)
    os.kill(engine_pid, signal.SIGKILL)
    t.join(60)
    assert_error(result["resp"], 503, needle="engine")
    assert server.proc.wait(60) == 1  # no VLLM_KEEP_ALIVE_ON_ENGINE_DEATH: the server exits
    assert "engine core died" in server.log_tail(20000)
