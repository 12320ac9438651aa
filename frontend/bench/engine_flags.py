"""Engine flags for the in-process benchmarks, generated from `EngineArgs` so they never drift.

Every field of `enginecore.config.EngineArgs` becomes `--field-name`; only the
flags a user actually gives are passed on, so the engine's own defaults apply
to the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from enginecore.config import EngineArgs

_CHOICES = {
    "backend": ("auto", "jax", "torch"),
    "platform": ("auto", "tpu", "cuda", "cpu"),
    "dtype": ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp32", "fp16"),
}


def _json_dict(s: str) -> dict:
    try:
        v = json.loads(s)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e.msg}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return v


def add_engine_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (), defaults: dict | None = None) -> None:
    """Add one flag per EngineArgs field (except `skip`). `defaults` overrides the engine's for this command."""
    group = parser.add_argument_group("engine arguments (as for `xlaserve serve`)")
    defaults = defaults or {}
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        t = str(f.type)
        engine_default = f.default if f.default is not dataclasses.MISSING else None
        shown = defaults.get(f.name, engine_default)
        kw: dict[str, Any] = {"dest": f.name, "default": defaults.get(f.name, argparse.SUPPRESS),
                              "help": f"default: {shown}"}
        if t == "bool":
            kw["action"] = argparse.BooleanOptionalAction
        elif t.startswith("dict"):
            kw["type"] = _json_dict
            kw["metavar"] = "JSON"
        elif t.startswith("int"):
            kw["type"] = int
        elif t.startswith("float"):
            kw["type"] = float
        elif t.startswith("list"):
            kw["nargs"] = "+"
        else:
            kw["type"] = str
        if f.name in _CHOICES:
            kw["choices"] = _CHOICES[f.name]
        group.add_argument(flag, **kw)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine flags present on `args`, as EngineArgs keyword arguments."""
    names = EngineArgs.field_names()
    return {k: v for k, v in vars(args).items() if k in names}
