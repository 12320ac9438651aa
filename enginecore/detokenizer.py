"""Incremental detokenization with stop strings.

Text is decoded from a sliding window of token ids (a few prompt tokens as
left context, so sentencepiece's leading spaces come out right); text ending
in U+FFFD (an incomplete UTF-8 sequence) is held until the next token
completes it. With a fast (Rust) tokenizer that window is kept by `tokenizers`'
own `DecodeStream`, one call per token; otherwise two `decode` calls per token
(about ten times slower, which added up to milliseconds per step at batch 64).
Stop strings are searched only in the newly added tail; while streaming, the
last `len(longest stop) - 1` characters are held back because they could
still become a stop string.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    _CONTEXT = 5

    def __init__(
        self,
        tokenizer,  # enginecore.tokenizer.Tokenizer
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop_str_in_output
        ctx = list(prompt_token_ids[-self._CONTEXT :])
        self.ids: list[int] = ctx
        self.prefix_offset = 0
        self.read_offset = len(ctx)
        self.output_text = ""
        self._sent = 0  # chars of output_text already handed out as deltas
        self.hold = max((len(s) for s in self.stop), default=1) - 1 if not self.include_stop else 0
        self._stream = None
        backend = getattr(getattr(tokenizer, "hf", None), "backend_tokenizer", None)
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            self._stream = DecodeStream(ids=ctx, skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add_tokens(self, new_ids: list[int]) -> str | None:
        """Append tokens; returns the stop string that matched (text is truncated), else None."""
        if self._stream is not None:
            return self._add_tokens_stream(new_ids)
        for t in new_ids:
            self.ids.append(int(t))
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                before = len(self.output_text)
                self.output_text += full[len(prefix) :]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
                hit = self._check_stop(before)
                if hit is not None:
                    return hit
        return None

    def _add_tokens_stream(self, new_ids: list[int]) -> str | None:
        for t in new_ids:
            t = int(t)
            self.ids.append(t)
            chunk = self._stream.step(self._backend, t)
            if chunk is None:  # an incomplete character: wait for the next token
                continue
            # the slow path's offsets, for flush_text: everything up to here is decoded ("" too: a skipped
            # special token leaves nothing pending)
            self.prefix_offset = max(len(self.ids) - self._CONTEXT, 0)
            self.read_offset = len(self.ids)
            if chunk:
                before = len(self.output_text)
                self.output_text += chunk
                hit = self._check_stop(before)
                if hit is not None:
                    return hit
        return None

    def _check_stop(self, before: int) -> str | None:
        if not self.stop:
            return None
        best = None
        for s in self.stop:
            start = max(0, before - len(s) + 1)
            idx = self.output_text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.output_text = self.output_text[: idx + len(s)] if self.include_stop else self.output_text[:idx]
        return s

    def flush_text(self) -> str:
        """Text decodable so far even if it ends mid-character (at the end of a request)."""
        rest = self._decode(self.ids[self.prefix_offset :])
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        if len(rest) > len(prefix):
            self.output_text += rest[len(prefix) :]
            self.prefix_offset = self.read_offset = len(self.ids)
        return self.output_text

    def get_delta(self, finished: bool) -> str:
        """New text since the last call; holds back a possible stop-string prefix unless finished."""
        end = len(self.output_text) if finished else max(self._sent, len(self.output_text) - self.hold)
        delta = self.output_text[self._sent : end]
        self._sent = end
        return delta

    def visible_text(self, finished: bool) -> str:
        end = len(self.output_text) if finished else max(self._sent, len(self.output_text) - self.hold)
        return self.output_text[:end]
