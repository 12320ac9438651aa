"""TorchModelRunner: the torch backend's `enginecore.runner.ModelRunner`.

One step: `InputBatch.update(so)` -> `prepare_step` (a padded ragged
`StepBatch`, numpy) -> `to_device` (pinned, non-blocking copies on CUDA; the
slot of every token is derived here) -> forward (a captured CUDA graph for
pure-decode buckets on CUDA, eager otherwise) -> logits only at the last
scheduled token of each request -> sampler -> the sampled tokens into
`last_tokens` on the device (the next step reads its newest tokens from
there) -> one copy of the results to the host, collected by the handle's
`result()` -> `finish_step`. On CUDA the copy is asynchronous, so the engine
builds the next step while this one runs. On a CPU, where the one-call C
layers run the model (float32 kernels, one rank, no q/k norms:
`cpu_layers.DecodeLayers.bind`), a decode step (each token its request's
only query) skips the device batch: numpy straight into those layers and,
for plain greedy rows, the LM head's argmax (`_decode_on_cpu`; at batch 1 a
step is mostly such glue).

Devices: `--platform cpu` runs float32 with the plain-torch attention;
`--platform cuda` runs bfloat16 with the Triton kernels and CUDA graphs
(`--enforce-eager` turns them off). `--tensor-parallel-size N` runs one
process per rank, each a `TorchModelRunner` in one `torchengine.distributed`
group (`placement`: its rank, its device, the rendezvous); `torchengine.tp_runner` starts them and
is rank 0's view of them; every rank runs the same steps (sampling included,
so each keeps its own copy of the tokens) and rank 0 returns the outputs.
"""

from __future__ import annotations

import functools
import gc
import logging
import os
import threading
import time

import numpy as np
import torch

from cpu_kernels import layout as qx
from enginecore.buckets import Buckets
from enginecore.config import ConfigError, EngineConfig
from enginecore.input_batch import InputBatch
from enginecore.kv_cache import check_cpu_kv_fits, kv_blocks_for
from enginecore.model_loader import ModelSource
from cpu_kernels.memory import describe_huge_pages, huge_page_array, populate_in_background, release_free_heap
from enginecore.outputs import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from enginecore.platform import CPU_WEIGHTS_FIRST_ROWS, cpu_dtype_note, resolve_dtype
from enginecore.runner_output import DoneStep, PendingStep, PromptLogprobs, SampledLogprobs, empty_output, \
    finish_step
from enginecore.sampling_batch import filled
from enginecore.sampling_params import SamplingParams
from enginecore.step_batch import StepBatch, begin_step, prepare_step
from cpu_kernels import torch_ops
from torchengine.attention import AttentionMetadata, DecodeGroup, PagedAttention, PrefillGroup, make_attention_backend
from torchengine.cpu_layers import DecodeLayers
from torchengine.distributed import RankPlacement, TPGroup
from torchengine.model import build_model, load_weights
from torchengine.sampler import SamplerOutput, SamplingTensors, log_softmax, sample, sample_in_chunks, top_n
from torchengine.tensor_parallel import apply_tensor_parallel

logger = logging.getLogger("xlaserve.torchengine")

PROMPT_LOGPROBS_ROWS = 256
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    """One rank: the torch model, the paged KV cache (one [NB, BS, Hkv, D] pair per layer), the input batch."""

    def __init__(self, config: EngineConfig, model: ModelSource, placement: RankPlacement | None = None):
        self.config = config
        self.model_source = model
        mc, cc, sc, pc, dc = (config.model_config, config.cache_config, config.scheduler_config,
                              config.parallel_config, config.device_config)
        self.rank, self.tp_size = (placement.rank if placement else 0), pc.tensor_parallel_size
        local_rank, local_size = (placement.local_rank, placement.local_size) if placement else (0, 1)
        self.placement = placement  # where this rank runs in the group; None: one rank
        capability = None
        if dc.platform == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("--platform cuda: torch sees no CUDA device (is this a CPU build of torch?)")
            if local_size > torch.cuda.device_count():
                raise ConfigError(f"--tensor-parallel-size {self.tp_size} / --nnodes {pc.nnodes} needs {local_size} "
                                  f"GPUs on each node; torch sees {torch.cuda.device_count()}")
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
            capability = torch.cuda.get_device_capability(self.device)
        elif dc.platform == "cpu":
            self.device = torch.device("cpu")
            torch.set_num_threads(cpu_threads(local_size))
        else:
            raise ConfigError(f"--backend torch does not run on --platform {dc.platform}")
        dtype = resolve_dtype(mc.dtype, dc.platform, capability)
        self.dtype = _DTYPES[dtype]
        self.kv_dtype = self.dtype if cc.kv_cache_dtype == "auto" else _DTYPES[cc.kv_cache_dtype]
        # --dtype bfloat16 on a CPU with AVX512-BF16: the float32 model with its linears and LM head in bfloat16
        # (QX_BDOT: `apply_cpu_kernels(bdot=True)`); compute_dtype is the activations' (float32 then)
        self.bdot = mc.quantization is None and qx.bdot_runs(torch_ops.lib, model.config, dc.platform, dtype,
                                                             self.tp_size)
        self.compute_dtype = torch.float32 if self.bdot else self.dtype
        if dc.platform == "cpu" and not self.bdot and (note := cpu_dtype_note(dtype)):
            logger.warning(note)
        self.arch = model.config
        heads, kv_heads = self.arch.num_attention_heads, self.arch.num_key_value_heads
        if kv_heads % self.tp_size or heads % self.tp_size:
            raise ConfigError(f"--tensor-parallel-size {self.tp_size} must divide the model's attention heads "
                              f"({heads}) and KV heads ({kv_heads})")
        self.block_size = cc.block_size
        self.max_model_len = sc.max_model_len
        self.buckets = Buckets.create(sc.max_num_batched_tokens, sc.max_num_seqs, *dc.bucket_minimums)
        self.input_batch = self._new_input_batch()
        self.to_device = HostToDevice(self.device)
        self.attn_backend = make_attention_backend(
            dc.attention_backend, self.device, self.kv_dtype, num_heads=heads // self.tp_size,
            num_kv_heads=kv_heads // self.tp_size, head_dim=self.arch.head_dim,
            sliding_window=self.arch.sliding_window,
        )
        if self.attn_backend.name == "triton" and self.kv_dtype != self.dtype:
            raise ConfigError(f"--kv-cache-dtype {cc.kv_cache_dtype} must equal the model dtype with the triton attention")
        self.model = None
        # torchengine.cpu_transform's one buffer of every weight's panels, None where it packed none
        self.cpu_arena: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.last_tokens = torch.zeros(sc.max_num_seqs + 1, dtype=torch.int64, device=self.device)  # [S + 1]
        self.cuda_graphs = None  # torchengine.cuda_graph.CUDAGraphs once captured
        self.tp = None  # torchengine.distributed.TPGroup when tp_size > 1
        self._pending: PendingStep | None = None
        # (caches, model, DecodeLayers or None): the one-call decode layers bound to them
        self._decode_layers_bound: tuple | None = None
        self._kv_populate = threading.Event()  # stops the CPU KV cache's background commit (populate_in_background)
        # CPU: LM head + sampler 64 rows at a time (see sampler.sample_in_chunks)
        self.logits_chunk_rows = 64 if self.device.type == "cpu" else None

    def _new_input_batch(self) -> InputBatch:
        sc = self.config.scheduler_config
        return InputBatch(sc.max_num_seqs, sc.max_model_len, self.block_size, self.arch.vocab_size)

    # -- lifecycle --------------------------------------------------------------------------

    def load_model(self) -> None:
        if self.tp_size > 1:
            self.tp = TPGroup.create(self.config, self.placement, self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            # with TP the model is sharded while still on the meta device: each rank allocates and reads its share only
            shard = None if self.tp is None else functools.partial(
                apply_tensor_parallel, rank=self.rank, world_size=self.tp_size, group=self.tp.group,
                enable_expert_parallel=self.config.parallel_config.enable_expert_parallel)
            model = build_model(self.arch, self.max_model_len + 1, self.device, self.compute_dtype, transform=shard)
            load_weights(model, self.model_source.iter_weights())
        if self.device.type == "cpu":
            model.weights_first_rows = CPU_WEIGHTS_FIRST_ROWS
            lib, why = torch_ops.load()
            logger.info("rank %d: CPU kernels: %s", self.rank, "AVX2 (cpu_kernels/csrc)" if lib is not None
                        else f"torch's ops only ({why})")
        if self.config.model_config.quantization == "gguf":
            from torchengine.quant import quantize_gguf_linears

            n = quantize_gguf_linears(model, self.model_source)
            if n == 0:
                raise ConfigError(f"--quantization gguf: {self.model_source.path} has no Q4_0/Q4_1 linear weights "
                                  "(a .gguf file is needed; other types are dequantized without the flag)")
            logger.info("rank %d: %d linears kept 4-bit (--quantization gguf)", self.rank, n)
        if self.device.type == "cpu":
            self._apply_cpu_kernels(model)
            release_free_heap()  # (the weights packed there were freed)
        self.model = model
        logger.info("rank %d: loaded %s (%s) on %s in %.1fs", self.rank, self.model_source.name, self.dtype,
                    self.device, time.perf_counter() - t0)

    def _apply_cpu_kernels(self, model) -> None:
        """The CPU kernels' modules swapped in where they run (`torchengine.cpu_transform`), then, for a float32
        model, the weights also as stored (`torchengine.quant.attach_qx`)."""
        from torchengine.cpu_transform import apply_cpu_kernels

        packed = apply_cpu_kernels(model, bdot=self.bdot)
        self.cpu_arena, n = packed.arena, packed.packed
        if n and self.bdot:
            logger.info("rank %d: %d weights in bfloat16 (AVX512-BF16: torch_ops.qx_gemm's QX_BDOT), multiplied by "
                        "their inputs rounded to bfloat16; the rest of the model in float32: %s", self.rank, n,
                        describe_huge_pages(self.cpu_arena.numpy()))
        elif n:
            logger.info("rank %d: %d float32 weights in panels (torch_ops.panel_gemm; greedy steps take the LM "
                        "head's argmax): %s", self.rank, n, describe_huge_pages(self.cpu_arena.numpy()))
            if (self.config.model_config.quantization != "gguf" and self.dtype == torch.float32
                    and self.tp_size == 1 and qx.enabled()):
                from torchengine.quant import attach_qx

                if n := attach_qx(model, self.model_source):
                    logger.info("rank %d: %d weights also as stored (a GGUF file's blocks, 16-bit values), "
                                "the same bits, for decode steps of few rows (torch_ops.qx_gemm; XLASERVE_Q4X=off: "
                                "float32 only)", self.rank, n)

    def shutdown(self) -> None:
        """Release the graphs, the model and the cache, then leave the tensor-parallel group (if any)."""
        self.release()
        self.leave_group()

    def release(self) -> None:
        """Drop the graphs, the model and the cache; the group stays (`leave_group`).

        The graphs go first: they hold the captured all-reduces, and NCCL (>= 2.26) waits for every graph
        using a communicator to be destroyed before it destroys the communicator.
        """
        self._kv_populate.set()
        self.cuda_graphs, self.kv_caches, self.model, self._pending = None, [], None, None
        self._decode_layers_bound, self.cpu_arena = None, None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def leave_group(self) -> None:
        """Leave the tensor-parallel group (no-op without one); every rank does so at about the same time."""
        if self.tp is not None:
            self.tp.shutdown()
            self.tp = None

    # -- KV cache ---------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        itemsize = torch.empty(0, dtype=self.kv_dtype).element_size()
        return self.arch.kv_cache_bytes_per_block(self.block_size, itemsize, self.tp_size)

    def determine_num_blocks(self) -> int:
        n = kv_blocks_for(self.config, self.kv_bytes_per_block(), self.block_size,
                          self._profile_kv_budget if self.device.type == "cuda" else None)
        return self.tp.min_over_ranks(n) if self.tp is not None else n

    def _profile_kv_budget(self) -> tuple[int, str]:
        """CUDA: memory left for the KV cache after weights and the peak of a max-size step."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        # every dummy request reads and writes the null block: one block per layer is enough
        self._allocate_kv_cache(1)
        for batch in self._profile_batches():
            self._run(batch).result()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.kv_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)  # context, NCCL, other processes
        budget = int(total * self.config.cache_config.gpu_memory_utilization) - peak - non_torch
        logger.info("rank %d: %.2f GiB total, peak %.2f GiB, non-torch %.2f GiB -> KV cache %.2f GiB", self.rank,
                    total / 2**30, peak / 2**30, non_torch / 2**30, budget / 2**30)
        budget = max(budget, 0)
        util = self.config.cache_config.gpu_memory_utilization
        return budget, f"--gpu-memory-utilization {util} (KV budget {budget / 2**30:.2f} GiB)"

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.arch.num_key_value_heads // self.tp_size, self.arch.head_dim)
        # one allocation for all layers; zeroed so masked-out slots never hold NaN. On a CPU: a fresh anonymous
        # mapping, which the OS hands out zeroed page by page as steps first write it, instead of torch.zeros'
        # memset of every page at start (~0.6 s a GiB on 2 cores, mostly for blocks a small load never uses)
        full = (self.arch.num_hidden_layers, 2, *shape)
        if self.device.type == "cpu":
            nbytes = num_blocks * self.kv_bytes_per_block()
            check_cpu_kv_fits(nbytes)  # (torch.zeros would have committed it all here, or been killed for it)
            raw = huge_page_array(nbytes, np.uint8)
            cache = torch.from_numpy(raw).view(self.kv_dtype).view(full)
            self._kv_populate.set()  # (an earlier cache's)
            # its pages committed in the background, so that steps do not pay their first writes' faults
            self._kv_populate = populate_in_background(raw.ctypes.data, nbytes, owner=raw)
        else:
            cache = torch.zeros(full, dtype=self.kv_dtype, device=self.device)
        self.kv_caches = [(cache[i, 0], cache[i, 1]) for i in range(self.arch.num_hidden_layers)]

    def init_kv_cache(self, num_blocks: int) -> None:
        self._allocate_kv_cache(num_blocks)
        self.num_blocks = num_blocks

    # -- warmup and CUDA graphs -------------------------------------------------------------

    def warmup(self) -> dict:
        t0 = time.perf_counter()
        sc, dc = self.config.scheduler_config, self.config.device_config
        stats: dict = {"attention_backend": self.attn_backend.name, "dtype": str(self.dtype).replace("torch.", "")}
        level = dc.warmup_level if dc.warmup != "auto" else "all"
        if self.device.type == "cuda" and level != "none":
            # compile the Triton configurations (q block rows, kv splits) of every prefill token bucket and
            # every decode request bucket before serving; eager (--enforce-eager) decode steps use them too
            for tokens in self.buckets.token_buckets(level):
                self._run(self._dummy_batch(1, min(tokens, self.max_model_len - 1))).result()
            for reqs in self.buckets.reqs:
                self._run(self._dummy_batch(min(reqs, sc.max_num_batched_tokens), 1)).result()
            if not dc.enforce_eager and self.attn_backend.supports_cuda_graphs:
                from torchengine.cuda_graph import CUDAGraphs

                unknown = set(dc.compilation_config) - {"cudagraph_capture_sizes"}
                if unknown:
                    logger.warning("compilation_config keys ignored by the torch backend: %s", sorted(unknown))
                shapes = self.buckets.decode_shapes(dc.compilation_config.get("cudagraph_capture_sizes"))
                self.cuda_graphs = CUDAGraphs(self.model, self.attn_backend, self.kv_caches,
                                              self.input_batch.max_blocks_per_req, shapes, self.device)
                stats["cuda_graphs"] = self.cuda_graphs.capture()
        elif level != "none":
            self._run(self._dummy_batch(8, 1)).result()
            self._run(self._dummy_batch(1, min(16, self.max_model_len - 1, sc.max_num_batched_tokens))).result()
        stats["warmup_s"] = round(time.perf_counter() - t0, 3)
        return stats

    def _dummy_batch(self, num_reqs: int, q_len: int, params: SamplingParams | None = None) -> StepBatch:
        """A step of `num_reqs` fresh requests of `q_len` tokens, all in the null block.

        A request bucket may be larger than --max-num-seqs (the smallest one is 8 on a GPU): the batch then
        holds --max-num-seqs requests and is padded to the bucket, as a real step would be.
        """
        num_reqs = min(num_reqs, self.config.scheduler_config.max_num_seqs)
        ib = self._new_input_batch()
        params = params or SamplingParams(temperature=0.0)
        nb = -(-q_len // self.block_size)
        news = [NewRequestData(f"dummy-{i}", [0] * q_len, params, [0] * nb, 0, [], i, 0) for i in range(num_reqs)]
        so = SchedulerOutput(news, CachedRequestData(), {n.req_id: q_len for n in news}, num_reqs * q_len,
                             set(), set())
        ib.update(so)
        return prepare_step(ib, so, self.buckets)

    def _profile_batches(self) -> list[StepBatch]:
        sc = self.config.scheduler_config
        longest = min(sc.max_num_batched_tokens, self.max_model_len - 1)
        heavy = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, presence_penalty=0.1, logprobs=1)
        # the widest step: one token for each of --max-num-seqs requests (_dummy_batch's cap) within the token budget
        return [self._dummy_batch(1, longest), self._dummy_batch(sc.max_num_batched_tokens, 1, heavy)]

    # -- one step -----------------------------------------------------------------------------

    def execute(self, so: SchedulerOutput) -> PendingStep | DoneStep:
        batch = begin_step(self.input_batch, so, self.buckets, self._pending)
        if batch is None:
            return DoneStep(empty_output())
        step = self._run(batch)
        self._pending = step
        return step

    @torch.inference_mode()
    def _run(self, batch: StepBatch) -> PendingStep:
        T, R = batch.num_tokens, batch.num_reqs
        hidden = None
        out = None
        if not batch.prompt_logprobs and (layers := self._decode_layers()) is not None:
            out = self._decode_on_cpu(batch, layers) if T == R else self._step_on_cpu(batch, layers)
        if out is None:
            out, hidden = self._forward(batch)
        rows = batch.sample_rows[:R]
        if self.device.type == "cpu":  # the tokens the next step may read before this step's results are read
            on = rows >= 0
            if on.any():
                self.last_tokens.numpy()[rows[on]] = out.sampled.numpy()[:R][on]
        elif (rows >= 0).any():
            r = self.to_device("sample_rows", np.where(rows >= 0, rows, self.last_tokens.shape[0] - 1), torch.int64)
            self.last_tokens.index_copy_(0, r, out.sampled)
        results = {"sampled": out.sampled}
        if out.topk_ids is not None:
            results.update(topk_ids=out.topk_ids, topk_logprobs=out.topk_logprobs,
                           sampled_logprobs=out.sampled_logprobs, sampled_ranks=out.sampled_ranks)
        event = None
        if self.device.type == "cuda":
            host = {k: v.to("cpu", non_blocking=True) for k, v in results.items()}
            event = torch.cuda.Event()
            event.record()
        else:
            host = results
        return PendingStep(self._finish, batch, host=host, event=event,
                           hidden=hidden if batch.prompt_logprobs else None)

    def _decode_on_cpu(self, batch: StepBatch, layers: DecodeLayers) -> SamplerOutput:
        """A step whose every token is its request's only query, on the CPU kernels: all layers in one C call
        (the same kernels as the model's) and, for plain greedy rows, the LM head's argmax without logits. Its
        inputs stay numpy until the C calls (a torch op costs several numpy ones; at batch 1 the step is mostly
        such glue); no attention metadata, no sampling tensors unless a row needs them."""
        T = batch.num_tokens
        positions = batch.positions[:T].astype(np.int64)
        slots = self._slot_mapping(batch)[:T]
        hidden = layers(self._cpu_embeddings(batch), torch.from_numpy(positions),
                        torch.from_numpy(slots), batch.kv_lens, batch.block_tables)  # [T, H]: row i is request i
        return self._sample(hidden, batch, lambda: SamplingTensors.from_batch(batch.sampling, self.device, None, T))

    def _step_on_cpu(self, batch: StepBatch, layers: DecodeLayers) -> SamplerOutput | None:
        """Any other step without prompt logprobs (prefill chunks, decodes beside them) on the CPU kernels: every
        layer in one C call (`DecodeLayers.step`: the Python layers' kernels in their order, their attention's
        decode and prefill groups; the same bits), the last layer's o linear and MLP on the sampled rows alone
        where `sampled_rows_alone`; then the LM head and sampler as `_decode_on_cpu`'s. None where the attention
        plans other groups (the Python layers run the step)."""
        T, R = batch.num_tokens, batch.num_reqs
        groups = self.attn_backend.plan(batch, self.device, self.block_size, self.compute_dtype)
        if not all(isinstance(g, (DecodeGroup, PrefillGroup)) for g in groups):
            return None
        rows = np.ascontiguousarray(batch.logits_indices[:R], dtype=np.int64)
        keep = rows if self.sampled_rows_alone else None
        hidden = layers.step(self._cpu_embeddings(batch),
                             torch.from_numpy(batch.positions[:T].astype(np.int64)),
                             torch.from_numpy(self._slot_mapping(batch)[:T]),
                             next((g for g in groups if isinstance(g, DecodeGroup)), None),
                             next((g for g in groups if isinstance(g, PrefillGroup)), None), keep)
        if keep is None:
            hidden = hidden[torch.from_numpy(rows)]
        return self._sample(hidden, batch, lambda: SamplingTensors.from_batch(batch.sampling, self.device, None, R))

    def _cpu_embeddings(self, batch: StepBatch) -> torch.Tensor:
        """The step's T token embeddings [T, H] for the one-call layers, the tokens the previous step sampled
        taken from last_tokens (already there on a CPU)."""
        T = batch.num_tokens
        ids = batch.input_ids[:T]
        src = batch.input_from_row[:T]
        if (src >= 0).any():
            ids = np.where(src >= 0, self.last_tokens.numpy()[np.maximum(src, 0)], ids)
        return self.model.embed(torch.from_numpy(ids.astype(np.int64)))

    def _sample(self, hidden: torch.Tensor, batch: StepBatch, sampling_tensors) -> SamplerOutput:
        """The LM head and the sampler on `hidden` [R, H] (a row per request): for plain greedy rows the head's
        argmax without logits where the model has it (`Transformer.greedy_tokens`), else the logits through
        `sample_in_chunks` with `sampling_tensors()` (built only then)."""
        if batch.sampling.plain_greedy and (tokens := self.model.greedy_tokens(hidden)) is not None:
            return SamplerOutput(sampled=tokens)
        return sample_in_chunks(self.model.compute_logits, hidden, sampling_tensors(), self.logits_chunk_rows)

    @property
    def sampled_rows_alone(self) -> bool:
        """Whether a prefill's sampled rows alone go through the last layer's o linear and MLP (`_forward`): where
        a row's bits do not depend on the row count, the float32 panels; not the 4-bit linears (their Q4 kernel
        takes few rows, the float32 copies many), nor GPU or bfloat16 GEMMs (which may pick another algorithm),
        nor tensor parallelism (an all-reduce of more than two ranks may sum in an order that depends on the
        size), nor a MoE model whose experts are torch matmuls (their bits depend on which other rows went to
        the same expert; the CPU kernels' packed experts, `CpuExperts`, are panels)."""
        return (self.model is not None and self.cpu_arena is not None and self.tp_size == 1
                and self.config.model_config.quantization != "gguf"
                and all(getattr(ly.mlp, "experts", True) is not None for ly in self.model.layers))

    def _forward(self, batch: StepBatch) -> tuple[SamplerOutput, torch.Tensor | None]:
        """Any step: (the sampler's output, the hidden states: None from a CUDA graph or where the sampled rows
        alone ran the last layer's o linear and MLP)."""
        T, R = batch.num_tokens, batch.num_reqs
        put = self.to_device
        input_ids = put("input_ids", batch.input_ids, torch.int64)  # [Tp]
        if (batch.input_from_row >= 0).any():  # tokens the previous step sampled, still only on the device
            src = put("input_from_row", batch.input_from_row, torch.int64)
            input_ids = torch.where(src >= 0, self.last_tokens[src.clamp(min=0)], input_ids)
        positions = put("positions", batch.positions, torch.int64)  # [Tp]
        logits_indices = put("logits_indices", batch.logits_indices, torch.int64)  # [Rp]
        meta = AttentionMetadata(
            slot_mapping=put("slot_mapping", self._slot_mapping(batch), torch.int64),
            cu_q_lens=put("cu_q_lens", batch.cu_q_lens),
            kv_lens=put("kv_lens", batch.kv_lens),
            block_tables=put("block_tables", batch.block_tables[:, : batch.num_block_cols]),
            num_reqs=R,
            num_tokens=T,
        )
        st = SamplingTensors.from_batch(batch.sampling, self.device, lambda name, a: put("sampling." + name, a), R)
        if self.cuda_graphs is not None and not batch.prompt_logprobs and self.cuda_graphs.can_replay(batch):
            return sample(self.cuda_graphs.replay(batch, input_ids, positions, logits_indices, meta)[:R], st), None
        # eager: padding buys nothing, run the T real tokens only (the kernels read cu_q_lens for the rest)
        meta.slot_mapping = meta.slot_mapping[:T]
        meta.groups = self.attn_backend.plan(batch, self.device, self.block_size, self.compute_dtype)
        attn = PagedAttention(self.attn_backend, self.kv_caches, meta)
        if batch.prompt_logprobs or R >= T or not self.sampled_rows_alone:
            hidden = self.model(input_ids[:T], positions[:T], attn)  # [T, H]
            return self._sample(hidden[logits_indices[:R]], batch, lambda: st), hidden
        rows = self.model(input_ids[:T], positions[:T], attn, keep=logits_indices[:R])  # [R, H]
        return self._sample(rows, batch, lambda: st), None

    def _decode_layers(self) -> DecodeLayers | None:
        """The one-call layers for these caches (decode steps, and any other without prompt logprobs: `step`), None
        off the float32 CPU kernels' path."""
        if self.device.type != "cpu":
            return None
        bound = self._decode_layers_bound
        if bound is None or bound[0] is not self.kv_caches or bound[1] is not self.model:
            bound = self._decode_layers_bound = (self.kv_caches, self.model, DecodeLayers.bind(
                self.model, self.attn_backend, self.kv_caches))
        return bound[2]

    def _slot_mapping(self, batch: StepBatch) -> np.ndarray:
        """[Tp] cache slot of every token (block * block_size + offset); -1 for padding (writes nothing)."""
        T, R, bs = batch.num_tokens, batch.num_reqs, self.block_size
        cu = batch.cu_q_lens
        tok_req = np.arange(R) if T == R else np.repeat(np.arange(R), np.diff(cu[: R + 1]))
        pos = batch.positions[:T]
        slot = filled(batch.padded_num_tokens, -1, np.int64)
        slot[:T] = batch.block_tables[tok_req, pos // bs].astype(np.int64) * bs + pos % bs
        return slot

    def _finish(self, step: PendingStep) -> ModelRunnerOutput:
        if step.device["event"] is not None:
            step.device["event"].synchronize()
        h = {k: v.numpy() for k, v in step.device["host"].items()}
        batch = step.batch
        logprobs = None
        if "topk_ids" in h:
            logprobs = SampledLogprobs(h["topk_ids"], h["topk_logprobs"], h["sampled_logprobs"], h["sampled_ranks"])
        plp = None
        if batch.prompt_logprobs:
            with torch.inference_mode():
                plp = {sl.req_id: self._prompt_logprobs(step.device["hidden"], sl) for sl in batch.prompt_logprobs}
        if self._pending is step:
            self._pending = None
        return finish_step(self.input_batch, batch, h["sampled"], logprobs, plp)

    def _prompt_logprobs(self, hidden: torch.Tensor, sl) -> PromptLogprobs:
        """One request's prompt logprobs, PROMPT_LOGPROBS_ROWS positions at a time: a long prompt's full
        [positions, vocab] float32 matrix (8k x 128k: 4 GiB) is never materialised, which the memory profile
        does not account for. Top-k is taken on the device; only [rows, k] comes back."""
        parts = []
        k = sl.num_logprobs
        for s in range(0, sl.num_tokens, PROMPT_LOGPROBS_ROWS):
            e = min(s + PROMPT_LOGPROBS_ROWS, sl.num_tokens)
            lp = log_softmax(self.model.compute_logits(hidden[sl.token_start + s : sl.token_start + e]))
            tgt_ids = torch.from_numpy(sl.target_ids[s:e].astype(np.int64)).to(lp.device)
            tgt = lp.gather(1, tgt_ids[:, None])[:, 0]
            rank = (lp > tgt[:, None]).sum(-1) + 1
            vals, ids = top_n(lp, k)  # ties: lower id first
            parts.append([x.cpu().numpy() for x in (tgt, rank, ids, vals)])
        return PromptLogprobs(*(np.concatenate(x) for x in zip(*parts)))
