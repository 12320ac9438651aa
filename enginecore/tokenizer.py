"""Tokenizers: a Hugging Face folder's own, or one built straight from a GGUF's vocabulary.

For GGUF files with a byte-level BPE vocabulary (`tokenizer.ggml.model ==
"gpt2"`, SmolLM2, Qwen, Llama 3) the tokenizer is assembled with the
`tokenizers` library from the file's tokens and merges in well under a second;
transformers' own GGUF conversion takes ~15 s here and, for SmolLM2, sets the
wrong EOS token. Other GGUF vocabularies (sentencepiece) fall back to
transformers' conversion, cached on disk after the first time.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import types
from dataclasses import dataclass

from enginecore import envs
from enginecore.model_loader import ModelLoadError, ModelSource

logger = logging.getLogger("xlaserve.tokenizer")

# llama.cpp's pre-tokenizer names -> the regex split used before byte-level BPE
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


class TextEncodingError(ValueError):
    """Text that cannot be tokenized (HTTP 400): it is not valid Unicode."""


@dataclass
class Tokenizer:
    """A transformers tokenizer plus the ids the engine needs."""

    hf: object  # transformers.PreTrainedTokenizerBase
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    chat_template: str | None

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate ("\ud800" in JSON): `tokenizers` raises TypeError
                raise TextEncodingError(f"the text is not valid Unicode: {e.reason} at character {e.start} "
                                        f"({text[e.start:e.end]!r})") from None
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, chat_template: str | None = None, **kwargs) -> str:
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(
                "this model has no chat template; pass --chat-template or use /v1/completions"
            )
        return self.hf.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


def _gguf_header(path: str, reader=None):
    from enginecore.model_checks import read_gguf

    return reader or read_gguf(path)


_GGUF_CHECKPOINT_MODULE = "transformers.modeling_gguf_pytorch_utils"
_GGUF_CHECKPOINT_LOCK = threading.RLock()


def _defer_gguf_checkpoint_module() -> None:
    """Keep transformers' fast-tokenizer module from importing torch.

    `transformers.tokenization_utils_tokenizers` (PreTrainedTokenizerFast) imports `load_gguf_checkpoint` from
    the module that reads GGUF *weights* into torch tensors, and that module imports torch: ~1.5 s of a 2-core
    machine's CPU in the API server's process, which needs no torch, while the engine core loads beside it. A
    tokenizer never calls it. Until something does, that module is a stand-in whose `load_gguf_checkpoint` (or
    any other public name) loads the real one, once (under a lock: two threads never run it twice), and puts it
    in its place in sys.modules and on the transformers package. Nothing changes where torch is already
    imported (the torch backend's process, offline `LLM`), nor for a caller that reads GGUF weights through
    transformers (tests): its first call pays the import, as it would have at start.
    """
    with _GGUF_CHECKPOINT_LOCK:
        if "torch" in sys.modules or _GGUF_CHECKPOINT_MODULE in sys.modules:
            return
        try:
            spec = importlib.util.find_spec(_GGUF_CHECKPOINT_MODULE)  # (imports the transformers package)
        except ImportError:
            return
        if spec is None or spec.loader is None:
            return
        package = sys.modules["transformers"]
        attr = _GGUF_CHECKPOINT_MODULE.rpartition(".")[2]
        stand_in = types.ModuleType(_GGUF_CHECKPOINT_MODULE)
        stand_in.__spec__ = importlib.machinery.ModuleSpec(_GGUF_CHECKPOINT_MODULE, None)  # (no loader: no reload)
        loaded: list[types.ModuleType] = []

        def real() -> types.ModuleType:
            with _GGUF_CHECKPOINT_LOCK:
                if not loaded:
                    mod = importlib.util.module_from_spec(spec)
                    sys.modules[_GGUF_CHECKPOINT_MODULE] = mod
                    try:
                        spec.loader.exec_module(mod)
                    except BaseException:
                        sys.modules[_GGUF_CHECKPOINT_MODULE] = stand_in
                        raise
                    setattr(package, attr, mod)
                    loaded.append(mod)
                return loaded[0]

        def getattr_(name: str):
            if name.startswith("__"):  # the import system's probes (__path__, ...): a plain module's answers
                raise AttributeError(name)
            return getattr(real(), name)

        def load_gguf_checkpoint(*args, **kwargs):
            return real().load_gguf_checkpoint(*args, **kwargs)

        stand_in.__getattr__ = getattr_
        stand_in.load_gguf_checkpoint = load_gguf_checkpoint
        sys.modules[_GGUF_CHECKPOINT_MODULE] = stand_in
        setattr(package, attr, stand_in)  # as an import would: `transformers.modeling_gguf_pytorch_utils.X`


def _fast_tokenizer_class():
    """transformers' PreTrainedTokenizerFast, imported without torch where nothing else has imported it."""
    _defer_gguf_checkpoint_module()
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast


def _build_bpe_from_gguf(path: str, fast, reader=None):
    """`fast`: the fast tokenizer class (`_fast_tokenizer_class()`)."""
    from tokenizers import Regex, Tokenizer as RawTokenizer, decoders, models, pre_tokenizers

    get = _gguf_header(path, reader).get
    tokens = get("tokenizer.ggml.tokens")
    merges = get("tokenizer.ggml.merges") or []
    token_types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
    pre = get("tokenizer.ggml.pre", "gpt2")
    vocab = {t: i for i, t in enumerate(tokens)}
    merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    bpe = models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False)
    tk = RawTokenizer(bpe)
    if pre in ("llama3", "llama-bpe", "dbrx", "smaug-bpe"):
        pattern = _LLAMA3_PATTERN
    elif pre in ("qwen2", "deepseek-llm"):
        pattern = _QWEN2_PATTERN
    else:
        pattern = _GPT2_PATTERN
    splits = []
    if pre == "smollm":  # llama.cpp splits every digit before the GPT-2 regex
        splits.append(pre_tokenizers.Digits(individual_digits=True))
    splits.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False))
    splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tk.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tk.decoder = decoders.ByteLevel()
    # control (3) and user-defined (4) tokens are matched whole, before BPE
    from tokenizers import AddedToken

    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(token_types) if t == 3]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(token_types) if t == 4]
    tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)

    def tok_str(key):
        i = get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    hf = fast(
        tokenizer_object=tk,
        bos_token=tok_str("tokenizer.ggml.bos_token_id"),
        eos_token=tok_str("tokenizer.ggml.eos_token_id"),
        unk_token=tok_str("tokenizer.ggml.unknown_token_id"),
        pad_token=tok_str("tokenizer.ggml.padding_token_id"),
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = get("tokenizer.chat_template")
    if get("tokenizer.ggml.add_bos_token", False):
        # byte-level BPE models in GGUF rarely ask for it; honour it through a template
        from tokenizers import processors

        bos = tok_str("tokenizer.ggml.bos_token_id")
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    return hf


def _cache_dir() -> str:
    return envs.cache_dir("tokenizers")


def _load_gguf_tokenizer(path: str, reader=None):
    """The Hugging Face tokenizer of a GGUF file, converted once and then cached by file identity.

    Building it from the GGUF's vocabulary and merges takes seconds (twice that
    with the GGUF metadata parse) at every start; loading the saved conversion
    takes half a second. The key covers the file (path, size, mtime) and the
    tokenizers/transformers versions that wrote it.
    """
    import tokenizers

    fast = _fast_tokenizer_class()  # (imports transformers)
    import transformers

    st = os.stat(path)
    ident = f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}:{tokenizers.__version__}"
    cached = os.path.join(_cache_dir(), hashlib.sha256(ident.encode()).hexdigest()[:16])
    config = os.path.join(cached, "tokenizer_config.json")
    if os.path.isfile(config):
        try:
            with open(config) as f:
                cls = json.load(f).get("tokenizer_class")
            # what _build_bpe_from_gguf saved loads as that class directly: AutoTokenizer's import alone costs
            # ~2.5 s (every model's config class, and torch through the generation config)
            if cls in (fast.__name__, "PreTrainedTokenizerFast"):
                return fast.from_pretrained(cached, local_files_only=True)
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(cached, local_files_only=True, trust_remote_code=False)
        except Exception:  # a damaged cache entry: convert again
            shutil.rmtree(cached, ignore_errors=True)
    reader = _gguf_header(path, reader)
    if reader.get("tokenizer.ggml.model") == "gpt2":
        tok = _build_bpe_from_gguf(path, fast, reader)
    else:  # sentencepiece vocabularies: transformers' converter
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                            local_files_only=True)
    try:  # written aside, then renamed: a concurrent start never reads half an entry
        os.makedirs(_cache_dir(), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=_cache_dir())
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, cached)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        logger.warning("cannot cache the converted tokenizer in %s (%s); converting at every start", _cache_dir(), e)
    return tok


def _eos_ids_from_folder(folder: str) -> list[int]:
    ids: list[int] = []
    for fn in ("generation_config.json", "config.json"):
        p = os.path.join(folder, fn)
        if os.path.isfile(p):
            try:
                with open(p) as f:
                    v = json.load(f).get("eos_token_id")
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(v, int):
                ids.append(v)
            elif isinstance(v, list):
                ids.extend(int(x) for x in v)
    return ids


def load_tokenizer(
    src: ModelSource, tokenizer: str | None = None, use_generation_config: bool = True
) -> Tokenizer:
    """The tokenizer for `src` (or the folder/GGUF named by --tokenizer)."""
    target = tokenizer or (src.path if src.kind == "hf" else None)
    try:
        if target is None:
            hf = _load_gguf_tokenizer(src.path, src.gguf_reader)
        elif os.path.isfile(target) and target.endswith(".gguf"):
            hf = _load_gguf_tokenizer(target)
        elif os.path.isdir(target):
            from transformers import AutoTokenizer

            # never Hugging Face remote code (a tokenizer_config.json with auto_map is refused, not run)
            hf = AutoTokenizer.from_pretrained(target, local_files_only=True, trust_remote_code=False)
        else:
            raise ModelLoadError(f"{target}: tokenizer not found (a local folder or .gguf file is needed)")
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{target or src.path}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
    eos: list[int] = []
    if hf.eos_token_id is not None:
        eos.append(int(hf.eos_token_id))
    if src.kind == "gguf" and src.config.eos_token_id is not None:
        eos.append(int(src.config.eos_token_id))
    if use_generation_config and src.kind == "hf":
        eos.extend(_eos_ids_from_folder(src.path))
    seen = []
    for e in eos:
        if e not in seen:
            seen.append(e)
    return Tokenizer(
        hf=hf,
        eos_token_ids=tuple(seen),
        bos_token_id=hf.bos_token_id,
        chat_template=getattr(hf, "chat_template", None),
    )
