"""`xlaserve serve` flags: vLLM spellings, --config YAML, dotted JSON flags, --help=, the vLLM-compat table."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import subprocess
import sys

import pytest

from enginecore.config import ConfigError, EngineArgs
from frontend.args import ENGINE_FLAG_DOCS, engine_args_from_namespace, human_int, parse_serve_args, serving_engine_args
from frontend.cli import build_parser
from frontend.vllm_compat import VLLM_COMPAT_FLAGS


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def parse(*argv: str) -> argparse.Namespace:
    return parse_serve_args(serve_parser(), list(argv))


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "frontend.cli", *argv], capture_output=True, text=True, timeout=60)


def test_every_engine_arg_has_a_documented_flag():
    parser = serve_parser()
    options = {s for a in parser._actions for s in a.option_strings}
    for f in dataclasses.fields(EngineArgs):
        assert f.name in ENGINE_FLAG_DOCS, f"EngineArgs.{f.name} has no help text / group in frontend/args.py"
        assert "--" + f.name.replace("_", "-") in options


def test_defaults_match_engine_args():
    ns = parse()
    assert engine_args_from_namespace(ns) == EngineArgs()
    assert ns.host == "127.0.0.1" and ns.port == 8000


def test_serve_takes_smaller_prefill_chunks_on_a_cpu_only_where_the_flag_is_not_given():
    """`serve` and `warmup` on a CPU: steps of 512 tokens (offline keeps 2048); a given flag, another platform,
    or chunked prefill turned off keep the offline rule; a larger --max-num-seqs raises the budget to it."""
    from enginecore.config import SERVE_CPU_MAX_NUM_BATCHED_TOKENS

    def budget(*argv, serving=True):
        args = (serving_engine_args if serving else engine_args_from_namespace)(parse(*argv))
        return args.create_engine_config(model_max_len=8192).scheduler_config.max_num_batched_tokens

    assert SERVE_CPU_MAX_NUM_BATCHED_TOKENS == 512
    assert budget("--platform", "cpu") == 512
    assert budget("--platform", "cpu", serving=False) == 2048
    assert budget("--platform", "cpu", "--max-num-batched-tokens", "1024") == 1024
    assert budget("--platform", "cpu", "--max-num-seqs", "600") == 600
    assert budget("--platform", "cpu", "--no-enable-chunked-prefill", "--max-model-len", "4096") == 4096
    # a TPU's own default (8192) is decided with the config; warmup --topology on this CPU host compiles for a TPU
    for argv in (("--platform", "tpu"), ("--topology", "v5e:2x2")):
        assert serving_engine_args(parse(*argv)).max_num_batched_tokens is None, argv


def test_vllm_spellings_parse_into_engine_args():
    ns = parse("some/model", "--dtype", "bfloat16", "--max-model-len", "2K", "--served-model-name", "a", "b",
               "--block-size", "32", "--no-enable-prefix-caching", "--max-num-seqs", "8",
               "--max-num-batched-tokens", "1k", "--scheduling-policy", "priority", "--tensor-parallel-size", "2",
               "--enforce-eager", "--max-logprobs", "5", "--kv-cache-memory-bytes", "1GiB",
               "--compilation-config", '{"level": 3}', "--backend", "torch", "--platform", "cpu",
               "--max-waiting-requests", "7")
    a = engine_args_from_namespace(ns)
    assert a.model == "some/model"
    assert (a.dtype, a.max_model_len, a.served_model_name) == ("bfloat16", 2048, ["a", "b"])
    assert (a.block_size, a.enable_prefix_caching, a.max_num_seqs, a.max_num_batched_tokens) == (32, False, 8, 1000)
    assert (a.scheduling_policy, a.tensor_parallel_size, a.enforce_eager, a.max_logprobs) == ("priority", 2, True, 5)
    assert a.kv_cache_memory_bytes == 2**30 and a.compilation_config == {"level": 3}
    assert (a.backend, a.platform, a.max_waiting_requests) == ("torch", "cpu", 7)


def test_human_readable_ints():
    assert human_int("512") == 512
    assert human_int("1k") == 1000 and human_int("1K") == 1024
    assert human_int("2M") == 2 * 2**20 and human_int("4GiB") == 4 * 2**30
    with pytest.raises(argparse.ArgumentTypeError):
        human_int("lots")


def test_dotted_json_flags_and_O():
    assert parse("--compilation-config.level", "3").compilation_config == {"level": 3}
    assert parse("-O3").compilation_config == {"level": 3}
    assert parse("-O", "2").compilation_config == {"level": 2}
    assert parse("-O.backend=inductor").compilation_config == {"backend": "inductor"}
    ns = parse("--compilation-config", '{"level": 1, "x": {"y": 1}}', "--compilation-config.x.z", "true")
    assert ns.compilation_config == {"level": 1, "x": {"y": 1, "z": True}}


def test_dotted_form_only_for_json_flags(capsys):
    with pytest.raises(SystemExit):
        parse("--max-model-len.x", "3")
    assert "only for JSON flags" in capsys.readouterr().err


def test_config_yaml_and_command_line_precedence(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: /m\nmax-model-len: 1024\nmax_num_seqs: 4\nenable-prefix-caching: false\n"
                   "served-model-name: [x, y]\ncompilation-config: {level: 2}\nport: 9001\n"
                   "api-key: [k1, k2]\nenforce-eager: true\n")
    ns = parse("--config", str(cfg), "--max-num-seqs", "6")
    a = engine_args_from_namespace(ns)
    assert (a.model, a.max_model_len, a.max_num_seqs, a.enable_prefix_caching) == ("/m", 1024, 6, False)
    assert a.served_model_name == ["x", "y"] and a.compilation_config == {"level": 2} and a.enforce_eager
    assert ns.port == 9001 and ns.api_key == ["k1", "k2"]


def test_config_yaml_unknown_key(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("max-model-lenn: 3\n")
    with pytest.raises(SystemExit):
        parse("--config", str(cfg))
    assert "unknown flag 'max-model-lenn'" in capsys.readouterr().err


def test_model_given_twice_differently(capsys):
    with pytest.raises(SystemExit):
        parse("a", "--model", "b")
    assert "given twice" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--quantization", "awq"], "argument --quantization/-q: invalid choice: 'awq'"),
    (["-q", "awq"], "invalid choice: 'awq'"),
    (["--speculative-config", "{}"], "speculative decoding"),
    (["--enable-lora"], "LoRA"),
    (["--cpu-offload-gb", "4"], "offloading"),
    (["--tokenizer-mode", "slow"], "--tokenizer-mode slow"),
])
def test_rejected_vllm_flags_name_the_flag(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--trust-remote-code"], ["--disable-custom-all-reduce"], ["--swap-space", "4"],
                                  ["--cpu-offload-gb", "0"], ["--tokenizer-mode", "auto"]])
def test_noop_vllm_flags_warn(argv, caplog):
    with caplog.at_level(logging.WARNING, logger="xlaserve.cli"):
        ns = parse(*argv)
    assert "no-op" in caplog.text and argv[0] in caplog.text
    assert not hasattr(ns, "_vllm_compat_seen")


def test_unknown_flag_is_an_error(capsys):
    with pytest.raises(SystemExit):
        parse("--no-such-flag")
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_compat_table_has_no_clash_with_real_flags():
    parser = serve_parser()
    real = {s for a in parser._actions if a.dest != "_vllm_compat_seen" for s in a.option_strings}
    for f in VLLM_COMPAT_FLAGS:
        assert "--" + f.name not in real


def test_pipeline_parallel_rejected_by_config():
    a = engine_args_from_namespace(parse("--pipeline-parallel-size", "2", "--platform", "cpu"))
    with pytest.raises(ConfigError, match="--pipeline-parallel-size 2"):
        a.create_engine_config(model_max_len=2048)


def test_cli_help_group_and_version():
    r = run_cli("serve", "--help=CacheConfig")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("CacheConfig")
    for flag in ("--block-size", "--gpu-memory-utilization", "--enable-prefix-caching", "--kv-cache-memory-bytes"):
        assert flag in r.stdout
    assert "--max-num-seqs" not in r.stdout  # SchedulerConfig
    r = run_cli("serve", "--help=max-num-seqs")
    assert "--max-num-seqs" in r.stdout and "--block-size" not in r.stdout
    r = run_cli("serve", "--help=listgroup")
    assert all(g in r.stdout for g in ("ModelConfig", "SchedulerConfig", "ParallelConfig", "DeviceConfig", "Frontend"))
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("xlaserve ")
    r = run_cli("--help")
    for cmd in ("serve", "chat", "complete", "run-batch", "collect-env", "warmup", "bench"):
        assert cmd in r.stdout


def test_cli_rejects_unsupported_vllm_flag_before_loading_anything():
    r = run_cli("serve", "--speculative-config", "{}")
    assert r.returncode == 2
    assert "--speculative-config {}: this vLLM flag is not supported by xlaserve" in r.stderr
    r = run_cli("serve", "--quantization", "gptq")  # ours takes gguf only
    assert r.returncode == 2
    assert "invalid choice: 'gptq'" in r.stderr


def test_collect_env_runs():
    r = run_cli("collect-env", "--no-devices", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["packages"]["fastapi"] and "detected_platform" in info
    from enginecore.model_loader import resolve_model

    dense = resolve_model(None).config  # the embedded default: every parameter active
    assert info["model"]["num_params"] == info["model"]["num_active_params"] == dense.num_params() > 100e6


def test_collect_env_describes_a_moe_model(tmp_path):
    """--model: a Mixture-of-Experts folder's total and active parameter counts and its experts."""
    import torch
    import transformers as tf

    from enginecore.model_loader import resolve_model

    torch.manual_seed(0)
    tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    )).save_pretrained(tmp_path)
    r = run_cli("collect-env", "--no-devices", "--model", str(tmp_path))
    assert r.returncode == 0, r.stderr
    arch = resolve_model(str(tmp_path)).config
    total, active = arch.num_params(), arch.num_params(active=True)
    assert active < total
    for line in ("architecture: Qwen3MoeForCausalLM", f"num_params: {total}", f"num_active_params: {active}",
                 "num_experts: 8", "experts_per_token: 2"):
        assert line in r.stdout
    bad = run_cli("collect-env", "--no-devices", "--json", "--model", str(tmp_path / "nope.gguf"))
    assert bad.returncode == 0 and json.loads(bad.stdout)["model"].startswith("unavailable (")


def test_warmup_subcommand_hands_serve_flags_to_jaxengine(monkeypatch, capsys):
    import types

    seen = {}

    def fake_run_warmup(engine_args, level="all"):
        seen["args"], seen["level"] = engine_args, level
        return [{"bucket": "model tokens=16 reqs=8", "seconds": 0.5, "compiles": 1, "cache_hits": 0,
                 "cache_misses": 1, "status": "compiled"}]

    monkeypatch.setitem(sys.modules, "jaxengine.warmup", types.SimpleNamespace(run_warmup=fake_run_warmup))
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["warmup"]
    code = sub.get_default("_run")(sub, ["--max-model-len", "256", "--max-num-seqs", "4", "--level", "decode",
                                         "--compilation-cache-dir", "/tmp/xc", "--platform", "cpu"])
    assert code == 0
    assert seen["level"] == "decode" and seen["args"].max_model_len == 256 and seen["args"].max_num_seqs == 4
    assert seen["args"].max_num_batched_tokens == 512  # serve's budget on a CPU: the shapes it will run
    assert seen["args"].compilation_cache_dir == "/tmp/xc"
    out = capsys.readouterr().out
    assert "model tokens=16 reqs=8" in out and "compiled" in out


def test_bench_subcommand_is_mounted():
    r = run_cli("bench", "--help")
    assert r.returncode == 0 and "bench" in r.stdout


def test_auto_backend_on_a_cpu(monkeypatch, tmp_path):
    """--backend auto on a CPU: torch where its AVX2 kernels run and the settings are theirs, else jax (also
    for jax's own features: orbax weights, an XLA compilation cache)."""
    from enginecore.platform import cpu_kernels_unavailable

    def backend(**kw):
        return EngineArgs(platform="cpu", **kw).create_engine_config(model_max_len=2048).device_config.backend

    assert backend() == ("jax" if cpu_kernels_unavailable() else "torch")
    orbax = tmp_path / "orbax-model"
    (orbax / "orbax").mkdir(parents=True)
    (orbax / "xlaserve_orbax.json").write_text("{}")
    from enginecore import platform as plat

    # bfloat16 weights run no kernels of ours: torch where the CPU multiplies bfloat16 natively (oneDNN), else jax
    for native in (True, False):
        monkeypatch.setattr(plat, "cpu_bf16_matmuls", lambda native=native: native)
        for kw in (dict(dtype="bfloat16"), dict(dtype="bfloat16", kv_cache_dtype="bfloat16")):
            assert backend(**kw) == ("torch" if native else "jax"), (native, kw)
        assert backend(dtype="bfloat16", compilation_cache_dir=str(tmp_path)) == "jax"  # jax's own feature
        assert backend(dtype="float16") == "jax"
    assert plat.cpu_dtype_note("float32") == "" and "float32" in plat.cpu_dtype_note("bfloat16")
    for kw in (dict(attention_backend="reference"),
               dict(data_parallel_size=2), dict(tensor_parallel_size=2), dict(backend="jax"),
               dict(load_format="orbax"), dict(model=str(orbax)), dict(compilation_cache_dir=str(tmp_path))):
        assert backend(**kw) == "jax", kw
    assert backend(backend="torch", dtype="bfloat16") == "torch"
    for kv in ("float16", "bfloat16"):  # a 16-bit cache under float32 weights: the kernels serve it
        assert backend(kv_cache_dtype=kv) == ("jax" if cpu_kernels_unavailable() else "torch"), kv
    if not cpu_kernels_unavailable():  # an explicit torch-only flag wins over jax's features
        assert backend(attention_backend="torch", compilation_cache_dir=str(tmp_path)) == "torch"
    monkeypatch.setenv("XLASERVE_CPU_KERNELS", "torch")
    assert cpu_kernels_unavailable() == "XLASERVE_CPU_KERNELS=torch"
    assert backend() == "jax"
    monkeypatch.setenv("XLASERVE_CPU_KERNELS", "off")
    assert cpu_kernels_unavailable() == "XLASERVE_CPU_KERNELS=off"


def test_cpu_kernels_fall_back_when_their_cache_is_unwritable(tmp_path, monkeypatch):
    """An unwritable kernel cache is a reason to run torch's ops, not a crash at start-up."""
    from cpu_kernels import torch_ops

    if torch_ops.cpu_kernels_unavailable():
        pytest.skip(torch_ops.cpu_kernels_unavailable())
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XLASERVE_CACHE", str(blocker))  # a file: its kernels/ folder cannot be made
    torch_ops.load.cache_clear()
    try:
        lib, why = torch_ops.load()
        assert lib is None and "cannot write the kernel cache" in why
    finally:
        torch_ops.load.cache_clear()


def test_log_lines_go_to_the_stderr_of_the_moment(monkeypatch):
    """The CLI's log handler writes to whatever sys.stderr is when a line is logged: one replaced and closed
    since (a redirect, a test's capture) neither loses the line nor raises "I/O operation on closed file"."""
    import io

    from enginecore.logging_setup import configure_logging

    first, now = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("INFO", prefix="test")
    first.close()
    monkeypatch.setattr(sys, "stderr", now)
    logging.getLogger("xlaserve.test").info("engine %s", "ready")
    assert "INFO" in now.getvalue() and "[xlaserve.test] engine ready" in now.getvalue()


def test_unknown_compilation_config_keys_are_refused():
    """--compilation-config keys the backends read and vLLM's (no-ops here) pass; any other is a ConfigError that
    names it and the accepted keys, and `serve` exits 2 with that message before loading weights."""
    from enginecore.config import COMPILATION_CONFIG_KEYS, VLLM_COMPILATION_CONFIG_KEYS

    def config(*argv):
        return engine_args_from_namespace(parse("--platform", "cpu", *argv)).create_engine_config(model_max_len=2048)

    assert config("-O3", "--compilation-config.cpu_layers", "false").device_config.compilation_config == {
        "level": 3, "cpu_layers": False}
    assert config("-O.backend=inductor").device_config.compilation_config == {"backend": "inductor"}
    for key in (*COMPILATION_CONFIG_KEYS, *VLLM_COMPILATION_CONFIG_KEYS):
        EngineArgs(platform="cpu", compilation_config={key: 1}).create_engine_config(model_max_len=2048)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) 'cpu_layer', 'x'\. xlaserve reads cpu_linears, .*"
                                          r"cudagraph_capture_sizes; vLLM's level, mode"):
        config("--compilation-config", '{"x": {"y": 1}, "cpu_layer": false}')
    with pytest.raises(ConfigError, match="--compilation-cache-dir"):
        config("--compilation-config.cache_dir", "/tmp/c")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        config("--compilation-config", "3")
    r = run_cli("serve", "--platform", "cpu", "--compilation-config.scan_layer", "false")
    assert r.returncode == 2
    assert "--compilation-config: unknown key(s) 'scan_layer'" in r.stderr


def test_vllm_compilation_config_keys_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="xlaserve.config"):
        EngineArgs(platform="cpu", compilation_config={"level": 3, "cpu_layers": True}).create_engine_config(2048)
    assert "--compilation-config level: vLLM's torch.compile options, a no-op" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="xlaserve.config"):
        EngineArgs(platform="cpu", compilation_config={"cpu_layers": True}).create_engine_config(2048)
    assert "compilation-config" not in caplog.text
