"""`pip install .` (not editable) gives a working `xlaserve serve`: the wheel carries every package and the C
sources, and the installed copy builds its CPU kernels on first use.

The wheel is built from this checkout and installed into a folder of its own (`--target`, no dependencies: they
are this venv's); the server then runs from that folder (`PYTHONPATH`, the console script, a working directory
outside the checkout, an empty kernel cache), so nothing of the checkout can stand in for a missing file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import httpx
import pytest

from benchmarks._server import free_port

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("enginecore", "cpu_kernels", "jaxengine", "torchengine", "pallas_kernels", "triton_kernels", "frontend")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("install")
    # built from a copy of the files git knows (tracked, or new and not ignored): setuptools' build/ folder in
    # the checkout could hold files since removed
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    src = tmp / "src"
    for rel in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, rel)):
            os.makedirs(src / os.path.dirname(rel), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), src / rel)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
                   check=True, timeout=600, cwd=tmp)
    (wheel,) = (tmp / "dist").glob("xlaserve-*.whl")
    site = tmp / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(site), str(wheel)], check=True,
                   timeout=600, cwd=tmp)
    env = {**os.environ, "PYTHONPATH": str(site), "XLASERVE_CACHE": str(tmp / "cache")}
    return tmp, site, env


def test_the_wheel_carries_every_package_and_the_c_sources(installed):
    _, site, _ = installed
    for pkg in PACKAGES:
        assert (site / pkg / "__init__.py").is_file(), pkg
    csrc = site / "cpu_kernels" / "csrc"
    from cpu_kernels.build import C_SOURCES, HEADERS, XLA_FFI_SOURCE

    for src in (*C_SOURCES, *HEADERS, XLA_FFI_SOURCE):
        assert (csrc / os.path.basename(src)).is_file(), src
    assert (site / "enginecore" / "gguf_dequant.c").is_file()
    assert (site / "bin" / "xlaserve").is_file()


def test_the_installed_copy_builds_its_kernels_and_serves(installed):
    tmp, site, env = installed
    probe = subprocess.run(
        [sys.executable, "-c", "import enginecore, cpu_kernels.torch_ops as t; print(enginecore.__file__); "
                               "print(t.load()[1] or 'built')"],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr
    where, built = probe.stdout.split("\n")[:2]
    assert where.startswith(str(site)), where  # the installed copy, not the checkout
    from cpu_kernels.torch_ops import load

    if load()[0] is not None:  # where the kernels run here, the installed sources must build too
        assert built == "built", built
        assert any(f.startswith("cpu_kernels-") for f in os.listdir(tmp / "cache" / "kernels"))
    port = free_port()
    with open(tmp / "server.log", "w") as log:
        proc = subprocess.Popen([str(site / "bin" / "xlaserve"), "serve", "--backend", "torch", "--platform", "cpu",
                                 "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
                                 "--max-num-seqs", "2", "--served-model-name", "smol"],
                                cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url, tmp / "server.log")
        r = httpx.post(url + "/v1/completions", json={"model": "smol", "prompt": "The capital of France is",
                                                      "max_tokens": 4, "temperature": 0}, timeout=300)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["text"]
    finally:
        proc.terminate()
        proc.wait(60)


def _wait_healthy(proc: subprocess.Popen, url: str, log, timeout: float = 600.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the installed server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the installed server was not healthy in {timeout:.0f} s:\n{log.read_text()[-3000:]}")
