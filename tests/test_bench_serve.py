"""`bench serve` end to end: against a scripted SSE server (known timings), then our real server."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks._server import ServerProcess
from frontend.bench import main as bench_main
from frontend.bench.serve import ServeConfig, prepare, run_serve

CHUNK_GAP = 0.02  # seconds between the scripted server's chunks


class _Scripted(BaseHTTPRequestHandler):
    """/v1/models, /tokenize (one token per word) and streamed /v1/completions: one word per chunk."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def _json(self, obj, code=200):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            return self._json({"object": "list", "data": [{"id": "scripted-model", "object": "model"}]})
        self._json({"error": "no"}, 404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            return self._json({"tokens": list(range(len(body["prompt"].split())))})
        chat = self.path == "/v1/chat/completions"
        if self.path != "/v1/completions" and not chat:
            return self._json({"error": "no"}, 404)
        n = body["max_tokens"]
        if n > 100:
            return self._json({"error": {"message": f"max_tokens {n} is too large"}}, 400)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()

        def send(obj):
            self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
            self.wfile.flush()

        if chat:  # OpenAI's first chat chunk: the role, no content, sent before any token
            send({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        for i in range(n):
            time.sleep(CHUNK_GAP)
            c = {"delta": {"content": f" w{i}"}} if chat else {"text": f" w{i}"}
            send({"choices": [{"index": 0, **c, "finish_reason": None}]})
        send({"choices": [{"index": 0, **({"delta": {}} if chat else {"text": ""}), "finish_reason": "length"}]})
        prompt = body["messages"][0]["content"] if chat else body["prompt"]
        usage = {"choices": [], "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.close_connection = True


class _Server(ThreadingHTTPServer):
    request_queue_size = 64  # the default backlog of 5 resets connections under a burst
    daemon_threads = True


@pytest.fixture(scope="module")
def scripted_server():
    srv = _Server(("127.0.0.1", 0), _Scripted)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_serve_against_scripted_server(scripted_server):
    cfg = ServeConfig(base_url=scripted_server, num_prompts=6, random_input_len=20, random_output_len=5,
                      disable_tqdm=True, ready_timeout=10, request_timeout=30)
    model, reqs, source, counter = prepare(cfg)
    assert model == "scripted-model" and source == "server /tokenize"
    assert all(r.prompt_len == 20 and len(r.prompt.split()) == 20 for r in reqs)
    res = run_serve(cfg, model, reqs, source, counter, max_concurrency=2)
    m = res.metrics
    assert (m.completed, m.failed) == (6, 0)
    assert m.total_input_tokens == 120 and m.total_output_tokens == 30
    # 5 chunks CHUNK_GAP apart: TTFT ~ 1 gap, ITL ~ 1 gap, TPOT ~ 1 gap (loose bounds: shared CPU)
    assert CHUNK_GAP * 1000 * 0.8 < m.itl_ms.median < CHUNK_GAP * 1000 * 4
    assert CHUNK_GAP * 1000 * 0.8 < m.tpot_ms.median < CHUNK_GAP * 1000 * 4
    assert m.ttft_ms.median >= CHUNK_GAP * 1000 * 0.8
    assert all(len(r.itl) == 4 for r in res.records)
    assert m.max_concurrent_requests <= 6


def test_serve_cli_sweep_writes_json_and_plot(scripted_server, tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "sweep.png"
    rc = bench_main(["serve", "--base-url", scripted_server, "--num-prompts", "4", "--random-input-len", "8",
                     "--random-output-len", "3", "--sweep-concurrency", "1,4", "--disable-tqdm",
                     "--output-json", str(out), "--plot-path", str(png), "--request-rate", "50",
                     "--burstiness", "0.5"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert [r["max_concurrency"] for r in data["runs"]] == [1, 4]
    assert all(r["completed"] == 4 and r["failed"] == 0 for r in data["runs"])
    assert png.stat().st_size > 1000


def test_serve_chat_endpoint_does_not_count_the_role_chunk(scripted_server):
    cfg = ServeConfig(base_url=scripted_server, endpoint="/v1/chat/completions", num_prompts=2,
                      random_input_len=6, random_output_len=4, disable_tqdm=True, skip_test_run=True)
    model, reqs, source, counter = prepare(cfg)
    res = run_serve(cfg, model, reqs, source, counter, None)
    assert res.metrics.completed == 2
    for r in res.records:
        # 4 content chunks; the role chunk and the bare finish chunk are not output
        assert len(r.chunk_times) == 4 and r.output_tokens == 4 and r.generated_text == " w0 w1 w2 w3"
        assert r.ttft >= CHUNK_GAP * 0.8


def test_serve_reports_failures_when_the_server_errors(scripted_server):
    cfg = ServeConfig(base_url=scripted_server, num_prompts=2, random_input_len=4, random_output_len=500,
                      disable_tqdm=True, skip_test_run=True)
    model, reqs, source, counter = prepare(cfg)
    res = run_serve(cfg, model, reqs, source, counter, None)
    assert res.metrics.failed == 2 and res.metrics.completed == 0
    assert "HTTP 400" in res.records[0].error and "too large" in res.records[0].error


# ---- our real server ------------------------------------------------------------------


@pytest.mark.slow
def test_serve_against_our_server(tmp_path):
    srv = ServerProcess(["--max-model-len", "256", "--max-num-seqs", "4"],
                        str(tmp_path / "server.log"), env={"JAX_PLATFORMS": "cpu"})
    try:
        cfg = ServeConfig(base_url=srv.url, num_prompts=4, random_input_len=32,
                          random_output_len=8, ignore_eos=True, temperature=0.0, disable_tqdm=True,
                          ready_timeout=600, request_timeout=300)
        deadline = time.monotonic() + cfg.ready_timeout
        while True:  # fail fast if the server dies while starting
            if not srv.alive():
                pytest.fail(f"server exited {srv.proc.returncode}:\n{srv.log_tail(3000)}")
            try:
                model, reqs, source, counter = prepare(dataclasses.replace(cfg, ready_timeout=5))
                break
            except RuntimeError as e:
                if time.monotonic() > deadline:
                    pytest.fail(f"server did not come up: {e}\n{srv.log_tail(3000)}")
        res = run_serve(cfg, model, reqs, source, counter, max_concurrency=4)
        errors = [r.error for r in res.records if not r.success]
        assert res.metrics.completed == 4, errors
        assert res.metrics.total_output_tokens == 4 * 8  # ignore_eos: exactly max_tokens each
        assert all(r.prompt_len == 32 for r in reqs) or source.startswith("estimate")
        assert res.metrics.ttft_ms.median > 0 and res.metrics.tpot_ms.median > 0
    finally:
        srv.stop(timeout=30)
