"""Structured outputs: a constraint -> an llguidance grammar -> one matcher per request -> token bitmasks.

llguidance (one abi3 wheel, no dependencies; JSON schema, regex, Lark and
GBNF grammars) is the grammar library on every platform. The pieces:

- `grammar_text`: a `StructuredOutputsParams` as llguidance grammar text, and
  `validate` (the API side's cheap check, no tokenizer: a bad schema, regex or
  grammar is a 400 naming the field);
- `GrammarCompiler` (engine process): builds the llguidance tokenizer once and
  compiles grammars in a small thread pool, off the step loop, cached by
  grammar text; each request gets a copy of the compiled matcher;
- `RequestGrammar`: a request's matcher: fed the tokens the request generates,
  it fills the request's row of the step's packed bitmask
  `[rows, ceil(vocab / 32)]` int32 (bit t of word t // 32 set: token t allowed).

The scheduler drives them (a request whose grammar is not compiled yet waits);
the samplers apply the bitmask on the device before any other processing
(`enginecore.sampling_ref.apply_token_bitmask` is the spec).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Callable

import numpy as np

from enginecore.sampling_params import SamplingParamsError, StructuredOutputsParams

logger = logging.getLogger("xlaserve.structured_outputs")


def bitmask_width(vocab_size: int) -> int:
    """int32 words of one row of a token bitmask."""
    return -(-vocab_size // 32)


class GrammarError(ValueError):
    """A constraint that does not compile (the request fails alone)."""


def _close_objects(schema):
    """`disable_additional_properties`: objects without `additionalProperties` get false."""
    if isinstance(schema, dict):
        out = {k: _close_objects(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_close_objects(v) for v in schema]
    return schema


def _structural_tag_grammar(text: str, param: str) -> str:
    """vLLM's structural tag ({"type": "structural_tag", "structures": [{begin, schema, end}], "triggers"}) as
    llguidance's StructTag grammar: free text, and after a trigger one of the structures."""
    import llguidance

    try:
        spec = json.loads(text)
        triggers = list(spec["triggers"])
        tags = []
        for s in spec["structures"]:
            trig = [t for t in triggers if s["begin"].startswith(t)]
            if not trig:
                raise ValueError(f"structure begin {s['begin']!r} starts with none of the triggers {triggers}")
            tags.append(llguidance.StructTag(trigger=trig[0], begin=s["begin"], grammar=s.get("schema", {}),
                                             end=s.get("end", "")))
        if not tags:
            raise ValueError("no structures")
        return llguidance.StructTag.to_grammar(tags)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise SamplingParamsError(f"invalid structural_tag: {type(e).__name__}: {e}", param) from None


def grammar_text(so: StructuredOutputsParams, disable_any_whitespace: bool = False,
                 disable_additional_properties: bool = False, param: str = "structured_outputs") -> str:
    """The llguidance grammar (JSON text) of a constraint. Raises SamplingParamsError for a malformed spec."""
    from llguidance import LLMatcher

    kind = so.kind
    if kind in ("json", "json_object"):
        schema = so.json if kind == "json" else {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise SamplingParamsError(f"the JSON schema is not valid JSON: {e}", param) from None
        if not isinstance(schema, dict):
            raise SamplingParamsError(f"the JSON schema must be an object, got {type(schema).__name__}", param)
        if so.disable_additional_properties or disable_additional_properties:
            schema = _close_objects(schema)
        defaults = {"whitespace_flexible": not (so.disable_any_whitespace or disable_any_whitespace)}
        overrides = {"whitespace_pattern": so.whitespace_pattern} if so.whitespace_pattern else None
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=defaults, overrides=overrides)
        except (ValueError, TypeError) as e:
            raise SamplingParamsError(f"invalid JSON schema: {e}", param) from None
    if kind == "regex":
        return LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice)
        return LLMatcher.grammar_from_lark(f"start: {alts}\n")
    if kind == "grammar":
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(so.grammar)  # Lark as is; GBNF / EBNF (`::=`) converted
        except Exception as e:  # noqa: BLE001 - the converter raises bare Exceptions for unknown rules
            raise SamplingParamsError(f"invalid grammar: {e}", param) from None
        return LLMatcher.grammar_from_lark(lark)
    return LLMatcher.grammar_from_lark(_structural_tag_grammar(so.structural_tag, param))


def validate(so: StructuredOutputsParams, param: str = "structured_outputs", disable_any_whitespace: bool = False,
             disable_additional_properties: bool = False) -> None:
    """Cheap check without a tokenizer (about a millisecond): SamplingParamsError naming `param` if the
    schema, regex or grammar cannot compile."""
    from llguidance import LLMatcher

    g = grammar_text(so, disable_any_whitespace, disable_additional_properties, param)
    err = LLMatcher.validate_grammar(g, None)
    if err:
        raise SamplingParamsError(f"invalid {so.kind} in {param}: {err.strip()}", param)


def build_ll_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids):
    """The llguidance tokenizer of a fast HF tokenizer, covering `vocab_size` ids (a model's vocabulary
    may exceed its tokenizer's: the ids past the tokenizer are never allowed)."""
    import llguidance.hf

    n = max(int(vocab_size), len(hf_tokenizer))
    eos = [int(e) for e in eos_token_ids] or None
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n, eos_token=eos)


class GrammarCompiler:
    """Compiles constraints into llguidance matchers in a thread pool, cached by grammar text (LRU).

    `tokenizer_factory() -> LLTokenizer` runs once, in the pool, when the first constrained request
    arrives (it loads the tokenizer: about a second). Compilation releases the GIL, so the step loop
    keeps running meanwhile.
    """

    def __init__(self, tokenizer_factory: Callable[[], object], disable_any_whitespace: bool = False,
                 disable_additional_properties: bool = False, max_workers: int = 2, cache_size: int = 256):
        self._tokenizer_factory = tokenizer_factory
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="grammar")
        self._cache: OrderedDict[str, concurrent.futures.Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.disable_any_whitespace = disable_any_whitespace
        self.disable_additional_properties = disable_additional_properties
        # stats (read by the step loop; written by the pool threads)
        self.compile_seconds = 0.0
        self.num_compiled = 0

    def tokenizer(self):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                t0 = time.perf_counter()
                self._tokenizer = self._tokenizer_factory()
                logger.info("llguidance tokenizer built in %.2fs (vocabulary %d)", time.perf_counter() - t0,
                            self._tokenizer.vocab_size)
            return self._tokenizer

    def submit(self, so: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of the compiled (template) matcher; failed with GrammarError / SamplingParamsError."""
        try:
            text = grammar_text(so, self.disable_any_whitespace, self.disable_additional_properties)
        except SamplingParamsError as e:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.set_exception(GrammarError(str(e)))
            return fut
        with self._lock:
            fut = self._cache.get(text)
            if fut is not None:
                self._cache.move_to_end(text)
                return fut
            fut = self._cache[text] = self._pool.submit(self._compile, text)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, text: str):
        from llguidance import LLMatcher

        tok = self.tokenizer()
        t0 = time.perf_counter()
        m = LLMatcher(tok, text, log_level=0)
        dt = time.perf_counter() - t0
        self.compile_seconds += dt
        self.num_compiled += 1
        if m.is_error():
            raise GrammarError(f"the grammar does not compile: {m.get_error()}")
        return m

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RequestGrammar:
    """One request's constraint: its compiled matcher once ready, fed the request's output tokens.

    With `start_after_token_ids` (the end of the reasoning) the constraint applies only to the tokens
    after the first occurrence of that sequence in the output.
    """

    def __init__(self, future: concurrent.futures.Future, start_after_token_ids: list[int] | None = None):
        self.future = future
        self.matcher = None
        self.error: str | None = None
        self.start_after = list(start_after_token_ids) if start_after_token_ids else None
        self.active = self.start_after is None  # enforcing from now on
        self._recent: list[int] = []

    def ready(self) -> bool:
        """Compiled (or failed: `error` set). Never blocks."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.future.done():
            return False
        try:
            self.matcher = self.future.result().deep_copy()
        except Exception as e:  # noqa: BLE001 - reported on the request
            self.error = str(e) or type(e).__name__
        return True

    def accept(self, token: int) -> None:
        """A generated token. Raises GrammarError if the matcher rejects it (the sampler's mask should
        have prevented it)."""
        if not self.active:
            n = len(self.start_after)
            self._recent = (self._recent + [token])[-n:]
            if self._recent == self.start_after:
                self.active = True
            return
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} is not allowed by the grammar: {self.matcher.get_error()}")

    def is_terminated(self) -> bool:
        """The grammar is complete and admits nothing more: the request is done."""
        return self.active and self.matcher is not None and self.matcher.is_stopped()

    def fill_bitmask(self, out: np.ndarray, index: int) -> None:
        """The allowed next tokens into row `index` of `out` [n, W] int32."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, out, index)
