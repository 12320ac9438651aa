"""Qwen3-Coder's XML calls (`--tool-call-parser qwen3_xml`, also `qwen3_coder`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; they become JSON by the type the tool's schema gives them (a string when
the schema says nothing). The arguments stream one finished parameter at a time.
"""

from __future__ import annotations

import json

from frontend.tool_parsers.base import Parse, PartialCall, ToolParser, after_next_marker, content_until, skip_ws


class Qwen3XmlToolParser(ToolParser):
    name = "qwen3_xml"
    START, END = "<tool_call>", "</tool_call>"
    FUNC, FUNC_END = "<function=", "</function>"
    PARAM, PARAM_END = "<parameter=", "</parameter>"
    markers = (START,)

    def parse(self, text: str, final: bool) -> Parse:
        start, p = content_until(text, self.START, final)
        if start < 0:
            return p
        i = start
        while (i := after_next_marker(text, i, self.START)) is not None:
            i = skip_ws(text, i)
            if i >= len(text) or self.FUNC.startswith(text[i:]):
                return p
            if not text.startswith(self.FUNC, i):
                p.error = True
                return p
            i = self._function(text, i + len(self.FUNC), p)
            if i is None:
                return p
            i = skip_ws(text, i)
            if text.startswith(self.END, i):
                i += len(self.END)
        return p

    def _function(self, text: str, i: int, p: Parse) -> int | None:
        gt = text.find(">", i)
        if gt < 0:
            return None
        call = PartialCall(text[i:gt].strip())
        p.calls.append(call)
        props = (self.functions.get(call.name, {}).get("parameters") or {}).get("properties") or {}
        pieces: list[str] = []
        i = gt + 1
        while True:
            i = skip_ws(text, i)
            if text.startswith(self.FUNC_END, i):
                call.arguments, call.done = ("{" + ", ".join(pieces) + "}"), True
                return i + len(self.FUNC_END)
            if not text.startswith(self.PARAM, i):
                # the tail may still become a tag; anything else is malformed
                if i < len(text) and not self.FUNC_END.startswith(text[i:]) and not self.PARAM.startswith(text[i:]):
                    p.error = True
                return None
            gt = text.find(">", i)
            if gt < 0:
                return None
            key = text[i + len(self.PARAM): gt].strip()
            end = text.find(self.PARAM_END, gt + 1)
            if end < 0:
                return None
            value = text[gt + 1: end]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            pieces.append(f"{json.dumps(key)}: {json.dumps(_convert(value, props.get(key)), ensure_ascii=False)}")
            call.arguments = "{" + ", ".join(pieces)
            i = end + len(self.PARAM_END)


def _convert(value: str, schema: dict | None):
    """A parameter's text as the JSON type its schema names (text when unsure, as vLLM does)."""
    types = (schema or {}).get("type", "string")
    types = types if isinstance(types, list) else [types]
    if "string" in types or not types:
        return value
    v = value.strip()
    if v == "null" and "null" in types:
        return None
    try:
        if "integer" in types and "number" not in types:
            return int(v)
        if "number" in types:
            f = float(v)
            return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f
        if "boolean" in types:
            if v.lower() in ("true", "false"):
                return v.lower() == "true"
            return value
        if "object" in types or "array" in types:
            return json.loads(v)
    except ValueError:
        pass
    return value
