"""A server subprocess for the benchmarks and the tests that start one: a free port, the process with its
log file, readiness on /health, a stop that escalates to a kill; and the parsers of what a server answers
(Prometheus text, server-sent events); a benchmark's worker subprocess that hands back its result as JSON."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A port of 127.0.0.1 free now (the kernel's pick; another process may take it before the server does)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_json_worker(cmd: list[str], env: dict | None = None, timeout: float | None = None, **run_kw) -> dict:
    """Runs `cmd + ["--out", PATH]` (a benchmark's worker, which writes its result to PATH as JSON) and returns
    that result, or {"error": why} when it failed or overran `timeout`; the file is removed either way. `env` is
    added to this process's; `run_kw` goes to `subprocess.run` (e.g. where the worker's stdout goes)."""
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        p = subprocess.run([*cmd, "--out", out], env={**os.environ, **(env or {})}, timeout=timeout, **run_kw)
        if p.returncode != 0:
            return {"error": f"exited {p.returncode} (see its traceback above)"}
        with open(out) as f:
            return json.load(f)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {timeout:.0f} s"}
    finally:
        os.unlink(out)


class LoggedProcess:
    """`cmd` started in the repository root with its output in `log_path`; `env` is added to this process's.
    With `group`, it gets a session of its own and `stop()` signals that whole process group (servers that
    start workers of their own); without, only the process (which ends its children itself)."""

    def __init__(self, cmd: list[str], log_path: str, env: dict | None = None, *, group: bool = False):
        self.log_path = log_path
        self.group = group
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, **(env or {})}, start_new_session=group)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path) as f:
            return f.read()[-n:]

    def _signal(self, sig: int) -> None:
        if self.group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited in `timeout` seconds; closes the log. The exit code."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()
        return self.proc.returncode


class ServerProcess(LoggedProcess):
    """`xlaserve serve ARGS` on a free port of 127.0.0.1 (`url`); `wait_ready()` waits for /health."""

    ready_timeout = 900.0

    def __init__(self, args: list[str], log_path: str, env: dict | None = None, *, group: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__([sys.executable, "-m", "frontend.cli", "serve", "--host", "127.0.0.1", "--port",
                          str(self.port), *args], log_path, env, group=group)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until /health answers 200; raises RuntimeError (with the log's end) if the server exits first, or
        stops it and raises if it is not ready in `timeout` seconds (default `ready_timeout`)."""
        import httpx

        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()  # closes the log
                raise RuntimeError(f"server exited with {self.proc.returncode} (log: {self.log_path}):\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout}s (log: {self.log_path}):\n{self.log_tail()}")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value (labels sorted, model_name left out), 'name': the sum over
    all of name's samples}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "model_name")
            if labels:
                key = f"{s.name}{{{labels}}}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def sse_events(lines: str | Iterable[str]) -> list[dict]:
    """The JSON events of a server-sent-event stream (its text, or its lines), without the final [DONE]."""
    if isinstance(lines, str):
        lines = lines.splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
