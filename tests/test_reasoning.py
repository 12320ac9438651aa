"""Reasoning parsers: `<think>...</think>` split out, non-streamed and streamed with every split point; where
the output starts (prompt and enable_thinking); the token ids a constraint waits for; reasoning before
tool calls."""

from __future__ import annotations

import pytest

from frontend.chat_output import ChatOutputParser
from frontend.reasoning_parsers import REASONING_PARSERS
from frontend.tool_parsers import TOOL_PARSERS


class FakeTokenizer:
    """`</think>` as one added token (Qwen3, DeepSeek-R1), or spelled out in pieces (SmolLM2)."""

    def __init__(self, has_token: bool):
        self.hf = self if has_token else None
        self.unk_token_id = None

    def convert_tokens_to_ids(self, tok):
        return 151668 if tok == "</think>" else None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def parser(name: str, has_token: bool = True):
    return REASONING_PARSERS[name](FakeTokenizer(has_token))


CASES = [
    # (parser, prompt tail, kwargs, output, reasoning, content)
    ("deepseek_r1", "<|Assistant|><think>\n", None, "Let me think.\n</think>\n\nParis.", "Let me think.\n", "\n\nParis."),
    ("deepseek_r1", "<|Assistant|>", None, "<think>Hmm</think>Paris.", "Hmm", "Paris."),
    ("deepseek_r1", "<|Assistant|>", None, "Still thinking when cut off", "Still thinking when cut off", None),
    ("deepseek_r1", "<think>\n\n</think>\n\n", None, "Paris.", None, "Paris."),
    ("qwen3", "<|im_start|>assistant\n", None, "<think>\nHmm, France.\n</think>\n\nParis.", "\nHmm, France.\n",
     "\n\nParis."),
    ("qwen3", "<|im_start|>assistant\n", None, "Paris, no thinking.", None, "Paris, no thinking."),
    ("qwen3", "<|im_start|>assistant\n", None, "Not <think> at the start", None, "Not <think> at the start"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", None, "thought</think>Paris.", "thought", "Paris."),
    ("qwen3", "<|im_start|>assistant\n", {"enable_thinking": False}, "<think>x</think>y", None, "<think>x</think>y"),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", None, "Paris.", None, "Paris."),
]


@pytest.mark.parametrize("name,prompt,kwargs,text,reasoning,content", CASES)
def test_extract_and_stream_every_split(name, prompt, kwargs, text, reasoning, content):
    rr = parser(name).for_request(prompt, kwargs)
    assert rr.extract(text) == (reasoning, content)
    for cut in range(len(text) + 1):
        for cut2 in (cut, min(cut + 3, len(text))):
            s = rr.streamer()
            parts = [s.feed(text[:cut], False), s.feed(text[cut:cut2], False), s.feed(text[cut2:], True)]
            r, c = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
            assert (r or None, c or None) == (reasoning, content), (cut, cut2)
    # one character at a time: nothing of a tag leaks into either field
    s = rr.streamer()
    parts = [s.feed(ch, False) for ch in text] + [s.feed("", True)]
    assert all("<think" not in p[0] and "</think" not in p[0] for p in parts)


def test_constraint_start_ids():
    assert parser("qwen3").for_request("<|im_start|>assistant\n", None).constraint_start_ids() == [151668]
    assert parser("deepseek_r1", has_token=False).for_request("", None).constraint_start_ids() == \
        [ord(c) for c in "</think>"]
    # reasoning already closed in the prompt, or thinking off: the constraint applies from the first token
    assert parser("qwen3").for_request("x<think>\n\n</think>\n\n", None).constraint_start_ids() is None
    assert parser("qwen3").for_request("x", {"enable_thinking": False}).constraint_start_ids() is None


def test_reasoning_then_tool_calls_stream_like_non_stream():
    text = ('<think>I should call the weather tool.</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Paris"}}\n</tool_call>')
    rr = parser("qwen3").for_request("<|im_start|>assistant\n", None)
    p = ChatOutputParser(rr, TOOL_PARSERS["hermes"](), "auto", None)
    msg = p.parse(text)
    assert msg.reasoning == "I should call the weather tool." and msg.content == "\n\n"
    assert [(c.name, c.arguments) for c in msg.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    assert p.finish_reason("stop", bool(msg.tool_calls)) == "tool_calls"
    for step in (1, 2, 5):
        s = p.streamer()
        r = c = args = ""
        names = []
        for k in range(0, len(text), step):
            d = s.feed(text[k:k + step], k + step >= len(text))
            r, c = r + d.reasoning, c + d.content
            for tc in d.tool_calls:
                if "id" in tc:
                    names.append(tc["function"]["name"])
                args += tc["function"]["arguments"]
        assert (r, c, names, args) == (msg.reasoning, msg.content, ["get_weather"], '{"city": "Paris"}')
        assert s.called
    # include_reasoning: false drops it
    assert ChatOutputParser(rr, None, "none", None, include_reasoning=False).parse(text).reasoning is None


def test_chat_endpoint_splits_reasoning(smollm2_tokenizer):
    from tests.test_tool_calls import chat_app, check_stream_matches, run_chat

    script = ["Paris is in Fr", "ance.</th", "ink>\n\nThe capital", " is Paris."]
    _, app = chat_app(smollm2_tokenizer, script, reasoning_parser="deepseek_r1")
    resp = check_stream_matches(app, {"n": 2}, n=2)
    for ch in resp["choices"]:
        m = ch["message"]
        assert m["reasoning"] == m["reasoning_content"] == "Paris is in France."
        assert m["content"] == "\n\nThe capital is Paris." and ch["finish_reason"] == "stop"
    status, resp = run_chat(app, {"include_reasoning": False})
    assert "reasoning" not in resp["choices"][0]["message"]
    assert resp["choices"][0]["message"]["content"] == "\n\nThe capital is Paris."
    # no parser: the text as generated, no reasoning fields at all
    _, app = chat_app(smollm2_tokenizer, script)
    status, resp = run_chat(app, {})
    assert resp["choices"][0]["message"]["content"] == "".join(script) and "reasoning" not in resp["choices"][0]["message"]
