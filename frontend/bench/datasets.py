"""Benchmark requests: random token ids (in-process), a JSONL of prompts, and random text (HTTP).

In-process benchmarks feed token ids straight to the engine, so prompt
lengths are exact. Over HTTP a prompt is text: `TextPromptBuilder` joins
whole-word tokens and then trims or extends the text until the counter
(the server's /tokenize, a local tokenizer, or the word count) says it has
the wanted number of tokens.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass
class SampleRequest:
    """One benchmark request. `prompt` is token ids or text; prompt_len is in tokens."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] for a length drawn uniformly around `length` (vLLM's --random-range-ratio)."""
    if length < 0:
        raise ValueError(f"length must be >= 0, got {length}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = int(length * (1.0 - range_ratio))
    high = int(length * (1.0 + range_ratio))
    return low, high


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float, minimum: int) -> list[int]:
    low, high = length_range(length, range_ratio)
    low = max(low, minimum)
    high = max(high, low)
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def random_token_requests(
    num_requests: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    exclude_ids: Sequence[int] = (),
) -> list[SampleRequest]:
    """Prompts of random token ids: a shared random prefix of prefix_len, then input_len ± ratio each.

    Deterministic for a seed. Ids in exclude_ids (special tokens) are never drawn.
    """
    if num_requests < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {num_requests}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    if prefix_len < 0:
        raise ValueError(f"--prefix-len must be >= 0, got {prefix_len}")
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(exclude_ids), dtype=np.int64))
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(rng, num_requests, input_len, range_ratio, minimum=0 if prefix_len else 1)
    out_lens = sample_lengths(rng, num_requests, output_len, range_ratio, minimum=1)
    prefix = [int(t) for t in rng.choice(allowed, size=prefix_len)]
    reqs = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = prefix + [int(t) for t in rng.choice(allowed, size=n_in)]
        reqs.append(SampleRequest(ids, len(ids), n_out))
    return reqs


def load_jsonl_requests(
    path: str,
    default_output_len: int | None,
    count_tokens: Callable[[str], int] | None = None,
    num_requests: int | None = None,
) -> list[SampleRequest]:
    """One JSON object a line: {"prompt": text or token ids, "output_len": int (optional)}."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--dataset-path {path!r} does not exist")
    reqs: list[SampleRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict) or "prompt" not in obj:
                raise ValueError(f"{path}:{lineno}: each line needs a 'prompt' field")
            prompt = obj["prompt"]
            out_len = obj.get("output_len", default_output_len)
            if out_len is None:
                raise ValueError(f"{path}:{lineno}: no 'output_len' and no --output-len given")
            if not isinstance(out_len, int) or out_len < 1:
                raise ValueError(f"{path}:{lineno}: output_len must be a positive integer, got {out_len!r}")
            if isinstance(prompt, list):
                plen = len(prompt)
            elif isinstance(prompt, str):
                plen = count_tokens(prompt) if count_tokens else len(prompt.split())
            else:
                raise ValueError(f"{path}:{lineno}: prompt must be text or a list of token ids")
            reqs.append(SampleRequest(prompt, plen, out_len))
            if num_requests is not None and len(reqs) >= num_requests:
                break
    if not reqs:
        raise ValueError(f"{path}: no requests in the file")
    return reqs


# ---- text prompts for HTTP servers --------------------------------------------------

# Used when no tokenizer is at hand: common words, nearly all one token in BPE vocabularies.
_FALLBACK_WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue side "
    "kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education"
).split()

_WORD = re.compile(r"^ [a-z]{3,12}$")


def word_pool(tokenizer=None, limit: int = 4096) -> list[str]:
    """Words that are one token each with a leading space (so joined text tokenizes word by word)."""
    if tokenizer is None:
        return [" " + w for w in _FALLBACK_WORDS]
    words = []
    vocab_size = len(tokenizer)
    for tid in range(vocab_size):
        s = tokenizer.decode([tid])
        if _WORD.match(s) and tokenizer.encode(s, add_special_tokens=False) == [tid]:
            words.append(s)
            if len(words) >= limit:
                break
    return words or [" " + w for w in _FALLBACK_WORDS]


class TextPromptBuilder:
    """Random word prompts fitted to an exact token count by a counter (bounded number of tries)."""

    def __init__(self, words: Sequence[str], count_tokens: Callable[[str], int] | None, seed: int = 0,
                 max_tries: int = 8):
        if not words:
            raise ValueError("the word pool is empty")
        self.words = list(words)
        self.count = count_tokens
        self.rng = np.random.default_rng(seed)
        self.max_tries = max_tries

    def _draw(self, n: int) -> list[str]:
        return [self.words[i] for i in self.rng.integers(0, len(self.words), size=n)]

    def fit(self, prefix: list[str], target: int) -> tuple[str, int]:
        """Text of prefix + random words with `target` tokens (or as close as max_tries gets); returns (text, count)."""
        body = self._draw(max(target - len(prefix), 1))
        text = "".join(prefix + body).lstrip()
        if self.count is None:
            return text, len(prefix) + len(body)
        n = self.count(text)
        best = (abs(n - target), text, n)
        for _ in range(self.max_tries):
            if n == target:
                break
            if n > target:
                body = body[: max(len(body) - (n - target), 1)]
            else:
                body = body + self._draw(target - n)
            text = "".join(prefix + body).lstrip()
            n = self.count(text)
            best = min(best, (abs(n - target), text, n), key=lambda b: b[0])
        return best[1], best[2]

    def build(self, num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
              prefix_len: int = 0, progress=None) -> list[SampleRequest]:
        in_lens = sample_lengths(self.rng, num_requests, input_len, range_ratio, minimum=1)
        out_lens = sample_lengths(self.rng, num_requests, output_len, range_ratio, minimum=1)
        prefix = self._draw(prefix_len)
        reqs = []
        for n_in, n_out in zip(in_lens, out_lens):
            text, n = self.fit(prefix, prefix_len + n_in)
            reqs.append(SampleRequest(text, n, n_out))
            if progress is not None:
                progress.update(1)
        return reqs
