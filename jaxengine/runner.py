"""JaxModelRunner: the JAX backend behind `enginecore.runner.ModelRunner`.

One step: `InputBatch.update` -> `InputBatch.prepare` (numpy, padded to the
token x request buckets) -> one jitted model step on device (KV written into
the paged cache, attention, logits only at `logits_indices`; the cache is
donated and updated in place) -> the jitted sampler -> one device-to-host copy
-> `make_runner_output`.

Compiled programs depend only on bucket keys: the model step on
(tokens, requests) — block tables always travel at full width and the
attention loops stop at the batch's real kv lengths, so decode never reads
max_model_len of KV and the table width never forces a compile; the sampler on
(requests, variant flags). Warmup policy (``XLASERVE_WARMUP``): ``all``
compiles every key up front (the TPU default: XLA compiles there are slow and
the persistent cache makes restarts cheap); ``decode`` only the pure-decode
buckets with plain sampling; ``none`` (the CPU/GPU default) compiles lazily on
first use. ``XLASERVE_CHECK_RECOMPILATION=1`` turns any compile after warmup
into an error (see `compilation.py`), so serving with the guard on CPU needs
``XLASERVE_WARMUP=all``.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from enginecore.batch import InputBatch, StepBatch, make_runner_output, pick_bucket, prompt_logprobs_np
from enginecore.config import ConfigError, EngineConfig
from enginecore.model_loader import ModelSource
from enginecore.outputs import ModelRunnerOutput, SchedulerOutput
from jaxengine import platform as plat
from jaxengine.attention import ragged_paged_attention_xla
from jaxengine.compilation import CompileGuard, CompileMonitor, enable_persistent_cache, resolve_cache_dir
from jaxengine.model import (
    AttentionMetadata,
    DecoderConfig,
    abstract_params,
    compute_logits,
    forward,
    kv_cache_bytes_per_block,
    kv_cache_shape,
)
from jaxengine.sampler import sample
from jaxengine.sharding import (
    ShardingRules,
    kv_cache_sharding,
    make_mesh,
    param_shardings,
    replicated,
    shard_attention,
)

logger = logging.getLogger("xlaserve.jax")

WARMUP_LEVELS = ("none", "decode", "all")


def _model_step(params, kv_cache, input_ids, md, logits_indices, *, cfg, attention_fn, scan_layers):
    """-> (logits [Rp, V] f32 at logits_indices, hidden [Tp, H] before the final norm, kv_cache)."""
    hidden, kv_cache = forward(params, kv_cache, input_ids, md, cfg, attention_fn, scan_layers=scan_layers)
    return compute_logits(params, hidden[logits_indices], cfg), hidden, kv_cache


def _prompt_logprobs(params, hidden_rows, *, cfg):
    """hidden_rows [N, H] -> log_softmax of their logits [N, V] f32 (the rare prompt_logprobs path)."""
    return jax.nn.log_softmax(compute_logits(params, hidden_rows, cfg), axis=-1)


class JaxModelRunner:
    """The JAX backend: flax-free functional model, paged KV cache, jitted sampler, TP over a mesh."""

    def __init__(self, config: EngineConfig, model: ModelSource) -> None:
        self.config = config
        self.source = model
        mc, cc, sc, pc, dc = (
            config.model_config, config.cache_config, config.scheduler_config,
            config.parallel_config, config.device_config,
        )
        if pc.data_parallel_size != 1:
            raise ConfigError(
                f"--data-parallel-size {pc.data_parallel_size} is not supported by the jax backend "
                "(run one server per replica); use --tensor-parallel-size"
            )
        self.platform = dc.platform
        self.devices = plat.devices_for(self.platform)
        dtype = plat.resolve_dtype(mc.canonical_dtype, self.platform)
        kv_dtype = dtype if cc.kv_cache_dtype == "auto" else cc.kv_cache_dtype
        self.cfg = DecoderConfig.from_arch(model.config, dtype=dtype, kv_dtype=kv_dtype)
        self.mesh = make_mesh(pc.tensor_parallel_size, 1, self.devices)
        self.rules = ShardingRules.for_model(self.cfg, self.mesh)
        self.attention_backend = plat.resolve_attention_backend(dc.attention_backend, self.platform)
        self.block_size = cc.block_size
        self.input_batch = ib = InputBatch(
            max_num_seqs=sc.max_num_seqs,
            max_model_len=sc.max_model_len,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            block_size=cc.block_size,
            vocab_size=self.cfg.vocab_size,
            max_logprobs=mc.max_logprobs,
            **self._min_buckets(),
        )
        # block tables travel at one fixed width (the widest column bucket, >= max_blocks_per_req)
        self.table_width = ib.block_buckets[-1]
        opts = dict(dc.compilation_config or {})
        self.scan_layers = bool(opts.get("scan_layers", True))
        self.sampler_method = opts.get("sampler_method", "topk")
        self.warmup_level = os.environ.get("XLASERVE_WARMUP", "all" if self.platform == "tpu" else "none")
        if self.warmup_level not in WARMUP_LEVELS:
            raise ConfigError(f"XLASERVE_WARMUP must be one of {', '.join(WARMUP_LEVELS)}; got {self.warmup_level!r}")
        self.cache_dir = resolve_cache_dir(dc.compilation_cache_dir)
        if self.cache_dir:
            enable_persistent_cache(self.cache_dir)
        self.monitor = CompileMonitor().install()
        self.guard = CompileGuard(self.monitor)
        self._rep = replicated(self.mesh)
        attention_fn = shard_attention(self._attention_fn(), self.mesh, self.rules)
        # outputs pinned (logits/hidden replicated, cache on its heads) so that the sampler and the
        # next step always see the same shardings: no layout-driven recompiles
        self._step = jax.jit(
            functools.partial(_model_step, cfg=self.cfg, attention_fn=attention_fn, scan_layers=self.scan_layers),
            donate_argnums=(1,),
            out_shardings=(self._rep, self._rep, kv_cache_sharding(self.rules, self.mesh)),
        )
        self._plp = jax.jit(functools.partial(_prompt_logprobs, cfg=self.cfg))
        self.params = None
        self.kv_cache = None
        self.num_blocks = 0
        self.load_seconds = 0.0

    def _min_buckets(self) -> dict:
        """Smallest token / request buckets: TPU and GPU keep 16 / 8; CPU: XLASERVE_CPU_MIN_BUCKETS, default "1,1" (a padded row costs as much as a real one)."""
        if self.platform != "cpu":
            return {}
        env = os.environ.get("XLASERVE_CPU_MIN_BUCKETS", "1,1")
        t, r = (int(x) for x in env.split(","))
        return {"min_token_bucket": t, "min_req_bucket": r}

    # -- lifecycle ----------------------------------------------------------------------

    def _attention_fn(self):
        if self.attention_backend == "reference":
            return ragged_paged_attention_xla
        return plat.pallas_attention(self.platform)

    def load_model(self) -> None:
        from jaxengine.checkpoint import load_orbax_params, is_orbax_checkpoint
        from jaxengine.loader import load_params

        if self.platform == "cpu":
            plat.tune_host_allocator()
        t0 = time.perf_counter()
        shardings = param_shardings(abstract_params(self.cfg), self.rules, self.mesh)
        fmt = self.config.model_config.load_format
        if fmt == "orbax" or (fmt == "auto" and is_orbax_checkpoint(self.source.folder)):
            self.params = load_orbax_params(self.source.folder, self.cfg, shardings)
        else:
            self.params = load_params(self.source, self.cfg, shardings)
        self.load_seconds = time.perf_counter() - t0
        logger.info("jax: weights loaded in %.2fs (%s, dtype %s, tp %d, attention %s)", self.load_seconds,
                    self.source.kind if fmt != "orbax" else "orbax", self.cfg.dtype,
                    self.mesh.shape["model"], self.attention_backend)

    def determine_num_blocks(self) -> int:
        cc, sc = self.config.cache_config, self.config.scheduler_config
        per_block = kv_cache_bytes_per_block(self.cfg, self.block_size)
        blocks_per_seq = self.input_batch.max_blocks_per_req
        useful = sc.max_num_seqs * blocks_per_seq + 1
        if self.platform == "cpu":
            explicit = cc.kv_cache_memory_bytes is not None
            budget = cc.kv_cache_memory_bytes if explicit else plat.default_cpu_kv_bytes()
            n = budget // per_block
            if n < blocks_per_seq + 1:
                if explicit:
                    raise ConfigError(
                        f"--kv-cache-memory-bytes {budget} holds {n} blocks of {per_block} bytes, fewer than the "
                        f"{blocks_per_seq + 1} needed for one --max-model-len {sc.max_model_len} sequence"
                    )
                n = blocks_per_seq + 1
            return int(min(n, useful))
        # accelerators: what is left of gpu_memory_utilization after weights and activations
        shards = self.mesh.shape["model"] if self.rules.shard_heads else 1
        free = plat.device_kv_budget(self.devices[0], cc.gpu_memory_utilization, self._activation_bytes())
        n = int(free // (per_block / shards))
        if n < blocks_per_seq + 1:
            raise ConfigError(
                f"only {n} KV blocks fit in --gpu-memory-utilization {cc.gpu_memory_utilization}; "
                f"one --max-model-len {sc.max_model_len} sequence needs {blocks_per_seq + 1}. Lower --max-model-len "
                "or raise --gpu-memory-utilization"
            )
        return int(min(n, useful))

    def _activation_bytes(self) -> int:
        c, sc = self.cfg, self.config.scheduler_config
        T, R = sc.max_num_batched_tokens, sc.max_num_seqs
        per_tok = c.hidden_size * 6 + c.intermediate_size * 3 + c.num_q_heads * c.head_dim * 4
        return int(4 * (T * per_tok + R * c.vocab_size * 6)) + (256 << 20)

    def init_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        shape = kv_cache_shape(self.cfg, num_blocks, self.block_size)
        dtype = self.cfg.kv_dtype
        sharding = kv_cache_sharding(self.rules, self.mesh)
        self.kv_cache = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
        logger.info("jax: KV cache %s %s (%.1f MiB)", shape, dtype,
                    np.prod(shape) * jnp.dtype(dtype).itemsize / 2**20)

    def shutdown(self) -> None:
        self.monitor.uninstall()
        self.params = None
        self.kv_cache = None

    # -- one step -------------------------------------------------------------------------

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.input_batch.update(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        batch = self.input_batch.prepare(scheduler_output)
        logits, hidden = self._run_model(batch)
        out = self._run_sampler(logits, batch)
        plp = self._run_prompt_logprobs(hidden, batch) if batch.prompt_logprobs else None
        out = jax.device_get(out)
        return make_runner_output(
            batch,
            out["sampled"],
            out.get("topk_ids"),
            out.get("topk_logprobs"),
            out.get("sampled_logprobs"),
            out.get("sampled_ranks"),
            prompt_logprobs=plp,
        )

    def _device_md(self, batch: StepBatch):
        Rp = batch.padded_num_reqs
        W = self.table_width
        table = np.zeros((Rp, W), np.int32)
        table[:, : batch.block_tables.shape[1]] = batch.block_tables
        host = (
            batch.input_ids,
            AttentionMetadata(batch.positions, batch.kv_lens, table.reshape(-1), batch.cu_q_lens, batch.distribution),
            batch.logits_indices,
        )
        return jax.device_put(host, self._rep)

    def _run_model(self, batch: StepBatch):
        ids, md, li = self._device_md(batch)
        key = ("model", batch.padded_num_tokens, batch.padded_num_reqs)
        with self.guard.dispatch(key):
            logits, hidden, self.kv_cache = self._step(self.params, self.kv_cache, ids, md, li)
        return logits, hidden

    def _sampler_args(self, sb):
        """Host arrays + static flags for `sample`; bias and penalties travel together (one variant)."""
        Rp = sb.temperature.shape[0]
        V = self.cfg.vocab_size
        processed = sb.bias is not None or sb.output_counts is not None
        extra = None
        if processed:
            extra = (
                sb.bias if sb.bias is not None else np.zeros((Rp, V), np.float32),
                sb.output_counts if sb.output_counts is not None else np.zeros((Rp, V), np.float32),
                sb.prompt_mask if sb.prompt_mask is not None else np.zeros((Rp, V), bool),
                sb.presence if sb.presence is not None else np.zeros(Rp, np.float32),
                sb.frequency if sb.frequency is not None else np.zeros(Rp, np.float32),
                sb.repetition if sb.repetition is not None else np.ones(Rp, np.float32),
            )
        flags = dict(
            all_greedy=bool(sb.all_greedy),
            needs_filtering=bool(sb.needs_filtering and not sb.all_greedy),
            num_logprobs=int(sb.num_logprobs),
        )
        base = (sb.temperature, sb.top_k, sb.top_p, sb.min_p, sb.uniform)
        return base, extra, flags

    def _run_sampler(self, logits, batch: StepBatch):
        base, extra, flags = self._sampler_args(batch.sampling)
        key = ("sampler", batch.padded_num_reqs, flags["all_greedy"], flags["needs_filtering"],
               flags["num_logprobs"], extra is not None)
        args = jax.device_put(base + (extra or ()), self._rep)
        with self.guard.dispatch(key):
            return sample(logits, *args, **flags, method=self.sampler_method)

    def _run_prompt_logprobs(self, hidden, batch: StepBatch):
        # rows picked on the host so the program depends on the row bucket only, not the token bucket
        rows = np.concatenate([np.arange(s.token_start, s.token_start + s.num_tokens) for s in batch.prompt_logprobs])
        n = pick_bucket(self.input_batch.token_buckets, len(rows))
        h = np.asarray(jax.device_get(hidden))
        padded = np.zeros((n, h.shape[1]), h.dtype)
        padded[: len(rows)] = h[rows]
        with self.guard.dispatch(("prompt_logprobs", n)):
            lp = np.asarray(self._plp(self.params, jax.device_put(padded, self._rep)))
        out, off = {}, 0
        for s in batch.prompt_logprobs:
            out[s.req_id] = prompt_logprobs_np(lp[off : off + s.num_tokens], s.target_ids, s.num_logprobs)
            off += s.num_tokens
        return out

    # -- warmup -----------------------------------------------------------------------------

    def bucket_keys(self, level: str = "all") -> list[tuple]:
        """Every program key serving can dispatch, at a warmup level."""
        ib = self.input_batch
        keys: list[tuple] = []
        reqs = ib.req_buckets
        for i, Rp in enumerate(reqs):
            min_reqs = reqs[i - 1] + 1 if i else 1  # the fewest requests that land in this bucket
            toks = [Tp for Tp in ib.token_buckets if Tp >= min_reqs]
            if level == "decode":
                toks = toks[:1]
            keys += [("model", Tp, Rp) for Tp in toks]
        variants = [(True, False), (False, False), (False, True)]  # (all_greedy, needs_filtering)
        lps = sorted({0, self.input_batch.max_logprobs})
        for Rp in reqs:
            for g, f in variants:
                for nlp in lps:
                    for processed in (False, True):
                        if level == "decode" and (nlp or processed or f):
                            continue
                        keys.append(("sampler", Rp, g, f, nlp, processed))
        if level == "all":
            keys += [("prompt_logprobs", n) for n in ib.token_buckets]
        return keys

    def warmup(self, level: str | None = None) -> dict:
        """Compile (by running on dummy inputs that write nothing) every key of the warmup level.

        Returns {"level", "buckets": [{"key", "seconds", "compiles"}], "seconds", "compiles",
        "cache_hits", "cache_misses", "cache_dir"}; then arms the recompilation guard.
        """
        level = level or self.warmup_level
        if level not in WARMUP_LEVELS:
            raise ConfigError(f"warmup level must be one of {', '.join(WARMUP_LEVELS)}; got {level!r}")
        t_all = time.perf_counter()
        self.monitor.bind_current_thread()
        c0, h0, m0 = self.monitor.snapshot()
        rows = []
        for key in self.bucket_keys(level) if level != "none" else []:
            c, h, m = self.monitor.snapshot()
            t0 = time.perf_counter()
            jax.block_until_ready(self._run_dummy(key))
            self.guard.seen.add(key)
            c1, h1, m1 = self.monitor.snapshot()
            rows.append({"key": key, "seconds": round(time.perf_counter() - t0, 3), "compiles": c1 - c,
                         "cache_hits": h1 - h, "cache_misses": m1 - m})
        c1, h1, m1 = self.monitor.snapshot()
        self.guard.arm()
        stats = {
            "level": level,
            "buckets": rows,
            "seconds": round(time.perf_counter() - t_all, 3),
            "compiles": c1 - c0,
            "cache_hits": h1 - h0,
            "cache_misses": m1 - m0,
            "cache_dir": self.cache_dir,
            "recompilation_guard": self.guard.armed,
        }
        if rows:
            logger.info("jax warmup (%s): %d buckets in %.1fs, %d compiles, persistent cache %d hits / %d misses",
                        level, len(rows), stats["seconds"], stats["compiles"], stats["cache_hits"],
                        stats["cache_misses"])
        return stats

    def _run_dummy(self, key: tuple):
        W = self.table_width
        if key[0] == "model":
            _, Tp, Rp = key
            z = lambda n: np.zeros(n, np.int32)  # noqa: E731
            md = AttentionMetadata(z(Tp), z(Rp), z(Rp * W), z(Rp + 1), z(3))  # mixed_end 0: writes nothing
            ids, md, li = jax.device_put((z(Tp), md, z(Rp)), self._rep)
            logits, hidden, self.kv_cache = self._step(self.params, self.kv_cache, ids, md, li)
            return logits
        if key[0] == "sampler":
            _, Rp, g, f, nlp, processed = key
            V = self.cfg.vocab_size
            base = (np.ones(Rp, np.float32), np.zeros(Rp, np.int32), np.ones(Rp, np.float32),
                    np.zeros(Rp, np.float32), np.full(Rp, 0.5, np.float32))
            extra = ()
            if processed:
                extra = (np.zeros((Rp, V), np.float32), np.zeros((Rp, V), np.float32), np.zeros((Rp, V), bool),
                         np.zeros(Rp, np.float32), np.zeros(Rp, np.float32), np.ones(Rp, np.float32))
            logits = jnp.zeros((Rp, V), jnp.float32, device=self._rep)
            args = jax.device_put(base + extra, self._rep)
            return sample(logits, *args, all_greedy=g, needs_filtering=f, num_logprobs=nlp,
                          method=self.sampler_method)
        if key[0] == "prompt_logprobs":
            hidden = np.zeros((key[1], self.cfg.hidden_size), self.cfg.jnp_dtype)
            return self._plp(self.params, jax.device_put(hidden, self._rep))
        raise ValueError(f"unknown bucket key {key!r}")


__all__ = ["JaxModelRunner"]
