"""Frozen engine configuration, grouped and defaulted as vLLM does.

`EngineArgs` holds every flag the engine honours (named as the CLI flags with
underscores); `EngineArgs.create_engine_config()` validates and splits them
into the frozen groups below. Values derived at run time (number of KV
blocks, buckets) do not live here.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from enginecore.flags import DTYPE_ALIASES, ConfigError
from enginecore.sampling_params import DEFAULT_MAX_LOGPROBS

Platform = Literal["auto", "tpu", "cuda", "cpu"]
Backend = Literal["auto", "jax", "torch"]


@dataclass(frozen=True)
class ModelConfig:
    model: str | None  # None: the embedded default model
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None  # None: the model's max positions
    seed: int = 0
    served_model_name: tuple[str, ...] | None = None
    generation_config: str = "auto"  # "auto" (from the model) or "vllm" (ignore it)
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    load_format: str = "auto"
    # "gguf": keep a GGUF file's 4-bit weights (Q4_0 / Q4_1) quantized and multiply them as they are
    # (torch backend on CPU); None: dequantize every weight on load
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.quantization not in (None, "gguf"):
            raise ConfigError(f"--quantization must be gguf (or unset); got {self.quantization!r}.")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp32", "fp16"):
            raise ConfigError(f"--dtype must be one of auto, bfloat16, float16, float32; got {self.dtype!r}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be positive, got {self.max_model_len}.")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            raise ConfigError(f"--generation-config must be 'auto', 'vllm' or a folder; got {self.generation_config!r}.")
        if self.load_format not in ("auto", "safetensors", "gguf", "orbax"):
            raise ConfigError(f"--load-format must be one of auto, safetensors, gguf, orbax; got {self.load_format!r}.")

    @property
    def canonical_dtype(self) -> str:
        """auto, float32, bfloat16 or float16 (vLLM's aliases resolved)."""
        return DTYPE_ALIASES.get(self.dtype, self.dtype)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    kv_cache_dtype: str = "auto"
    # CPU: bytes of KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE, in bytes here).
    kv_cache_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 256 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size must be a power of two up to 256 (16 is usual); got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError(f"--num-gpu-blocks-override must be at least 2, got {self.num_gpu_blocks_override}.")
        if self.prefix_caching_hash_algo not in ("sha256", "xxhash", "builtin", "sha256_cbor"):
            raise ConfigError(
                f"--prefix-caching-hash-algo must be sha256, sha256_cbor, xxhash or builtin; got {self.prefix_caching_hash_algo!r}."
            )
        if self.kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not supported (auto, bfloat16, float16, float32).")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no per-request cap
    max_num_partial_prefills: int = 1
    # Most prompt tokens (of requests with more than one token to compute) a step takes while more than one request
    # could share it (0: no cap but max_num_batched_tokens); a request alone gets the whole budget (xlaserve flag)
    max_shared_prefill_tokens: int = 0
    scheduling_policy: str = "fcfs"
    max_model_len: int = 8192  # copied from the model config once resolved
    # Bound of the waiting queue; beyond it new requests get 503 (xlaserve flag).
    max_waiting_requests: int = 4096
    # Schedule step N+1 while step N computes (vLLM's --async-scheduling).
    async_scheduling: bool = True
    # Tokens a streamed request's output holds before it is sent (vLLM's --stream-interval): its first token and its
    # end go out at once. Applied where outputs are detokenized (enginecore.processor.OutputProcessor).
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ConfigError(f"--stream-interval must be at least 1, got {self.stream_interval}.")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}.")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be at least "
                f"--max-num-seqs ({self.max_num_seqs})."
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) is smaller than --max-model-len "
                f"({self.max_model_len}) with chunked prefill disabled: long prompts could never be scheduled. "
                "Raise --max-num-batched-tokens, lower --max-model-len, or enable chunked prefill."
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}.")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"--long-prefill-token-threshold must be >= 0, got {self.long_prefill_token_threshold}.")
        if self.max_num_partial_prefills < 1:
            raise ConfigError(f"--max-num-partial-prefills must be at least 1, got {self.max_num_partial_prefills}.")
        if self.max_shared_prefill_tokens < 0:
            raise ConfigError(f"--max-shared-prefill-tokens must be >= 0, got {self.max_shared_prefill_tokens}.")
        if self.max_shared_prefill_tokens and not self.enable_chunked_prefill:
            raise ConfigError("--max-shared-prefill-tokens splits prompts over steps: it needs chunked prefill.")
        if self.max_waiting_requests < 1:
            raise ConfigError(f"--max-waiting-requests must be at least 1, got {self.max_waiting_requests}.")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.pipeline_parallel_size != 1:
            raise ConfigError(
                f"--pipeline-parallel-size {self.pipeline_parallel_size} is not supported yet; use "
                "--tensor-parallel-size."
            )
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size and --data-parallel-size must be at least 1.")


TPU_CHIPS = ("v5e", "v6e", "v5p")
_TOPOLOGY_RE = re.compile(r"^(v5e|v6e|v5p):(\d+(?:x\d+){1,2})$")


def parse_topology_name(name: str) -> tuple[str, tuple[int, ...]]:
    """'v5e:2x2' -> ('v5e', (2, 2)); a ConfigError naming the value and the accepted forms otherwise (v5e and
    v6e slices are 2-D grids of chips, v5p slices 3-D)."""
    m = _TOPOLOGY_RE.match(name.strip()) if isinstance(name, str) else None
    if m is None:
        raise ConfigError(
            f"--topology {name!r} is not a TPU topology name: use <chip>:<grid> with chip one of "
            f"{', '.join(TPU_CHIPS)}, e.g. v5e:2x2, v6e:2x4, v5e:4x4 (2-D for v5e/v6e) or v5p:2x2x1 (3-D)")
    chip, grid = m.group(1), tuple(int(d) for d in m.group(2).split("x"))
    want = 3 if chip == "v5p" else 2
    if len(grid) != want or min(grid) < 1:
        raise ConfigError(f"--topology {name!r}: a {chip} slice is a {want}-D grid of chips "
                          f"(e.g. {'v5p:2x2x1' if want == 3 else chip + ':2x2'})")
    return chip, grid


@dataclass(frozen=True)
class DeviceConfig:
    platform: str = "cpu"  # resolved: tpu, cuda or cpu
    backend: str = "jax"  # resolved: jax or torch
    enforce_eager: bool = False
    attention_backend: str = "auto"  # auto | reference | pallas | triton | torch
    compilation_config: dict = field(default_factory=dict)
    compilation_cache_dir: str | None = None
    # Which padded step shapes to compile (jax) or capture (torch, CUDA) before serving:
    # auto (all for `serve` and on TPU, else none: compile on first use), none, decode, all.
    warmup: str = "auto"
    # Smallest token / request buckets; None: 16 / 8 on TPU and GPU, 1 / 1 on CPU.
    min_token_bucket: int | None = None
    min_seq_bucket: int | None = None
    # A TPU slice such as "v5e:2x2": `xlaserve warmup` compiles for it without a TPU; `serve` checks
    # that the attached chips are that kind. None: whatever is attached.
    topology: str | None = None

    def __post_init__(self) -> None:
        if self.warmup not in ("auto", "none", "decode", "all"):
            raise ConfigError(f"--warmup must be one of auto, none, decode, all; got {self.warmup!r}.")
        if self.topology is not None:
            parse_topology_name(self.topology)
            if self.platform != "tpu":
                raise ConfigError(f"--topology {self.topology} names TPU chips; it needs --platform tpu, "
                                  f"not {self.platform}.")
        for name in ("min_token_bucket", "min_seq_bucket"):
            v = getattr(self, name)
            if v is not None and (v < 1 or v & (v - 1)):
                raise ConfigError(f"--{name.replace('_', '-')} must be a power of two, got {v}.")

    @property
    def bucket_minimums(self) -> tuple[int, int]:
        """(tokens, requests): padded rows cost a full share of the matmuls on a CPU, little on TPU/GPU tiles."""
        default = (1, 1) if self.platform == "cpu" else (16, 8)
        return (self.min_token_bucket or default[0], self.min_seq_bucket or default[1])

    @property
    def warmup_level(self) -> str:
        if self.warmup != "auto":
            return self.warmup
        return "all" if self.platform == "tpu" else "none"


STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """`--structured-outputs-config` (vLLM's StructuredOutputsConfig): llguidance is the one grammar backend."""

    backend: str = "auto"  # auto | guidance (both llguidance)
    disable_fallback: bool = False  # accepted; there is no other backend to fall back to
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens
    disable_additional_properties: bool = False  # JSON schemas: additionalProperties false unless given
    reasoning_parser: str = ""  # vLLM's other spelling of --reasoning-parser (the frontend reads it; a conflict is refused)

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ConfigError(
                f"--structured-outputs-config backend {self.backend!r} is not available: xlaserve's grammar "
                f"backend is llguidance ('guidance', or 'auto'); xgrammar, outlines and lm-format-enforcer "
                "are not installed.")

    @classmethod
    def from_dict(cls, d: dict | None) -> "StructuredOutputsConfig":
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"--structured-outputs-config: unknown key(s) {', '.join(sorted(unknown))} "
                              f"(known: {', '.join(sorted(known))}).")
        return cls(**d)


@dataclass(frozen=True)
class EngineConfig:
    """All groups together (vLLM's VllmConfig)."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)


# A server's step budget on a CPU. A step there is compute-bound from a few rows on, so a 2048-token prefill
# chunk holds every running request's next token for its whole length (~2 s for the embedded model on 2 cores):
# 512-token chunks cut the median TTFT at concurrency 16 from 2.4 s to 1.45 s at the same output tok/s
# (benchmarks/README.md, bench_peers, session 26). Offline (`LLM`) keeps 2048: there the larger chunks ran
# 2-5% faster.
SERVE_CPU_MAX_NUM_BATCHED_TOKENS = 512
# ... and its prompt tokens while more than one request could share a step (`SchedulerConfig.
# max_shared_prefill_tokens`). Prompts that arrive together then get their first tokens one after the other
# instead of all at the end of one long step, and running requests' next tokens wait for 128 prompt tokens, not
# 512: median TTFT at concurrency 4 / 16 ~0.6x / ~0.4x, output tok/s 0.92-1.05x (benchmarks/README.md,
# session 34). A request alone keeps the 512-token steps (a 1500-token prompt's TTFT 4-11% shorter than in
# 128-token chunks).
SERVE_CPU_SHARED_PREFILL_TOKENS = 128


@dataclass
class EngineArgs:
    """Every engine flag, named as the CLI flag with underscores (vLLM's EngineArgs)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    served_model_name: list[str] | str | None = None
    generation_config: str = "auto"
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    load_format: str = "auto"
    quantization: str | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_shared_prefill_tokens: int | None = None
    scheduling_policy: str = "fcfs"
    max_waiting_requests: int = 4096
    async_scheduling: bool = True
    stream_interval: int = 1
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    platform: str = "auto"
    backend: str = "auto"
    enforce_eager: bool = False
    attention_backend: str = "auto"
    compilation_config: dict | None = None
    compilation_cache_dir: str | None = None
    warmup: str = "auto"
    min_token_bucket: int | None = None
    min_seq_bucket: int | None = None
    topology: str | None = None
    structured_outputs_config: dict | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        unknown = set(kwargs) - cls.field_names()
        if unknown:
            raise ConfigError(f"Unknown engine argument(s): {', '.join(sorted(unknown))}.")
        return cls(**kwargs)

    def _max_num_seqs(self, platform: str) -> int:
        """--max-num-seqs, or vLLM's default for the platform: CPU gets a smaller batch."""
        return self.max_num_seqs if self.max_num_seqs is not None else (256 if platform != "cpu" else 64)

    def apply_serving_defaults(self) -> None:
        """The defaults `xlaserve serve` (and `xlaserve warmup`, which compiles what serve will run) changes from
        the offline ones, where the flag was not given: on a CPU, steps of at most SERVE_CPU_MAX_NUM_BATCHED_TOKENS
        tokens (vLLM 0.32 on a CPU: 2048 for its API server, 4096 for `LLM`), and of at most
        SERVE_CPU_SHARED_PREFILL_TOKENS prompt tokens while requests share them."""
        from enginecore.platform import detect_platform

        if not self.enable_chunked_prefill:
            return
        platform = self.platform if self.platform != "auto" else "tpu" if self.topology else detect_platform()
        if platform != "cpu":  # (`warmup --topology` compiles for a TPU: jaxengine.aot takes auto as tpu)
            return
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(SERVE_CPU_MAX_NUM_BATCHED_TOKENS, self._max_num_seqs(platform))
        if self.max_shared_prefill_tokens is None:
            self.max_shared_prefill_tokens = SERVE_CPU_SHARED_PREFILL_TOKENS

    def create_engine_config(self, model_max_len: int | None = None) -> EngineConfig:
        """Validate and freeze. `model_max_len` is the model's own limit, if known."""
        from enginecore.platform import cpu_auto_backend, resolve_platform_and_backend

        platform, backend = resolve_platform_and_backend(self.platform, self.backend)
        if self.backend == "auto" and platform == "cpu":
            backend = cpu_auto_backend(self.dtype, self.data_parallel_size, self.attention_backend,
                                       self.kv_cache_dtype, self.tensor_parallel_size, self.load_format, self.model,
                                       self.compilation_cache_dir)
        if self.quantization == "gguf":
            # the 4-bit matmul is torch's CPU kernel (torchengine.quant)
            if self.backend == "auto" and platform == "cpu":
                backend = "torch"
            if backend != "torch" or platform != "cpu":
                raise ConfigError(f"--quantization gguf runs on --backend torch --platform cpu only (got --backend "
                                  f"{backend} --platform {platform}); without it GGUF weights are dequantized")
            if self.tensor_parallel_size != 1:
                raise ConfigError("--quantization gguf does not run with --tensor-parallel-size > 1")
        max_model_len = self.max_model_len or model_max_len or 8192
        if model_max_len is not None and self.max_model_len is not None and self.max_model_len > model_max_len:
            raise ConfigError(
                f"--max-model-len {self.max_model_len} is larger than the model's maximum "
                f"({model_max_len} positions)."
            )
        served = self.served_model_name
        if isinstance(served, str):
            served = [served]
        model_config = ModelConfig(
            model=self.model,
            tokenizer=self.tokenizer,
            dtype=self.dtype,
            max_model_len=max_model_len,
            seed=self.seed,
            served_model_name=tuple(served) if served else None,
            generation_config=self.generation_config,
            max_logprobs=self.max_logprobs,
            load_format=self.load_format,
            quantization=self.quantization,
        )
        max_num_seqs = self._max_num_seqs(platform)
        if self.max_num_batched_tokens is not None:
            mnbt = self.max_num_batched_tokens
        elif self.enable_chunked_prefill:
            mnbt = 8192 if platform != "cpu" else 2048
        else:
            mnbt = max(max_model_len, 2048)
        mnbt = max(mnbt, max_num_seqs) if self.max_num_batched_tokens is None else mnbt
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=mnbt,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_shared_prefill_tokens=self.max_shared_prefill_tokens or 0,
            scheduling_policy=self.scheduling_policy,
            max_model_len=max_model_len,
            max_waiting_requests=self.max_waiting_requests,
            async_scheduling=self.async_scheduling,
            stream_interval=self.stream_interval,
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
            prefix_caching_hash_algo=self.prefix_caching_hash_algo,
            kv_cache_dtype=self.kv_cache_dtype,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
        )
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            data_parallel_size=self.data_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
        )
        if self.attention_backend not in ("auto", "reference", "pallas", "triton", "torch"):
            raise ConfigError(
                f"--attention-backend must be auto, reference, pallas, triton or torch; got {self.attention_backend!r}."
            )
        if self.attention_backend == "pallas" and backend != "jax":
            raise ConfigError("--attention-backend pallas needs --backend jax.")
        if self.attention_backend in ("triton", "torch") and backend != "torch":
            raise ConfigError(f"--attention-backend {self.attention_backend} needs --backend torch.")
        device_config = DeviceConfig(
            platform=platform,
            backend=backend,
            enforce_eager=self.enforce_eager,
            attention_backend=self.attention_backend,
            compilation_config=dict(self.compilation_config or {}),
            compilation_cache_dir=self.compilation_cache_dir,
            warmup=self.warmup,
            min_token_bucket=self.min_token_bucket,
            min_seq_bucket=self.min_seq_bucket,
            topology=self.topology,
        )
        return EngineConfig(model_config, cache_config, scheduler_config, parallel_config, device_config,
                            StructuredOutputsConfig.from_dict(self.structured_outputs_config))
