"""Soak test: many clients, a realistic mix of good, cancelled and bad requests, then the engine is killed.

    python -m benchmarks.soak [--duration 600] [--clients 24] [--backend torch] [--server-arg=--flag ...]
                              [--url URL] [--no-kill] [--json PATH]

Starts `xlaserve serve` (the embedded model, `--max-num-seqs 8`, dev mode for
the engine's pid) unless `--url` names a running one, then for `--duration`
seconds each of `--clients` threads sends, at random: completions and chats,
plain and streamed, with n 1-2, greedy or seeded, stop strings; streams
dropped after a few chunks and non-streamed requests abandoned mid-way
(cancels); malformed bodies that must get 400. Then it checks what a user
would: every good request answered 200 with a well-formed body, every bad
one 400, no 5xx, no unexpected status or connection error; greedy and seeded
requests asked twice gave the same text; after the load, no request running
or waiting and no KV block in use; the server's and engine's RSS growth;
finally (unless --no-kill) the engine process is SIGKILLed with a request in
flight: that request gets 503, /health 503, and the server exits with
status 1. Prints the counts, latency percentiles, blocks after and RSS, and
exits 1 if a check failed. `run_soak()` is what tests/test_soak.py runs for
30 seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx

from benchmarks._server import ServerProcess, parse_metrics

PROMPTS = ["The capital of France is", "Once upon a time", "List three colors:", "def fibonacci(n):",
           "The best way to learn is", "Water boils at", "My favourite animal is", "In 1969, humans"]
STOPS = [["."], [" the"], ["\n"], [",", "!"]]
MIX = {"completion": 22, "completion_stream": 14, "chat": 18, "chat_stream": 14, "drop_stream": 10,
       "abandon": 4, "bad": 18}
RSS_GROWTH_LIMIT_MB = 300.0


def bad_bodies(max_model_len: int) -> list[tuple[str, object]]:
    """(path, body) pairs every one of which must be answered 400."""
    chat = "/v1/chat/completions"
    return [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}),
        ("/v1/completions", {"prompt": "x", "logprobs": 50}),
        ("/v1/completions", {"prompt": "x", "temperature": -1}),
        ("/v1/completions", {"prompt": [1, 2, 10**9]}),
        ("/v1/completions", {"prompt": "word " * (max_model_len + 10), "max_tokens": 1}),
        ("/v1/completions", {"prompt": "x", "n": 0}),
        ("/v1/completions", {}),
        (chat, {"messages": []}),
        (chat, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        (chat, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}),
    ]


@dataclass
class SoakResult:
    duration_s: float = 0.0
    clients: int = 0
    good: int = 0
    cancelled: int = 0
    bad_input_400: int = 0
    server_errors_5xx: int = 0
    unexpected: int = 0
    connection_errors: int = 0
    determinism_checked: int = 0
    determinism_mismatches: int = 0
    latency_s: dict = field(default_factory=dict)  # p50 / p90 / p99 of good requests
    ttft_s: dict = field(default_factory=dict)  # of good streams
    preemptions: float = 0.0
    generation_tokens: float = 0.0
    running_after: float = -1.0
    waiting_after: float = -1.0
    used_blocks_after: float = -1.0
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0
    engine_kill: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)  # the first few unexpected answers, for the report

    @property
    def rss_growth_mb(self) -> float:
        return self.rss_end_mb - self.rss_start_mb

    def problems(self, rss_limit_mb: float = RSS_GROWTH_LIMIT_MB) -> list[str]:
        out = []
        for name in ("server_errors_5xx", "unexpected", "connection_errors", "determinism_mismatches"):
            if getattr(self, name):
                out.append(f"{name}: {getattr(self, name)}")
        if self.good == 0 or self.bad_input_400 == 0:
            out.append(f"too little traffic: {self.good} good, {self.bad_input_400} bad inputs")
        if (self.running_after, self.waiting_after, self.used_blocks_after) != (0, 0, 0):
            out.append(f"not idle after the load: {self.running_after} running, {self.waiting_after} waiting, "
                       f"{self.used_blocks_after} KV blocks used")
        if self.rss_start_mb and self.rss_growth_mb > rss_limit_mb:
            out.append(f"RSS grew {self.rss_growth_mb:.0f} MB (limit {rss_limit_mb:.0f})")
        kill = self.engine_kill
        if kill and not (kill.get("inflight_status") == 503 and kill.get("exit_code") == 1
                         and not kill.get("answered_200_after")):
            out.append(f"engine death not handled: {kill}")
        return out


def percentiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    pick = lambda q: round(xs[min(len(xs) - 1, int(q * len(xs)))], 3)  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": round(xs[-1], 3)}


def metrics(url: str, headers: dict) -> dict[str, float]:
    return parse_metrics(httpx.get(url + "/metrics", headers=headers, timeout=30).text)


class _Tally:
    """What the client threads found (one lock; the counts are small)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.r = SoakResult()
        self.latencies: list[float] = []
        self.ttfts: list[float] = []
        self.seen: dict[str, str] = {}  # deterministic request -> its text

    def add(self, field_name: str, detail: str | None = None) -> None:
        with self.lock:
            setattr(self.r, field_name, getattr(self.r, field_name) + 1)
            if detail is not None and len(self.r.failures) < 10:
                self.r.failures.append(detail)

    def good(self, latency: float, ttft: float | None, key: str | None, text: str | None) -> None:
        with self.lock:
            self.r.good += 1
            self.latencies.append(latency)
            if ttft is not None:
                self.ttfts.append(ttft)
            if key is None:
                return
            if key in self.seen:
                self.r.determinism_checked += 1
                if self.seen[key] != text:
                    self.r.determinism_mismatches += 1
                    if len(self.r.failures) < 10:
                        self.r.failures.append(f"same request, other text: {key}: {self.seen[key]!r} vs {text!r}")
            else:
                self.seen[key] = text


def _random_request(rng: random.Random, kind: str) -> tuple[str, dict, str | None]:
    """(path, body, determinism key or None)."""
    n = rng.choice((1, 1, 2))
    # few distinct shapes, so that greedy and seeded requests come back often enough to be compared
    body: dict = {"max_tokens": rng.choice((8, 16, 24)), "n": n}
    if rng.random() < 0.5:
        body["temperature"] = 0.0
    else:
        body["temperature"] = 0.8
        if rng.random() < 0.6:
            body["seed"] = rng.randint(0, 1)
    if rng.random() < 0.3:
        body["stop"] = rng.choice(STOPS)
    prompt = rng.choice(PROMPTS[:4] if rng.random() < 0.7 else PROMPTS)
    if kind.startswith("chat"):
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    deterministic = body["temperature"] == 0.0 or "seed" in body
    key = json.dumps({"path": path, **body}, sort_keys=True) if deterministic else None
    if kind.endswith("stream"):
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return path, body, key


def _text_of(path: str, choices: list[dict]) -> str:
    by_index = sorted(choices, key=lambda c: c["index"])
    if path.endswith("chat/completions"):
        return json.dumps([c["message"]["content"] for c in by_index])
    return json.dumps([c["text"] for c in by_index])


def _check_choices(path: str, body: dict, choices: list[dict]) -> str | None:
    if sorted(c["index"] for c in choices) != list(range(body.get("n", 1))):
        return f"choice indices {[c['index'] for c in choices]} for n={body.get('n', 1)}"
    if any(c.get("finish_reason") not in ("stop", "length") for c in choices):
        return f"finish reasons {[c.get('finish_reason') for c in choices]}"
    return None


def _one_plain(http: httpx.Client, tally: _Tally, path: str, body: dict, key: str | None) -> None:
    t0 = time.monotonic()
    r = http.post(path, json=body)
    if r.status_code != 200:
        tally.add("server_errors_5xx" if r.status_code >= 500 else "unexpected", f"{r.status_code}: {r.text[:300]}")
        return
    data = r.json()
    problem = _check_choices(path, body, data["choices"])
    usage = data["usage"]["completion_tokens"]
    if problem is None and usage > body["max_tokens"] * body.get("n", 1):
        problem = f"{usage} completion tokens for max_tokens {body['max_tokens']} x n {body.get('n', 1)}"
    if problem is not None:
        tally.add("unexpected", f"{path}: {problem}")
        return
    tally.good(time.monotonic() - t0, None, key, _text_of(path, data["choices"]))


def _one_stream(http: httpx.Client, tally: _Tally, path: str, body: dict, key: str | None,
                drop_after: int | None) -> None:
    t0 = time.monotonic()
    ttft, events, texts, finishes = None, 0, {}, {}
    with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            r.read()
            tally.add("server_errors_5xx" if r.status_code >= 500 else "unexpected",
                      f"{r.status_code}: {r.text[:300]}")
            return
        done = False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                tally.add("server_errors_5xx" if chunk["error"]["code"] >= 500 else "unexpected",
                          f"stream error event: {chunk['error']}")
                return
            events += 1
            for c in chunk.get("choices", []):
                piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                    texts[c["index"]] = texts.get(c["index"], "") + piece
                if c.get("finish_reason"):
                    finishes[c["index"]] = c["finish_reason"]
            if drop_after is not None and events >= drop_after:
                tally.add("cancelled")
                return  # leaving the block closes the connection: the server must abort the request
    if drop_after is not None:  # it ended before we dropped it: a normal answer
        tally.add("cancelled")
        return
    n = body.get("n", 1)
    if not done or sorted(finishes) != list(range(n)) or set(finishes.values()) - {"stop", "length"}:
        tally.add("unexpected", f"{path}: stream ended badly (done={done}, finishes={finishes})")
        return
    text = json.dumps([texts.get(i, "") for i in range(n)])
    tally.good(time.monotonic() - t0, ttft, key, text)


def _client_loop(url: str, headers: dict, tally: _Tally, seed: int, deadline: float, max_model_len: int) -> None:
    rng = random.Random(seed)
    kinds, weights = list(MIX), list(MIX.values())
    bad = bad_bodies(max_model_len)
    with httpx.Client(base_url=url, headers=headers, timeout=300) as http:
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            try:
                if kind == "bad":
                    path, body = rng.choice(bad)
                    r = (http.post(path, content=body, headers={"content-type": "application/json"})
                         if isinstance(body, bytes) else http.post(path, json=body))
                    err = r.json().get("error", {}) if r.headers.get("content-type", "").startswith(
                        "application/json") else {}
                    if r.status_code == 400 and err.get("code") == 400 and err.get("message"):
                        tally.add("bad_input_400")
                    else:
                        tally.add("server_errors_5xx" if r.status_code >= 500 else "unexpected",
                                  f"bad input {body!r:.80} -> {r.status_code}: {r.text[:200]}")
                elif kind == "abandon":
                    path, body, _ = _random_request(rng, "completion")
                    body.update(max_tokens=200, ignore_eos=True)
                    try:
                        httpx.post(url + path, json=body, headers=headers, timeout=rng.uniform(0.3, 1.5))
                    except httpx.TimeoutException:
                        pass
                    tally.add("cancelled")
                else:
                    stream_kind = kind if kind != "drop_stream" else rng.choice(("completion_stream", "chat_stream"))
                    path, body, key = _random_request(rng, stream_kind)
                    if kind == "drop_stream":
                        body.update(max_tokens=64, ignore_eos=True)
                        _one_stream(http, tally, path, body, None, drop_after=rng.randint(1, 4))
                    elif body.get("stream"):
                        _one_stream(http, tally, path, body, key, drop_after=None)
                    else:
                        _one_plain(http, tally, path, body, key)
            except httpx.HTTPError as e:
                tally.add("connection_errors", f"{kind}: {type(e).__name__}: {e}")


def _rss_mb(pid: int | None) -> float:
    if pid is None:
        return 0.0
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p] + p.children(recursive=True)
    except psutil.Error:
        return 0.0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def wait_idle(url: str, headers: dict, timeout: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url, headers)
        idle = (m.get("vllm:num_requests_running"), m.get("vllm:num_requests_waiting"),
                m.get("xlaserve:kv_cache_used_blocks")) == (0, 0, 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def run_soak(url: str, duration: float, clients: int, server_pid: int | None = None, seed: int = 0,
             headers: dict | None = None, log=print) -> SoakResult:
    """The load and the checks after it (not the engine kill: `kill_engine`)."""
    headers = headers or {}
    info = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]
    max_model_len = int(info.get("max_model_len") or 2048)
    tally = _Tally()
    # one client's random mix for a few seconds first (its results not counted), so that the baseline RSS is
    # taken after the first allocations of the paths it took
    _client_loop(url, headers, _Tally(), seed + 10_000, time.monotonic() + min(5.0, duration / 6), max_model_len)
    before = wait_idle(url, headers)
    rss_start = _rss_mb(server_pid)
    t0 = time.monotonic()
    deadline = t0 + duration
    threads = [threading.Thread(target=_client_loop, args=(url, headers, tally, seed + i, deadline, max_model_len),
                                name=f"soak-client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    next_log = t0 + 60
    while any(t.is_alive() for t in threads):
        time.sleep(0.5)
        if time.monotonic() > next_log:
            r = tally.r
            log(f"  {time.monotonic() - t0:.0f}s: {r.good} good, {r.cancelled} cancelled, {r.bad_input_400} bad "
                f"inputs (400), {r.server_errors_5xx} 5xx, {r.unexpected} unexpected, rss {_rss_mb(server_pid):.0f} MB")
            next_log += 60
    r = tally.r
    r.duration_s = round(time.monotonic() - t0, 1)
    r.clients = clients
    after = wait_idle(url, headers)
    r.running_after = after.get("vllm:num_requests_running", -1)
    r.waiting_after = after.get("vllm:num_requests_waiting", -1)
    r.used_blocks_after = after.get("xlaserve:kv_cache_used_blocks", -1)
    r.preemptions = after.get("vllm:num_preemptions_total", 0) - before.get("vllm:num_preemptions_total", 0)
    r.generation_tokens = (after.get("vllm:generation_tokens_total", 0)
                           - before.get("vllm:generation_tokens_total", 0))
    r.latency_s, r.ttft_s = percentiles(tally.latencies), percentiles(tally.ttfts)
    r.rss_start_mb, r.rss_end_mb = round(rss_start, 1), round(_rss_mb(server_pid), 1)
    return r


def kill_engine(url: str, proc: subprocess.Popen, headers: dict | None = None) -> dict:
    """SIGKILL the engine process with a request in flight: that request must get 503, the server exit 1."""
    headers = headers or {}
    engine_pid = httpx.get(url + "/server_info", headers=headers, timeout=30).json()["engine_pid"]
    out: dict = {}

    def inflight():
        try:
            out["inflight_status"] = httpx.post(url + "/v1/completions", headers=headers, timeout=120, json={
                "prompt": "Count to a thousand:", "max_tokens": 200, "ignore_eos": True}).status_code
        except httpx.HTTPError as e:
            out["inflight_status"] = type(e).__name__

    t = threading.Thread(target=inflight)
    t.start()
    deadline = time.monotonic() + 60
    while metrics(url, headers).get("vllm:num_requests_running", 0) < 1 and time.monotonic() < deadline:
        if not t.is_alive():
            return {**out, "exit_code": None, "note": "the in-flight request ended before the kill"}
        time.sleep(0.1)
    os.kill(engine_pid, signal.SIGKILL)
    t.join(60)
    answered = 0
    for _ in range(5):  # until it exits, the server may still answer, but never 200
        try:
            r = httpx.post(url + "/v1/completions", headers=headers, json={"prompt": "x", "max_tokens": 1},
                           timeout=10)
            answered += r.status_code == 200
        except httpx.HTTPError:
            break
    out["answered_200_after"] = answered
    try:
        out["exit_code"] = proc.wait(60)
    except subprocess.TimeoutExpired:
        out["exit_code"] = None
    return out


def start_server(server_args: list[str], log_path: str, timeout: float = 900.0) -> ServerProcess:
    """`xlaserve serve` on a free port (dev mode: /server_info gives the engine's pid), ready on /health;
    `stop()` it when done."""
    srv = ServerProcess(server_args, log_path, env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_LOG_STATS_INTERVAL": "30"})
    srv.wait_ready(timeout)
    return srv


def report(r: SoakResult) -> str:
    lines = [
        f"soak: {r.duration_s:.0f}s, {r.clients} clients",
        f"  requests: {r.good} good, {r.cancelled} cancelled, {r.bad_input_400} bad inputs answered 400, "
        f"{r.server_errors_5xx} 5xx, {r.unexpected} unexpected, {r.connection_errors} connection errors",
        f"  determinism: {r.determinism_checked} repeated greedy/seeded requests, {r.determinism_mismatches} "
        "with another text",
        f"  latency of good requests (s): {r.latency_s}; time to first token of streams (s): {r.ttft_s}",
        f"  generated {r.generation_tokens:.0f} tokens ({r.generation_tokens / max(r.duration_s, 1e-9):.1f}/s), "
        f"{r.preemptions:.0f} preemptions",
        f"  after: {r.running_after:.0f} running, {r.waiting_after:.0f} waiting, {r.used_blocks_after:.0f} KV "
        "blocks used",
        f"  RSS (server + engine): {r.rss_start_mb:.0f} MB -> {r.rss_end_mb:.0f} MB ({r.rss_growth_mb:+.0f} MB)",
    ]
    if r.engine_kill:
        lines.append(f"  engine killed: in-flight request -> {r.engine_kill.get('inflight_status')}, 200s after: "
                     f"{r.engine_kill.get('answered_200_after')}, server exit code {r.engine_kill.get('exit_code')}")
    for f in r.failures:
        lines.append(f"  ! {f}")
    problems = r.problems()
    lines.append("  checks: " + ("all passed" if not problems else "FAILED: " + "; ".join(problems)))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    ap.add_argument("--clients", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default=None, help="--backend of the started server (default: the server's own)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra `xlaserve serve` argument (repeat; e.g. --server-arg=--num-gpu-blocks-override=64)")
    ap.add_argument("--url", default=None, help="soak a running server instead (no RSS, no engine kill)")
    ap.add_argument("--no-kill", action="store_true", help="do not kill the engine at the end")
    ap.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "xlaserve-soak-server.log"),
                    help="the started server's log (default: %(default)s)")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    srv = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        server_args = ["--max-num-seqs", "8", "--max-model-len", "2048", *args.server_arg]
        if args.backend:
            server_args += ["--backend", args.backend]
        print(f"starting xlaserve serve {' '.join(server_args)} (log: {args.log})")
        srv = start_server(server_args, args.log)
        url = srv.url
    try:
        result = run_soak(url, args.duration, args.clients, srv.proc.pid if srv else None, args.seed)
        if srv is not None and not args.no_kill:
            result.engine_kill = kill_engine(url, srv.proc)
    finally:
        if srv is not None:
            srv.stop()
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**asdict(result), "rss_growth_mb": result.rss_growth_mb, "problems": result.problems()}, f,
                      indent=2)
    return 1 if result.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
