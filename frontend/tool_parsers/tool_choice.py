"""`tools` and `tool_choice` of a chat request: validation (400s naming the field), the JSON schema that
enforces a named or `required` choice through structured outputs, and the parsers of those outputs.

- named (`{"type": "function", "function": {"name": "f"}}`): the output *is* the arguments object
  (schema: the function's `parameters`); one call, finish_reason as generated ("stop"), as vLLM.
- `required`: the output is a JSON array of `{"name": <a tool>, "parameters": <its schema>}` (vLLM's
  shape: anyOf per tool, at least one item; at most one with `parallel_tool_calls: false`; no other
  keys in an item, which only made small models ramble).
"""

from __future__ import annotations

from dataclasses import dataclass

from enginecore.sampling_params import SamplingParamsError, StructuredOutputsParams
from frontend.tool_parsers.base import Parse, PartialCall, ToolParser, scan_call_list, scan_calls, skip_ws

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolChoiceError(ValueError):
    """A bad `tools` / `tool_choice` (HTTP 400); `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict]  # normalized: {"type": "function", "function": {"name", "parameters", ...}}
    name: str | None = None  # the named function

    @property
    def enforced(self) -> bool:
        return self.mode in ("required", "named")


def normalize_tools(tools: list | None) -> list[dict]:
    out = []
    for i, t in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise ToolChoiceError(f"{where}: only {{'type': 'function', 'function': {{...}}}} tools are supported",
                                  "tools")
        fn = t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolChoiceError(f"{where}.function needs a non-empty string 'name'", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolChoiceError(f"{where}.function.parameters must be a JSON schema object", "tools")
        out.append({**t, "type": "function", "function": dict(fn)})
    names = [t["function"]["name"] for t in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ToolChoiceError(f"tools: function names must be unique; repeated: {', '.join(dup)}", "tools")
    return out


def resolve_tool_choice(tools: list | None, tool_choice, *, auto_enabled: bool) -> ToolChoice:
    """vLLM's rules: tools without tool_choice mean "auto"; tool_choice needs tools; "auto" needs
    --enable-auto-tool-choice and --tool-call-parser; a named tool must be one of the tools;
    "required" with an empty tools list behaves as "none" (OpenAI)."""
    norm = normalize_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if norm else "none"
    if tool_choice == "none":
        return ToolChoice("none", norm)
    if tools is None:
        raise ToolChoiceError("tool_choice needs tools: when using `tool_choice`, `tools` must be set", "tool_choice")
    if tool_choice == "required":
        return ToolChoice("required", norm) if norm else ToolChoice("none", norm)
    if tool_choice == "auto":
        if not auto_enabled:
            raise ToolChoiceError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                  "to be set", "tool_choice")
        return ToolChoice("auto", norm)
    usage = 'use "none", "auto", "required" or {"type": "function", "function": {"name": "my_function"}}'
    if not isinstance(tool_choice, dict):
        raise ToolChoiceError(f"invalid tool_choice {tool_choice!r}: {usage}", "tool_choice")
    fn = tool_choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
        raise ToolChoiceError(f"invalid tool_choice {tool_choice!r}: {usage}", "tool_choice")
    if name not in {t["function"]["name"] for t in norm}:
        raise ToolChoiceError(f"tool_choice names the function {name!r}, which is not one of the tools", "tool_choice")
    return ToolChoice("named", norm, name)


def _parameters(fn: dict) -> dict:
    return fn.get("parameters") or EMPTY_PARAMETERS


def invalid_tool_schema(choice: ToolChoice, parallel_tool_calls: bool | None, error: Exception) -> ToolChoiceError:
    """The 400 of an enforced choice whose schema does not compile (`error`: the input processor's, naming
    "tools"): the tools[i] at fault, found by compiling the schema of each tool alone (on this failure only)."""
    from enginecore import structured_outputs

    for i, t in enumerate(choice.tools):
        name = t["function"]["name"]
        if choice.mode == "named" and name != choice.name:
            continue
        one = tool_choice_schema(ToolChoice(choice.mode, [t], choice.name), parallel_tool_calls)
        try:
            structured_outputs.validate(StructuredOutputsParams(json=one, param="tools"), "tools")
        except SamplingParamsError as e:
            return ToolChoiceError(f"tools[{i}] ({name}): parameters is not a valid JSON schema: {e}", "tools")
        except ImportError:
            break
    return ToolChoiceError(f"tools: the JSON schema that enforces tool_choice does not compile: {error}", "tools")


def tool_choice_schema(choice: ToolChoice, parallel_tool_calls: bool | None) -> dict | None:
    """The JSON schema that enforces a named or required choice (None for none/auto)."""
    if choice.mode == "named":
        fn = next(t["function"] for t in choice.tools if t["function"]["name"] == choice.name)
        return _parameters(fn)
    if choice.mode != "required":
        return None
    defs: dict = {}
    items = []
    for t in choice.tools:
        fn = t["function"]
        params = dict(_parameters(fn))  # its $defs move to the top
        # "#/$defs/x" references must resolve from the top of the combined schema
        for k, v in (params.pop("$defs", None) or {}).items():
            if k in defs and defs[k] != v:
                raise ToolChoiceError(f"tools: two tools define $defs.{k} differently; tool_choice 'required' "
                                      "merges them into one schema", "tools")
            defs[k] = v
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                                                       "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class NamedToolParser(ToolParser):
    """The output of a named tool_choice: the arguments object itself."""

    name = "named"

    def __init__(self, function_name: str):
        super().__init__()
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> Parse:
        args = text.strip()
        return Parse(0, [PartialCall(self.function_name, args, final)] if (args or not final) else [])


class RequiredToolParser(ToolParser):
    """The output of tool_choice "required": `[{"name": ..., "parameters": {...}}, ...]`."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parse:
        p = Parse(0)
        i = skip_ws(text, 0)
        if i >= len(text):
            p.error = final
            return p
        if text[i] != "[":
            p.error = True
            return p
        return scan_calls(p, scan_call_list, text, i + 1, final)
