"""`xlaserve chat` and `xlaserve complete`: small clients of a running server (as `vllm chat` / `vllm complete`).

With `-q/--quick "prompt"` they send one request and exit; otherwise they
read prompts line by line from stdin until EOF (chat keeps the conversation).
Replies are streamed to stdout.
"""

from __future__ import annotations

import argparse
import os
import sys

from enginecore import envs


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://localhost:8000/v1", help="The server's /v1 URL (default: %(default)s).")
    p.add_argument("--model-name", default=None, help="Model to use (default: the first of /v1/models).")
    p.add_argument("--api-key", default=None, help="API key (default: $OPENAI_API_KEY, then $VLLM_API_KEY).")
    p.add_argument("-q", "--quick", default=None, metavar="PROMPT", help="Send this one prompt, print the reply, exit.")
    p.add_argument("--max-tokens", type=int, default=None, help="max_tokens of each request.")
    p.add_argument("--temperature", type=float, default=None, help="Sampling temperature.")


def register(subparsers) -> None:
    chat = subparsers.add_parser("chat", help="Chat with a running server.",
                                 description="Chat with a running xlaserve (or any OpenAI-compatible) server.")
    _common(chat)
    chat.add_argument("--system-prompt", default=None, help="A system message to start the conversation with.")
    chat.set_defaults(_run=run_chat)
    comp = subparsers.add_parser("complete", help="Complete text with a running server.",
                                 description="Text completion against a running xlaserve server.")
    _common(comp)
    comp.set_defaults(_run=run_complete)


def _connect(args):
    from openai import OpenAI

    key = args.api_key or os.environ.get("OPENAI_API_KEY") or envs.VLLM_API_KEY or "EMPTY"
    client = OpenAI(base_url=args.url, api_key=key, max_retries=0)
    model = args.model_name or client.models.list().data[0].id
    return client, model


def _lines(prompt: str):
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input(prompt if interactive else "")
        except (EOFError, KeyboardInterrupt):
            return
        if line.strip():
            yield line


def _run(fn, args) -> int:
    import openai

    try:
        return fn(args)
    except openai.APIConnectionError:
        print(f"error: cannot reach the server at {args.url}", file=sys.stderr)
    except openai.APIStatusError as e:
        print(f"error: HTTP {e.status_code}: {e.message}", file=sys.stderr)
    return 1


def _sampling(args) -> dict:
    out = {}
    if args.max_tokens is not None:
        out["max_tokens"] = args.max_tokens
    if args.temperature is not None:
        out["temperature"] = args.temperature
    return out


def run_chat(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    return _run(_chat, parser.parse_args(argv))


def _chat(args) -> int:
    client, model = _connect(args)
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    prompts = [args.quick] if args.quick is not None else _lines("> ")
    for text in prompts:
        messages.append({"role": "user", "content": text})
        reply = []
        for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, **_sampling(args)):
            for choice in chunk.choices:
                if choice.delta.content:
                    reply.append(choice.delta.content)
                    print(choice.delta.content, end="", flush=True)
        print(flush=True)
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def run_complete(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    return _run(_complete, parser.parse_args(argv))


def _complete(args) -> int:
    client, model = _connect(args)
    prompts = [args.quick] if args.quick is not None else _lines("> ")
    for text in prompts:
        for chunk in client.completions.create(model=model, prompt=text, stream=True, **_sampling(args)):
            for choice in chunk.choices:
                print(choice.text, end="", flush=True)
        print(flush=True)
    return 0
