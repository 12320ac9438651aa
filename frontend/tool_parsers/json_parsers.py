"""Parsers for models that write their calls as JSON objects: hermes, llama3_json, mistral."""

from __future__ import annotations

from frontend.tool_parsers.base import (Parse, PartialCall, ToolParser, after_next_marker, content_until,
                                        parse_call_object, scan_call_list, scan_calls, scan_value, skip_ws)


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call (Hermes, Qwen2.5, Qwen3)."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    markers = (START,)

    def parse(self, text: str, final: bool) -> Parse:
        start, p = content_until(text, self.START, final)
        if start < 0:
            return p
        return scan_calls(p, self._calls, text, start, final)

    def _calls(self, text: str, i: int, final: bool, p: Parse) -> None:
        while (i := after_next_marker(text, i, self.START)) is not None:
            call, end = parse_call_object(text, i, final)
            p.calls.append(call)
            if end is None:
                return
            i = skip_ws(text, end)
            if text.startswith(self.END, i):
                i += len(self.END)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: an optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}`
    objects separated by `;`. Only an output that starts with a call is parsed (vLLM's rule)."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    markers = (TAG,)

    def parse(self, text: str, final: bool) -> Parse:
        i = skip_ws(text, 0)
        rest = text[i:]
        if not final and (not rest or self.TAG.startswith(rest)):
            return Parse(0)
        if rest.startswith(self.TAG):
            i += len(self.TAG)
        elif not rest.startswith("{"):
            return Parse(len(text))
        return scan_calls(Parse(0), self._calls, text, i, final)

    @staticmethod
    def _calls(text: str, i: int, final: bool, p: Parse) -> None:
        # text after the calls (scan_call_list's ValueError): not a tool call after all
        scan_call_list(text, i, final, p, sep=";", close=None)


class MistralToolParser(ToolParser):
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
    `[TOOL_CALLS]name[ARGS]{...}` per call. `[TOOL_CALLS]` is a special token in Mistral's tokenizers:
    the server keeps special tokens in the text for this parser."""

    name = "mistral"
    START, ARGS = "[TOOL_CALLS]", "[ARGS]"
    markers = (START,)

    def parse(self, text: str, final: bool) -> Parse:
        start, p = content_until(text, self.START, final)
        if start < 0:
            return p
        i = skip_ws(text, start + len(self.START))
        if i >= len(text):
            return p
        return scan_calls(p, scan_call_list if text[i] == "[" else self._named, text, i + (text[i] == "["), final)

    def _named(self, text: str, i: int, final: bool, p: Parse) -> None:
        while i < len(text):
            a = text.find(self.ARGS, i)
            if a < 0:
                return
            call = PartialCall(text[i:a].strip())
            p.calls.append(call)
            j = skip_ws(text, a + len(self.ARGS))
            if j >= len(text):
                return
            end = scan_value(text, j, final)
            if end is None:
                if text[j] == "{":
                    call.arguments = text[j:]
                return
            call.arguments, call.done = text[j:end], True
            i = skip_ws(text, end)
            if text.startswith(self.START, i):
                i = skip_ws(text, i + len(self.START))
            elif i < len(text):
                raise ValueError("text after a call")
