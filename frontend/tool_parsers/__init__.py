"""Tool-call parsers (`--tool-call-parser`), and the enforced tool choices (named, `required`).

See `base.py` for the one method a parser implements, `parse(text, final)`.
"""

from __future__ import annotations

from frontend.tool_parsers.base import ToolCall, ToolCallStreamer, ToolParser, complete_calls, make_tool_call_id
from frontend.tool_parsers.json_parsers import HermesToolParser, Llama3JsonToolParser, MistralToolParser
from frontend.tool_parsers.qwen3_xml import Qwen3XmlToolParser
from frontend.tool_parsers.tool_choice import (
    NamedToolParser,
    RequiredToolParser,
    ToolChoice,
    ToolChoiceError,
    invalid_tool_schema,
    resolve_tool_choice,
    tool_choice_schema,
)

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_xml": Qwen3XmlToolParser,
    "qwen3_coder": Qwen3XmlToolParser,  # vLLM's other name for the same format
}

__all__ = [
    "TOOL_PARSERS", "ToolCall", "ToolCallStreamer", "ToolParser", "complete_calls", "make_tool_call_id",
    "NamedToolParser", "RequiredToolParser", "ToolChoice", "ToolChoiceError", "invalid_tool_schema",
    "resolve_tool_choice", "tool_choice_schema",
]
