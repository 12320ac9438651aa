"""`xlaserve serve` flags, spelled as vLLM spells them.

Every `EngineArgs` field becomes a `--kebab-case` flag (grouped as vLLM groups
them: ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig,
DeviceConfig); the HTTP server's own flags form the Frontend group. On top of
argparse:

- `--config file.yaml`: flags from a YAML mapping; the command line wins;
- JSON flags (`--compilation-config '{"level": 3}'`) also take the dotted
  form `--compilation-config.level 3`, and `-O3` / `-O 3` / `-O.level 3`;
- `--help=<group|flag|keyword>` prints part of the help, as in vLLM;
- vLLM flags we do not implement: see `frontend.vllm_compat`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import typing

from enginecore.config import COMPILATION_CONFIG_KEYS, EngineArgs
from frontend.reasoning_parsers import REASONING_PARSERS
from frontend.tool_parsers import TOOL_PARSERS
from frontend.vllm_compat import add_compat_flags, check_compat_flags

ENGINE_GROUPS = ("ModelConfig", "CacheConfig", "SchedulerConfig", "ParallelConfig", "DeviceConfig",
                 "StructuredOutputsConfig")
ALL_GROUPS = ENGINE_GROUPS + ("Frontend", "VllmCompat")

# field -> (group, help, choices)
ENGINE_FLAG_DOCS: dict[str, tuple[str, str, tuple | None]] = {
    "model": ("ModelConfig", "Model: a local Hugging Face folder or .gguf file. Default: the embedded "
              "SmolLM2-135M-Instruct (GGUF). Also accepted as the positional MODEL.", None),
    "tokenizer": ("ModelConfig", "Tokenizer folder or .gguf file (default: the model's own).", None),
    "dtype": ("ModelConfig", "Weights and activations dtype.",
              ("auto", "bfloat16", "float16", "float32", "half", "float", "bf16", "fp16", "fp32")),
    "max_model_len": ("ModelConfig", "Context length (prompt + output). Default: the model's maximum. "
                      "Accepts 1k (1000) / 1K (1024) suffixes.", None),
    "seed": ("ModelConfig", "Seed for requests that do not give one.", None),
    "served_model_name": ("ModelConfig", "Model name(s) in the API; the first is reported by /v1/models "
                          "and in responses. Default: --model (or the embedded model's name).", None),
    "generation_config": ("ModelConfig", "'auto': default sampling parameters and EOS ids from the model's "
                          "generation_config.json; 'vllm': ignore it; or a folder holding one.", None),
    "max_logprobs": ("ModelConfig", "Largest logprobs / top_logprobs / prompt_logprobs a request may ask for "
                     "(-1: no limit).", None),
    "load_format": ("ModelConfig", "Weights format.", ("auto", "safetensors", "gguf", "orbax")),
    "quantization": ("ModelConfig", "gguf: keep a GGUF file's Q4_0/Q4_1 weights 4-bit and multiply them as "
                     "they are (torch on CPU; bf16 activations for steps of up to 16 tokens). Unset: every "
                     "weight dequantized on load.", ("gguf",)),
    "block_size": ("CacheConfig", "Tokens per KV-cache block.", (1, 8, 16, 32, 64, 128, 256)),
    "gpu_memory_utilization": ("CacheConfig", "Fraction of accelerator memory for weights, activations and the "
                               "KV cache.", None),
    "num_gpu_blocks_override": ("CacheConfig", "Use this many KV-cache blocks instead of sizing them from "
                                "memory.", None),
    "enable_prefix_caching": ("CacheConfig", "Reuse KV blocks of identical prompt prefixes.", None),
    "prefix_caching_hash_algo": ("CacheConfig", "Hash of prefix-cache blocks.",
                                 ("sha256", "sha256_cbor", "xxhash", "builtin")),
    "kv_cache_dtype": ("CacheConfig", "KV-cache dtype ('auto': the model dtype). On a CPU with float32 weights, "
                       "float16 / bfloat16 hold twice the tokens and speed decode attention up; attention stays "
                       "float32 arithmetic on the rounded K/V.",
                       ("auto", "bfloat16", "float16", "float32")),
    "kv_cache_memory_bytes": ("CacheConfig", "Bytes of KV cache (overrides --gpu-memory-utilization for the "
                              "cache; on CPU the default budget). Accepts K/M/G suffixes.", None),
    "max_num_seqs": ("SchedulerConfig", "Most sequences in one step (default 256; 64 on CPU).", None),
    "max_num_batched_tokens": ("SchedulerConfig", "Token budget of one step (default 8192; on CPU 2048, and for "
                               "`serve` / `warmup` 512, at least --max-num-seqs).", None),
    "enable_chunked_prefill": ("SchedulerConfig", "Split long prompts over several steps.", None),
    "long_prefill_token_threshold": ("SchedulerConfig", "Most prompt tokens one request gets per step "
                                     "(0: no cap).", None),
    "max_num_partial_prefills": ("SchedulerConfig", "Most requests partially prefilled at once.", None),
    "max_shared_prefill_tokens": ("SchedulerConfig", "Most prompt tokens a step takes while more than one request "
                                  "could share it; a request alone gets the whole --max-num-batched-tokens "
                                  "(0: no cap; `serve` / `warmup` on CPU: 128). Prompts that arrive together get "
                                  "their first tokens one after another instead of all at the end of one long "
                                  "step.", None),
    "scheduling_policy": ("SchedulerConfig", "fcfs, or priority (requests' `priority` field; lower first).",
                          ("fcfs", "priority")),
    "max_waiting_requests": ("SchedulerConfig", "Bound of the waiting queue; beyond it requests get HTTP 503.",
                             None),
    "async_scheduling": ("SchedulerConfig", "Schedule and build step N+1 while step N runs on the device "
                         "(same outputs; --no-async-scheduling runs them one after the other).", None),
    "stream_interval": ("SchedulerConfig", "Tokens a streamed response gathers before it sends them (1: each token "
                        "as it comes; the first token and the end are never held). Larger values spend less of the API "
                        "process's CPU a token, for many concurrent streams.", None),
    "tensor_parallel_size": ("ParallelConfig", "Tensor-parallel devices.", None),
    "data_parallel_size": ("ParallelConfig", "Data-parallel replicas.", None),
    "pipeline_parallel_size": ("ParallelConfig", "Pipeline stages (only 1 is supported).", None),
    "enable_expert_parallel": ("ParallelConfig", "A Mixture-of-Experts model's experts split over the "
                               "tensor-parallel devices (whole experts per device; EP size = TP, each data-parallel "
                               "core holding all the experts) instead of every expert's columns.", None),
    "nnodes": ("ParallelConfig", "Hosts one engine spans (jax: jax.distributed's processes, one per host; torch: "
               "torch.distributed's nodes). Run the same command on every host with its --node-rank.", None),
    "node_rank": ("ParallelConfig", "This host's rank among --nnodes (0 serves HTTP; the others run --headless).",
                  None),
    "master_addr": ("ParallelConfig", "Address of node 0 (jax.distributed's coordinator / torch.distributed's "
                    "rendezvous).", None),
    "master_port": ("ParallelConfig", "Port of node 0's coordinator / rendezvous.", None),
    "distributed_executor_backend": ("ParallelConfig", "How an engine's ranks are started: mp (local processes; "
                                     "with --nnodes, each other node runs `serve --headless --node-rank R`), ray "
                                     "(actors placed on the Ray cluster of RAY_ADDRESS, over its nodes: no "
                                     "--headless nodes to start), uni (one process). Default: uni for one rank, "
                                     "else mp.", ("mp", "ray", "uni")),
    "data_parallel_size_local": ("ParallelConfig", "Data-parallel engine cores on this node (default: all of "
                                 "--data-parallel-size).", None),
    "data_parallel_rank": ("ParallelConfig", "With --data-parallel-external-lb: the one rank this server runs.",
                           None),
    "data_parallel_start_rank": ("ParallelConfig", "The rank of this node's first engine core.", None),
    "data_parallel_address": ("ParallelConfig", "Address of the head node's API server, which other nodes' engine "
                              "cores connect to.", None),
    "data_parallel_rpc_port": ("ParallelConfig", "Port on --data-parallel-address for the engine cores.", None),
    "data_parallel_backend": ("ParallelConfig", "How data-parallel engine cores are started: mp (local "
                              "processes) or ray (actors on a Ray cluster).", ("mp", "ray")),
    "data_parallel_hybrid_lb": ("ParallelConfig", "One API server per node, for that node's engine cores (an "
                                "external load balancer in front of the nodes).", None),
    "data_parallel_external_lb": ("ParallelConfig", "One API server per data-parallel rank (--data-parallel-rank); "
                                  "an external load balancer routes between them.", None),
    "platform": ("DeviceConfig", "Hardware (auto: TPU, else CUDA, else CPU).", ("auto", "tpu", "cuda", "cpu")),
    "backend": ("DeviceConfig", "Engine backend (auto: jax on TPU, torch on CUDA; on CPU torch where its AVX2 kernels run with float32 and one process, else jax, also for orbax weights or a compilation cache).",
                ("auto", "jax", "torch")),
    "enforce_eager": ("DeviceConfig", "No CUDA graphs / no jit of the step (debugging).", None),
    "attention_backend": ("DeviceConfig", "Attention implementation.",
                          ("auto", "reference", "pallas", "triton", "torch")),
    "compilation_config": ("DeviceConfig", "Compilation options as JSON, e.g. '{\"cpu_layers\": false}'; also "
                           "--compilation-config.cpu_layers false, -O.cpu_layers false. Keys: "
                           + ", ".join(COMPILATION_CONFIG_KEYS) + "; vLLM's (level, mode, backend, ...; -O3 is "
                           "level 3) are accepted and do nothing; any other key is an error.", None),
    "compilation_cache_dir": ("DeviceConfig", "Persistent compilation cache folder.", None),
    "warmup": ("DeviceConfig", "Step shapes to compile (jax) / capture (torch, CUDA graphs) before serving: all "
               "(the default of `serve`), decode (pure-decode steps only), none (compile on first use), auto "
               "(all on TPU and for `serve`, none offline).", ("auto", "all", "decode", "none")),
    "min_token_bucket": ("DeviceConfig", "Smallest padded token count of a step, a power of two (default 16 on "
                         "TPU/GPU, 1 on CPU).", None),
    "min_seq_bucket": ("DeviceConfig", "Smallest padded request count of a step, a power of two (default 8 on "
                       "TPU/GPU, 1 on CPU).", None),
    "topology": ("DeviceConfig", "TPU slice, e.g. v5e:2x2, v6e:2x4, v5p:2x2x1. `xlaserve warmup --topology` compiles "
                 "every program for it on any host, no TPU needed (libtpu); `serve` checks the attached chips "
                 "match it.", None),
    "structured_outputs_config": ("StructuredOutputsConfig", "Structured outputs as JSON, e.g. '{\"backend\": "
                                  "\"guidance\", \"disable_any_whitespace\": true}': backend auto|guidance "
                                  "(llguidance), disable_any_whitespace, disable_additional_properties, "
                                  "disable_fallback; also --structured-outputs-config.backend guidance.", None),
}

_INT_SUFFIX = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*$")


def human_int(value: str) -> int:
    """'512', '1k' (1000), '1K' (1024), '2G', '4GiB' -> int, as vLLM parses sizes."""
    m = _INT_SUFFIX.match(str(value))
    if not m:
        raise argparse.ArgumentTypeError(f"expected an integer (with an optional k/K/M/G suffix), got {value!r}")
    num, unit, binary = m.groups()
    if not unit:
        if "." in num:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}")
        return int(num)
    power = "kmgt".index(unit.lower()) + 1
    base = 1024 if (unit.isupper() or binary and binary.lower() == "ib") else 1000
    return int(float(num) * base**power)


def json_value(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {value!r} ({e})") from None


def _json_or_list(value: str):
    """CORS lists: vLLM takes JSON ('["*"]'); a comma-separated list is accepted too."""
    try:
        out = json.loads(value)
    except json.JSONDecodeError:
        out = [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(out, str):
        out = [out]
    if not isinstance(out, list):
        raise argparse.ArgumentTypeError(f"expected a JSON list, got {value!r}")
    return out


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_HUMAN_INT_FIELDS = {"max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes", "num_gpu_blocks_override"}


def engine_field_types() -> dict[str, object]:
    return typing.get_type_hints(EngineArgs)


def json_flag_dests() -> set[str]:
    """Destinations of the flags whose value is a JSON object (they take the dotted form)."""
    hints = engine_field_types()
    return {n for n, t in hints.items() if dict in _type_members(t)}


def _type_members(t) -> set:
    args = typing.get_args(t)
    return {typing.get_origin(a) or a for a in args} if args else {typing.get_origin(t) or t}


def add_engine_args(parser: argparse.ArgumentParser) -> dict[str, argparse._ArgumentGroup]:
    groups = {g: parser.add_argument_group(g, f"EngineArgs: {g}") for g in ENGINE_GROUPS}
    hints = engine_field_types()
    for f in dataclasses.fields(EngineArgs):
        group_name, help_text, choices = ENGINE_FLAG_DOCS.get(f.name, ("ModelConfig", f"EngineArgs.{f.name}.", None))
        g = groups[group_name]
        members = _type_members(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        kw: dict = dict(dest=f.name, default=default, help=help_text + " (default: %(default)s)")
        if bool in members:
            g.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, **kw)
            continue
        if f.name == "served_model_name":
            g.add_argument(_flag(f.name), nargs="+", **kw)
            continue
        if dict in members:
            kw["type"] = json_value
            kw["metavar"] = "JSON"
        elif f.name in _HUMAN_INT_FIELDS:
            kw["type"] = human_int
        elif int in members:
            kw["type"] = int
        elif float in members:
            kw["type"] = float
        if choices:
            kw["choices"] = choices
            if all(isinstance(c, int) for c in choices):
                kw["type"] = int
        g.add_argument(_flag(f.name), *(["-q"] if f.name == "quantization" else []), **kw)  # vLLM's -q
    return groups


def add_frontend_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = parser.add_argument_group("Frontend", "The OpenAI-compatible HTTP server.")
    a = g.add_argument
    a("--host", default="127.0.0.1", help="Host to bind (default: %(default)s).")
    a("--port", type=int, default=8000, help="Port to bind (default: %(default)s).")
    a("--uds", default=None, help="Serve on this Unix domain socket instead of host:port.")
    a("--root-path", default="", help="ASGI root_path, when behind a path-based proxy.")
    a("--allowed-origins", type=_json_or_list, default=["*"], help="CORS origins (JSON list).")
    a("--allowed-methods", type=_json_or_list, default=["*"], help="CORS methods (JSON list).")
    a("--allowed-headers", type=_json_or_list, default=["*"], help="CORS headers (JSON list).")
    a("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    a("--api-key", action="append", default=None,
      help="Require `Authorization: Bearer KEY` on /v1/* (repeatable; also VLLM_API_KEY).")
    a("--ssl-keyfile", default=None, help="TLS private key file.")
    a("--ssl-certfile", default=None, help="TLS certificate file.")
    a("--ssl-ca-certs", default=None, help="CA certificates file (client verification).")
    a("--ssl-cert-reqs", type=int, default=0, help="ssl.CERT_* value for client certificates (default 0: none).")
    a("--disable-uvicorn-access-log", action="store_true", help="No per-request access log lines.")
    a("--uvicorn-log-level", default="info", choices=["debug", "info", "warning", "error", "critical", "trace"],
      help="uvicorn's log level (default: %(default)s).")
    a("--enable-request-id-headers", action="store_true",
      help="Add X-Request-Id to responses (the client's X-Request-Id, or a generated one).")
    a("--disable-fastapi-docs", action="store_true", help="No /docs, /redoc and /openapi.json.")
    a("--max-log-len", type=int, default=None, help="Truncate prompts in request logs to this many characters / ids.")
    a("--enable-log-requests", action="store_true", help="Log each request (prompt and sampling parameters).")
    a("--disable-log-requests", action="store_true",
      help="Do not log requests (the default; kept for vLLM command lines).")
    a("--disable-log-stats", action="store_true",
      help="No periodic stats line (throughput, running/waiting, KV usage, prefix-cache hit rate).")
    a("--chat-template", default=None, help="Chat template: a file, or the template itself (inline Jinja).")
    a("--chat-template-content-format", default="auto", choices=["auto", "string", "openai"],
      help="How message content reaches the template: 'string' (parts joined) or 'openai' (list of parts); "
           "auto detects it from the template.")
    a("--trust-request-chat-template", action="store_true",
      help="Allow requests to carry their own chat_template.")
    a("--response-role", default="assistant", help="Role of generated chat messages (default: %(default)s).")
    a("--enable-auto-tool-choice", action="store_true",
      help='Allow tool_choice "auto" (the default when a request has tools): the model decides, and '
           "--tool-call-parser finds its calls in the text.")
    a("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
      help="How the model writes tool calls: hermes (<tool_call>{json}</tool_call>: Hermes, Qwen2.5, Qwen3), "
           "llama3_json (Llama 3.x JSON), mistral ([TOOL_CALLS]), qwen3_xml / qwen3_coder (Qwen3-Coder XML).")
    a("--exclude-tools-when-tool-choice-none", action="store_true",
      help='With tool_choice "none", do not show the tools to the chat template either.')
    a("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
      help="Split <think>...</think> into the answer's `reasoning` / `reasoning_content` (deepseek_r1, qwen3); "
           "structured outputs and enforced tool choices then apply after the reasoning.")
    a("--disable-frontend-multiprocessing", action="store_true",
      help="Run the engine core in the API process (a thread) instead of its own process.")
    a("--enable-server-load-tracking", action="store_true", help="Count in-flight requests, reported by GET /load.")
    a("--max-request-body-bytes", type=human_int, default=16 * 2**20,
      help="Largest request body; larger ones get HTTP 413 (default: %(default)s bytes).")
    a("--enable-prompt-tokens-details", action="store_true",
      help="Report usage.prompt_tokens_details.cached_tokens (prefix-cache hits).")
    a("--enable-force-include-usage", action="store_true", help="Always send usage in streams.")
    a("--return-tokens-as-token-ids", action="store_true",
      help="Logprob tokens as 'token_id:N' instead of text.")
    a("--shutdown-timeout", type=float, default=5.0,
      help="On SIGTERM/SIGINT: seconds in-flight requests may finish before they are aborted (default: %(default)s).")
    a("--headless", action="store_true",
      help="Serve no HTTP: this host runs its share of the engine (--node-rank > 0 of --nnodes, or the engine cores "
           "of --data-parallel-size-local that connect to --data-parallel-address) until node 0 stops.")
    a("--api-server-count", type=int, default=1,
      help="API server processes in front of the engine cores (default: %(default)s).")
    a("--h11-max-incomplete-event-size", type=int, default=None, help="uvicorn h11 limit on header bytes.")
    return g


def build_serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds every `serve` flag to `parser` (also used by `warmup` and `run-batch`)."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="Model (same as --model): a Hugging Face folder or .gguf file; default: embedded SmolLM2.")
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="Read flags from a YAML file (keys are flag names); the command line wins.")
    add_engine_args(parser)
    add_frontend_args(parser)
    add_compat_flags(parser)
    return parser


# ---- argv preprocessing: --config, dotted JSON flags, -O ----------------------------


def _parse_scalar(v: str):
    try:
        return json.loads(v)
    except json.JSONDecodeError:
        return v


def _set_path(d: dict, path: list[str], value) -> None:
    for k in path[:-1]:
        d = d.setdefault(k, {})
        if not isinstance(d, dict):
            raise ValueError(f"{'.'.join(path)}: {k} is not an object")
    d[path[-1]] = value


def expand_optimization_flag(argv: list[str]) -> list[str]:
    """-O3 -> --compilation-config.level 3;  -O 3 / -O '{...}' / -O.level 3 -> the long forms."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            out.extend(argv[i:])
            break
        if re.fullmatch(r"-O\d+", a):
            out += ["--compilation-config.level", a[2:]]
        elif a == "-O" and i + 1 < len(argv):
            v = argv[i + 1]
            out += (["--compilation-config.level", v] if v.isdigit() else ["--compilation-config", v])
            i += 1
        elif a.startswith("-O."):
            out.append("--compilation-config." + a[3:])
        else:
            out.append(a)
        i += 1
    return out


def collect_dotted_json_flags(argv: list[str], json_flags: set[str]) -> tuple[list[str], dict[str, dict]]:
    """Pull `--x.y[.z] value` / `--x.y=value` out of argv; returns the rest and {dest: nested dict}."""
    rest: list[str] = []
    dotted: dict[str, dict] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            rest.extend(argv[i:])
            break
        m = re.fullmatch(r"--([A-Za-z0-9_-]+)\.([A-Za-z0-9_.-]+)(?:=(.*))?", a, flags=re.S)
        if not m:
            rest.append(a)
            i += 1
            continue
        dest = m.group(1).replace("-", "_")
        if dest not in json_flags:
            raise ValueError(f"{a}: the dotted form --flag.key is only for JSON flags "
                             f"({', '.join(_flag(d) for d in sorted(json_flags))})")
        if m.group(3) is not None:
            value = m.group(3)
        else:
            if i + 1 >= len(argv):
                raise ValueError(f"{a}: expected a value")
            value = argv[i + 1]
            i += 1
        _set_path(dotted.setdefault(dest, {}), m.group(2).split("."), _parse_scalar(value))
        i += 1
    return rest, dotted


def yaml_config_to_argv(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """A YAML mapping of flag names to values -> argv tokens (to go before the real command line)."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    known = {s: act for act in parser._actions for s in act.option_strings}
    out: list[str] = []
    for key, value in data.items():
        name = "--" + str(key).replace("_", "-")
        if key in ("model", "model_tag"):
            name = "--model"
        if name == "--config":
            raise ValueError(f"--config {path}: a config file cannot name another config file")
        act = known.get(name)
        if act is None:
            raise ValueError(f"--config {path}: unknown flag {key!r} ({name})")
        if isinstance(act, argparse.BooleanOptionalAction):
            out.append(name if value else "--no-" + name[2:])
        elif act.nargs == 0:
            if value:
                out.append(name)
        elif isinstance(value, dict):
            out += [name, json.dumps(value)]
        elif isinstance(value, list):
            if act.nargs in ("+", "*"):
                out += [name] + [str(v) for v in value]
            elif act.type is _json_or_list:
                out += [name, json.dumps(value)]
            else:
                for v in value:  # action="append"
                    out += [name, str(v)]
        elif value is None:
            continue
        else:
            out += [name, str(value)]
    return out


def _find_config_path(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return None


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def parse_serve_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Full pipeline: --help=, -O, dotted JSON, --config YAML, argparse, vLLM-compat checks, model tag."""
    for a in argv:
        if a.startswith("--help="):
            print_partial_help(parser, a.split("=", 1)[1])
            raise SystemExit(0)
    try:
        argv = expand_optimization_flag(list(argv))
        config_path = _find_config_path(argv)
        if config_path:
            argv = yaml_config_to_argv(config_path, parser) + argv
        argv, dotted = collect_dotted_json_flags(argv, json_flag_dests())
    except ValueError as e:
        parser.error(str(e))
    ns = parser.parse_args(argv)
    for dest, extra in dotted.items():
        cur = getattr(ns, dest) or {}
        if not isinstance(cur, dict):
            parser.error(f"{_flag(dest)} must be a JSON object to merge {_flag(dest)}.KEY values into")
        setattr(ns, dest, _deep_merge(cur, extra))
    errors = check_compat_flags(ns)
    if errors:
        parser.error("\n".join(errors))
    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            parser.error(f"the model is given twice: positional {ns.model_tag!r} and --model {ns.model!r}")
        ns.model = ns.model_tag
    return ns


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    kwargs = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(ns, f.name)}
    return EngineArgs(**kwargs)


def serving_engine_args(ns: argparse.Namespace) -> EngineArgs:
    """The engine arguments of `serve`, and of `warmup`, which compiles what serve will run: the flags, then the
    server's own defaults (`EngineArgs.apply_serving_defaults`). `run-batch` keeps the offline ones."""
    args = engine_args_from_namespace(ns)
    args.apply_serving_defaults()
    return args


# ---- --help=<group|flag|keyword> ------------------------------------------------------


def print_partial_help(parser: argparse.ArgumentParser, what: str, file=None) -> None:
    file = file or sys.stdout
    groups = {g.title: g for g in parser._action_groups if g.title in ALL_GROUPS}
    key = what.strip()
    if key.lower() in ("listgroup", "list", "groups"):
        print("Argument groups (use --help=<group>):", file=file)
        for title in ALL_GROUPS:
            if title in groups:
                print(f"  {title}", file=file)
        return

    def emit(title: str, description: str | None, actions) -> None:
        fmt = parser._get_formatter()
        fmt.start_section(title)
        if description:
            fmt.add_text(description)
        fmt.add_arguments(actions)
        fmt.end_section()
        print(fmt.format_help(), file=file, end="")

    for title, g in groups.items():
        if title.lower() == key.lower():
            emit(title, g.description, g._group_actions)
            return
    flag = "--" + key.lstrip("-")
    for act in parser._actions:
        if flag in act.option_strings:
            emit(f"Flag {flag}", None, [act])
            return
    needle = key.lower().lstrip("-").replace("_", "-")
    hits = [act for act in parser._actions if any(needle in s for s in act.option_strings)]
    if hits:
        emit(f"Flags matching {key!r}", None, hits)
        return
    print(f"No group or flag matches {key!r}. Groups: {', '.join(ALL_GROUPS)} "
          "(or --help=listgroup).", file=file)
