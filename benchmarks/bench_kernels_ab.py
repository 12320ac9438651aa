"""Two builds of the CPU kernels in one process, interleaved: a git revision's `cpu_kernels/csrc`
against the working tree's.

    python -m benchmarks.bench_kernels_ab [--base HEAD~1] [--rows 1,8,32,64] [--reps 20] [--what linears|bdot]
    python -m benchmarks.bench_kernels_ab --what attention [--context 170] [--rows 1,8,32,64] [--kv-dtype float16]
                                          [--layout jax]
    python -m benchmarks.bench_kernels_ab --what layers [--context 170] [--rows 1,8,32,64]
    python -m benchmarks.bench_kernels_ab --what qx [--base HEAD~1] [--rows 1,2,4,8,12] [--qx-kind bf16|f16|q4k|i8|iq4]
                                          [--qx-tiles avx2]

This machine's speed drifts by up to 2x between minutes (its memory bandwidth is shared), so kernels timed in
separate runs tell little; here every repetition runs both builds back to back on the same weights, and the
best of --reps of each is compared, and (the last column) their medians: the best rounds are those no other
load disturbed, the medians show what a busy minute costs (a change that evens out the threads' work, say).
What it times: one decode step's float32 linears of the embedded model
(SmolLM2-135M: 30 layers of q/k/v, o, gate/up and down, random weights packed in panels as the engines pack
them, ~425 MB, then the tied LM head's greedy argmax over 49152 rows, 113 MB), so the weights stream from
memory as in a real step; `--what bdot`: the same as QX_BDOT's bfloat16 panels (`--dtype bfloat16` on a CPU with
AVX512-BF16; half the bytes). `--what attention`: one decode step's attention instead, 30 layers of
`decode_attention` over paged caches of the embedded model's shape (9 query heads, 3 KV heads of 64, blocks of
16 tokens, separate K and V caches as the torch backend keeps them, ~380 MB), every row --context tokens long
in blocks scattered at random as a long-running server's are (`--layout jax`: jaxengine's one cache a layer,
each token's K and V rows interleaved by kv head, `decode_attention_tasks` as its custom call runs it, the
tasks split between Python threads; rows too few for the threads, which the custom call gives the split order
(`decode_split_phase`), still take those tasks here: the split order is timed in torch's layout). Both builds must give the same bits (checked
first): the kernels' outputs do not depend on how they are tiled. `--kv-dtype float16` (or bfloat16): the
working tree's build reads a cache of that dtype (the same values rounded, half the bytes), the base's a float32
one; their outputs then differ by that rounding, so the bits are not compared. `--what layers`: one whole
`decode_layers` call (what the torch backend runs for a decode step: every layer's norms, linears, RoPE, KV
write and attention; random weights, the attention's scattered float32 caches), so a change that moves work
between the kernels (e.g. fetching the next layer's cache during this one's MLP) is timed as a step sees it.
`--what qx`: the working tree's decode step linears and greedy head from float32 panels
(`panel_gemm`) against the same weights as a GGUF file's Q4_1 blocks and Q8_0 head multiplied as stored
(`qx_gemm`, what a GGUF model served in float32 runs for steps of up to `qx_max_rows()` rows), in the working
tree's build and in the base's (the blocks packed as the working tree packs them), the same bits (checked first);
`--qx-kind q4k`: the linears' blocks with float32 scales (a GGUF file's Q4_K, kind QX_Q4_K);
`--qx-kind i8`: the same Q4_1 weights in the wide form (QX_I8: int8, float32 scales and offsets per 16: Q6_K, Q5_K
and linears of mixed types); `--qx-kind iq4`: 4-bit indices into IQ4_NL's 16 values with float32 scales (a GGUF
file's IQ4_NL and IQ4_XS, kind QX_IQ4);
`--qx-kind bf16` (f16): bfloat16-exact (float16-exact) weights against the same as those 16 bits (what a bfloat16
checkpoint served in float32 runs); `--qx-kind bdot`: the same bfloat16 weights multiplied by activations rounded to
bfloat16 (QX_BDOT, `--dtype bfloat16` on a CPU with AVX512-BF16: other bits, not compared). On a CPU with AVX-512
`qx_gemm` runs its AVX-512 tiles, `--qx-tiles avx2` its 256-bit ones (a CPU without AVX-512's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out): q/k/v fused, o, gate/up fused, down
LAYERS, VOCAB, HIDDEN = 30, 49152, 576
HQ, HKV, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M's attention, the engines' block size


def build(units: list, headers: tuple, name: str):
    from cpu_kernels import torch_ops
    from enginecore.native import build_shared

    path, why = build_shared(name, units, ("-fopenmp",), headers=headers)
    lib, why = torch_ops.open_library(path) if path else (None, why)
    if lib is None:
        raise SystemExit(f"cannot build {name}: {why}")
    return lib


def base_build(rev: str):
    """The CPU kernels of git revision `rev`, built: its `cpu_kernels/csrc` (or, before the wing had a folder
    of its own, its one `torchengine/cpu_kernels.c`)."""
    from cpu_kernels.build import C_FLAGS

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:cpu_kernels/csrc"], cwd=root,
                           capture_output=True, text=True).stdout.split()
    files = [f"cpu_kernels/csrc/{n}" for n in names if n.endswith((".c", ".h"))] or ["torchengine/cpu_kernels.c"]
    with tempfile.TemporaryDirectory() as tmp:
        for rel in files:
            with open(os.path.join(tmp, os.path.basename(rel)), "wb") as f:
                f.write(subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=root, check=True,
                                       capture_output=True).stdout)
        flags = [f for f in C_FLAGS if not f.startswith("-I")] + [f"-I{tmp}"]
        units = [(os.path.join(tmp, os.path.basename(r)), "c", flags) for r in files if r.endswith(".c")]
        headers = tuple(os.path.join(tmp, os.path.basename(r)) for r in files if r.endswith(".h"))
        return build(units, headers, "cpu_kernels_ab")


def best_of(libs, step, reps: int) -> tuple[dict[str, float], float]:
    """Each build's best time of `step(name)` over `reps` rounds, the builds back to back in every round, and
    the ratio of their median times (base / new)."""
    times = {name: [] for name in libs}
    for _ in range(reps):
        for name in libs:
            t0 = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - t0)
    return ({name: min(t) for name, t in times.items()},
            statistics.median(times["base"]) / statistics.median(times["new"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", default="HEAD~1", help="the git revision to compare against (default HEAD~1)")
    ap.add_argument("--rows", default="1,8,32,64", help="tokens a step")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--what", choices=("linears", "bdot", "attention", "layers", "qx"), default="linears")
    ap.add_argument("--context", type=int, default=170, help="--what attention / layers: tokens each row attends")
    ap.add_argument("--layout", default="torch", choices=("torch", "jax"),
                    help="--what attention: torch's separate K and V caches, or jaxengine's one cache a layer")
    ap.add_argument("--qx-kind", default="q4", choices=("q4", "q4k", "i8", "iq4", "bf16", "f16", "bdot"),
                    help="--what qx: a GGUF's Q4_1 (q4k: Q4_K; i8: the wide form) blocks and Q8_0 head, or "
                         "bfloat16-exact weights as bfloat16 (bdot: bfloat16 products, --dtype bfloat16 on AVX512-BF16)")
    ap.add_argument("--qx-tiles", default="auto", choices=("auto", "avx2"),
                    help="--what qx: avx2 runs qx_gemm's 256-bit tiles where it would run its AVX-512 ones")
    ap.add_argument("--kv-dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                    help="--what attention: the working tree's cache dtype (the base's is float32)")
    args = ap.parse_args()

    import torch

    from cpu_kernels import layout as qx
    from enginecore.platform import cpu_kernels_unavailable
    from cpu_kernels import torch_ops

    why = cpu_kernels_unavailable()
    if why:
        print(f"the CPU kernels cannot run here: {why}")
        return 1
    threads = int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    torch.set_num_threads(threads)
    if args.what == "qx":
        return qx_step(args, threads)
    base = base_build(args.base)
    new = torch_ops.lib()
    if new is None:
        print(f"the working tree's kernels do not build: {torch_ops.load()[1]}")
        return 1
    libs = {"base": base, "new": new}

    if args.what == "attention":
        return attention(libs, args, threads)
    if args.what == "layers":
        return decode_step(libs, args, threads)
    bdot = args.what == "bdot"
    if bdot and not new.bdot_supported():
        print("no AVX512-BF16 here: QX_BDOT does not run")
        return 1
    g = torch.Generator().manual_seed(0)

    def panels(w):  # float32 panels, or QX_BDOT's (--what bdot)
        p = torch_ops.pack_panels(w)
        return torch.from_numpy(qx.bdot_panels(new, p.numpy())) if bdot else p

    def gemm(lib, x, M, K, w, N, y, best):
        rc = (lib.qx_gemm(x, M, K, w, N, y, best, torch_ops.QX_KINDS["BDOT"], threads) if bdot
              else lib.panel_gemm(x, M, K, w, N, y, best, threads))
        if rc:
            raise RuntimeError("the kernel refused its arguments")

    layers = [[panels(torch.randn(n, k, generator=g) / k ** 0.5) for k, n in SHAPES] for _ in range(LAYERS)]
    head = panels(torch.randn(VOCAB, HIDDEN, generator=g) / HIDDEN ** 0.5)

    print(f"decode step linears of SmolLM2-135M ({'QX_BDOT, ~270 MB' if bdot else 'float32, ~540 MB'}, weights "
          f"streamed from memory), {threads} thread(s); base {args.base} vs the working tree, best of {args.reps} "
          "interleaved")
    print(f"{'rows':>5}  {'base ms':>8}  {'new ms':>8}  {'base GFLOP/s':>12}  {'new GFLOP/s':>11}  {'speedup':>7}  {'median':>7}")
    for M in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(M, k, generator=g) for k in (576, 1536)}
        outs = {name: step_outputs(M) for name in libs}

        def step(name: str) -> None:
            lib, (ys, best) = libs[name], outs[name]
            for l, ws in enumerate(layers):
                for j, ((k, n), w) in enumerate(zip(SHAPES, ws)):
                    gemm(lib, xs[k].data_ptr(), M, k, w.data_ptr(), n, ys[l, j].data_ptr(), None)
            gemm(lib, xs[HIDDEN].data_ptr(), M, HIDDEN, head.data_ptr(), VOCAB, None, best.data_ptr())

        for name in libs:
            step(name)
        if not same_outputs(outs["base"], outs["new"]):
            print(f"{M:>5}  the two builds give different outputs")
            return 1
        best, med = best_of(libs, step, args.reps)
        flops = 2 * M * (LAYERS * sum(k * n for k, n in SHAPES) + HIDDEN * VOCAB)
        print(f"{M:>5}  {best['base'] * 1e3:>8.1f}  {best['new'] * 1e3:>8.1f}  {flops / best['base'] / 1e9:>12.0f}  "
              f"{flops / best['new'] / 1e9:>11.0f}  {best['base'] / best['new']:>6.2f}x  {med:>6.2f}x", flush=True)
    return 0


def step_outputs(M: int):
    """A step's outputs at M rows: ({(layer, linear): [M, out]}, the greedy tokens [M])."""
    import torch

    return ({(l, j): torch.empty(M, n) for l in range(LAYERS) for j, (_, n) in enumerate(SHAPES)},
            torch.empty(M, dtype=torch.int64))


def same_outputs(a, b) -> bool:
    """Whether two `step_outputs` hold the same bits."""
    import torch

    return all(torch.equal(a[0][key], b[0][key]) for key in a[0]) and torch.equal(a[1], b[1])


def attention(libs, args, threads: int) -> int:
    import numpy as np
    import torch

    g = torch.Generator().manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    per_row = -(-args.context // BLOCK)
    num_blocks = max(rows) * per_row + 1
    caches = [(torch.randn(num_blocks, BLOCK, HKV, HEAD_DIM, generator=g),
               torch.randn(num_blocks, BLOCK, HKV, HEAD_DIM, generator=g)) for _ in range(LAYERS)]
    from cpu_kernels.torch_ops import KV_TYPES

    kv_dtype = getattr(torch, args.kv_dtype)
    tasks = {name: tasks_fn(lib) for name, lib in libs.items()} if args.layout == "jax" else {}
    if args.layout == "jax":  # one cache a layer, K and V of kv head h at rows 2h and 2h + 1 of a token
        caches = [(torch.stack([k, v], dim=3).reshape(num_blocks, BLOCK, 2 * HKV, HEAD_DIM),) for k, v in caches]
        new_caches = caches if kv_dtype == torch.float32 else [(c.to(kv_dtype),) for c, in caches]
    else:
        new_caches = caches if kv_dtype == torch.float32 else [(k.to(kv_dtype), v.to(kv_dtype)) for k, v in caches]
    print(f"decode step attention, SmolLM2-135M shapes, {LAYERS} layers, {args.context} tokens a row in scattered "
          f"blocks of {BLOCK}, {args.layout}'s cache layout, {threads} thread(s); base {args.base} vs the working "
          f"tree, best of {args.reps} interleaved")
    print(f"{'rows':>5}  {'base ms':>8}  {'new ms':>8}  {'base GB/s':>9}  {'new GB/s':>8}  {'speedup':>7}  {'median':>7}")
    for M in rows:
        tables = torch.from_numpy(np.random.default_rng(M).permutation(num_blocks - 1)[: M * per_row]
                                  .reshape(M, per_row).astype(np.int32) + 1)
        kv_lens = torch.full((M,), args.context, dtype=torch.int32)
        tokens = torch.arange(M, dtype=torch.int64)
        q = torch.randn(M, HQ, HEAD_DIM, generator=g)
        outs = {name: torch.empty(M, HQ, HEAD_DIM) for name in libs}
        hs = libs["new"].decode_heads_per_task(M, HQ, HKV, threads)  # heads a task, as the custom call picks

        def step(name: str) -> None:
            lib, out = libs[name], outs[name]
            if args.layout == "jax":
                return jax_layout_step(tasks[name], hs, new_caches if name == "new" else caches, q, M, kv_lens,
                                       tables, per_row, out, threads)
            # the last argument, the cache's dtype (torch_ops.KV_TYPES), is ignored by a base from before it
            for kc, vc in (new_caches if name == "new" else caches):
                if lib.decode_attention(q.data_ptr(), q.stride(0), M, tokens.data_ptr(), kv_lens.data_ptr(),
                                        tables.data_ptr(), per_row, kc.data_ptr(), vc.data_ptr(), BLOCK, HQ, HKV,
                                        HEAD_DIM, HEAD_DIM ** -0.5, 0, out.data_ptr(), threads, KV_TYPES[kc.dtype]):
                    raise RuntimeError("decode_attention refused its arguments")

        for name in libs:
            step(name)
        if kv_dtype == torch.float32 and not torch.equal(outs["base"], outs["new"]):
            print(f"{M:>5}  the two builds give different outputs")
            return 1
        best, med = best_of(libs, step, args.reps)
        nbytes = 2 * LAYERS * M * args.context * HKV * HEAD_DIM * 4  # K and V read once (float32: the base's)
        print(f"{M:>5}  {best['base'] * 1e3:>8.1f}  {best['new'] * 1e3:>8.1f}  {nbytes / best['base'] / 1e9:>9.1f}  "
              f"{nbytes / best['new'] / 1e9:>8.1f}  {best['base'] / best['new']:>6.2f}x  {med:>6.2f}x", flush=True)
    return 0


def tasks_fn(lib):
    """The library's `decode_attention_tasks` with its signature (what jaxengine's custom call runs)."""
    import ctypes

    f = lib.decode_attention_tasks
    P, I, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    f.argtypes = [P, L, P, P, P, I, P, P, L, L, I, I, I, I, ctypes.c_float, I, P, I, I, I, I]
    f.restype = I
    return f


def jax_layout_step(f, hs: int, caches, q, M: int, kv_lens, tables, per_row: int, out, threads: int) -> None:
    """One step's decode attention over jaxengine's cache layout, as its custom call runs it: `f` (`tasks_fn`;
    K at a token row's 2h, V at 2h + 1, rows 2 Hkv D long) over tasks of `hs` heads, split between `threads`
    Python threads (ctypes lets go of the GIL), each a contiguous share, every layer."""
    import threading

    from cpu_kernels.torch_ops import KV_TYPES

    ntasks = M * (HQ // hs)
    errors = []

    def share(t0: int, t1: int) -> None:
        for (c,) in caches:
            es = c.element_size()
            if f(q.data_ptr(), HQ * HEAD_DIM, None, kv_lens.data_ptr(), tables.data_ptr(), per_row, c.data_ptr(),
                 c.data_ptr() + HEAD_DIM * es, 2 * HKV * HEAD_DIM, 2 * HEAD_DIM, BLOCK, HQ, HKV, HEAD_DIM,
                 HEAD_DIM ** -0.5, 0, out.data_ptr(), hs, t0, t1, KV_TYPES[c.dtype]):
                errors.append("decode_attention_tasks refused its arguments")

    bounds = [ntasks * t // threads for t in range(threads + 1)]
    helpers = [threading.Thread(target=share, args=(bounds[t], bounds[t + 1])) for t in range(1, threads)]
    for h in helpers:
        h.start()
    share(bounds[0], bounds[1])
    for h in helpers:
        h.join()
    if errors:
        raise RuntimeError(errors[0])


def decode_step(libs, args, threads: int) -> int:
    import ctypes

    import numpy as np
    import torch

    from cpu_kernels import torch_ops

    g = torch.Generator().manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    per_row = -(-args.context // BLOCK)
    num_blocks = max(rows) * per_row + 1
    inter = SHAPES[3][0]
    weights = []  # (the tensors of a layer, kept alive), one decode_layer struct each
    # each build's own decode_layer: one without run_layers ends before q_norm / k_norm (appended with it)
    old = [f for f in torch_ops._DecodeLayer._fields_ if f[0] not in ("q_norm", "k_norm")]
    layout = {name: torch_ops._DecodeLayer if hasattr(lib, "run_layers")
              else type("DecodeLayer", (ctypes.Structure,), {"_fields_": old}) for name, lib in libs.items()}
    structs = {name: (layout[name] * LAYERS)() for name in libs}
    for cs in zip(*structs.values()):
        t = {name: torch_ops.pack_panels(torch.randn(n, k, generator=g) / k ** 0.5)
             for name, (k, n) in zip(("qkv", "o", "gate_up", "down"), SHAPES)}
        t["norm"] = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
        t["k"], t["v"] = (torch.randn(num_blocks, BLOCK, HKV, HEAD_DIM, generator=g) for _ in range(2))
        for c in cs:
            c.attn_norm = c.mlp_norm = t["norm"].data_ptr()
            c.key_cache, c.value_cache = t["k"].data_ptr(), t["v"].data_ptr()
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(c, f"{name}_w", t[name].data_ptr())
        weights.append(t)
    ang = torch.arange(args.context + 1.0)[:, None] * 10000.0 ** (-torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    cos, sin = (torch.cat([a, a], dim=1).contiguous() for a in (ang.cos(), ang.sin()))  # [positions, D]
    print(f"decode step decode_layers, SmolLM2-135M shapes (float32, random weights), {LAYERS} layers, "
          f"{args.context} tokens a row in scattered blocks of {BLOCK}, {threads} thread(s); base {args.base} vs "
          f"the working tree, best of {args.reps} interleaved")
    print(f"{'rows':>5}  {'base ms':>8}  {'new ms':>8}  {'speedup':>7}  {'median':>7}")
    for M in rows:
        tables = np.ascontiguousarray(np.random.default_rng(M).permutation(num_blocks - 1)[: M * per_row]
                                      .reshape(M, per_row).astype(np.int32) + 1)
        kv_lens = np.full(M, args.context, dtype=np.int32)
        pos = args.context - 1
        positions = torch.full((M,), pos, dtype=torch.int64)
        slots = torch.from_numpy(tables[:, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK)
        x = torch.randn(M, HIDDEN, generator=g)
        ws = torch.empty(libs["new"].decode_workspace(M, HIDDEN, HQ, HKV, HEAD_DIM, inter), dtype=torch.float32)
        outs = {name: torch.empty(M, HIDDEN) for name in libs}

        def step(name: str) -> None:
            if libs[name].decode_layers(
                    ctypes.addressof(structs[name]), LAYERS, x.data_ptr(), M, positions.data_ptr(), cos.shape[0],
                    cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), kv_lens.ctypes.data, tables.ctypes.data,
                    per_row, BLOCK, HIDDEN, HQ, HKV, HEAD_DIM, inter, 1e-5, HEAD_DIM ** -0.5, 0, ws.data_ptr(),
                    outs[name].data_ptr(), threads, 0):
                raise RuntimeError("decode_layers refused its arguments")

        for name in libs:
            step(name)
        if not torch.equal(outs["base"], outs["new"]):
            print(f"{M:>5}  the two builds give different outputs")
            return 1
        best, med = best_of(libs, step, args.reps)
        print(f"{M:>5}  {best['base'] * 1e3:>8.1f}  {best['new'] * 1e3:>8.1f}  {best['base'] / best['new']:>6.2f}x  {med:>6.2f}x",
              flush=True)
    return 0


def qx_step(args, threads: int) -> int:
    """--what qx: float32 panels against GGUF blocks multiplied as stored, the same weights, and the blocks in the
    base's build (its packing the working tree's)."""
    import numpy as np
    import torch

    from cpu_kernels import layout as qx
    from enginecore.model_loader import Int4Groups, Int8Groups, Iq4Groups
    from cpu_kernels import torch_ops

    lib = torch_ops.lib()
    if lib is None:
        print(f"the working tree's kernels do not build: {torch_ops.load()[1]}")
        return 1
    if args.qx_kind == "bdot" and not lib.bdot_supported():
        print("no AVX512-BF16 here: QX_BDOT does not run")
        return 1
    base = base_build(args.base)
    if args.qx_tiles == "avx2":
        lib.qx512_use(0)
        base.qx512_use(0)
    tiles = "AVX-512" if lib.qx512_use(-1) else "256-bit"
    rng = np.random.default_rng(0)

    def f16(shape, s):
        return (rng.standard_normal(shape) * s).astype(np.float16).astype(np.float32)

    bdot = args.qx_kind == "bdot"
    bf16, q4k, i8, iq4 = args.qx_kind in ("bf16", "f16", "bdot"), *(args.qx_kind == k for k in ("q4k", "i8", "iq4"))
    half = torch.float16 if args.qx_kind == "f16" else torch.bfloat16

    def bf16_weight(n, k):  # (or float16s, --qx-kind f16)
        return (torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)) / k ** 0.5).to(half).float()

    def halves(w):
        p = torch_ops.pack_panels(w).numpy()
        return torch.from_numpy(qx.bdot_panels(lib, p) if bdot else qx.half_panels(lib, "w", p, qx.half_kind(p)))

    layers = []  # per layer: [(float32 panels, qx panels)] for q/k/v, o, gate/up, down
    for _ in range(LAYERS):
        ws = []
        for k, n in SHAPES:
            if bf16:
                w = bf16_weight(n, k)
                ws.append((torch_ops.pack_panels(w), halves(w)))
                continue
            d, m = f16((n, k // 32), 0.01), f16((n, k // 32), 0.05)
            if q4k:  # a Q4_K's scales d * sc and offsets -(dmin * mn): float32, 6 more bits than a float16's
                d, m = d * rng.integers(1, 64, d.shape), m * rng.integers(1, 64, m.shape)
            if iq4:  # IQ4_XS's scales d * (sc - 32)
                g = Iq4Groups(rng.integers(0, 16, (n, k)).astype(np.uint8), d * rng.integers(-32, 32, d.shape))
                packed = qx.pack_q4x(g.q, g.scale, None, qx.QX_KINDS["IQ4"])
            else:
                g = Int4Groups(rng.integers(0, 16, (n, k)).astype(np.uint8), d.astype(np.float32),
                               m.astype(np.float32))
                packed = qx.pack_i8x(qx.to_wide(g)) if i8 else qx.pack_q4x(g.q, g.scale, g.offset, qx.q4_kind(g))
            ws.append((torch_ops.pack_panels(torch.from_numpy(g.dequantize())), torch.from_numpy(packed)))
        layers.append(ws)
    if bf16:
        w = bf16_weight(VOCAB, HIDDEN)
        head = (torch_ops.pack_panels(w), halves(w))
        kinds = (torch_ops.QX_KINDS["BDOT" if bdot else "BF16" if half == torch.bfloat16 else "F16"],) * 2
        what = (f"{'b' if half == torch.bfloat16 else ''}float16-exact weights as those 16 bits (qx_gemm, ~270 MB)"
                if not bdot else "the same bfloat16 weights times activations rounded to bfloat16 (QX_BDOT, ~270 MB)")
    else:
        h = Int8Groups(rng.integers(-128, 128, (VOCAB, HIDDEN)).astype(np.int8), f16((VOCAB, HIDDEN // 32), 0.002))
        head = (torch_ops.pack_panels(torch.from_numpy(h.dequantize())), torch_ops.pack_q8x(h.q, h.scale))
        name = "Q4_K" if q4k else "I8" if i8 else "IQ4" if iq4 else "Q4_1"
        kinds = torch_ops.QX_KINDS[name], torch_ops.QX_KINDS["Q8_0"]
        what = f"{name} blocks and a Q8_0 head as stored (qx_gemm, ~{ {'Q4_K': 110, 'I8': 190}.get(name, 100)} MB)"
    print(f"decode step linears and greedy head of SmolLM2-135M's shapes, {threads} thread(s): float32 panels "
          f"(panel_gemm, ~540 MB) vs {what} in {tiles} tiles, the same weights, and the blocks in {args.base}'s "
          f"build; best of {args.reps} interleaved (medians: the last column)")
    print(f"{'rows':>5}  {'f32 ms':>8}  {'base ms':>8}  {'qx ms':>8}  {'f32 GB/s':>8}  {'qx GB/s':>8}  {'vs f32':>7}  "
          f"{'vs base':>7}  {'median':>7}")
    nbytes = {"f32": 4 * (LAYERS * sum(k * n for k, n in SHAPES) + VOCAB * HIDDEN)}
    nbytes["qx"] = (nbytes["f32"] // 2 if bf16 else
                    LAYERS * sum(k * n for k, n in SHAPES) * (24 if q4k else 48 if i8 else 20) // 32
                    + VOCAB * HIDDEN * 34 // 32)
    for M in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(M, k) for k in (576, 1536)}
        outs = {name: step_outputs(M) for name in ("f32", "base", "new")}

        def step(name: str) -> None:
            ys, best = outs[name]
            qlib = base if name == "base" else lib
            for l, ws in enumerate(layers):
                for j, ((k, n), (wf, wq)) in enumerate(zip(SHAPES, ws)):
                    y = ys[l, j].data_ptr()
                    rc = (lib.panel_gemm(xs[k].data_ptr(), M, k, wf.data_ptr(), n, y, None, threads) if name == "f32"
                          else qlib.qx_gemm(xs[k].data_ptr(), M, k, wq.data_ptr(), n, y, None, kinds[0], threads))
                    if rc:
                        raise RuntimeError(f"{name}: the kernel refused its arguments")
            rc = (lib.panel_gemm(xs[HIDDEN].data_ptr(), M, HIDDEN, head[0].data_ptr(), VOCAB, None, best.data_ptr(),
                                 threads) if name == "f32" else
                  qlib.qx_gemm(xs[HIDDEN].data_ptr(), M, HIDDEN, head[1].data_ptr(), VOCAB, None, best.data_ptr(),
                               kinds[1], threads))
            if rc:
                raise RuntimeError(f"{name}: the kernel refused its arguments")

        for name in outs:
            step(name)
        if not same_outputs(outs["base"], outs["new"]) or not bdot and not same_outputs(outs["f32"], outs["new"]):
            print(f"{M:>5}  they give different outputs")  # (bfloat16 products: other bits than float32's)
            return 1
        best, med = best_of(outs, step, args.reps)
        print(f"{M:>5}  {best['f32'] * 1e3:>8.1f}  {best['base'] * 1e3:>8.1f}  {best['new'] * 1e3:>8.1f}  "
              f"{nbytes['f32'] / best['f32'] / 1e9:>8.1f}  {nbytes['qx'] / best['new'] / 1e9:>8.1f}  "
              f"{best['f32'] / best['new']:>6.2f}x  {best['base'] / best['new']:>6.2f}x  {med:>6.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
