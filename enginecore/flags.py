"""What the flag-reading modules share below `config`: the error a bad flag raises, and vLLM's dtype aliases.

`config` re-exports both (`from enginecore.config import ConfigError` stays the usual spelling); `platform`,
which `config` calls to resolve `--platform`, `--backend` and `--dtype`, imports them from here, so it never
imports `config`.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An invalid flag or combination of flags; the message names the flag."""


DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}
