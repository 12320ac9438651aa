"""Smoke test of the server on the torch backend, with the engine core in-process
(--disable-frontend-multiprocessing), ending with a SIGTERM while a stream is in flight: the server
finishes or aborts it, frees the port and exits 0.
"""

from __future__ import annotations

import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from tests.test_api_server import MODEL, ServerProcess

pytestmark = pytest.mark.slow


def test_torch_backend_in_process_smoke_and_sigterm(tmp_path):
    srv = ServerProcess([MODEL, "--backend", "torch", "--platform", "cpu", "--disable-frontend-multiprocessing",
                         "--max-model-len", "256", "--max-num-seqs", "2", "--max-num-batched-tokens", "128",
                         "--served-model-name", "smol", "--shutdown-timeout", "2"], str(tmp_path / "server.log"),
                        env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)
        assert [m.id for m in client.models.list().data] == ["smol"]
        info = httpx.get(srv.url + "/server_info").json()
        assert info["backend"] == "torch" and info["multiprocess"] is False
        r = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=4, temperature=0)
        assert r.choices[0].text and r.usage.completion_tokens == 4
        chat = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=3, temperature=0)
        assert chat.choices[0].message.content
        # SIGTERM with a long stream in flight
        got: list[str] = []

        def consume():
            try:
                stream = client.completions.create(model="smol", prompt="Count: 1 2 3", max_tokens=200, stream=True,
                                                   extra_body={"ignore_eos": True})
                for ch in stream:
                    got.append(ch.choices[0].text if ch.choices else "")
            except Exception as e:  # the connection may close under us: that is the point
                got.append(f"<{type(e).__name__}>")

        t = threading.Thread(target=consume)
        t.start()
        deadline = time.monotonic() + 120
        while not got and time.monotonic() < deadline:
            time.sleep(0.1)
        assert got, "the stream never started"
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(60) == 0
        assert time.monotonic() - t0 < 30
        t.join(30)
        assert not t.is_alive()
        with socket.socket() as s:  # the port is free again
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", srv.port))
        assert "server stopped" in srv.log_tail()
    finally:
        srv.stop()
