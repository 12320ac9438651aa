"""`xlaserve bench` argument plumbing: subcommands register, engine flags come from EngineArgs."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from enginecore.config import EngineArgs
from frontend.bench import register
from frontend.bench.engine_flags import engine_kwargs


def parser():
    p = argparse.ArgumentParser(prog="xlaserve")
    register(p.add_subparsers(dest="command"))
    return p


def test_every_engine_arg_is_a_flag_and_only_given_ones_pass_through():
    p = parser()
    args = p.parse_args(["bench", "throughput", "--backend", "torch", "--max-num-seqs", "4",
                         "--no-enable-prefix-caching", "--compilation-config", '{"level": 1}'])
    assert args.func.__name__ == "throughput_main"
    assert engine_kwargs(args) == {"backend": "torch", "max_num_seqs": 4, "enable_prefix_caching": False,
                                   "compilation_config": {"level": 1}}
    EngineArgs.from_kwargs(**engine_kwargs(args))  # accepted by the engine as is
    help_text = p._subparsers._group_actions[0].choices["bench"]._subparsers._group_actions[0].choices[
        "latency"].format_help()
    for f in dataclasses.fields(EngineArgs):
        assert "--" + f.name.replace("_", "-") in help_text


def test_compare_defaults_to_float32_and_owns_backends():
    args = parser().parse_args(["bench", "compare"])
    assert engine_kwargs(args) == {"dtype": "float32"}
    assert args.backends == "jax,torch" and args.func.__name__ == "compare_main"


def test_frontend_cli_hook_runs_the_leaf(capsys):
    p = argparse.ArgumentParser(prog="xlaserve")
    bench = register(p.add_subparsers(dest="command"))
    run = bench.get_default("_run")
    assert run(bench, []) == 0  # no subcommand: help
    assert "latency" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run(bench, ["serve", "--request-rate", "fast"])


class _StubLLM:
    """What `bench latency` / `throughput` read of an LLM: the engine's model and tokenizer, generate()."""

    def __init__(self, arch):
        import types

        self.llm_engine = types.SimpleNamespace(model=types.SimpleNamespace(config=arch), tokenizer=object())

    def reset_prefix_cache(self):
        return True

    def generate(self, prompts, params, use_tqdm=True):
        import types

        params = params if isinstance(params, list) else [params] * len(prompts)
        out = types.SimpleNamespace
        return [out(prompt_token_ids=p, outputs=[out(token_ids=[1] * sp.max_tokens)]) for p, sp in zip(prompts, params)]


MOE = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
       "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
       "num_local_experts": 8, "num_experts_per_tok": 2}  # Mixtral-8x7B's sizes: 46.7B, 12.9B active


@pytest.mark.parametrize("cmd", ["latency", "throughput"])
def test_bench_latency_and_throughput_print_total_and_active_params(monkeypatch, capsys, tmp_path, cmd):
    import json

    from enginecore.arch import ArchConfig
    from frontend.bench import offline

    arch = ArchConfig.from_hf_dict(MOE)
    monkeypatch.setattr(offline, "build_llm", lambda kwargs: _StubLLM(arch))
    out = tmp_path / "r.json"
    args = parser().parse_args(["bench", cmd, "--disable-tqdm", "--output-json", str(out), "--input-len", "4",
                                "--output-len", "2", *(["--num-iters", "1", "--num-iters-warmup", "0"]
                                                       if cmd == "latency" else ["--num-prompts", "2"])])
    assert args.func(args) == 0
    assert "Model parameters: 46.7B total, 12.9B active (2 of 8 experts per token)" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert (r["num_params"], r["num_active_params"]) == (arch.num_params(), arch.num_params(active=True))


def test_params_line_of_a_dense_model():
    from enginecore.arch import ArchConfig
    from frontend.bench.common import params_line

    dense = ArchConfig.from_hf_dict({**MOE, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert params_line(dense) == "Model parameters: 7.2B total, 7.2B active"  # Mistral-7B's sizes
