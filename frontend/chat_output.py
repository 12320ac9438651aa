"""One chat choice's text -> reasoning, content and tool calls (non-streamed and streamed alike).

The reasoning parser, if any, runs first; tool calls are looked for in the content only (as vLLM).
Which tool parser applies depends on the request's tool choice: the server's `--tool-call-parser` for
"auto", the enforced shapes for a named function or "required" (`tool_parsers.tool_choice`), none
for "none". Streaming and non-streaming run the same parsers, so streamed deltas add up to the
non-streamed message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from frontend.reasoning_parsers import RequestReasoning
from frontend.tool_parsers import ToolCall, ToolCallStreamer, ToolParser


@dataclass
class ParsedMessage:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's delta.tool_calls entries

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    """Per request: builds one streamer per choice and parses finished texts."""

    def __init__(self, reasoning: RequestReasoning | None, tool_parser: ToolParser | None, mode: str,
                 parallel_tool_calls: bool | None, include_reasoning: bool = True):
        self.reasoning = reasoning
        self.tool_parser = tool_parser
        self.mode = mode  # tool choice: none | auto | named | required
        self.single_call = parallel_tool_calls is False
        self.include_reasoning = include_reasoning

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tool_parser is not None

    def parse(self, text: str) -> ParsedMessage:
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.extract(text)
        if not self.include_reasoning:
            reasoning = None
        if self.tool_parser is None:
            return ParsedMessage(reasoning, content)
        content, calls = self.tool_parser.extract_tool_calls(content or "")
        if self.single_call:
            calls = calls[:1]
        return ParsedMessage(reasoning, content, calls)

    def finish_reason(self, generated: str | None, called: bool) -> str | None:
        """vLLM (after OpenAI): "tool_calls" when auto made calls or required stopped; named keeps "stop"."""
        if generated is None:
            return None
        if (self.mode == "auto" and called) or (self.mode == "required" and generated == "stop"):
            return "tool_calls"
        return generated

    def streamer(self) -> "ChoiceStreamer":
        return ChoiceStreamer(self)


class ChoiceStreamer:
    def __init__(self, parent: ChatOutputParser):
        self.parent = parent
        self.reasoning = parent.reasoning.streamer() if parent.reasoning is not None else None
        self.tools = ToolCallStreamer(parent.tool_parser) if parent.tool_parser is not None else None

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def feed(self, text: str, final: bool) -> ParsedDelta:
        reasoning, content = ("", text) if self.reasoning is None else self.reasoning.feed(text, final)
        if not self.parent.include_reasoning:
            reasoning = ""
        if self.tools is None:
            return ParsedDelta(reasoning, content)
        content, calls = self.tools.feed(content, final)
        if self.parent.single_call:
            calls = [c for c in calls if c["index"] == 0]
        return ParsedDelta(reasoning, content, calls)
