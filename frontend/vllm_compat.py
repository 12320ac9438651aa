"""vLLM flags xlaserve does not implement: each is accepted as a no-op (with a warning) or rejected.

People come with `vllm serve` command lines. A flag from vLLM that we do not
implement must never be silently ignored: either it cannot change what the
server computes here (then it is a no-op and we say so in the log), or it
would (then start-up fails with a message naming the flag). Some flags are a
no-op only for certain values (e.g. `--cpu-offload-gb 0`).

Flags unknown to both vLLM and xlaserve fail in argparse as usual.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

logger = logging.getLogger("xlaserve.cli")

NOOP, REJECT = "noop", "reject"


@dataclass(frozen=True)
class CompatFlag:
    name: str  # without leading dashes
    kind: str  # NOOP or REJECT
    reason: str
    takes_value: bool = True
    noop_values: tuple[str, ...] = ()  # REJECT flags that are a no-op for these values
    short: str | None = None


_F = CompatFlag
VLLM_COMPAT_FLAGS: tuple[CompatFlag, ...] = (
    # no-ops: cannot change results here
    _F("trust-remote-code", NOOP, "xlaserve never runs code shipped with a model", takes_value=False),
    _F("disable-custom-all-reduce", NOOP, "there is no custom all-reduce kernel to disable", takes_value=False),
    _F("download-dir", NOOP, "xlaserve loads local files only and never downloads weights"),
    _F("hf-token", NOOP, "xlaserve never contacts the Hugging Face Hub"),
    _F("max-seq-len-to-capture", NOOP, "CUDA graphs / XLA programs are captured per bucket up to --max-model-len"),
    _F("swap-space", NOOP, "preemption is by recompute; there is no CPU swap space"),
    _F("max-parallel-loading-workers", NOOP, "weights are loaded by one process"),
    _F("disable-async-output-proc", NOOP, "output processing already runs in the API process", takes_value=False),
    _F("use-v2-block-manager", NOOP, "there is one block manager", takes_value=False),
    _F("num-lookahead-slots", NOOP, "there is no speculative decoding"),
    _F("disable-cascade-attn", NOOP, "there is no cascade attention", takes_value=False),
    _F("cuda-graph-sizes", NOOP, "graph / program sizes are the token buckets (powers of two)"),
    _F("calculate-kv-scales", NOOP, "the KV cache is not quantized", takes_value=False),
    _F("ray-workers-use-nsight", NOOP, "Ray workers are not profiled with Nsight", takes_value=False),
    _F("otlp-traces-endpoint", NOOP, "OpenTelemetry tracing is not implemented; use /metrics"),
    _F("collect-detailed-traces", NOOP, "OpenTelemetry tracing is not implemented; use /metrics"),
    _F("disable-mm-preprocessor-cache", NOOP, "models are text-only", takes_value=False),
    # no-op only for the default value
    _F("cpu-offload-gb", REJECT, "weight offloading to the CPU is not supported", noop_values=("0", "0.0")),
    _F("tokenizer-mode", REJECT, "only the model's own (fast) tokenizer is used", noop_values=("auto",)),
    _F("config-format", REJECT, "configs are read as Hugging Face config.json or GGUF metadata",
       noop_values=("auto", "hf")),
    _F("model-impl", REJECT, "xlaserve has one implementation per architecture", noop_values=("auto",)),
    _F("preemption-mode", REJECT, "preemption is by recompute only", noop_values=("recompute",)),
    _F("device", REJECT, "use --platform {auto,tpu,cuda,cpu}", noop_values=("auto",)),
    # rejected: would change results or behaviour
    _F("speculative-config", REJECT, "speculative decoding is not supported"),
    _F("num-speculative-tokens", REJECT, "speculative decoding is not supported"),
    _F("speculative-model", REJECT, "speculative decoding is not supported"),
    _F("enable-lora", REJECT, "LoRA adapters are not supported", takes_value=False),
    _F("lora-modules", REJECT, "LoRA adapters are not supported"),
    _F("max-loras", REJECT, "LoRA adapters are not supported"),
    _F("max-lora-rank", REJECT, "LoRA adapters are not supported"),
    _F("max-cpu-loras", REJECT, "LoRA adapters are not supported"),
    _F("fully-sharded-loras", REJECT, "LoRA adapters are not supported", takes_value=False),
    _F("lora-dtype", REJECT, "LoRA adapters are not supported"),
    _F("enable-prompt-adapter", REJECT, "prompt adapters are not supported", takes_value=False),
    _F("kv-transfer-config", REJECT, "disaggregated prefill / KV transfer is not supported"),
    _F("kv-events-config", REJECT, "KV cache events are not published"),
    _F("enable-eplb", REJECT, "expert-parallel load balancing (redundant experts) is not supported",
       takes_value=False),
    _F("tool-parser-plugin", REJECT, "tool-call parser plugins are not supported; see --tool-call-parser"),
    _F("guided-decoding-backend", REJECT, "renamed in vLLM; use --structured-outputs-config '{\"backend\": \"guidance\"}'"),
    _F("limit-mm-per-prompt", REJECT, "models are text-only"),
    _F("mm-processor-kwargs", REJECT, "models are text-only"),
    _F("rope-scaling", REJECT, "overriding the model's RoPE is not supported"),
    _F("rope-theta", REJECT, "overriding the model's RoPE is not supported"),
    _F("hf-overrides", REJECT, "overriding the model's config is not supported"),
    _F("override-generation-config", REJECT, "use --generation-config with a folder instead"),
    _F("revision", REJECT, "models are local files; a Hub revision cannot be honoured"),
    _F("code-revision", REJECT, "models are local files; a Hub revision cannot be honoured"),
    _F("tokenizer-revision", REJECT, "models are local files; a Hub revision cannot be honoured"),
    _F("logits-processors", REJECT, "custom logits processors are not supported"),
    _F("logits-processor-pattern", REJECT, "custom logits processors are not supported"),
    _F("enable-sleep-mode", REJECT, "sleep mode is not supported", takes_value=False),
    _F("disable-sliding-window", REJECT, "sliding-window models always use their window", takes_value=False),
    _F("worker-cls", REJECT, "there are no pluggable workers"),
    _F("worker-extension-cls", REJECT, "there are no pluggable workers"),
    _F("scheduler-cls", REJECT, "the scheduler is not pluggable"),
    _F("middleware", REJECT, "custom ASGI middleware is not supported"),
    _F("log-config-file", REJECT, "use --uvicorn-log-level; custom logging configs are not supported"),
    _F("tool-server", REJECT, "built-in tools are not supported"),
)

_BY_NAME = {f.name: f for f in VLLM_COMPAT_FLAGS}
COMPAT_DEST = "_vllm_compat_seen"


class _CompatAction(argparse.Action):
    """Records a vLLM-only flag; `check_compat_flags` decides after parsing."""

    def __init__(self, option_strings, dest, compat: CompatFlag, **kw):
        self.compat = compat
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        seen = getattr(namespace, COMPAT_DEST, None) or []
        negated = bool(option_string and option_string.startswith("--no-"))
        seen.append((self.compat.name, values, negated))
        setattr(namespace, COMPAT_DEST, seen)


def add_compat_flags(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    group = parser.add_argument_group(
        "VllmCompat",
        "vLLM flags xlaserve accepts as a no-op (logged) or rejects with a reason. "
        "See `--help=VllmCompat` for the table.",
    )
    for f in VLLM_COMPAT_FLAGS:
        status = "no-op" if f.kind == NOOP else (
            f"no-op for {', '.join(f.noop_values)}; otherwise rejected" if f.noop_values else "rejected"
        )
        opts = [f"--{f.name}"] + ([f.short] if f.short else [])
        if f.takes_value:
            group.add_argument(*opts, dest=COMPAT_DEST, action=_CompatAction, compat=f, nargs="?", const=None,
                               default=argparse.SUPPRESS, metavar="VALUE", help=f"[{status}] {f.reason}.")
        else:
            group.add_argument(*opts, f"--no-{f.name}", dest=COMPAT_DEST, action=_CompatAction, compat=f, nargs=0,
                               default=argparse.SUPPRESS, help=f"[{status}] {f.reason}.")
    return group


def check_compat_flags(namespace: argparse.Namespace) -> list[str]:
    """Warn about no-op vLLM flags; return error messages for rejected ones."""
    errors = []
    for name, value, negated in getattr(namespace, COMPAT_DEST, None) or []:
        f = _BY_NAME[name]
        if negated:  # --no-enable-lora etc.: asks for what we already do
            logger.warning("--no-%s: a vLLM flag that is a no-op in xlaserve (%s).", name, f.reason)
            continue
        shown = f"--{name}" + (f" {value}" if isinstance(value, str) else "")
        if f.kind == NOOP or (isinstance(value, str) and value in f.noop_values):
            logger.warning("%s: a vLLM flag that is a no-op in xlaserve (%s); ignoring it.", shown, f.reason)
        else:
            errors.append(f"{shown}: this vLLM flag is not supported by xlaserve: {f.reason}.")
    if hasattr(namespace, COMPAT_DEST):
        delattr(namespace, COMPAT_DEST)
    return errors
