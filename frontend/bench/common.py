"""Small helpers shared by the bench subcommands: JSON output, tables, environment notes."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from typing import Any, Sequence


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return _jsonable(obj.item())
    return obj


def write_json(path: str, obj: Any) -> str:
    """Write strict JSON (nan -> null, inf -> "inf") and return the path."""
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_jsonable(obj), f, indent=2)
        f.write("\n")
    return path


def run_info() -> dict:
    """Where and when a result was measured, stored beside every result."""
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host_cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.{digits}f}"
    return str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 2) -> str:
    """A plain fixed-width table (first column left-aligned, the rest right-aligned)."""
    cells = [[fmt(c, digits) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.ljust(widths[i]) if i == 0 else v.rjust(widths[i]) for i, v in enumerate(vals))

    out = [line(list(headers)), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


def parse_int_list(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"expected positive integers, got {s!r}")
    return vals


def param_counts(arch) -> dict[str, int]:
    """The model's parameters (an `ArchConfig`'s): all of them, and those one token reads (a MoE layer's top-k
    experts, not all; the same number for a dense model)."""
    return {"num_params": arch.num_params(), "num_active_params": arch.num_params(active=True)}


def format_count(n: int) -> str:
    """135000000 -> '135.0M' (K, M, B, T)."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.{1 if n < 100 * size else 0}f}{unit}"
    return str(n)


def params_line(arch) -> str:
    """One line for a report: total and active parameters, and the experts where the model has them."""
    c = param_counts(arch)
    line = f"Model parameters: {format_count(c['num_params'])} total, {format_count(c['num_active_params'])} active"
    if arch.moe is not None:
        line += f" ({arch.moe.top_k} of {arch.moe.num_experts} experts per token)"
    return line


def special_token_ids(tokenizer) -> list[int]:
    """Ids a random prompt should not contain (bos/eos/chat markers)."""
    hf = getattr(tokenizer, "hf", tokenizer)
    ids = set(getattr(hf, "all_special_ids", []) or [])
    ids |= set(getattr(tokenizer, "eos_token_ids", ()) or ())
    return sorted(i for i in ids if i is not None)
