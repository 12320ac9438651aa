"""Frozen engine configuration, grouped and defaulted as vLLM does.

`EngineArgs` holds every flag the engine honours (named as the CLI flags with
underscores); `EngineArgs.create_engine_config()` validates and splits them
into the frozen groups below. Values derived at run time (number of KV
blocks, buckets) do not live here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from enginecore.flags import DTYPE_ALIASES, ConfigError
from enginecore.sampling_params import DEFAULT_MAX_LOGPROBS

logger = logging.getLogger("xlaserve.config")


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
    # a MoE model's experts split over the tensor-parallel devices, each device holding whole experts, in place of
    # every expert's columns split over them. EP size = TP: each data-parallel core is its own engine with all the
    # experts over its own TP group (vLLM's EP spans TP x DP ranks that step together: not implemented)
    enable_expert_parallel: bool = False
    # Beyond one process (vLLM's flags). One engine over several hosts: `--nnodes N --node-rank R --master-addr A
    # --master-port P` on every host (jax: jax.distributed's multi-controller runtime, the coordinator at A:P;
    # torch: torch.distributed's rendezvous at A:P); node 0 serves HTTP, the others run `--headless`.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    # how the ranks of one engine are started: mp (local processes), ray (actors in a placement group on a Ray
    # cluster), uni (one process); None: uni for one rank, else mp
    distributed_executor_backend: str | None = None
    # Data parallelism: --data-parallel-size engine cores (each its own --tensor-parallel-size group) behind one
    # API server, or behind an external load balancer (one server per rank, --data-parallel-external-lb), or one
    # API server per node for its local cores (--data-parallel-hybrid-lb)
    data_parallel_size_local: int | None = None  # cores on this node (None: all, on one node)
    data_parallel_rank: int | None = None  # external LB: the rank this server runs
    data_parallel_start_rank: int = 0  # the first rank of this node's cores
    data_parallel_address: str | None = None  # the head node's address, which the other nodes' cores connect to
    data_parallel_rpc_port: int = 29550  # the head node's port for them
    data_parallel_backend: str = "mp"  # mp: local processes; ray: actors on a Ray cluster
    data_parallel_hybrid_lb: bool = False
    data_parallel_external_lb: bool = False

    def __post_init__(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes}).")
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"--master-port {self.master_port} is not a TCP port.")
        if self.distributed_executor_backend not in (None, "mp", "ray", "uni"):
            raise ConfigError(f"--distributed-executor-backend must be mp, ray or uni; got "
                              f"{self.distributed_executor_backend!r}.")
        if self.distributed_executor_backend == "uni" and (self.tensor_parallel_size > 1 or self.nnodes > 1):
            raise ConfigError("--distributed-executor-backend uni runs one process: it cannot run "
                              f"--tensor-parallel-size {self.tensor_parallel_size} / --nnodes {self.nnodes}.")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ConfigError(f"--data-parallel-backend must be mp or ray; got {self.data_parallel_backend!r}.")
        local = self.data_parallel_size_local
        if local is not None and not 0 <= local <= self.data_parallel_size:
            raise ConfigError(f"--data-parallel-size-local {local} must be in [0, --data-parallel-size "
                              f"{self.data_parallel_size}].")
        if self.data_parallel_rank is not None and not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ConfigError(f"--data-parallel-rank {self.data_parallel_rank} must be in [0, --data-parallel-size "
                              f"{self.data_parallel_size}).")
        if not 0 <= self.data_parallel_start_rank < self.data_parallel_size:
            raise ConfigError(f"--data-parallel-start-rank {self.data_parallel_start_rank} must be in [0, "
                              f"--data-parallel-size {self.data_parallel_size}).")
        if self.data_parallel_hybrid_lb and self.data_parallel_external_lb:
            raise ConfigError("--data-parallel-hybrid-lb and --data-parallel-external-lb exclude each other.")
        if not 0 < self.data_parallel_rpc_port < 65536:
            raise ConfigError(f"--data-parallel-rpc-port {self.data_parallel_rpc_port} is not a TCP port.")
        if self.pipeline_parallel_size != 1:
            raise ConfigError(
                f"--pipeline-parallel-size {self.pipeline_parallel_size} is not supported yet; use "
                "--tensor-parallel-size."
            )
        if self.tensor_parallel_size < 1 or self.data_parallel_size < 1:
            raise ConfigError("--tensor-parallel-size and --data-parallel-size must be at least 1.")


# --compilation-config keys the backends read (jaxengine.runner, torchengine.runner) and what each does
COMPILATION_CONFIG_KEYS = {
    "cpu_linears": "jax on a CPU: linears and LM head on the CPU kernels (default true)",
    "cpu_decode_attention": "jax on a CPU: attention over the KV cache on the CPU kernels (default true)",
    "cpu_layers": "jax on a CPU: every layer of a step in one kernel call, not a scan over layers (default true)",
    "scan_layers": "jax: the layers as one scanned program (default true)",
    "sampler_method": "jax: how the sampler finds top-k / top-p tokens (default topk)",
    "logits_chunk_rows": "jax: rows of the LM head and sampler at a time (default 64 on a CPU, else all)",
    "weights_first_rows": "jax: steps of up to this many rows multiply weights first (default 32 on a CPU)",
    "store_executables": "jax on a CPU: keep serialized executables in the compilation cache (default true)",
    "cudagraph_capture_sizes": "torch on CUDA: the decode batch sizes captured as CUDA graphs (default all)",
}
# vLLM's keys for its torch.compile / Inductor / CUDA-graph pipeline, which xlaserve does not have: accepted (with a
# warning) so that vLLM command lines such as `-O3` start; they cannot change what is computed here
VLLM_COMPILATION_CONFIG_KEYS = (
    "level", "mode", "backend", "custom_ops", "splitting_ops", "use_inductor", "compile_sizes",
    "inductor_compile_config", "inductor_passes", "pass_config", "cudagraph_mode", "use_cudagraph",
    "cudagraph_num_of_warmups", "cudagraph_copy_inputs", "full_cuda_graph", "max_capture_size",
    "max_cudagraph_capture_size", "use_inductor_graph_partition", "debug_dump_path", "compile_mm_encoder",
)


def check_compilation_config(value: Any) -> dict:
    """`--compilation-config` as a dict, or a ConfigError naming each unknown key and the accepted ones."""
    if not isinstance(value, dict):
        raise ConfigError(f"--compilation-config must be a JSON object (or -O LEVEL), got {value!r}.")
    unknown = sorted(set(value) - COMPILATION_CONFIG_KEYS.keys() - set(VLLM_COMPILATION_CONFIG_KEYS))
    if unknown:
        cache_keys = {"cache_dir", "local_cache_dir"} & set(unknown)
        hint = " (the compilation cache folder is --compilation-cache-dir)" if cache_keys else ""
        raise ConfigError(
            f"--compilation-config: unknown key(s) {', '.join(map(repr, unknown))}{hint}. xlaserve reads "
            f"{', '.join(COMPILATION_CONFIG_KEYS)}; vLLM's {', '.join(VLLM_COMPILATION_CONFIG_KEYS)} are accepted "
            "and do nothing here.")
    return value


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
        check_compilation_config(self.compilation_config)
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


# A server's step budget on a CPU. A step there is compute-bound from a few rows on, so a long prefill chunk holds
# every running request's next token for its whole length: smaller chunks cut the median TTFT under load at the
# same output tok/s. Offline (`LLM`) keeps 2048, where larger chunks ran faster. Measured with `python -m
# benchmarks.bench_peers --servers ours --concurrency 1,4,16` (benchmarks/HISTORY.md, bench_peers).
SERVE_CPU_MAX_NUM_BATCHED_TOKENS = 512
# ... and its prompt tokens while more than one request could share a step (`SchedulerConfig.
# max_shared_prefill_tokens`): prompts that arrive together then get their first tokens one after the other instead
# of all at the end of one long step, and running requests' next tokens wait for 128 prompt tokens, not 512 (lower
# median TTFT at concurrency 4 and 16, about the same output tok/s; the same bench_peers command, `--ours-args
# "--max-shared-prefill-tokens 0"` for the uncapped steps). A request alone keeps the 512-token steps.
SERVE_CPU_SHARED_PREFILL_TOKENS = 128


@dataclass
class EngineArgs:
    """Every engine flag, named as the CLI flag with underscores (vLLM's EngineArgs).

    A flag's default is its config group's (`ModelConfig.dtype`, as vLLM writes them); the few that differ are
    None or "auto" where `create_engine_config` decides them for the platform and say so."""

    model: str | None = None  # None: the embedded default model
    tokenizer: str | None = ModelConfig.tokenizer
    dtype: str = ModelConfig.dtype
    max_model_len: int | None = ModelConfig.max_model_len
    seed: int = ModelConfig.seed
    served_model_name: list[str] | str | None = ModelConfig.served_model_name
    generation_config: str = ModelConfig.generation_config
    max_logprobs: int = ModelConfig.max_logprobs
    load_format: str = ModelConfig.load_format
    quantization: str | None = ModelConfig.quantization
    block_size: int = CacheConfig.block_size
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    num_gpu_blocks_override: int | None = CacheConfig.num_gpu_blocks_override
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    prefix_caching_hash_algo: str = CacheConfig.prefix_caching_hash_algo
    kv_cache_dtype: str = CacheConfig.kv_cache_dtype
    kv_cache_memory_bytes: int | None = CacheConfig.kv_cache_memory_bytes
    max_num_seqs: int | None = None  # None: the platform's (`_max_num_seqs`)
    max_num_batched_tokens: int | None = None  # None: the platform's and the chunking's (`create_engine_config`)
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill
    long_prefill_token_threshold: int = SchedulerConfig.long_prefill_token_threshold
    max_num_partial_prefills: int = SchedulerConfig.max_num_partial_prefills
    max_shared_prefill_tokens: int | None = None  # None: no cap, or serve's on a CPU (`apply_serving_defaults`)
    scheduling_policy: str = SchedulerConfig.scheduling_policy
    max_waiting_requests: int = SchedulerConfig.max_waiting_requests
    async_scheduling: bool = SchedulerConfig.async_scheduling
    stream_interval: int = SchedulerConfig.stream_interval
    tensor_parallel_size: int = ParallelConfig.tensor_parallel_size
    data_parallel_size: int = ParallelConfig.data_parallel_size
    pipeline_parallel_size: int = ParallelConfig.pipeline_parallel_size
    enable_expert_parallel: bool = ParallelConfig.enable_expert_parallel
    nnodes: int = ParallelConfig.nnodes
    node_rank: int = ParallelConfig.node_rank
    master_addr: str = ParallelConfig.master_addr
    master_port: int = ParallelConfig.master_port
    distributed_executor_backend: str | None = ParallelConfig.distributed_executor_backend
    data_parallel_size_local: int | None = ParallelConfig.data_parallel_size_local
    data_parallel_rank: int | None = ParallelConfig.data_parallel_rank
    data_parallel_start_rank: int = ParallelConfig.data_parallel_start_rank
    data_parallel_address: str | None = ParallelConfig.data_parallel_address
    data_parallel_rpc_port: int = ParallelConfig.data_parallel_rpc_port
    data_parallel_backend: str = ParallelConfig.data_parallel_backend
    data_parallel_hybrid_lb: bool = ParallelConfig.data_parallel_hybrid_lb
    data_parallel_external_lb: bool = ParallelConfig.data_parallel_external_lb
    platform: str = "auto"  # DeviceConfig holds the resolved one
    backend: str = "auto"  # DeviceConfig holds the resolved one
    enforce_eager: bool = DeviceConfig.enforce_eager
    attention_backend: str = DeviceConfig.attention_backend
    compilation_config: dict | None = None
    compilation_cache_dir: str | None = DeviceConfig.compilation_cache_dir
    warmup: str = DeviceConfig.warmup
    min_token_bucket: int | None = DeviceConfig.min_token_bucket
    min_seq_bucket: int | None = DeviceConfig.min_seq_bucket
    topology: str | None = DeviceConfig.topology
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

    def _group(self, group: type, **decided: Any) -> Any:
        """`group` from the flags of its fields' names, with `decided` (values resolved here) in place of those."""
        flags = {f.name: getattr(self, f.name) for f in dataclasses.fields(group) if f.name not in decided}
        return group(**flags, **decided)

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
        max_model_len = self.max_model_len or model_max_len or SchedulerConfig.max_model_len
        if model_max_len is not None and self.max_model_len is not None and self.max_model_len > model_max_len:
            raise ConfigError(
                f"--max-model-len {self.max_model_len} is larger than the model's maximum "
                f"({model_max_len} positions)."
            )
        served = self.served_model_name
        if isinstance(served, str):
            served = [served]
        model_config = self._group(ModelConfig, max_model_len=max_model_len,
                                   served_model_name=tuple(served) if served else None)
        max_num_seqs = self._max_num_seqs(platform)
        if self.max_num_batched_tokens is not None:
            mnbt = self.max_num_batched_tokens
        elif self.enable_chunked_prefill:
            mnbt = 8192 if platform != "cpu" else 2048
        else:
            mnbt = max(max_model_len, 2048)
        mnbt = max(mnbt, max_num_seqs) if self.max_num_batched_tokens is None else mnbt
        scheduler_config = self._group(SchedulerConfig, max_num_seqs=max_num_seqs, max_num_batched_tokens=mnbt,
                                       max_shared_prefill_tokens=self.max_shared_prefill_tokens or 0,
                                       max_model_len=max_model_len)
        cache_config = self._group(CacheConfig)
        parallel_config = self._group(ParallelConfig)
        if parallel_config.enable_expert_parallel and parallel_config.data_parallel_size > 1:
            logger.warning("--enable-expert-parallel with --data-parallel-size %d: the experts split over each core's "
                           "--tensor-parallel-size %d devices (EP size %d), not over TP x DP as in vLLM: every "
                           "data-parallel core holds all the experts", parallel_config.data_parallel_size,
                           parallel_config.tensor_parallel_size, parallel_config.tensor_parallel_size)
        if self.attention_backend not in ("auto", "reference", "pallas", "triton", "torch"):
            raise ConfigError(
                f"--attention-backend must be auto, reference, pallas, triton or torch; got {self.attention_backend!r}."
            )
        if self.attention_backend == "pallas" and backend != "jax":
            raise ConfigError("--attention-backend pallas needs --backend jax.")
        if self.attention_backend in ("triton", "torch") and backend != "torch":
            raise ConfigError(f"--attention-backend {self.attention_backend} needs --backend torch.")
        device_config = self._group(DeviceConfig, platform=platform, backend=backend,
                                    compilation_config=dict(check_compilation_config(self.compilation_config or {})))
        if vllm_only := [k for k in VLLM_COMPILATION_CONFIG_KEYS if k in device_config.compilation_config]:
            logger.warning("--compilation-config %s: vLLM's torch.compile options, a no-op in xlaserve",
                           ", ".join(vllm_only))
        return EngineConfig(model_config, cache_config, scheduler_config, parallel_config, device_config,
                            StructuredOutputsConfig.from_dict(self.structured_outputs_config))
