"""`xlaserve run-batch -i in.jsonl -o out.jsonl [MODEL] [engine flags]`: OpenAI batch files, offline.

Each input line is `{"custom_id", "method": "POST", "url": "/v1/completions" |
"/v1/chat/completions", "body": {...}}`. Requests run on an in-process engine
(the engine core in a thread, as `--disable-frontend-multiprocessing`) through
the same request handlers as the server, so a line's `response.body` is exactly
what the server would answer. Output lines are appended as requests finish
(completion order), each flushed: a run that stops half-way can be restarted
with the same arguments, and custom_ids already in the output are not redone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import uuid

from frontend.args import build_serve_parser, engine_args_from_namespace, parse_serve_args

logger = logging.getLogger("xlaserve.run_batch")

URLS = ("/v1/completions", "/v1/chat/completions")


def register(subparsers) -> None:
    p = subparsers.add_parser("run-batch", help="Run an OpenAI batch file (JSONL) offline.",
                              usage="xlaserve run-batch -i INPUT.jsonl -o OUTPUT.jsonl [MODEL] [engine options]",
                              description="Run an OpenAI batch file offline; engine flags as for `serve`.")
    p.add_argument("-i", "--input-file", required=True, help="Input JSONL (OpenAI batch format).")
    p.add_argument("-o", "--output-file", required=True, help="Output JSONL (appended; resumable).")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="Requests in flight at once (default: 4 x --max-num-seqs).")
    p.add_argument("--no-progress", action="store_true", help="No progress bar.")
    build_serve_parser(p)
    p.set_defaults(_run=run_batch_cli)


def run_batch_cli(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    ns = parse_serve_args(parser, argv)
    from enginecore.config import ConfigError
    from enginecore.model_loader import ModelLoadError

    try:
        return asyncio.run(run_batch(ns))
    except (ConfigError, ModelLoadError, ValueError, OSError) as e:
        logger.error("%s", e)
        return 2


def done_custom_ids(path: str) -> set[str]:
    """custom_ids already answered in an existing output file (a torn last line is ignored)."""
    done: set[str] = set()
    if not os.path.exists(path):
        return done
    with open(path) as f:
        for line in f:
            try:
                cid = json.loads(line).get("custom_id")
            except (json.JSONDecodeError, AttributeError):
                continue
            if cid is not None:
                done.add(cid)
    return done


def _output_line(custom_id, status: int, request_id: str | None, body, error: str | None) -> str:
    return json.dumps({
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id or f"batch-{uuid.uuid4().hex}",
                     "body": body},
        "error": error,
    }) + "\n"


def read_input(path: str) -> list[tuple[int, dict | None, str | None]]:
    """(line number, parsed line or None, error or None) per non-empty line."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                if not isinstance(item, dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                out.append((n, None, f"line {n}: not valid JSON ({e})"))
                continue
            out.append((n, item, None))
    return out


async def run_batch(ns: argparse.Namespace, core_factory=None) -> int:
    from pydantic import ValidationError

    from enginecore.engine import build_engine_parts, served_model_names
    from frontend.engine_client import AsyncEngineClient
    from frontend.protocol import ChatCompletionRequest, CompletionRequest
    from frontend.serve import frontend_options
    from frontend.serving_chat import ServingChat
    from frontend.serving_common import error_status
    from frontend.serving_completion import ServingCompletion

    items = read_input(ns.input_file)
    done = done_custom_ids(ns.output_file)
    todo = [it for it in items if it[1] is None or it[1].get("custom_id") not in done]
    skipped = len(items) - len(todo)
    if skipped:
        logger.info("%d of %d requests are already in %s; running the other %d", skipped, len(items),
                    ns.output_file, len(todo))
    if not todo:
        return 0
    config, model, tokenizer = build_engine_parts(engine_args_from_namespace(ns))
    names = served_model_names(config, model)
    options = frontend_options(ns, config, model)
    client = AsyncEngineClient(config, model, tokenizer)
    await client.start(multiprocess=False, core_factory=core_factory)
    handlers = {"/v1/completions": (CompletionRequest, ServingCompletion(client, names, options)),
                "/v1/chat/completions": (ChatCompletionRequest, ServingChat(client, names, options))}
    limit = ns.max_concurrency or 4 * config.scheduler_config.max_num_seqs
    sem = asyncio.Semaphore(max(1, min(limit, config.scheduler_config.max_waiting_requests)))
    bar = None
    if not ns.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc="Running batch", unit="req", file=sys.stderr, dynamic_ncols=True)
    failures = 0

    async def one(out, n: int, item: dict | None, parse_error: str | None) -> None:
        nonlocal failures
        custom_id = item.get("custom_id") if item else None
        status, request_id, body, error = 200, None, None, None
        try:
            if parse_error:
                raise ValueError(parse_error)
            url = item.get("url")
            if url not in handlers:
                raise ValueError(f"line {n}: url {url!r} is not supported (use one of {', '.join(URLS)})")
            if item.get("method", "POST").upper() != "POST":
                raise ValueError(f"line {n}: method must be POST")
            model_cls, handler = handlers[url]
            req = model_cls.model_validate(item.get("body") or {})
            if req.stream:
                raise ValueError(f"line {n}: stream is not supported in batch files")
            async with sem:
                resp = await handler.create(req, None)
            body = json.loads(resp.body)
            request_id = body.get("id")
        except ValidationError as e:
            status, error = 400, f"line {n}: invalid body: {e.errors()[0].get('msg')} at " \
                                 f"{'.'.join(str(x) for x in e.errors()[0].get('loc', ()))}"
        except ValueError as e:
            status, error = 400, str(e)
        except Exception as e:
            status, error = error_status(e)
        if error is not None:
            failures += 1
        out.write(_output_line(custom_id, status, request_id, body, error))
        out.flush()
        if bar is not None:
            bar.update(1)

    try:
        with open(ns.output_file, "a") as out:
            await asyncio.gather(*(one(out, n, item, err) for n, item, err in todo))
    finally:
        if bar is not None:
            bar.close()
        await client.shutdown()
    logger.info("batch done: %d requests, %d failed; results in %s", len(todo), failures, ns.output_file)
    return 0
