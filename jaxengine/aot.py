"""`xlaserve warmup --topology v5e:2x2`: compile the TPU server's programs on a host without a TPU.

The runner is built on libtpu's compile-only devices of the named slice
(`jaxengine.tpu_target`), its KV cache shape fixed by the fit check
(`jaxengine.hbm`) but never allocated, its weights never read: the programs
are lowered from `JaxModelRunner.abstract_inputs` (ShapeDtypeStructs with
their shardings), exactly as `serve` lowers them on a TPU, and compiled by
libtpu for that chip, in parallel, into the persistent compilation cache.

What this proves, and what it does not
--------------------------------------
Verified: every program the TPU server would run (each token bucket's model
step with the Pallas attention compiled by Mosaic, sharded over the slice's
mesh; each request bucket's sampler variants; prompt logprobs) compiles for
that chip, and its HBM footprint (XLA's ``memory_analysis``) fits. Not
verified: that the programs run correctly or fast on a TPU, and that a TPU
host *hits* these cache entries: the key covers the HLO, jaxlib and libtpu
versions, XLA_FLAGS / LIBTPU_INIT_ARGS, the compile options and libtpu's
fingerprint of the topology, and only a TPU can tell whether its attached
topology fingerprints like the compile-only one. Hence the second artifact:
serialized executables (``executables_dir``), which a TPU host loads with
`load_executables` without any cache-key matching (same jax/jaxlib/libtpu).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re

from enginecore.config import ConfigError, EngineArgs
from enginecore.model_checks import arch_from_config_json
from enginecore.model_loader import ModelSource, resolve_model
from jaxengine.hbm import MemoryPlan, check_fit
from jaxengine.step_cost import (ShardedShape, StepCost, expected_distinct_experts, model_step_cost, moe_split,
                                 prompt_logprobs_cost, sample_step_cost)
from jaxengine.tpu_target import GiB, Topology, num_hosts, parse_topology, topology_devices

logger = logging.getLogger("xlaserve.aot")

DEFAULT_ROOFLINE_CONTEXT = 1024  # cached tokens per request assumed by the roofline of a model step
ROW_MAJOR_4D = "3,2,1,0"  # an XLA layout's dims, minor to major


def resolve_aot_model(model: str | None) -> ModelSource:
    """Like `resolve_model`, and also a folder holding only config.json: AOT compilation needs no weights."""
    path = os.path.expanduser(model) if model else None
    if path and os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json")) \
            and not any(f.endswith((".safetensors", ".gguf")) for f in os.listdir(path)):
        arch = arch_from_config_json(os.path.join(path, "config.json"))
        return ModelSource("hf", os.path.abspath(path), os.path.basename(os.path.normpath(path)), arch)
    return resolve_model(model)


@dataclasses.dataclass
class AotReport:
    """What `run_aot_warmup` compiled, for which target, and how it sizes up."""

    target: dict  # topology, device_kind, chips, hosts, mesh, chip peaks
    plan: MemoryPlan
    rows: list[dict]  # one per program
    fit: dict  # the compiled programs' per-device HBM peak against the chip
    cache_dir: str | None
    executables_dir: str | None
    notes: list[str]


def _engine_config(engine_args: EngineArgs, topo: Topology):
    from jaxengine.compilation import DEFAULT_CACHE_DIR, resolve_cache_dir

    args = dataclasses.replace(engine_args, topology=topo.name)
    if args.platform == "auto":
        args.platform = "tpu"
    if args.platform != "tpu":
        raise ConfigError(f"--topology {topo.name} compiles for a TPU; it needs --platform tpu (or auto), "
                          f"not --platform {args.platform}")
    if args.backend == "auto":
        args.backend = "jax"
    if args.compilation_cache_dir is None:
        args.compilation_cache_dir = resolve_cache_dir(None) or DEFAULT_CACHE_DIR
    source = resolve_aot_model(args.model)
    return args.create_engine_config(model_max_len=source.config.max_position_embeddings), source


def run_aot_warmup(engine_args: EngineArgs, topology: str, level: str = "all", *, executables_dir: str | None = None,
                   roofline_context: int = DEFAULT_ROOFLINE_CONTEXT, threads: int | None = None,
                   progress=None) -> AotReport:
    """Compile every program of `level` for the TPU slice `topology` ("v5e:2x2") from abstract weights.

    Raises ConfigError before compiling anything when libtpu is missing, the slice has too few chips
    for --tensor-parallel-size, or the model does not fit the chip's HBM (`jaxengine.hbm.check_fit`).
    """
    import jax

    from jaxengine.runner import JaxModelRunner

    topo = parse_topology(topology)
    config, source = _engine_config(engine_args, topo)
    devices = topology_devices(topo)
    tp = config.parallel_config.tensor_parallel_size
    if tp > len(devices):
        raise ConfigError(f"--tensor-parallel-size {tp} needs {tp} chips; --topology {topo.name} has {len(devices)}")
    hosts, nnodes = num_hosts(devices), config.parallel_config.nnodes
    slice_ = f"--topology {topo.name} is {hosts} host(s) of {len(devices) // hosts} chips"
    if nnodes not in (1, hosts):  # (1: a Cloud TPU VM slice's workers come from its environment)
        raise ConfigError(f"--nnodes {nnodes}: {slice_}; pass --nnodes {hosts} or leave it out")
    # One engine spans the whole multi-host slice (every host's process runs it); a mesh on some hosts' chips
    # would leave the others nothing to run, and libtpu aborts compiling for such a subset of ids.
    if hosts > 1 and tp != len(devices):
        one_host = f"{topo.chip.name}:{'2x2x1' if len(topo.dims) == 3 else '2x2'}"
        raise ConfigError(f"--tensor-parallel-size {tp}: {slice_}, and one engine runs over all of a multi-host "
                          f"slice's chips: pass --tensor-parallel-size {len(devices)}, or a one-host slice's "
                          f"--topology (e.g. {one_host}) for {tp} chips")
    jax.clear_caches()  # programs already in memory would never reach the persistent cache
    runner = JaxModelRunner(config, source, devices=devices)
    try:
        where = f"{topo.name} ({topo.chip.device_kind})"
        plan = check_fit(config, runner.arch, runner.mesh, runner.rules, runner.kv_bytes_per_block(),
                         topo.chip.hbm_bytes, where)
        runner.init_kv_cache(plan.num_blocks, allocate=False)
        logger.info("aot: %s, tp %d, %s", where, tp, plan.describe())
        stats = runner.warmup(level, threads=threads, progress=progress)
        rows = _rows(runner, stats, topo, roofline_context)
        fit = _compiled_fit(rows, plan)
        saved = _save_executables(runner, executables_dir, topo, plan) if executables_dir else None
    finally:
        runner.shutdown()
    mesh_devices = list(runner.mesh.devices.flat)
    hosts = num_hosts(devices)
    target = {"topology": topo.name, "device_kind": topo.chip.device_kind, "chips": topo.num_chips,
              "hosts": hosts, "chips_per_host": len(devices) // hosts, "host_chips": host_chips(mesh_devices),
              "mesh_chips": len(mesh_devices), "mesh_hosts": num_hosts(mesh_devices),
              "tensor_parallel_size": tp, "heads_sharded": runner.rules.shard_heads,
              "hbm_gib_per_chip": topo.chip.hbm_bytes / GiB, "peak_bf16_tflops": topo.chip.peak_bf16_flops / 1e12,
              "hbm_gbps": topo.chip.hbm_bandwidth / 1e9, "num_programs": len(rows),
              "attention": runner.attention_backend, "dtype": runner.dtype, "kv_dtype": runner.kv_dtype,
              "num_blocks": plan.num_blocks, "roofline_context": roofline_context,
              "experts": _experts_line(runner)}
    notes = _notes(target, rows, config, runner.cache_dir, saved)
    return AotReport(target, plan, rows, fit, runner.cache_dir, saved, notes)


def _rows(runner, stats: dict, topo: Topology, context: int) -> list[dict]:
    import jax.numpy as jnp

    from jaxengine.model import jnp_dtype

    arch, sc = runner.arch, runner.config.scheduler_config
    stored = runner.cache_kv_heads * runner.heads_tp * runner.cache_head_dim  # K/V elements per token, padded
    padding = stored / (arch.num_key_value_heads * arch.head_dim)
    shape = ShardedShape.of(arch, runner.mesh.shape["model"], runner.rules.shard_heads,
                            jnp.dtype(jnp_dtype(runner.dtype)).itemsize, jnp.dtype(jnp_dtype(runner.kv_dtype)).itemsize,
                            padding, runner.config.parallel_config.enable_expert_parallel)
    peak, bw = topo.chip.peak_bf16_flops, topo.chip.hbm_bandwidth
    kv = runner.abstract_inputs().kv_cache
    kv_local = kv.sharding.shard_shape(kv.shape)
    rows = []
    for p in stats["programs"]:
        key = p["key"]
        prog = runner.programs[key]
        mem = prog.memory_analysis()
        cost = _program_cost(key, arch, shape, sc.max_num_seqs, context)
        rows.append({
            "key": key, "bucket": key.describe(), "compile_s": p["seconds"],
            "status": p["status"],
            "args_bytes": mem.argument_size_in_bytes, "out_bytes": mem.output_size_in_bytes,
            "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
            "code_bytes": mem.generated_code_size_in_bytes,
            "flops": cost.flops, "bytes": cost.bytes, "roofline_ms": cost.seconds(peak, bw) * 1e3,
            "experts_read": (expected_distinct_experts(arch.moe.num_experts, arch.moe.top_k, key.size)
                             / shape.experts_ep if arch.moe is not None and key.kind == "model" else None),
            "bound": cost.bound(peak, bw),
            "kv_layout": kv_cache_layout(prog.as_text(), kv_local) if key.kind == "model" else None,
        })
    return rows


def host_chips(mesh_devices) -> list[list[int]]:
    """The mesh's chips (device ids, in mesh order) of each host, by jax process index: on the slice, host i
    (TPU_WORKER_ID i) is the process that drives them."""
    by_host: dict[int, list[int]] = {}
    for d in mesh_devices:
        by_host.setdefault(d.process_index, []).append(d.id)
    return [by_host[h] for h in sorted(by_host)]


def _experts_line(runner) -> str | None:
    """How a MoE model's experts sit on the chips (None: dense)."""
    m = runner.arch.moe
    if m is None:
        return None
    tp = runner.mesh.shape["model"]
    ep, cols, _ = moe_split(runner.arch, tp, runner.config.parallel_config.enable_expert_parallel)
    where = (f"{m.num_experts // ep} whole experts per chip (expert parallel)" if ep > 1 else
             f"every expert's {m.intermediate_size // cols} of {m.intermediate_size} columns per chip"
             if cols > 1 else "every expert whole on every chip")
    return f"{m.num_sparse_layers} sparse layers of {m.num_experts} experts, top-{m.top_k}: {where}"


def kv_cache_layout(hlo_text: str, local_shape: tuple[int, ...]) -> str | None:
    """The (per-device) KV-cache parameter's dim order in a compiled program, minor to major ("3,2,1,0":
    row-major, what the Pallas kernel takes; anything else makes XLA copy the cache in and out of every
    step). None when the program has no such parameter."""
    param = re.compile(r"=\s*[a-z0-9]+" + re.escape("[" + ",".join(map(str, local_shape)) + "]") + r"\{([0-9,]+)")
    for line in hlo_text.splitlines():
        if " parameter(" in line:
            m = param.search(line)
            if m:
                return m.group(1)
    return None


def _program_cost(key, arch, shape: ShardedShape, max_reqs: int, context: int) -> StepCost:
    if key.kind == "model":
        return model_step_cost(arch, shape, tokens=key.size, reqs=min(key.size, max_reqs), context=context)
    if key.kind == "sample":
        return sample_step_cost(arch, shape, reqs=key.size)
    return prompt_logprobs_cost(arch, shape, rows=key.size)


def _compiled_fit(rows: list[dict], plan: MemoryPlan) -> dict:
    """Per device: the largest program's arguments + outputs (less the donated cache) + temporaries, plus the
    code of every program (all stay loaded), against the chip's HBM and the --gpu-memory-utilization budget."""
    resident = [r["args_bytes"] + r["out_bytes"] - r["alias_bytes"] + r["temp_bytes"] for r in rows]
    i = max(range(len(rows)), key=resident.__getitem__)
    peak_row, code = rows[i], sum(r["code_bytes"] for r in rows)
    peak = resident[i] + code
    return {"peak_bytes": peak, "peak_program": peak_row["bucket"], "code_bytes": code,
            "max_temp_bytes": max(r["temp_bytes"] for r in rows), "estimated_temp_bytes": plan.temporaries_bytes,
            "budget_bytes": plan.budget_bytes, "hbm_bytes": plan.hbm_bytes,
            "fits_hbm": peak <= plan.hbm_bytes, "fits_budget": peak <= plan.budget_bytes}


def _key_name(key) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", key.describe())


def _save_executables(runner, out_dir: str, topo: Topology, plan: MemoryPlan) -> str:
    """One serialized executable per program (`compilation.serialize_program`) plus manifest.json (what they
    were compiled for, and which file holds which program)."""
    import importlib.metadata

    import jax
    import jaxlib

    from jaxengine.compilation import serialize_program

    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    files = {}
    for key, prog in runner.programs.items():
        name = _key_name(key) + ".jaxexe"
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(serialize_program(prog))
        files[name] = list(key)
    try:
        libtpu = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        libtpu = None
    mesh = list(runner.mesh.devices.flat)
    # the chips each program runs on, in mesh order: every host of a slice loads the same executables onto them
    manifest = {"topology": topo.name, "device_kind": topo.chip.device_kind, "num_blocks": plan.num_blocks,
                "hosts": num_hosts(mesh), "mesh_device_ids": [d.id for d in mesh],
                "jax": jax.__version__, "jaxlib": jaxlib.__version__, "libtpu": libtpu,
                "xla_flags": os.environ.get("XLA_FLAGS", ""), "programs": files}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    return out_dir


def load_executables(path: str, devices=None) -> dict:
    """On the TPU host (every host of a multi-host slice): {ProgramKey: loaded executable} from `executables_dir`
    (same jax, jaxlib and libtpu), onto `devices` in mesh order (None: the slice's chips the manifest names, in
    its mesh order, from all of the default backend's devices)."""
    import jax

    from jaxengine.compilation import load_program
    from jaxengine.programs import ProgramKey

    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    if devices is None and "mesh_device_ids" in manifest:
        by_id = {d.id: d for d in jax.devices()}
        gone = [i for i in manifest["mesh_device_ids"] if i not in by_id]
        if gone:
            raise ConfigError(f"{path}: compiled for {manifest['topology']} chips {manifest['mesh_device_ids']}; "
                              f"jax sees no device with id {gone[:4]} here ({len(by_id)} devices)")
        devices = [by_id[i] for i in manifest["mesh_device_ids"]]
    out = {}
    for name, key in manifest["programs"].items():
        with open(os.path.join(path, name), "rb") as f:
            out[ProgramKey(*key)] = load_program(f.read(), devices)
    return out


def _notes(target: dict, rows: list[dict], config, cache_dir: str | None, saved: str | None) -> list[str]:
    cc = config.cache_config
    flags = " ".join(f"{k}={os.environ[k]!r}" for k in ("XLA_FLAGS", "LIBTPU_INIT_ARGS") if os.environ.get(k))
    notes = [
        f"verified: all {target['num_programs']} programs compile for {target['device_kind']} "
        f"({target['topology']}, {target['mesh_chips']} of {target['chips']} chips in the mesh) with libtpu.",
        "not verified (no TPU here): that they run, their speed, and that a TPU host hits these cache entries.",
        f"the KV cache shape is part of every model program: start the server with --num-gpu-blocks-override "
        f"{target['num_blocks']} (and the same model, dtype and scheduler flags) to hit them"
        + ("" if cc.num_gpu_blocks_override else " (the server would otherwise size it from the chip's reported "
           "memory and may pick another count)") + ".",
        "the cache key includes XLA_FLAGS and LIBTPU_INIT_ARGS: run the server with the same values"
        + (f" ({flags})" if flags else " (none set here)") + ".",
    ]
    copying = [r["bucket"] for r in rows if r["kv_layout"] not in (None, ROW_MAJOR_4D)]
    if copying:
        notes.append(f"WARNING: {', '.join(copying)} keep the KV cache in a layout the Pallas kernel does not "
                     "take, so XLA copies the whole cache every step: a bug to fix (see "
                     "jaxengine.platform.pallas_cache_heads).")
    if target["hosts"] > 1:
        per_host = "; ".join(f"host {h}: chips {ids}" for h, ids in enumerate(target["host_chips"]))
        notes.append(
            f"a {target['hosts']}-host slice ({target['chips_per_host']} chips a host): every host runs the same "
            f"{target['num_programs']} SPMD programs, each compiled once here for the whole mesh, one jax process a "
            f"host driving its own chips (jax process i, worker i of a Cloud TPU VM slice; {per_host}). Start `xlaserve serve` with the "
            "same flags on every worker (gcloud ... ssh --worker=all) and give each worker this compilation cache "
            "(copy it, or a --compilation-cache-dir they share)" + (" and the executables" if saved else "") + ".")
    if saved:
        notes.append(f"serialized executables in {saved}: a TPU host loads them with jaxengine.aot.load_executables "
                     "(no cache-key matching, but the same jax/jaxlib/libtpu versions).")
    if cache_dir:
        notes.append(f"persistent compilation cache: {cache_dir}")
    return notes


def format_report(report: AotReport) -> str:
    """The target, one row per program, the HBM fit and the notes, as plain text."""
    t, g = report.target, (lambda b: f"{b / GiB:.2f}")
    lines = [
        f"target: {t['device_kind']} x {t['chips']} ({t['topology']}, {t['hosts']} host(s) of "
        f"{t['chips_per_host']} chips); mesh: "
        f"tensor-parallel {t['tensor_parallel_size']} on {t['mesh_chips']} chip(s), heads "
        f"{'sharded' if t['heads_sharded'] else 'replicated'}; attention {t['attention']}; "
        f"{t['dtype']} weights, {t['kv_dtype']} KV cache",
        f"chip: {t['hbm_gib_per_chip']:.0f} GiB HBM, {t['peak_bf16_tflops']:.0f} TFLOP/s bf16, "
        f"{t['hbm_gbps']:.0f} GB/s; plan {report.plan.describe()}",
        f"roofline: max(FLOPs / peak, bytes / bandwidth) per chip from jaxengine.step_cost, a model step of N tokens "
        f"from min(N, --max-num-seqs) requests with {t['roofline_context']} cached tokens each: an estimate on paper.",
    ]
    if t.get("experts"):
        lines.append(f"experts: {t['experts']}; a step of N tokens reads only the experts they reach, "
                     "E(1 - (1 - k/E)^N) under uniform routing (experts_read: per chip), and multiplies k per token.")
    lines.append("")
    moe = bool(t.get("experts"))
    cols = ("bucket", "compile_s", "status", "args_GiB", "out_GiB", "temp_GiB", "code_MiB", "GFLOP", "GB",
            "roofline_ms", "bound") + (("experts_read",) if moe else ())
    table = [[r["bucket"], f"{r['compile_s']:.1f}", r["status"], g(r["args_bytes"]), g(r["out_bytes"]),
              g(r["temp_bytes"]), f"{r['code_bytes'] / 2**20:.1f}", f"{r['flops'] / 1e9:.1f}",
              f"{r['bytes'] / 1e9:.2f}", f"{r['roofline_ms']:.3f}", r["bound"]]
             + ([f"{r['experts_read']:.1f}" if r.get("experts_read") is not None else "-"] if moe else [])
             for r in report.rows]
    widths = [max(len(c), *(len(row[i]) for row in table)) for i, c in enumerate(cols)]
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in table]
    f = report.fit
    lines += ["", f"HBM per chip after compiling: peak {g(f['peak_bytes'])} GiB ({f['peak_program']}: arguments + "
              f"outputs + temporaries, plus {f['code_bytes'] / 2**20:.1f} MiB of code for all programs); largest "
              f"temporaries {g(f['max_temp_bytes'])} GiB (estimated before compiling: {g(f['estimated_temp_bytes'])}); "
              f"{'fits' if f['fits_budget'] else 'DOES NOT FIT'} --gpu-memory-utilization's {g(f['budget_bytes'])} "
              f"GiB of {g(f['hbm_bytes'])} GiB", ""]
    lines += [f"- {n}" for n in report.notes]
    return "\n".join(lines)


__all__ = ["AotReport", "DEFAULT_ROOFLINE_CONTEXT", "format_report", "load_executables", "resolve_aot_model",
           "run_aot_warmup"]
