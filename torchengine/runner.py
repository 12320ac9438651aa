"""TorchModelRunner: the torch backend's `enginecore.runner.ModelRunner`.

One step: `InputBatch.update(so)` -> `prepare(so)` (a padded ragged
`StepBatch`, numpy) -> device tensors (pinned, non-blocking on CUDA) ->
forward (a captured CUDA graph for pure-decode buckets on CUDA, eager
otherwise) -> logits only at the last scheduled token of each request (and at
prompt positions for prompt logprobs) -> sampler -> one copy of the results to
the host -> `make_runner_output`.

Devices: `--platform cpu` runs float32 with the plain-torch attention;
`--platform cuda` runs bfloat16 with the Triton kernels and CUDA graphs
(`--enforce-eager` turns them off). `--tensor-parallel-size N` runs one
process per rank (`torchengine.distributed`): this runner is rank 0 and
forwards every call to the other ranks, which run the same steps and skip
sampling.
"""

from __future__ import annotations

import gc
import logging
import os
import time

import numpy as np
import torch

from enginecore.batch import InputBatch, StepBatch, make_runner_output, prompt_logprobs_np
from enginecore.config import ConfigError, EngineConfig
from enginecore.model_loader import ModelSource
from enginecore.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from enginecore.sampling_params import SamplingParams
from torchengine.attention import AttentionMetadata, PagedAttention, make_attention_backend
from torchengine.model import ModelArgs, build_model, load_weights
from torchengine.sampler import SamplingTensors, log_softmax, sample

logger = logging.getLogger("xlaserve.torchengine")

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30
PROMPT_LOGPROBS_ROWS = 256
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`--dtype auto`: float32 on the CPU, bfloat16 on CUDA (float16 before Ampere, as vLLM does)."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
    return _DTYPES[name]


def cpu_threads(tp_size: int = 1) -> int:
    """OMP_NUM_THREADS if set, else the cores this process may use, split between local ranks."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    n = int(env) if env.isdigit() and int(env) > 0 else len(os.sched_getaffinity(0))
    return max(1, n // tp_size)


class HostToDevice:
    """numpy -> device tensors. On CUDA through pinned buffers reused every step, copied non-blocking.

    A pinned buffer is rewritten only after the copy that last read it has
    finished (a CUDA event per buffer), so ranks that never read results back
    cannot race their own copies.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._pinned: dict[str, torch.Tensor] = {}
        self._copied: dict[str, torch.cuda.Event] = {}

    def __call__(self, name: str, arr: np.ndarray, dtype: torch.dtype | None = None) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(arr))
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        if self.device.type == "cpu":
            return t
        buf = self._pinned.get(name)
        if name in self._copied:
            self._copied.pop(name).synchronize()
        if buf is None or buf.numel() < t.numel() or buf.dtype != t.dtype:
            buf = torch.empty(max(t.numel(), 1), dtype=t.dtype, pin_memory=True)
            self._pinned[name] = buf
        staged = buf[: t.numel()].view(t.shape)
        staged.copy_(t)
        out = staged.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[name] = event
        return out


class TorchModelRunner:
    """Owns the torch model, the paged KV cache (one [NB, BS, Hkv, D] pair per layer) and the input batch."""

    def __init__(self, config: EngineConfig, model: ModelSource, rank: int = 0, init_method: str | None = None):
        self.config = config
        self.model_source = model
        mc, cc, sc, pc, dc = (config.model_config, config.cache_config, config.scheduler_config,
                              config.parallel_config, config.device_config)
        self.rank, self.tp_size = rank, pc.tensor_parallel_size
        if pc.data_parallel_size != 1:
            raise ConfigError(f"--data-parallel-size {pc.data_parallel_size} is not supported by the torch backend; "
                              "run one server per replica")
        self._init_method = init_method
        if dc.platform == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("--platform cuda: torch sees no CUDA device (is this a CPU build of torch?)")
            if self.tp_size > torch.cuda.device_count():
                raise ConfigError(f"--tensor-parallel-size {self.tp_size} needs {self.tp_size} GPUs; "
                                  f"torch sees {torch.cuda.device_count()}")
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        elif dc.platform == "cpu":
            self.device = torch.device("cpu")
            torch.set_num_threads(cpu_threads(self.tp_size))
        else:
            raise ConfigError(f"--backend torch does not run on --platform {dc.platform}")
        self.dtype = resolve_dtype(mc.canonical_dtype, self.device)
        self.kv_dtype = self.dtype if cc.kv_cache_dtype == "auto" else _DTYPES[cc.kv_cache_dtype]
        self.args = ModelArgs.from_arch(model.config)
        if self.args.n_kv_heads % self.tp_size or self.args.n_heads % self.tp_size:
            raise ConfigError(
                f"--tensor-parallel-size {self.tp_size} must divide the model's attention heads "
                f"({self.args.n_heads}) and KV heads ({self.args.n_kv_heads})"
            )
        self.block_size = cc.block_size
        self.max_model_len = sc.max_model_len
        self.input_batch = self._new_input_batch()
        self.to_device = HostToDevice(self.device)
        self.attn_backend = make_attention_backend(
            dc.attention_backend, self.device,
            num_heads=self.args.n_heads // self.tp_size, num_kv_heads=self.args.n_kv_heads // self.tp_size,
            head_dim=self.args.head_dim, sliding_window=self.args.sliding_window,
        )
        if self.attn_backend.name == "triton" and self.kv_dtype != self.dtype:
            raise ConfigError(f"--kv-cache-dtype {cc.kv_cache_dtype} must equal the model dtype with the triton attention")
        self.model = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.cuda_graphs = None  # torchengine.cuda_graph.CUDAGraphs once captured
        self.tp = None  # torchengine.distributed.TPGroup when tp_size > 1

    def _new_input_batch(self) -> InputBatch:
        mc, cc, sc = self.config.model_config, self.config.cache_config, self.config.scheduler_config
        return InputBatch(sc.max_num_seqs, sc.max_model_len, sc.max_num_batched_tokens, cc.block_size,
                          self.args.vocab_size, mc.max_logprobs)

    # -- the protocol (rank 0 forwards each call to the other ranks) -------------------

    def load_model(self) -> None:
        if self.tp_size > 1:
            from torchengine.distributed import TPGroup

            self.tp = TPGroup.create(self.config, self.rank, self.device, self._init_method)
        t0 = time.perf_counter()
        with torch.inference_mode():
            # with TP the model is sharded while still on the meta device: each rank allocates and reads its share only
            tp = (self.rank, self.tp_size, self.tp.group) if self.tp is not None else None
            model = build_model(self.args, self.max_model_len, self.device, self.dtype, tp=tp)
            load_weights(model, self.model_source.iter_weights())
        self.model = model
        logger.info("rank %d: loaded %s (%s) on %s in %.1fs", self.rank, self.model_source.name, self.dtype,
                    self.device, time.perf_counter() - t0)

    def determine_num_blocks(self) -> int:
        return self._call_all("determine_num_blocks")

    def init_kv_cache(self, num_blocks: int) -> None:
        self._call_all("init_kv_cache", num_blocks)

    def warmup(self) -> dict:
        return self._call_all("warmup")

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call_all("execute", scheduler_output)

    def shutdown(self) -> None:
        """Release the graphs, the model and the cache, then stop the other ranks.

        The graphs go first: they hold the captured all-reduces, and NCCL (>= 2.26) waits for every graph
        using a communicator to be destroyed before it destroys the communicator.
        """
        self.cuda_graphs, self.kv_caches, self.model = None, [], None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        if self.tp is not None:
            self.tp.shutdown(self.rank)
            self.tp = None

    def _call_all(self, name: str, *args):
        if self.tp is not None and self.rank == 0:
            self.tp.broadcast((name, args))
        return getattr(self, "_" + name)(*args)

    def serve_rank(self) -> None:
        """Ranks > 0: run rank 0's calls until it shuts down."""
        while True:
            name, args = self.tp.broadcast(None)
            if name == "shutdown":
                self.shutdown()
                return
            getattr(self, "_" + name)(*args)

    # -- KV cache ------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        per_token = 2 * self.args.n_layers * (self.args.n_kv_heads // self.tp_size) * self.args.head_dim
        return per_token * self.block_size * torch.empty(0, dtype=self.kv_dtype).element_size()

    def _determine_num_blocks(self) -> int:
        cc = self.config.cache_config
        if cc.kv_cache_memory_bytes is not None:
            budget, what = cc.kv_cache_memory_bytes, f"--kv-cache-memory-bytes {cc.kv_cache_memory_bytes}"
        elif self.device.type == "cuda":
            budget = self._profile_kv_budget()
            what = f"--gpu-memory-utilization {cc.gpu_memory_utilization} (KV budget {budget / 2**30:.2f} GiB)"
        else:
            budget, what = DEFAULT_CPU_KV_CACHE_BYTES, "the default CPU KV cache of 1 GiB"
        num_blocks = int(budget // self.kv_bytes_per_block())
        if self.tp is not None:
            num_blocks = self.tp.min_over_ranks(num_blocks)
        if num_blocks < 2:
            raise ConfigError(f"{what} leaves room for {num_blocks} KV blocks of {self.kv_bytes_per_block()} bytes; "
                              "at least 2 are needed")
        return num_blocks

    def _profile_kv_budget(self) -> int:
        """CUDA: memory left for the KV cache after weights and the peak of a max-size step."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        # every dummy request reads and writes the null block: one block per layer is enough
        self._allocate_kv_cache(1)
        for batch in self._profile_batches():
            self._run_batch(batch)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)  # context, NCCL, other processes
        budget = int(total * self.config.cache_config.gpu_memory_utilization) - peak - non_torch
        logger.info("rank %d: %.2f GiB total, peak %.2f GiB, non-torch %.2f GiB -> KV cache %.2f GiB", self.rank,
                    total / 2**30, peak / 2**30, non_torch / 2**30, budget / 2**30)
        return max(budget, 0)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.args.n_kv_heads // self.tp_size, self.args.head_dim)
        # one allocation for all layers; zeroed so masked-out slots never hold NaN
        cache = torch.zeros((self.args.n_layers, 2, *shape), dtype=self.kv_dtype, device=self.device)
        self.kv_caches = [(cache[i, 0], cache[i, 1]) for i in range(self.args.n_layers)]

    def _init_kv_cache(self, num_blocks: int) -> None:
        self._allocate_kv_cache(num_blocks)
        self.num_blocks = num_blocks

    # -- warmup and CUDA graphs -------------------------------------------------------------

    def _warmup(self) -> dict:
        t0 = time.perf_counter()
        sc, dc = self.config.scheduler_config, self.config.device_config
        stats: dict = {"attention_backend": self.attn_backend.name, "dtype": str(self.dtype).replace("torch.", "")}
        if self.device.type == "cuda":
            # compile the Triton configurations (q block rows, kv splits) of every prefill token bucket and
            # every decode request bucket before serving; eager (--enforce-eager) decode steps use them too
            for tokens in self.input_batch.token_buckets:
                self._run_batch(self._dummy_batch(1, min(tokens, self.max_model_len - 1)))
            for reqs in self.input_batch.req_buckets:
                self._run_batch(self._dummy_batch(min(reqs, sc.max_num_batched_tokens), 1))
            use_graphs = not dc.enforce_eager and self.attn_backend.supports_cuda_graphs
            if use_graphs:
                from torchengine.cuda_graph import CUDAGraphs, capture_pairs

                unknown = set(dc.compilation_config) - {"cudagraph_capture_sizes"}
                if unknown:
                    logger.warning("compilation_config keys ignored by the torch backend: %s", sorted(unknown))
                sizes = dc.compilation_config.get("cudagraph_capture_sizes")
                pairs = capture_pairs(self.input_batch, sizes)
                self.cuda_graphs = CUDAGraphs(self.model, self.attn_backend, self.kv_caches, self.input_batch,
                                              pairs, self.device)
                stats["cuda_graphs"] = self.cuda_graphs.capture()
        else:
            self._run_batch(self._dummy_batch(min(8, sc.max_num_seqs), 1))
            self._run_batch(self._dummy_batch(1, min(16, self.max_model_len - 1, sc.max_num_batched_tokens)))
        stats["warmup_s"] = round(time.perf_counter() - t0, 3)
        return stats

    def _dummy_batch(self, num_reqs: int, q_len: int, params: SamplingParams | None = None) -> StepBatch:
        """A step of `num_reqs` fresh requests of `q_len` tokens, all in the null block."""
        ib = self._new_input_batch()
        params = params or SamplingParams(temperature=0.0)
        nb = -(-q_len // self.block_size)
        news = [NewRequestData(f"dummy-{i}", [0] * q_len, params, [0] * nb, 0, [], i, 0) for i in range(num_reqs)]
        so = SchedulerOutput(news, [], {n.req_id: q_len for n in news}, num_reqs * q_len, set(), set())
        ib.update(so)
        return ib.prepare(so)

    def _profile_batches(self) -> list[StepBatch]:
        sc = self.config.scheduler_config
        longest = min(sc.max_num_batched_tokens, self.max_model_len - 1)
        widest = min(sc.max_num_seqs, sc.max_num_batched_tokens)
        heavy = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, presence_penalty=0.1, logprobs=1)
        return [self._dummy_batch(1, longest), self._dummy_batch(widest, 1, heavy)]

    # -- one step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        self.input_batch.update(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        return self._run_batch(self.input_batch.prepare(so))

    @torch.inference_mode()
    def _run_batch(self, batch: StepBatch) -> ModelRunnerOutput | None:
        T, R = batch.num_tokens, batch.num_reqs
        put = self.to_device
        input_ids = put("input_ids", batch.input_ids, torch.int64)  # [Tp]
        positions = put("positions", batch.positions, torch.int64)  # [Tp]
        logits_indices = put("logits_indices", batch.logits_indices, torch.int64)  # [Rp]
        meta = AttentionMetadata(
            slot_mapping=put("slot_mapping", batch.slot_mapping, torch.int64),
            cu_q_lens=put("cu_q_lens", batch.cu_q_lens),
            kv_lens=put("kv_lens", batch.kv_lens),
            block_tables=put("block_tables", batch.block_tables),
            num_reqs=R,
            num_tokens=T,
        )
        hidden = None
        if self.cuda_graphs is not None and not batch.prompt_logprobs and self.cuda_graphs.can_replay(batch):
            logits = self.cuda_graphs.replay(batch, input_ids, positions, logits_indices, meta)[:R]
        else:
            # eager: padding buys nothing, run the T real tokens only (the kernels read cu_q_lens for the rest)
            meta.slot_mapping = meta.slot_mapping[:T]
            meta.groups = self.attn_backend.plan(batch, self.device, self.block_size)
            attn = PagedAttention(self.attn_backend, self.kv_caches, meta)
            hidden = self.model(input_ids[:T], positions[:T], attn)  # [T, dim]
            logits = self.model.compute_logits(hidden[logits_indices[:R]])  # [R, V]
        if self.rank != 0:
            return None  # other ranks only take part in the collectives
        st = SamplingTensors.from_batch(batch.sampling, self.device, lambda name, a: put("sampling." + name, a), R)
        out = sample(logits, st)
        # the copy back to the host (waits for the step)
        host = lambda t: None if t is None else t.cpu().numpy()  # noqa: E731
        plp = {sl.req_id: self._prompt_logprobs(hidden, sl) for sl in batch.prompt_logprobs}
        return make_runner_output(
            batch, host(out.sampled), host(out.topk_ids), host(out.topk_logprobs), host(out.sampled_logprobs),
            host(out.sampled_ranks), prompt_logprobs=plp,
        )

    def _prompt_logprobs(self, hidden: torch.Tensor, sl) -> tuple[np.ndarray, ...]:
        """One request's prompt logprobs, PROMPT_LOGPROBS_ROWS positions at a time: a long prompt's full
        [positions, vocab] float32 matrix (8k x 128k: 4 GiB) is never materialised, which the memory profile
        does not account for."""
        parts = []
        for s in range(0, sl.num_tokens, PROMPT_LOGPROBS_ROWS):
            e = min(s + PROMPT_LOGPROBS_ROWS, sl.num_tokens)
            rows = hidden[sl.token_start + s : sl.token_start + e]
            lp = log_softmax(self.model.compute_logits(rows)).cpu().numpy()
            parts.append(prompt_logprobs_np(lp, sl.target_ids[s:e], sl.num_logprobs))
        return tuple(np.concatenate(x) for x in zip(*parts))
