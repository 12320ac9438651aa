"""What streaming a tool call costs the API server: every tool-call parser fed a call whose arguments hold
--kb KB of source code (a JSON string full of escapes: newlines, quotes, backslashes) in deltas of --chars
characters, as a streamed chat completion feeds `ToolCallStreamer` one detokenized delta at a time.

    python -m benchmarks.bench_tool_stream [--kb 4,16,64] [--chars 4]

A parser reads the whole text written so far at each delta (its deltas then add up to the non-streamed answer
by construction: frontend/tool_parsers/base.py), so the cost grows with the text; the table prints the time of
the whole stream, per delta, and the ratio to one non-streamed parse of the final text (`extract_tool_calls`,
measured in the same run): the overhead of streaming. The streamed arguments are checked equal to the
non-streamed ones first.
"""

from __future__ import annotations

import argparse
import json
import time

CODE_LINE = 'print("a \\\\ b", {"k": [1, 2]})\t# x = 1\n'


def call_text(parser: str, args: dict) -> str:
    """The call as the parser's models write it."""
    if parser == "qwen3_xml":
        return (f"<tool_call>\n<function=run>\n<parameter=code>\n{args['code']}\n</parameter>\n</function>\n"
                "</tool_call>")
    if parser == "llama3_json":
        return "<|python_tag|>" + json.dumps({"name": "run", "parameters": args})
    if parser == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": "run", "arguments": args}])
    return "<tool_call>\n" + json.dumps({"name": "run", "arguments": args}) + "\n</tool_call>"


def stream(parser, text: str, chars: int) -> tuple[str, int]:
    """The arguments `ToolCallStreamer` streams for `text` fed `chars` characters at a time, and the deltas."""
    from frontend.tool_parsers import ToolCallStreamer

    s, args, n = ToolCallStreamer(parser), "", 0
    for i in range(0, len(text), chars):
        n += 1
        args += "".join(d["function"]["arguments"] for d in s.feed(text[i:i + chars], final=False)[1])
    args += "".join(d["function"]["arguments"] for d in s.feed("", final=True)[1])
    return args, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kb", default="4,16,64", help="sizes of the arguments' code, KB")
    ap.add_argument("--chars", type=int, default=4, help="characters a delta (a token is ~4)")
    args = ap.parse_args()

    from frontend.tool_parsers import TOOL_PARSERS

    tools = [{"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]
    names = [n for n in ("hermes", "llama3_json", "mistral", "qwen3_xml") if n in TOOL_PARSERS]
    print(f"one tool call streamed in deltas of {args.chars} characters; its arguments: code with escapes")
    print(f"{'parser':>12}  {'KB':>4}  {'deltas':>6}  {'stream s':>8}  {'us/delta':>8}  {'one parse ms':>12}  "
          f"{'stream/parse':>12}")
    for kb in (int(k) for k in args.kb.split(",")):
        code = CODE_LINE * max(1, kb * 1024 // len(CODE_LINE))
        for name in names:
            parser = TOOL_PARSERS[name](tools)
            text = call_text(name, {"code": code})
            t0 = time.perf_counter()
            streamed, n = stream(parser, text, args.chars)
            t_stream = time.perf_counter() - t0
            t0 = time.perf_counter()
            _, calls = parser.extract_tool_calls(text)
            t_one = time.perf_counter() - t0
            if len(calls) != 1 or json.loads(calls[0].arguments) != {"code": code} or \
                    json.loads(streamed) != json.loads(calls[0].arguments):
                print(f"{name:>12}  {kb:>4}  the streamed arguments differ from the parsed ones")
                return 1
            print(f"{name:>12}  {kb:>4}  {n:>6}  {t_stream:>8.2f}  {1e6 * t_stream / n:>8.1f}  {1e3 * t_one:>12.2f}  "
                  f"{t_stream / t_one:>12.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
