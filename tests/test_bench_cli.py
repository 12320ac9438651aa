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
