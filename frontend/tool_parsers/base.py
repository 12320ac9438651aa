"""What every tool-call parser shares: the parse result, a JSON scanner for half-written text, and the
streaming driver that turns successive parses of a growing text into OpenAI's `delta.tool_calls`.

A parser has one method, `parse(text, final)`: it reads the text written so far and says where the
content before the calls ends and which calls it sees, each with its name (once complete) and the
part of its arguments that can no longer change. Non-streaming extraction is the same parse with
`final=True`, so a stream's deltas always add up to the non-streamed answer: each partial parse's
arguments are a prefix of the final ones, by construction.
"""

from __future__ import annotations

import contextvars
import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class PartialCall:
    name: str | None  # None until the whole name is written
    arguments: str = ""  # JSON text of the arguments written so far that cannot change any more
    done: bool = False  # the call is complete: `arguments` is final


@dataclass
class Parse:
    content_end: int  # text[:content_end] is content (text before the first call); never shrinks
    calls: list[PartialCall] = field(default_factory=list)
    error: bool = False  # the calls' text is malformed (at the end: no tool calls, all text is content)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = field(default_factory=make_tool_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolParser(ABC):
    """Finds tool calls in a model's output (`--tool-call-parser NAME`)."""

    name: str = ""
    markers: tuple[str, ...] = ()  # text that opens a tool-call section (checked against special tokens)

    def __init__(self, tools: list[dict] | None = None):
        self.functions = {t["function"]["name"]: t["function"] for t in tools or []}

    @abstractmethod
    def parse(self, text: str, final: bool) -> Parse: ...

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; malformed calls leave all the text as content."""
        p = self.parse(text, final=True)
        calls = complete_calls(p)
        if not calls:
            return (text or None), []
        return (text[: p.content_end] or None), calls


def complete_calls(p: Parse) -> list[ToolCall]:
    """The calls of a final parse, or [] if any is malformed or unfinished."""
    if p.error or not p.calls or not all(c.done and c.name for c in p.calls):
        return []
    for c in p.calls:
        try:
            if not isinstance(json.loads(c.arguments), dict):
                return []
        except ValueError:
            return []
    return [ToolCall(c.name, c.arguments) for c in p.calls]


class ToolCallStreamer:
    """One choice's streaming state: feed it the text deltas, get content and `delta.tool_calls` entries."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.text = ""
        self.sent_content = 0
        self.ids: list[str] = []
        self.sent_args: list[int] = []
        self.open_strings: dict[int, str] = {}  # scan_string's memo for this stream's text (_OPEN_STRINGS)

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict]]:
        self.text += delta
        memo = _OPEN_STRINGS.set(self.open_strings)
        try:
            p = self.parser.parse(self.text, final)
        finally:
            _OPEN_STRINGS.reset(memo)
        if final and not self.ids and not complete_calls(p):
            # nothing was announced as a call and nothing valid came: it was all content
            rest, self.sent_content = self.text[self.sent_content:], len(self.text)
            return rest, []
        content = ""
        if p.content_end > self.sent_content:
            content, self.sent_content = self.text[self.sent_content: p.content_end], p.content_end
        out: list[dict] = []
        for i, c in enumerate(p.calls):
            if c.name is None:
                break
            if i == len(self.ids):
                self.ids.append(make_tool_call_id())
                self.sent_args.append(0)
                out.append({"index": i, "id": self.ids[i], "type": "function",
                            "function": {"name": c.name, "arguments": ""}})
            new = c.arguments[self.sent_args[i]:]
            if new:
                out.append({"index": i, "function": {"arguments": new}})
                self.sent_args[i] = len(c.arguments)
        return content, out


# ---- scanning JSON that may be cut off anywhere -----------------------------------------------

_WS = " \t\r\n"
_SCALAR = re.compile(r"-?[0-9][0-9.eE+\-]*|true|false|null|-")


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def held_marker_prefix(s: str, marker: str) -> int:
    """Length of the longest tail of `s` that could be the start of `marker` (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(s)), 0, -1):
        if marker.startswith(s[-k:]):
            return k
    return 0


def content_until(text: str, marker: str, final: bool) -> tuple[int, Parse]:
    """(index of the first `marker`, a parse whose content ends there); no marker yet: (-1, a parse where
    everything is content except a tail that may be the marker's start)."""
    start = text.find(marker)
    if start < 0:
        return -1, Parse(len(text) if final else len(text) - held_marker_prefix(text, marker))
    return start, Parse(start)


def after_next_marker(text: str, i: int, marker: str) -> int | None:
    """The index after the next `marker` from i on (whitespace skipped; other text before it is dropped, as
    vLLM does), or None if there is none yet (the text may end with the marker's beginning)."""
    i = skip_ws(text, i)
    if text.startswith(marker, i):
        return i + len(marker)
    if i >= len(text) or marker.startswith(text[i:]):
        return None
    nxt = text.find(marker, i)
    return None if nxt < 0 else nxt + len(marker)


_VALUE_STOP = re.compile(r'["{}\[\]]')


# A streamed call's long string still open at the end of its text: {where it starts: that text}, one entry (only
# the last string of a text can be open). Each delta's parse reads the whole text again, and the text only grows:
# a string with no closing quote before len(t) in a text `t` resumes there in a text that starts with `t`.
# `ToolCallStreamer.feed` sets its own dict around its parse (so streams never share or keep each other's, and it
# goes with the stream); unset, as in a non-streamed parse, every string is scanned from its start.
_OPEN_STRINGS: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar("open_strings", default=None)
_OPEN_MIN = 1024  # characters; shorter strings are rescanned


def scan_string(s: str, i: int) -> int | None:
    """s[i] == '"': the index after the closing quote, or None if the string is not finished: from quote to
    quote (str.find), a quote closing it when an even number of backslashes precede it; in a stream, a long
    string found open in the previous text resumes where that text ended (_OPEN_STRINGS). Stepping from escape
    to escape, every delta's parse from the start, a streamed call whose arguments hold 64 KB of code cost
    2.7-4 ms of parsing a delta (benchmarks/bench_tool_stream.py)."""
    j = i + 1
    memo = _OPEN_STRINGS.get()
    seen = memo.get(i) if memo is not None else None
    if seen is not None and s.startswith(seen):
        j = len(seen)
    while (q := s.find('"', j)) >= 0:
        b = q
        while b > i + 1 and s[b - 1] == "\\":
            b -= 1
        if (q - b) % 2 == 0:
            return q + 1
        j = q + 1
    if memo is not None and len(s) - i >= _OPEN_MIN:
        memo.clear()
        memo[i] = s
    return None


def scan_value(s: str, i: int, final: bool) -> int | None:
    """The end of the JSON value at s[i] (not validated: json.loads does that), None if it may go on.
    Raises ValueError on text that cannot start a JSON value."""
    c = s[i]
    if c == '"':
        return scan_string(s, i)
    if c in "{[":
        depth, j = 0, i
        while True:  # jump from bracket to bracket; strings may hold any of them
            m = _VALUE_STOP.search(s, j)
            if m is None:
                return None
            c, j = m.group(), m.start()
            if c == '"':
                e = scan_string(s, j)
                if e is None:
                    return None
                j = e
                continue
            depth += 1 if c in "{[" else -1
            if depth == 0:
                return j + 1
            j += 1
    m = _SCALAR.match(s, i)
    if m is None:
        if not final and any(w.startswith(s[i:]) for w in ("true", "false", "null")):
            return None
        raise ValueError(f"not JSON at {i}: {s[i:i + 20]!r}")
    if m.end() == len(s) and not final:
        return None  # a number or literal at the end of the text may still grow
    return m.end()


NAME_KEYS = ("name",)
ARG_KEYS = ("arguments", "parameters")


def parse_call_object(s: str, i: int, final: bool) -> tuple[PartialCall, int | None]:
    """A `{"name": ..., "arguments": {...}}` object at s[i] (whitespace allowed before it).
    Returns the call and the index after the object, or None if it is not finished yet.
    Arguments stream as raw text once their object has started; arguments given as a JSON string
    (some models do) are decoded when complete. Raises ValueError on malformed text."""
    call = PartialCall(None)
    i = skip_ws(s, i)
    if i >= len(s):
        return call, None
    if s[i] != "{":
        raise ValueError(f"expected an object at {i}")
    i += 1
    name = args = None
    while True:
        i = skip_ws(s, i)
        if i >= len(s):
            break
        if s[i] == "}":
            call.name, call.done = name, True
            call.arguments = args if args is not None else "{}"
            return call, i + 1
        if s[i] == ",":
            i += 1
            continue
        if s[i] != '"':
            raise ValueError(f"expected a key at {i}")
        ke = scan_string(s, i)
        if ke is None:
            break
        key = json.loads(s[i:ke])
        i = skip_ws(s, ke)
        if i >= len(s):
            break
        if s[i] != ":":
            raise ValueError(f"expected ':' at {i}")
        i = skip_ws(s, i + 1)
        if i >= len(s):
            break
        ve = scan_value(s, i, final)
        if key in NAME_KEYS:
            if ve is None:
                break
            name = json.loads(s[i:ve])
            if not isinstance(name, str):
                raise ValueError("the function name is not a string")
            call.name = name
        elif key in ARG_KEYS:
            if ve is None:
                if s[i] == "{":
                    call.arguments = s[i:]
                break
            args = s[i:ve]
            if args.startswith('"'):
                args = json.loads(args)
            call.arguments = args
        elif ve is None:
            break
        i = ve
    return call, None


def scan_calls(p: Parse, calls, text: str, i: int, final: bool) -> Parse:
    """Run `calls(text, i, final, p)`, which appends the calls it reads to `p`; a malformed call (ValueError)
    marks the parse as an error, keeping the calls before it."""
    try:
        calls(text, i, final, p)
    except ValueError:
        p.error = True
    return p


def scan_call_list(text: str, i: int, final: bool, p: Parse, sep: str = ",", close: str | None = "]") -> None:
    """The call objects from `i` on, separated by `sep`, appended to `p`: by default those of a JSON array whose
    `[` ends before `i`; with `close=None` a list that ends with the text, where a last `sep` may end it too
    (Llama 3's `;`). ValueError: malformed, or other text after a call."""
    while True:
        call, end = parse_call_object(text, i, final)
        p.calls.append(call)
        if end is None:
            return
        i = skip_ws(text, end)
        if i >= len(text) or text[i] == close:
            return
        if text[i] != sep:
            raise ValueError(f"expected {sep!r}{f' or {close!r}' if close else ''} at {i}")
        i += 1
        if close is None and skip_ws(text, i) >= len(text):
            return

