"""JaxModelRunner: the JAX backend behind `enginecore.runner.ModelRunner`.

One step: `begin_step` (the scheduler's diff into the persistent rows, then the
padded numpy batch)
-> the ``model`` program (KV written into the donated cache) -> the ``sample``
program -> a handle; its `result()` copies the packed output to the host once
and ends in `finish_step`. Dispatch is asynchronous, so the engine schedules
and builds the next step while this one computes (see `enginecore.engine`).
Programs are described in `jaxengine.programs`.

Every program is compiled ahead of time from abstract shapes (`warmup`:
`--warmup all` for `serve`, in parallel, through the compilation cache:
serialized executables on CPU, JAX's persistent cache elsewhere) or, with `--warmup none`, on first use. ``XLASERVE_CHECK_RECOMPILATION=1``
turns any compilation after warmup into an error (`compilation.py`). The
abstract inputs come from the config and the mesh alone (`abstract_inputs`), so
the same lowering compiles for a TPU this host does not have: given libtpu's
compile-only devices and no weights (`jaxengine.aot`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from cpu_kernels import layout as qx
from enginecore.arch import rope_cos_sin
from enginecore.buckets import Buckets, pick_bucket
from enginecore.config import ConfigError, EngineConfig
from enginecore.input_batch import InputBatch
from enginecore.kv_cache import check_cpu_kv_fits, kv_blocks_for
from enginecore.model_loader import ModelSource
from cpu_kernels.memory import populate_in_background, release_free_heap
from enginecore.outputs import ModelRunnerOutput, SchedulerOutput
from enginecore.platform import CPU_WEIGHTS_FIRST_ROWS, cpu_dtype_note, resolve_dtype
from enginecore.runner_output import DoneStep, PendingStep, PromptLogprobs, SampledLogprobs, empty_output, \
    finish_step
from enginecore.step_batch import StepBatch, begin_step
from enginecore.structured_outputs import bitmask_width
from jaxengine import cpu_wing
from jaxengine import platform as plat
from jaxengine.attention import ragged_paged_attention_xla
from jaxengine.compilation import (
    CompileGuard,
    CompileMonitor,
    ExecutableStore,
    resolve_cache_dir,
    use_persistent_cache,
)
from jaxengine.hbm import check_fit, device_hbm_bytes, step_temporaries_bytes
from jaxengine.loader import attach_cpu_qx
from jaxengine.model import ModelKernels, abstract_params, is_spec, jnp_dtype, kv_cache_shape, xla_moe
from jaxengine.moe import routed_experts
from jaxengine.tpu_moe import tpu_experts
from jaxengine.programs import (
    ModelLayout,
    ProgramKey,
    SampleLayout,
    model_step,
    sampler_inputs,
    prompt_logprobs_step,
    sample_step,
    unpack_sample_output,
)
from jaxengine.sampler import SAMPLER_MODES, sampler_mode
from jaxengine.sharding import (
    ShardingRules,
    kv_cache_sharding,
    kv_head_repeats,
    make_mesh,
    param_shardings,
    repeat_kv_heads,
    replicated,
    shard_attention,
    shard_experts,
)
from jaxengine.tpu_target import check_attached

logger = logging.getLogger("xlaserve.jax")

PROMPT_LOGPROB_ROWS = (32, 256)  # row buckets of the prompt-logprobs program


class AbstractInputs(NamedTuple):
    """The device-resident inputs of the step programs, as ShapeDtypeStructs with their shardings."""

    params: object  # ModelParams of ShapeDtypeStruct
    kv_cache: jax.ShapeDtypeStruct  # [L * num_blocks, block_size, 2 * Hkv, D]
    last_tokens: jax.ShapeDtypeStruct  # [num_rows] i32
    rope: tuple  # (cos, sin) [max_model_len + 1, D / 2] f32


class JaxModelRunner:
    """The JAX backend: functional model, paged KV cache, jitted sampler, TP over a mesh.

    `devices`: where the mesh lives; default the platform's devices. `jaxengine.aot` passes
    libtpu's compile-only devices of a TPU topology to compile without a TPU.
    """

    def __init__(self, config: EngineConfig, model: ModelSource, devices=None) -> None:
        self.config = config
        self.source = model
        mc, cc, sc, pc, dc = (config.model_config, config.cache_config, config.scheduler_config,
                              config.parallel_config, config.device_config)
        self.platform = dc.platform
        self.devices = list(devices) if devices is not None else plat.devices_for(self.platform)
        # more devices than kv heads: each kv head repeated so that heads shard (jaxengine.sharding)
        self.kv_repeats = kv_head_repeats(model.config, pc.tensor_parallel_size)
        self.arch = repeat_kv_heads(model.config, self.kv_repeats)
        self.dtype = resolve_dtype(mc.dtype, self.platform)
        self.kv_dtype = self.dtype if cc.kv_cache_dtype == "auto" else cc.kv_cache_dtype
        jnp_dtype(self.dtype), jnp_dtype(self.kv_dtype)  # validate
        opts = dict(dc.compilation_config or {})
        # a model the CPU kernels do not cover runs on XLA's ops (but for the attention, which checks its own case)
        one_cpu = self.platform == "cpu" and pc.tensor_parallel_size == 1
        uncovered = cpu_wing.uncovered(self.arch) if one_cpu else []
        if uncovered:
            logger.info("jax CPU kernels: XLA's ops for the model, the kernels do not implement %s",
                        ", ".join(uncovered))
        # --dtype bfloat16 on a CPU with AVX512-BF16: the float32 model (self.dtype: the weights' and activations'
        # dtype in the programs) with its linears and LM head in bfloat16 products (QX_BDOT,
        # cpu_wing.pack_cpu_panels(bdot=True)), as the torch backend runs it; the KV cache as asked
        # (not a MoE model's: its experts' panels are float32 ones)
        self.bdot = (bool(opts.get("cpu_linears", True)) and not uncovered and self.arch.moe is None
                     and qx.bdot_runs(_kernels_lib, model.config, self.platform, self.dtype, pc.tensor_parallel_size))
        if self.bdot:
            self.dtype = "float32"
        elif self.platform == "cpu" and (note := cpu_dtype_note(self.dtype)):
            logger.warning(note)
        self.mesh = make_mesh(pc.tensor_parallel_size, 1, self.devices)
        self.rules = ShardingRules.for_model(self.arch, self.mesh, expert_parallel=pc.enable_expert_parallel)
        self.heads_tp = self.mesh.shape["model"] if self.rules.shard_heads else 1
        self.attention_backend = plat.resolve_attention_backend(dc.attention_backend, self.platform)
        self.block_size = cc.block_size
        self.buckets = Buckets.create(sc.max_num_batched_tokens, sc.max_num_seqs, *dc.bucket_minimums)
        self.input_batch = InputBatch(sc.max_num_seqs, sc.max_model_len, cc.block_size, self.arch.vocab_size)
        self.num_rows = self.buckets.max_reqs  # rows of the gathered-hidden buffer and of last_tokens
        self.max_logprobs = max(mc.max_logprobs, 0)
        self.scan_layers = bool(opts.get("scan_layers", True))
        self.sampler_method = opts.get("sampler_method", "topk")
        # CPU: LM head + sampler 64 rows at a time (see programs.sample_step)
        self.logits_chunk_rows = opts.get("logits_chunk_rows", 64 if self.platform == "cpu" else None)
        # CPU: the linears of steps of <= 32 tokens (and the LM head of <= 32 rows) run weights first
        # (see model.dense); TPU and GPU compilers choose their own layouts
        self.weights_first_rows = int(opts.get("weights_first_rows",
                                               CPU_WEIGHTS_FIRST_ROWS if self.platform == "cpu" else 0))
        # CPU, float32, one device: cpu_kernels.jax_ops' custom calls, off where they cannot run (the log
        # says why). Every linear and the LM head on weights packed at load (cpu_wing.pack_cpu_panels: they
        # read each layer's weights where they lie, where XLA's dots in the scan copy them first, with the
        # torch backend's kernel): compilation_config={"cpu_linears": False} turns them off. Attention over the
        # cache in place (a float32, float16 or bfloat16 one): {"cpu_decode_attention": False} turns it off.
        # A 16-bit model gets the attention only (its linears are XLA's: the panels are float32), unless it runs
        # as float32 with bfloat16 products (self.bdot); XLA's own attention loops took a 16-bit decode step of
        # the embedded model ~1.4 s.
        self.cpu_linears, self.cpu_decode_attention = False, False
        linears = bool(opts.get("cpu_linears", True)) and self.dtype == "float32" and not uncovered
        decode = bool(opts.get("cpu_decode_attention", True))
        if self.platform == "cpu" and self.mesh.size == 1 and (linears or decode):
            from cpu_kernels import jax_ops

            why = jax_ops.available()
            if why:
                logger.info("jax CPU kernels: XLA's ops (%s)", why)
            else:
                self.cpu_linears, self.cpu_decode_attention = linears, decode
        # ... and with both: every layer of a step in one custom call (jax_ops.layers; {"cpu_layers": False}:
        # one call per kernel, in a scan over layers)
        self.cpu_layers = (self.cpu_linears and self.cpu_decode_attention and self.arch.moe is None
                           and bool(opts.get("cpu_layers", True)))  # (its layers are the dense MLP's)
        if self.cpu_linears or self.cpu_decode_attention:
            logger.info("jax CPU kernels: linears %s, decode attention %s, every layer in one call %s",
                        *("on" if on else "off" for on in (self.cpu_linears, self.cpu_decode_attention,
                                                           self.cpu_layers)))
        # what forward runs: XLA's ops (weights first for few rows: model.dense), or the CPU kernels on the panels
        self.kernels = (cpu_wing.model_kernels(self.arch, layers=self.cpu_layers) if self.cpu_linears
                        else ModelKernels.xla(self.weights_first_rows))
        if self.arch.moe is not None and not self.cpu_linears:  # (on the panels: cpu_wing's sorted experts)
            # the routed experts' method by each bucket's token count (jaxengine.moe.pick_method) unless
            # compilation_config={"moe_method": ...} fixes one; split over the mesh under shard_map
            method = opts.get("moe_method")
            if self.platform == "tpu" and method in (None, "gmm"):
                # megablox's gmm reads the [out, in] experts as stored; ragged_dot's TPU kernel would have XLA
                # transpose every expert of the layer on every step (jaxengine.tpu_moe)
                experts = tpu_experts()
            else:
                experts = functools.partial(routed_experts, method=method, platform=self.platform)
            self.kernels = dataclasses.replace(self.kernels, moe=functools.partial(
                xla_moe, experts=shard_experts(experts, self.mesh, self.rules, self.arch)))
        self.warmup_level = dc.warmup_level
        self.cache_dir = resolve_cache_dir(dc.compilation_cache_dir)
        # On CPU the cache is a store of serialized executables (loading one skips tracing and lowering, most
        # of a warm start); elsewhere JAX's persistent cache, which `xlaserve warmup --topology` fills for TPU
        # hosts. Not both: XLA:CPU cannot re-serialize an executable that JAX's cache loaded (tested).
        # (one process only: an executable of a multi-process mesh is only valid with the same group)
        self._store_enabled = (bool(self.cache_dir) and devices is None and self.platform == "cpu"
                               and opts.get("store_executables", True) and jax.process_count() == 1)
        self._store: ExecutableStore | None = None
        # JAX's cache where there is no store (process-wide: set either way, an earlier runner may have left it on)
        use_persistent_cache(self.cache_dir if self.cache_dir and not self._store_enabled else None)
        self.monitor = CompileMonitor().install()
        self.guard = CompileGuard(self.monitor)
        self._rep = replicated(self.mesh)
        # per device, as the KV cache stores them (padded for the Pallas kernel on TPU)
        self.cache_kv_heads, self.cache_head_dim = plat.pallas_cache_heads(
            self.arch.num_key_value_heads // self.heads_tp, self.arch.head_dim, self.platform, self.attention_backend)
        self._attention = shard_attention(self._attention_fn(), self.mesh, self.rules,
                                          opaque=self.attention_backend == "pallas")
        self._programs: dict[ProgramKey, object] = {}
        self._pending: PendingStep | None = None
        self.params = None
        self.kv_cache = None
        self._kv_populate = threading.Event()  # stops the CPU KV cache's background commit
        self.last_tokens = None
        self.rope = None
        self.num_blocks = 0
        self.load_seconds = 0.0

    # -- lifecycle ----------------------------------------------------------------------

    def _attention_fn(self):
        if self.attention_backend == "reference":
            if self.cpu_decode_attention:  # (it checks the cache's dtype itself: jax_ops.KV_DTYPES)
                return cpu_wing.attention
            return ragged_paged_attention_xla
        return plat.pallas_attention(self.platform, self.devices[0].device_kind, block_size=self.block_size,
                                     group=self.arch.num_attention_heads // self.arch.num_key_value_heads,
                                     kv_heads=self.cache_kv_heads, head_dim=self.cache_head_dim,
                                     kv_dtype=jnp_dtype(self.kv_dtype))

    def load_model(self) -> None:
        from jaxengine.checkpoint import is_orbax_checkpoint, load_orbax_params
        from jaxengine.loader import load_params

        if self.platform == "cpu":
            plat.tune_host_allocator()
        if self.platform == "tpu":  # before any weight is read: a model that cannot fit fails now
            if self.config.device_config.topology:
                check_attached(self.config.device_config.topology, self.devices)
            check_fit(self.config, self.arch, self.mesh, self.rules, self.kv_bytes_per_block(),
                      device_hbm_bytes(self.devices[0]), self.devices[0].device_kind)
        t0 = time.perf_counter()
        shardings = param_shardings(abstract_params(self.arch, self.dtype), self.rules, self.mesh)
        fmt = self.config.model_config.load_format
        if fmt == "orbax" or (fmt == "auto" and is_orbax_checkpoint(self.source.folder)):
            if self.kv_repeats > 1:
                raise ConfigError(f"--tensor-parallel-size {self.mesh.shape['model']} repeats the kv heads, which "
                                  "orbax checkpoints do not support yet: load the Hugging Face or GGUF weights")
            self.params = load_orbax_params(self.source.folder, self.arch, self.dtype, shardings)
        else:
            self.params = load_params(self.source, self.arch, self.dtype, shardings, kv_repeats=self.kv_repeats)
        if self.cpu_linears:
            params, self.params = self.params, None
            self.params = cpu_wing.pack_cpu_panels(params, bdot=self.bdot)
            if self.bdot:
                logger.info("jax: every linear and the LM head in bfloat16 (AVX512-BF16: QX_BDOT), multiplied by their "
                            "inputs rounded to bfloat16; the rest of the model in float32")
            elif qx.enabled() and self.arch.moe is None:  # (no qx panels of experts)
                self.params, n = attach_cpu_qx(self.params, self.source, self.arch)
                if n:
                    logger.info("jax: %d weight groups also as stored (a GGUF file's blocks, 16-bit values), "
                                "the same bits, for decode steps of few rows (XLASERVE_Q4X=off: float32 only)", n)
        cos, sin = rope_cos_sin(self.arch, self.config.scheduler_config.max_model_len + 1)
        self.rope = jax.device_put((cos, sin), self._rep)
        if self.platform == "cpu":
            release_free_heap()  # (the weights packed above were freed)
        self.load_seconds = time.perf_counter() - t0
        logger.info("jax: weights loaded in %.2fs (%s, dtype %s, tp %d, attention %s)", self.load_seconds,
                    self.source.kind if fmt != "orbax" else "orbax", self.dtype,
                    self.mesh.shape["model"], self.attention_backend)

    def kv_bytes_per_block(self) -> int:
        """On one device: the KV cache splits over heads when the heads are sharded."""
        shape = kv_cache_shape(self.arch, 1, self.block_size, kv_heads=self.cache_kv_heads,
                               head_dim=self.cache_head_dim)
        return int(np.prod(shape)) * jnp.dtype(jnp_dtype(self.kv_dtype)).itemsize

    def _kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return kv_cache_shape(self.arch, num_blocks, self.block_size, kv_heads=self.cache_kv_heads * self.heads_tp,
                              head_dim=self.cache_head_dim)

    def determine_num_blocks(self) -> int:
        n = kv_blocks_for(self.config, self.kv_bytes_per_block(), self.block_size,
                          None if self.platform == "cpu" else self._device_kv_budget)
        if jax.process_count() > 1:  # one cache over every host's devices (jaxengine.multihost): what the tightest fits
            from jax.experimental import multihost_utils

            n = int(np.min(multihost_utils.process_allgather(np.array([n], np.int64))))
        return n

    def _device_kv_budget(self) -> tuple[int, str]:
        util = self.config.cache_config.gpu_memory_utilization
        budget = plat.device_kv_budget(self.devices[0], util, self._activation_bytes())
        return budget, f"--gpu-memory-utilization {util} ({budget / 2**30:.2f} GiB for the KV cache)"

    def _activation_bytes(self) -> int:
        return step_temporaries_bytes(self.config, self.arch, self.mesh, self.rules)

    def init_kv_cache(self, num_blocks: int, allocate: bool = True) -> None:
        """allocate=False only fixes the cache shape the programs are compiled for (AOT: no device memory)."""
        self.num_blocks = num_blocks
        # the cache shape is part of every program: the store's key with it
        self._store = self._executable_store() if self._store_enabled else None
        if not allocate:
            return
        shape = self._kv_cache_shape(num_blocks)
        dtype = jnp_dtype(self.kv_dtype)
        nbytes = int(np.prod(shape)) * jnp.dtype(dtype).itemsize
        zeros = jnp.zeros
        if self.platform == "cpu":
            check_cpu_kv_fits(nbytes)
            if self.cpu_linears or self.cpu_decode_attention:  # (their library is loaded: one device, x86 AVX2)
                from cpu_kernels import jax_ops

                zeros = jax_ops.zeros  # memory committed as steps first write it, not all here
        self.kv_cache = jax.jit(lambda: zeros(shape, dtype), out_shardings=self._kv_sharding)()
        if zeros is not jnp.zeros:  # its pages committed in the background (steps update the cache in place)
            self._kv_populate.set()
            self._kv_populate = populate_in_background(self.kv_cache.unsafe_buffer_pointer(), nbytes)
        self.last_tokens = jax.jit(lambda: jnp.zeros(self.num_rows, jnp.int32), out_shardings=self._rep)()
        logger.info("jax: KV cache %s %s (%.1f MiB)", shape, self.kv_dtype, nbytes / 2**20)

    @property
    def _kv_sharding(self):
        return kv_cache_sharding(self.rules, self.mesh)

    def shutdown(self) -> None:
        self._kv_populate.set()
        self.monitor.uninstall()
        self._pending = None
        self._programs.clear()
        self.params = self.kv_cache = self.last_tokens = None

    # -- programs ---------------------------------------------------------------------------

    def _model_layout(self, tokens: int) -> ModelLayout:
        reqs = pick_bucket(self.buckets.reqs, min(tokens, self.buckets.max_reqs))
        return ModelLayout(tokens, reqs, self.input_batch.max_blocks_per_req)

    def abstract_inputs(self) -> AbstractInputs:
        """The programs' device inputs from the config and the mesh alone: what `load_model` and
        `init_kv_cache` create, without reading or allocating anything; on a CPU with the panels, once the
        model is loaded, with the qx panels `attach_cpu_qx` gave it (which depend on the weights: a program
        compiled before the load has none, and its params' structure differs from the loaded ones')."""
        if not self.num_blocks:
            raise RuntimeError("the KV cache shape is not fixed yet: call init_kv_cache(num_blocks) first")
        rep = self._rep
        spec = abstract_params(self.arch, self.dtype)
        shardings = param_shardings(spec, self.rules, self.mesh)
        params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), spec, shardings,
                              is_leaf=is_spec)
        if self.cpu_linears:  # one device
            params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep),
                                  jax.eval_shape(functools.partial(cpu_wing.pack_cpu_panels, bdot=self.bdot),
                                                 params))
            if self.params is not None and self.params.panels is not None:  # loaded: its panels, qx ones included
                params = dataclasses.replace(params, panels=jax.tree.map(
                    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep), self.params.panels))
        kv = jax.ShapeDtypeStruct(self._kv_cache_shape(self.num_blocks), jnp_dtype(self.kv_dtype),
                                  sharding=self._kv_sharding)
        table = jax.ShapeDtypeStruct((self.config.scheduler_config.max_model_len + 1, self.arch.head_dim // 2),
                                     jnp.float32, sharding=rep)
        return AbstractInputs(params, kv, jax.ShapeDtypeStruct((self.num_rows,), jnp.int32, sharding=rep),
                              (table, table))

    def _lower(self, key: ProgramKey):
        # Pallas reads the TPU generation from the default device: make it this runner's
        # (libtpu's compile-only devices when compiling for a TPU target from a CPU host).
        with jax.default_device(self.devices[0]):
            return self._lower_program(key, self.abstract_inputs())

    def _lower_program(self, key: ProgramKey, inputs: AbstractInputs):
        rep = self._rep
        i32 = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32, sharding=rep)  # noqa: E731
        params, last = inputs.params, inputs.last_tokens
        if key.kind == "model":
            layout = self._model_layout(key.size)
            fn = jax.jit(functools.partial(model_step, layout=layout, num_rows=self.num_rows, arch=self.arch,
                                           attention_fn=self._attention, scan_layers=self.scan_layers,
                                           kernels=self.kernels),
                         donate_argnums=(1,), out_shardings=(rep, rep, self._kv_sharding))
            return fn.lower(params, inputs.kv_cache, last, inputs.rope, i32(layout.size))
        if key.kind == "sample":
            layout = SampleLayout(key.size)
            H, V, R = self.arch.hidden_size, self.arch.vocab_size, key.size
            rows = jax.ShapeDtypeStruct((self.num_rows, H), jnp_dtype(self.dtype), sharding=rep)
            extra = ()
            bitmask = jax.ShapeDtypeStruct((R, bitmask_width(V)), jnp.int32, sharding=rep)
            if key.mode == "masked":
                extra = (bitmask,)
            if key.mode == "processed":
                f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32, sharding=rep)  # noqa: E731
                extra = (f32(R, V), f32(R, V), jax.ShapeDtypeStruct((R, V), jnp.bool_, sharding=rep),
                         f32(R), f32(R), f32(R), bitmask)
            fn = jax.jit(functools.partial(sample_step, layout=layout, arch=self.arch, mode=key.mode,
                                           num_logprobs=self.max_logprobs, method=self.sampler_method,
                                           chunk_rows=self.logits_chunk_rows, kernels=self.kernels),
                         donate_argnums=(2,), out_shardings=(rep, rep))
            return fn.lower(params, rows, last, i32(layout.size), *extra)
        if key.kind == "prompt_logprobs":
            rows = jax.ShapeDtypeStruct((key.size, self.arch.hidden_size), jnp_dtype(self.dtype), sharding=rep)
            # (XLA's ops multiply these rows in their own orientation: weights_first_rows=0)
            kernels = self.kernels if self.cpu_linears else ModelKernels()
            fn = jax.jit(functools.partial(prompt_logprobs_step, arch=self.arch, k=self.max_logprobs,
                                           kernels=kernels), out_shardings=rep)
            return fn.lower(params, rows, i32(key.size))
        raise ValueError(f"unknown program {key!r}")

    def _compile(self, key: ProgramKey):
        return self._load_or_compile(key)[0]

    def _load_or_compile(self, key: ProgramKey) -> tuple[object, bool]:
        """(program, loaded from the executable store)."""
        store = self._store
        if store is not None:
            prog = store.load(key, self.mesh.devices.flat)
            if prog is not None:
                return prog, True
        with self.monitor.counting() as counts:
            prog = self._lower(key).compile()
        if store is not None and not counts.hits:  # compiled here, not loaded from JAX's cache
            store.save(key, prog)
        return prog, False

    def _executable_store(self) -> ExecutableStore:
        """The store for this runner's programs; its key covers everything that shapes them (not what names
        the model or the run)."""
        c = self.config
        config = dataclasses.replace(
            c, model_config=dataclasses.replace(c.model_config, model=None, tokenizer=None, served_model_name=None),
            device_config=dataclasses.replace(c.device_config, warmup="all", compilation_cache_dir=None))
        context = "\n".join([repr(config), repr(self.arch), self.platform, self.attention_backend,
                              f"cpu_linears={self.cpu_linears} {self.cpu_decode_attention} {self.cpu_layers}",
                              repr([(d.platform, d.device_kind, d.id) for d in self.devices]),
                              repr(self.abstract_inputs())])
        return ExecutableStore(self.cache_dir, context)

    @property
    def programs(self) -> MappingProxyType:
        """The compiled programs so far, by key (read-only: memory and cost analyses read them)."""
        return MappingProxyType(self._programs)

    def _program(self, key: ProgramKey):
        prog = self._programs.get(key)
        if prog is None:
            self.guard.check_key(key)
            t0 = time.perf_counter()
            prog = self._programs[key] = self._compile(key)
            logger.info("compiled %s lazily in %.2fs", key.describe(), time.perf_counter() - t0)
        return prog

    def program_keys(self, level: str = "all") -> list[ProgramKey]:
        """Every program serving can run, at a warmup level ("decode": those of pure-decode steps)."""
        keys = [ProgramKey("model", t) for t in self.buckets.token_buckets(level)]
        if level == "none":
            return keys
        modes = SAMPLER_MODES if level == "all" else ("greedy", "sample")
        keys += [ProgramKey("sample", r, m) for r in self.buckets.reqs for m in modes]
        if level == "all":
            keys += [ProgramKey("prompt_logprobs", n) for n in PROMPT_LOGPROB_ROWS]
        return keys

    def warmup(self, level: str | None = None, threads: int | None = None, progress=None) -> dict:
        """Compile every program of the warmup level, `threads` at a time (XLA compiles in parallel).

        Returns {"level", "programs": [{"key", "seconds", "compiles", "cache_hits", "cache_misses", "status"}],
        "seconds", "compiles", "cache_hits", "cache_misses", "cache_dir", "recompilation_guard"}; then arms the
        recompilation guard. `progress(done, total, key)` is called after each program.
        """
        level = level or self.warmup_level
        keys = [k for k in self.program_keys(level) if k not in self._programs] if level != "none" else []
        t_all = time.perf_counter()
        c0, h0, m0 = self.monitor.snapshot()
        rows = []

        def one(key):
            t0 = time.perf_counter()
            with self.monitor.counting() as counts:
                prog, loaded = self._load_or_compile(key)
            counts.hits += loaded  # a stored executable: a cache hit without tracing, lowering or XLA
            return key, prog, time.perf_counter() - t0, counts, loaded

        threads = threads or max(1, min(len(keys), len(os.sched_getaffinity(0))))
        progress = progress or _ProgressLog(t_all)
        loaded_total = 0
        if keys:
            with ThreadPoolExecutor(threads) as pool:
                for i, (key, prog, dt, counts, loaded) in enumerate(pool.map(one, keys)):
                    self._programs[key] = prog
                    loaded_total += loaded
                    rows.append({"key": key, "seconds": round(dt, 3), "compiles": counts.compiles,
                                 "cache_hits": counts.hits, "cache_misses": counts.misses,
                                 "status": "hit" if counts.hits and not counts.misses else "compiled"})
                    progress(i + 1, len(keys), key)
        c1, h1, m1 = self.monitor.snapshot()
        self.guard.arm(set(self._programs))
        stats = {
            "level": level,
            "programs": rows,
            "seconds": round(time.perf_counter() - t_all, 3),
            "compiles": c1 - c0,
            "cache_hits": h1 - h0 + loaded_total,
            "cache_misses": m1 - m0,
            "cache_dir": self.cache_dir,
            "recompilation_guard": self.guard.armed,
        }
        if rows:
            logger.info("jax warmup (%s): %d programs in %.1fs (%d threads): %d compiled, %d from the cache (%s)",
                        level, len(rows), stats["seconds"], threads, stats["compiles"], stats["cache_hits"],
                        "executables" if self._store is not None else "XLA persistent cache" if self.cache_dir else "off")
        return stats

    # -- one step -------------------------------------------------------------------------

    def execute(self, so: SchedulerOutput) -> PendingStep | DoneStep:
        batch = begin_step(self.input_batch, so, self.buckets, self._pending)
        if batch is None:
            return DoneStep(empty_output())
        Tp, Rp = batch.padded_num_tokens, batch.padded_num_reqs
        layout = self._model_layout(Tp)
        with self.guard.dispatch():
            hidden, rows, self.kv_cache = self._program(ProgramKey("model", Tp))(
                self.params, self.kv_cache, self.last_tokens, self.rope, layout.pack(batch))
            sb = batch.sampling
            mode = sampler_mode(sb.all_greedy, sb.num_logprobs >= 0, sb.processed, sb.masked)
            extra = sampler_inputs(sb, mode, Rp, self.arch.vocab_size)
            out, self.last_tokens = self._program(ProgramKey("sample", Rp, mode))(
                self.params, rows, self.last_tokens, SampleLayout(Rp).pack(sb, batch.sample_rows), *extra)
        step = PendingStep(self._finish, batch, out=out, hidden=hidden if batch.prompt_logprobs else None)
        self._pending = step
        return step

    def _finish(self, step: PendingStep) -> ModelRunnerOutput:
        batch = step.batch
        out = _host(step.device["out"])
        sampled, ids, lps, tok_lp, rank = unpack_sample_output(out, self.max_logprobs)
        logprobs = SampledLogprobs(ids, lps, tok_lp, rank) if batch.sampling.num_logprobs >= 0 else None
        plp = self._prompt_logprobs(step.device["hidden"], batch) if batch.prompt_logprobs else None
        if self._pending is step:
            self._pending = None
        return finish_step(self.input_batch, batch, sampled, logprobs, plp)

    def _prompt_logprobs(self, hidden, batch: StepBatch) -> dict[str, PromptLogprobs]:
        h = _host(hidden)
        out = {}
        for s in batch.prompt_logprobs:
            parts = []
            for start in range(0, s.num_tokens, PROMPT_LOGPROB_ROWS[-1]):
                n = min(s.num_tokens - start, PROMPT_LOGPROB_ROWS[-1])
                size = pick_bucket(PROMPT_LOGPROB_ROWS, n)
                rows = np.zeros((size, h.shape[1]), h.dtype)
                rows[:n] = h[s.token_start + start : s.token_start + start + n]
                targets = np.zeros(size, np.int32)
                targets[:n] = s.target_ids[start : start + n]
                with self.guard.dispatch():
                    res = self._program(ProgramKey("prompt_logprobs", size))(self.params, rows, targets)
                parts.append([_host(a)[:n] for a in res])
            tgt, rank, ids, vals = (np.concatenate(x) for x in zip(*parts))
            out[s.req_id] = PromptLogprobs(tgt, rank, ids, vals)
        return out


__all__ = ["JaxModelRunner"]


def _host(a) -> np.ndarray:
    """A replicated output on the host: this process's copy (over several processes (jaxengine.multihost) the
    array also lives on devices this process cannot read)."""
    return np.asarray(a if a.is_fully_addressable else a.addressable_data(0))


def _kernels_lib():
    """The jax build of the CPU kernels, or None (`cpu_kernels.jax_ops.lib`: imported when asked for)."""
    from cpu_kernels import jax_ops

    return jax_ops.lib()


class _ProgressLog:
    """Warm-up progress as a log line with a bar, at most one a second: a cold start compiles for minutes."""

    def __init__(self, t0: float, every: float = 1.0):
        self.t0, self.every, self.last = t0, every, t0

    def __call__(self, done: int, total: int, key: ProgramKey) -> None:
        now = time.perf_counter()
        if now - self.last < self.every and done < total:
            return
        if done == total and now - self.t0 < self.every:
            return  # everything came from the cache at once: the summary line says it
        self.last = now
        bar = "#" * (24 * done // total)
        logger.info("warmup [%-24s] %d/%d programs, %.0fs (%s)", bar, done, total, now - self.t0, key.describe())

