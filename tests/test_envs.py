"""enginecore.envs: each variable's default and parsing, read at access time, the only place the engine reads
XLASERVE_* / VLLM_* variables, and README.md's table of them."""

from __future__ import annotations

import pathlib
import re

import pytest

from enginecore import envs

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_defaults_when_unset(monkeypatch):
    for v in envs.ENV_VARS:
        monkeypatch.delenv(v.name, raising=False)
    import os

    assert envs.XLASERVE_CACHE == os.path.expanduser("~/.cache/xlaserve")
    assert envs.cache_dir("kernels") == os.path.join(os.path.expanduser("~/.cache/xlaserve"), "kernels")
    assert envs.XLASERVE_CPU_KERNELS == "auto"
    assert envs.XLASERVE_Q4X is True and envs.XLASERVE_KV_POPULATE is True
    assert envs.XLASERVE_CHECK_RECOMPILATION is False
    assert envs.XLASERVE_FAULT_INJECTION == ""
    assert envs.VLLM_XLA_CACHE_PATH == "~/.cache/xlaserve/xla"  # expanded where it is used
    assert envs.VLLM_API_KEY is None
    assert envs.VLLM_LOG_STATS_INTERVAL == 10.0
    assert envs.VLLM_SERVER_DEV_MODE is False and envs.VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is False
    assert envs.XLASERVE_TEST_BACKEND is None and envs.XLASERVE_TEST_STARTUP_TIMEOUT == 600.0


@pytest.mark.parametrize("name,raw,value", [
    ("XLASERVE_CACHE", "/tmp/xc", "/tmp/xc"),
    ("XLASERVE_CACHE", "~/xc", "~/xc"),  # a given value is used as given
    ("XLASERVE_CPU_KERNELS", "off", "off"),
    ("XLASERVE_CPU_KERNELS", "torch", "torch"),  # its earlier name
    ("XLASERVE_CPU_KERNELS", "on", "auto"),  # any other value: auto
    ("XLASERVE_CPU_KERNELS", "OFF", "auto"),
    ("XLASERVE_Q4X", "off", False),
    ("XLASERVE_Q4X", "on", True),
    ("XLASERVE_Q4X", "0", True),  # only `off` turns it off
    ("XLASERVE_KV_POPULATE", "off", False),
    ("XLASERVE_KV_POPULATE", "", True),
    ("XLASERVE_CHECK_RECOMPILATION", "1", True),
    ("XLASERVE_CHECK_RECOMPILATION", "TRUE", True),
    ("XLASERVE_CHECK_RECOMPILATION", "yes", True),
    ("XLASERVE_CHECK_RECOMPILATION", "on", False),  # the spellings it has always taken
    ("XLASERVE_CHECK_RECOMPILATION", "0", False),
    ("XLASERVE_FAULT_INJECTION", "  output:x ", "output:x"),
    ("VLLM_XLA_CACHE_PATH", "none", "none"),
    ("VLLM_API_KEY", "k", "k"),
    ("VLLM_LOG_STATS_INTERVAL", "2.5", 2.5),
    ("VLLM_SERVER_DEV_MODE", " On ", True),
    ("VLLM_SERVER_DEV_MODE", "no", False),
    ("VLLM_KEEP_ALIVE_ON_ENGINE_DEATH", "1", True),
    ("XLASERVE_TEST_STARTUP_TIMEOUT", "30", 30.0),
])
def test_values_are_parsed_at_each_access(monkeypatch, name, raw, value):
    monkeypatch.setenv(name, raw)
    assert getattr(envs, name) == value
    assert envs.environment_variables[name].read({name: raw}) == value


def test_bad_numbers_name_the_variable(monkeypatch):
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "often")
    with pytest.raises(ValueError, match="VLLM_LOG_STATS_INTERVAL='often': could not convert"):
        envs.VLLM_LOG_STATS_INTERVAL


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="XLASERVE_NOPE"):
        envs.XLASERVE_NOPE
    assert "XLASERVE_Q4X" in dir(envs)


def test_the_callers_see_the_variables(monkeypatch):
    from cpu_kernels import layout
    from enginecore.faults import FaultInjector
    from enginecore.platform import cpu_kernels_unavailable

    monkeypatch.setenv("XLASERVE_Q4X", "off")
    assert layout.enabled() is False
    monkeypatch.setenv("XLASERVE_CPU_KERNELS", "off")
    assert cpu_kernels_unavailable() == "XLASERVE_CPU_KERNELS=off"
    monkeypatch.setenv("XLASERVE_FAULT_INJECTION", "step:^x")
    assert FaultInjector.from_env().rules[0][0] == "step"
    monkeypatch.delenv("XLASERVE_FAULT_INJECTION")
    assert FaultInjector.from_env() is None


# a read of a variable by name: os.environ[...] (not an assignment) / .get(...) / getenv(...)
_ENV_READ = re.compile(r"""(?:environ(?:\.get)?|getenv)\(?\[?\s*f?["']((?:XLASERVE|VLLM)_[A-Z0-9_]+)["']"""
                       r"""(?!\]\s*=[^=])""")


def test_no_variable_is_read_outside_envs():
    """The engine, kernels, frontend and benchmarks read XLASERVE_* / VLLM_* only through enginecore.envs; tests
    read only their own (XLASERVE_TEST_*, listed there as test-only) directly."""
    found = []
    for pkg in ("enginecore", "jaxengine", "torchengine", "cpu_kernels", "pallas_kernels", "triton_kernels",
                "frontend", "benchmarks"):
        for path in (ROOT / pkg).rglob("*.py"):
            if path.name == "envs.py" and path.parent.name == "enginecore":
                continue
            found += [f"{path.relative_to(ROOT)}: {m.group(1)}" for m in _ENV_READ.finditer(path.read_text())]
    assert found == []
    for path in (ROOT / "tests").rglob("*.py"):
        for m in _ENV_READ.finditer(path.read_text()):
            var = envs.environment_variables.get(m.group(1))
            assert var is not None and var.test_only, f"{path.name} reads {m.group(1)}: a test-only variable of envs?"


def test_readme_lists_every_variable_with_its_default():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(2).strip() for m in re.finditer(r"^\| `([A-Z0-9_]+)` \|([^|]*)\|", section, re.M)}
    assert rows == {v.name: v.default_text for v in envs.ENV_VARS}
