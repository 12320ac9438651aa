"""`xlaserve serve`: start the engine core, then the HTTP server; shut both down cleanly.

Order: validate flags and resolve the model (fast failures first), bind the
port (fail before minutes of warm-up if it is taken), start the engine core
and wait until it is warm, then serve.

SIGTERM / SIGINT drain the server: new generation requests get 503 (the port
stays open, so clients see why rather than a refused connection) and /health
turns 503, while requests in flight run to their end for up to
--shutdown-timeout seconds (0: none); the rest are aborted (their streams end
with an error event). Then uvicorn closes the port and the connections, the
engine core stops (its tensor-parallel ranks with it) and the server exits 0.
A second SIGINT cuts the grace period short. If the engine core dies the
server exits (status 1) unless VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is set.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading

from enginecore import envs
from frontend.args import build_serve_parser, parse_serve_args, serving_engine_args

logger = logging.getLogger("xlaserve.serve")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", usage="xlaserve serve [MODEL] [options]", help="Start the OpenAI-compatible server.",
        description="Start the OpenAI-compatible server (flags as `vllm serve`). "
                    "`--help=<group|flag|keyword>` shows part of this help; groups: ModelConfig, CacheConfig, "
                    "SchedulerConfig, ParallelConfig, DeviceConfig, Frontend, VllmCompat.")
    build_serve_parser(p)
    p.set_defaults(_run=run_serve)


def run_serve(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    ns = parse_serve_args(parser, argv)
    return run_server(ns)


def run_server(ns: argparse.Namespace, core_factory=None) -> int:
    from enginecore.config import ConfigError
    from enginecore.model_loader import ModelLoadError

    try:
        return _run_loop(_serve(ns, core_factory))
    except (ConfigError, ModelLoadError) as e:
        logger.error("%s", e)
        return 2
    except KeyboardInterrupt:
        return 130


def _run_loop(coro) -> int:
    try:
        import uvloop

        factory = uvloop.new_event_loop
    except ImportError:  # pragma: no cover
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)


def bind_socket(host: str, port: int, uds: str | None) -> socket.socket:
    if uds:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(uds)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(uds)
        except OSError as e:
            sock.close()
            raise SystemExit(f"cannot bind --uds {uds}: {e.strerror}")
        return sock
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"cannot bind {host}:{port} ({e.strerror}); choose another --port / --host")
    sock.set_inheritable(True)
    return sock


def _http_options(ns: argparse.Namespace):
    from frontend.api_server import HTTPOptions

    keys = list(ns.api_key or [])
    if not keys and envs.VLLM_API_KEY:
        keys = [envs.VLLM_API_KEY]
    return HTTPOptions(
        api_keys=keys, root_path=ns.root_path or "", allowed_origins=ns.allowed_origins,
        allowed_methods=ns.allowed_methods, allowed_headers=ns.allowed_headers,
        allow_credentials=ns.allow_credentials, disable_fastapi_docs=ns.disable_fastapi_docs,
        enable_request_id_headers=ns.enable_request_id_headers,
        enable_server_load_tracking=ns.enable_server_load_tracking,
        max_request_body_bytes=ns.max_request_body_bytes, dev_mode=envs.VLLM_SERVER_DEV_MODE,
    )


def frontend_options(ns: argparse.Namespace, config, model):
    from enginecore.config import ConfigError
    from frontend.serving_common import FrontendOptions, load_sampling_defaults, resolve_chat_template

    from frontend.reasoning_parsers import REASONING_PARSERS
    from frontend.tool_parsers import TOOL_PARSERS

    if ns.enable_auto_tool_choice and not ns.tool_call_parser:
        raise ConfigError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(sorted(TOOL_PARSERS))}): "
                          "the parser that finds the model's calls in its text")
    # vLLM also takes the reasoning parser as --structured-outputs-config's reasoning_parser
    so_reasoning = config.structured_outputs_config.reasoning_parser or None
    if so_reasoning and ns.reasoning_parser and so_reasoning != ns.reasoning_parser:
        raise ConfigError(f"--reasoning-parser {ns.reasoning_parser} and --structured-outputs-config's "
                          f"reasoning_parser {so_reasoning} differ: give one")
    reasoning_parser = ns.reasoning_parser or so_reasoning
    if reasoning_parser and reasoning_parser not in REASONING_PARSERS:
        raise ConfigError(f"reasoning parser {reasoning_parser!r} is not one of {', '.join(sorted(REASONING_PARSERS))}")
    return FrontendOptions(
        response_role=ns.response_role,
        chat_template=resolve_chat_template(ns.chat_template),
        chat_template_content_format=ns.chat_template_content_format,
        trust_request_chat_template=ns.trust_request_chat_template,
        enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
        enable_force_include_usage=ns.enable_force_include_usage,
        return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
        log_requests=ns.enable_log_requests and not ns.disable_log_requests,
        max_log_len=ns.max_log_len,
        sampling_defaults=load_sampling_defaults(config, model),
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        tool_call_parser=ns.tool_call_parser,
        exclude_tools_when_tool_choice_none=ns.exclude_tools_when_tool_choice_none,
        reasoning_parser=reasoning_parser,
    )


def _make_uvicorn_server(config, drain):
    """uvicorn.Server that (1) awaits `drain(forced)` before its own shutdown closes the port (`forced()`: a
    second Ctrl-C) and (2) does not re-raise the caught signal after serving: we still have cleanup to do."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in original.items():
                    signal.signal(s, h)

        async def shutdown(self, sockets=None):
            await drain(lambda: self.force_exit)
            await super().shutdown(sockets=sockets)

    return Server(config)


def _uvicorn_config(ns: argparse.Namespace, app):
    import uvicorn

    return uvicorn.Config(
        app, log_level=ns.uvicorn_log_level, access_log=not ns.disable_uvicorn_access_log,
        # the drain (before uvicorn's shutdown) gave requests their --shutdown-timeout and aborted the rest;
        # uvicorn's own timeout only bounds the sending of their last bytes
        root_path=ns.root_path or "", timeout_graceful_shutdown=_SEND_BACKSTOP_S, timeout_keep_alive=5,
        ssl_keyfile=ns.ssl_keyfile, ssl_certfile=ns.ssl_certfile, ssl_ca_certs=ns.ssl_ca_certs,
        ssl_cert_reqs=ns.ssl_cert_reqs, h11_max_incomplete_event_size=ns.h11_max_incomplete_event_size,
        lifespan="off",
    )


# Seconds uvicorn may still spend sending the last bytes of responses after the drain.
_SEND_BACKSTOP_S = 5.0
# How often the drain looks at the number of requests in flight.
_DRAIN_POLL_S = 0.05


async def drain(state, client, grace_s: float, forced=lambda: False) -> None:
    """Refuse new generation requests (503), give those in flight `grace_s` seconds, then abort the rest."""
    from frontend.api_server import SHUTTING_DOWN

    state.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    if client.num_in_flight and grace_s > 0 and not client.is_dead:
        logger.info("shutting down: waiting up to %gs for %d request(s) in flight (--shutdown-timeout)", grace_s,
                    client.num_in_flight)
    while client.num_in_flight and not client.is_dead and not forced() and loop.time() < deadline:
        await asyncio.sleep(_DRAIN_POLL_S)
    if client.num_in_flight and not client.is_dead:
        logger.warning("shutting down: aborting %d request(s) still in flight after %gs", client.num_in_flight,
                       grace_s)
    client.stop_accepting(SHUTTING_DOWN)  # a request that got past the 503 check but is not queued yet
    client.fail_all(SHUTTING_DOWN)


async def _serve(ns: argparse.Namespace, core_factory=None) -> int:
    from enginecore.config import ConfigError
    from enginecore.engine import build_engine_config, load_engine_tokenizer, load_in_thread, served_model_names
    from frontend.api_server import ServerState, build_app
    from frontend.engine_client import AsyncEngineClient, EngineStartupError
    from frontend.metrics import ServerMetrics, StatsLogger

    if not ns.shutdown_timeout >= 0:  # (NaN too)
        raise ConfigError(f"--shutdown-timeout must be 0 (abort in-flight requests at once) or more seconds; "
                          f"got {ns.shutdown_timeout}")
    engine_args = serving_engine_args(ns)
    if engine_args.warmup == "auto":
        engine_args.warmup = "all"  # a server compiles every step shape before it answers: none while serving
    config, model = build_engine_config(engine_args)
    if ns.headless and config.parallel_config.data_parallel_size > 1 and config.parallel_config.nnodes == 1:
        from enginecore.engine_proc import run_dp_node

        stop = threading.Event()  # SIGTERM / SIGINT: stop this node's cores, telling the head
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        return await asyncio.to_thread(run_dp_node, config, stop)
    if ns.headless or config.parallel_config.node_rank > 0 or _tpu_slice_follower(config):
        return await asyncio.to_thread(run_headless, ns, config, model)
    if ns.api_server_count != 1:
        raise ConfigError(f"--api-server-count {ns.api_server_count}: xlaserve runs one API server process (its "
                          "engine client routes to every data-parallel core); give --api-server-count 1")
    from enginecore.engine_proc import dp_layout

    engine_ranks = dp_layout(config.parallel_config).served
    names = served_model_names(config, model)
    options = frontend_options(ns, config, model)
    http_opts = _http_options(ns)
    sock = bind_socket(ns.host, ns.port, ns.uds)
    metrics = ServerMetrics(names[0], config.scheduler_config.max_model_len, block_size=config.cache_config.block_size,
                            engines=engine_ranks)
    # the tokenizer loads while the engine core starts (client.start waits for both); what starting the core
    # imports is imported first, so the two threads never import the same modules at once
    import enginecore.engine_proc  # noqa: F401

    client = AsyncEngineClient(config, model, load_in_thread(load_engine_tokenizer, config, model), observer=metrics)
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    in_main_thread = threading.current_thread() is threading.main_thread()
    # until uvicorn takes the signals over: stop the start-up and clean up
    if in_main_thread:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, main_task.cancel)
    stats_task = None
    try:
        logger.info("starting the engine core (%s, backend %s on %s)", "own process"
                    if not ns.disable_frontend_multiprocessing else "in-process thread",
                    config.device_config.backend, config.device_config.platform)
        try:
            await client.start(multiprocess=not ns.disable_frontend_multiprocessing, core_factory=core_factory)
        except EngineStartupError as e:
            logger.error("the engine core failed to start: %s", e)
            return 1
        except asyncio.CancelledError:
            logger.info("interrupted during start-up")
            return 130
        if in_main_thread:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        metrics.set_cache_info(client.num_blocks, config.cache_config.block_size)
        state = ServerState(client, metrics, names, options)
        app = build_app(state, http_opts)
        server = _make_uvicorn_server(_uvicorn_config(ns, app),
                                      lambda forced: drain(state, client, ns.shutdown_timeout, forced))
        keep_alive = envs.VLLM_KEEP_ALIVE_ON_ENGINE_DEATH

        def on_dead(reason: str) -> None:
            if keep_alive:
                logger.error("engine core died (%s); VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is set: the server stays up "
                             "and answers 503", reason)
            else:
                logger.error("engine core died (%s); shutting the server down", reason)
                server.should_exit = True

        client.on_dead.append(on_dead)
        if not ns.disable_log_stats:
            interval = envs.VLLM_LOG_STATS_INTERVAL
            stats_task = asyncio.create_task(StatsLogger(metrics, interval).run())
        where = f"unix:{ns.uds}" if ns.uds else f"http{'s' if ns.ssl_certfile else ''}://{ns.host}:{ns.port}"
        logger.info("xlaserve %s API server on %s serving %s (max_model_len %d, %d KV blocks of %d tokens)",
                    _version(), where, ", ".join(names), config.scheduler_config.max_model_len, client.num_blocks,
                    config.cache_config.block_size)
        await server.serve(sockets=[sock])
        return 1 if client.is_dead else 0
    finally:
        if stats_task is not None:
            stats_task.cancel()
        if in_main_thread:
            for sig in (signal.SIGINT, signal.SIGTERM):
                with contextlib.suppress(Exception):
                    loop.remove_signal_handler(sig)
        await client.shutdown()
        sock.close()
        if ns.uds:
            with contextlib.suppress(OSError):
                os.unlink(ns.uds)
        logger.info("server stopped")


def _tpu_slice_follower(config) -> bool:
    """A Cloud TPU VM slice's worker > 0 (the same `xlaserve serve` runs on every worker; jax backend): headless."""
    if config.device_config.backend != "jax" or config.device_config.platform != "tpu":
        return False
    from jaxengine.multihost import tpu_slice_workers, tpu_worker_id

    return config.parallel_config.nnodes == 1 and tpu_slice_workers() > 1 and tpu_worker_id() > 0


def run_headless(ns: argparse.Namespace, config, model) -> int:
    """`--headless`: no HTTP; this host runs its share of the engine until the head stops it."""
    from enginecore.config import ConfigError
    from enginecore.runner import run_node

    pc = config.parallel_config
    if _tpu_slice_follower(config):
        logger.info("TPU slice worker %s: headless, driven by worker 0", os.environ.get("TPU_WORKER_ID"))
        return run_node(config, model)
    if pc.nnodes > 1:
        if pc.node_rank == 0:
            raise ConfigError("--node-rank 0 serves the API: run it without --headless (the other nodes are headless)")
        if not ns.headless:
            raise ConfigError(f"--node-rank {pc.node_rank} serves no HTTP (node 0 does): add --headless")
        logger.info("headless node %d of %d (%s backend): the engine's ranks of this host, driven by node 0 at %s:%d",
                    pc.node_rank, pc.nnodes, config.device_config.backend, pc.master_addr, pc.master_port)
        return run_node(config, model)
    raise ConfigError("--headless runs a host's share of an engine: give --nnodes N --node-rank R (R > 0) "
                      "--master-addr A --master-port P as on node 0, or this node's data-parallel cores: "
                      "--data-parallel-size N --data-parallel-size-local L --data-parallel-start-rank S")


def _version() -> str:
    from enginecore import __version__

    return __version__


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_serve(build_serve_parser(argparse.ArgumentParser()), sys.argv[1:]))
