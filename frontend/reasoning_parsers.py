"""Reasoning parsers (`--reasoning-parser`): split `<think>...</think>` out of a chat answer.

- `deepseek_r1`: the output starts inside the reasoning (DeepSeek-R1's template opens `<think>` in the
  prompt; a leading `<think>` in the output is dropped); everything up to `</think>` is reasoning, and
  an output that never closes it is all reasoning.
- `qwen3`: reasoning only when the output opens with `<think>` (Qwen3's hybrid models), or when the
  prompt ends inside an open `<think>` (templates that open it for the model, Qwen3-Thinking);
  `chat_template_kwargs: {"enable_thinking": false}` means no reasoning at all.

Both: a prompt that already closed the reasoning (ends with `</think>`, as Qwen3's template writes it
when thinking is off) means the output is all content.

The answer carries it as `reasoning` (current vLLM's field) and `reasoning_content` (its earlier name,
still what DeepSeek's API and many clients read), in `message` and in streamed `delta`s.
"""

from __future__ import annotations

from frontend.tool_parsers.base import held_marker_prefix

START, END = "<think>", "</think>"

# states of one output
_OPENING = "opening"  # may still start with <think>; content if it does not
_IN_REASONING_OPENING = "in-reasoning-opening"  # reasoning, with an optional leading <think> to drop
_REASONING = "reasoning"
_CONTENT = "content"


class ReasoningParser:
    """One server-wide parser; `for_request` gives the per-request view (`RequestReasoning`)."""

    name = ""
    starts_in_reasoning = False  # without any tag in the prompt or output

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._end_ids: list[int] | None = None

    def end_token_ids(self) -> list[int]:
        """`</think>`'s token ids: structured outputs start after them."""
        if self._end_ids is None:
            hf = getattr(self.tokenizer, "hf", None)
            tid = hf.convert_tokens_to_ids(END) if hf is not None else None
            unk = getattr(hf, "unk_token_id", None)
            if isinstance(tid, int) and tid >= 0 and tid != unk:
                self._end_ids = [tid]
            else:
                self._end_ids = list(self.tokenizer.encode(END, add_special_tokens=False))
        return self._end_ids

    def for_request(self, prompt_text: str, chat_template_kwargs: dict | None) -> "RequestReasoning":
        tail = prompt_text.rstrip()
        if (chat_template_kwargs or {}).get("enable_thinking") is False or tail.endswith(END):
            state = _CONTENT
        elif tail.endswith(START) or self.starts_in_reasoning:
            state = _IN_REASONING_OPENING
        else:
            state = _OPENING
        return RequestReasoning(self, state)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


class RequestReasoning:
    """What a parser decided for one request: where its outputs start, and where constraints start."""

    def __init__(self, parser: ReasoningParser, state: str):
        self.parser = parser
        self.state = state

    @property
    def expects_reasoning(self) -> bool:
        """Output will (or may, for qwen3) open with reasoning: a constraint must wait for `</think>`."""
        return self.state != _CONTENT

    def constraint_start_ids(self) -> list[int] | None:
        return self.parser.end_token_ids() if self.expects_reasoning else None

    def streamer(self) -> "ReasoningStreamer":
        return ReasoningStreamer(self.state)

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; the same state machine as streaming."""
        r, c = self.streamer().feed(text, final=True)
        return (r or None), (c or None)


class ReasoningStreamer:
    """Feed text deltas, get (reasoning delta, content delta); a tag split across deltas is held back."""

    def __init__(self, state: str):
        self.state = state
        self.buf = ""

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self.buf += delta
        reasoning = content = ""
        while True:
            if self.state in (_OPENING, _IN_REASONING_OPENING):
                s = self.buf.lstrip()
                if s.startswith(START):
                    self.buf, self.state = s[len(START):], _REASONING
                    continue
                if not final and START.startswith(s):
                    return reasoning, content  # "", "<", "<thi", ...: wait
                self.state = _REASONING if self.state == _IN_REASONING_OPENING else _CONTENT
                continue
            if self.state == _REASONING:
                idx = self.buf.find(END)
                if idx >= 0:
                    reasoning += self.buf[:idx]
                    self.buf, self.state = self.buf[idx + len(END):], _CONTENT
                    continue
                keep = 0 if final else held_marker_prefix(self.buf, END)
                reasoning += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return reasoning, content
            content += self.buf
            self.buf = ""
            return reasoning, content
