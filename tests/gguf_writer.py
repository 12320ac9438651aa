"""GGUF files for the tests: encoders for the types the gguf package cannot encode (Q4_K, Q6_K, IQ4_NL, IQ4_XS;
`q4_k`, `q6_k`, `iq4`), `encode` for any type, and `write_gguf` / `requantized_gguf`, which the session fixtures
`mixed_gguf` and `iq4_gguf` (tests/conftest.py) are made with; `hf_gguf` converts a Hugging Face folder (dense or
Mixture-of-Experts: tests/test_gguf_moe.py) as llama.cpp's converter does. tests/test_gguf_writer.py reads what
they write back with the gguf package's reader and with enginecore.model_loader."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import gguf
import numpy as np

T = gguf.GGMLQuantizationType


def encode(w: np.ndarray, ty: T) -> np.ndarray:
    """float32 [N, K] -> its GGUF blocks of type `ty` as the file stores them ([N, K / block * bytes] uint8; F32
    and F16: the values): ours where the gguf package has no encoder, else its own."""
    ours = {T.Q4_K: q4_k, T.Q6_K: q6_k, T.IQ4_NL: lambda a: iq4(a, 32), T.IQ4_XS: lambda a: iq4(a, 256)}
    return ours[ty](w) if ty in ours else gguf.quants.quantize(w, ty)


def write_gguf(path: str, arch: str, fields: Iterable[tuple[str, object, gguf.GGUFValueType, object]],
               tensors: Iterable[tuple[str, np.ndarray, T]]) -> str:
    """A GGUF file of `arch` with `fields` ((key, value, value type, an array's item type or None), in order) and
    `tensors` ((name, data as `encode` gives it, its type), in order). Returns `path`."""
    w = gguf.GGUFWriter(path, arch)
    for key, value, vtype, sub_type in fields:
        w.add_key_value(key, value, vtype, sub_type=sub_type)
    for name, data, ty in tensors:
        w.add_tensor(name, data, raw_dtype=ty)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def requantized_gguf(src_path: str, path: str, types: Callable[[str, int], T | None]) -> str:
    """The GGUF file at `src_path` with each tensor that `types(tensor name, layer)` names a GGML type for
    requantized to it (`encode`), the rest as stored; its tokenizer and metadata copied. Returns `path`."""
    src = gguf.GGUFReader(src_path)
    fields = [(f.name, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
              for f in src.fields.values() if f.name != "general.architecture" and not f.name.startswith("GGUF.")]

    def tensors():
        for t in src.tensors:
            to = types(t.name, int(t.name.split(".")[1]) if t.name.startswith("blk.") else -1)
            if to is None:
                yield t.name, t.data, t.tensor_type
            else:
                yield t.name, encode(gguf.quants.dequantize(t.data, t.tensor_type), to), to

    return write_gguf(path, src.fields["general.architecture"].contents(), fields, tensors())


def q4_k(w):
    """float32 [N, K] (K a multiple of 256) -> GGUF Q4_K super-blocks [N, K / 256 * 144] uint8, roughly (per 32
    weights (d * sc) * q - dmin * mn, six-bit sc and mn packed in 12 bytes, q's nibbles as the gguf package reads
    them)."""
    N, K = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)  # [blocks, sub-blocks, 32]
    lo = np.minimum(x.min(axis=2), 0)
    s = (x.max(axis=2) - lo) / 15
    d = (s.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-lo.min(axis=1) / 63).astype(np.float16).astype(np.float32)

    def six(a, u):
        return np.clip(np.round(np.divide(a, u[:, None], out=np.zeros_like(a), where=u[:, None] > 0)), 0, 63)

    sc, mn = six(s, d).astype(np.uint8), six(-lo, dmin).astype(np.uint8)
    eff, off = (d[:, None] * sc)[..., None], (dmin[:, None] * mn)[..., None]
    q = np.clip(np.round(np.divide(x + off, eff, out=np.zeros_like(x), where=eff != 0)), 0, 15).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, mn[:, :4] | (mn[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4], axis=1)
    qs = (q[:, 0::2] | q[:, 1::2] << 4).reshape(-1, 128)  # chunk c: sub-block 2c low, 2c + 1 high
    out = np.concatenate([d.astype(np.float16)[:, None].view(np.uint8), dmin.astype(np.float16)[:, None].view(
        np.uint8), scales, qs], axis=1)
    return out.reshape(N, -1)


def iq4(w, block):
    """float32 [N, K] -> GGUF IQ4_NL blocks (block 32: d, 16 bytes of nibbles) or IQ4_XS super-blocks (256: d, the
    eight sub-blocks' six-bit scales sc, d * (sc - 32) theirs, in two bits each of a uint16 and four bytes of
    nibbles, then 8 x 16 bytes), [N, K / block * bytes] uint8, roughly: each weight the index of the nearest of
    IQ4_NL's 16 values times its scale; nibbles as the gguf package reads them (element j < 16 the low one of byte
    j, j + 16 its high one, a sub-block of 32 at a time)."""
    N, K = w.shape
    values = np.asarray(gguf.quants.IQ4_NL.kvalues, np.float32)
    x = w.reshape(-1, block // 32, 32).astype(np.float32)  # [blocks, sub-blocks, 32]
    s = np.abs(x).max(axis=2) / 127  # per sub-block
    if block == 32:
        d = s[:, 0].astype(np.float16)
        eff = d.astype(np.float32)[:, None]
        head = [d[:, None].view(np.uint8)]
    else:
        d = (s.max(axis=1) / 31).astype(np.float16)
        sc = np.clip(np.round(np.divide(s, d.astype(np.float32)[:, None], out=np.zeros_like(s),
                                        where=d[:, None] > 0)), -32, 31).astype(np.int64) + 32
        eff = d.astype(np.float32)[:, None] * (sc - 32).astype(np.float32)
        hi = sum((sc[:, j] >> 4) << (2 * j) for j in range(8)).astype("<u2")
        lo = (sc[:, 0::2] & 15) | (sc[:, 1::2] & 15) << 4
        head = [d[:, None].view(np.uint8), hi[:, None].view(np.uint8), lo.astype(np.uint8)]
    scaled = np.divide(x, eff[..., None], out=np.zeros_like(x), where=eff[..., None] != 0)
    idx = np.abs(scaled[..., None] - values).argmin(axis=-1).astype(np.uint8)  # [blocks, sub-blocks, 32]
    qs = (idx[..., :16] | idx[..., 16:] << 4).reshape(len(x), -1)
    return np.concatenate([*head, qs], axis=1).reshape(N, -1)


def q6_k(w):
    """float32 [N, K] (K a multiple of 256) -> GGUF Q6_K super-blocks [N, K / 256 * 210] uint8, roughly (per 16
    weights a scale d * sc, q - 32 in [-32, 31]; ql's nibbles and qh's 2-bit pairs laid out as the gguf package
    reads them)."""
    N, K = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)  # [blocks, groups of 16, 16]
    s = np.abs(x).max(axis=2) / 31  # per group
    d = (s.max(axis=1) / 127).astype(np.float16).astype(np.float32)  # per block
    sc = np.clip(np.round(np.divide(s, d[:, None], out=np.zeros_like(s), where=d[:, None] > 0)), -128, 127)
    eff = (d[:, None] * sc)[..., None]
    q = np.clip(np.round(np.divide(x, eff, out=np.zeros_like(x), where=eff != 0)), -32, 31).astype(np.int64) + 32
    q = q.reshape(-1, 2, 128)  # [blocks, half h, r]
    ql = np.zeros((len(q), 2, 64), np.int64)
    qh = np.zeros((len(q), 2, 32), np.int64)
    for part in range(2):  # r // 64: the nibble
        ql |= (q[:, :, part * 64 : (part + 1) * 64] & 15) << (4 * part)
    for part in range(4):  # r // 32: the 2-bit pair
        qh |= (q[:, :, part * 32 : (part + 1) * 32] >> 4) << (2 * part)
    out = np.concatenate([ql.reshape(-1, 128).astype(np.uint8), qh.reshape(-1, 64).astype(np.uint8),
                          sc.astype(np.int8).view(np.uint8), d.astype(np.float16)[:, None].view(np.uint8)], axis=1)
    return out.reshape(N, -1)


# ---- Hugging Face folders as llama.cpp's converter writes them --------------------------------------------------

# model_type -> GGUF architecture (Mixtral is `llama` with an expert count)
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
             "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_ATTN = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
         "block_sparse_moe.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_EXPERT = {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down", "w1": "ffn_gate", "w3": "ffn_up",
           "w2": "ffn_down"}


def llama_cpp_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face q/k rows in llama.cpp's order (its converter interleaves each head's rotary halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_gguf(folder: str, path: str, types: Callable[[str], T] = lambda name: T.F32, per_expert: bool = False,
            skip: Iterable[str] = (), fields: dict | None = None) -> str:
    """The float32 Hugging Face folder `folder` (config.json + one safetensors file, per-expert tensors as
    transformers saves them) as llama.cpp's converter writes it: tensors renamed, Q/K rows of `llama` files
    interleaved, experts stacked `blk.N.ffn_gate_exps.weight` (or, `per_expert`, one `blk.N.ffn_gate.E.weight`
    each: Mixtral files of 2023), the shared expert's gate as [H], `{arch}.*` metadata. `types(GGUF name)` picks
    each tensor's type (1-D ones are F32); `skip`: GGUF tensor names left out; `fields`: metadata keys (without
    the `{arch}.`) to set, (value, GGUFValueType), or to leave out (None). Returns `path`."""
    import json
    import os
    import re

    from safetensors.numpy import load_file

    cfg = json.load(open(os.path.join(folder, "config.json")))
    mt = cfg["model_type"]
    arch = GGUF_ARCH[mt]
    U, F = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads") or nh
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    meta = {"block_count": (cfg["num_hidden_layers"], U), "embedding_length": (cfg["hidden_size"], U),
            "feed_forward_length": (cfg["intermediate_size"], U), "attention.head_count": (nh, U),
            "attention.head_count_kv": (nkv, U), "context_length": (cfg.get("max_position_embeddings", 2048), U),
            "vocab_size": (cfg["vocab_size"], U), "rope.freq_base": (float(rope), F),
            "attention.layer_norm_rms_epsilon": (float(cfg.get("rms_norm_eps", 1e-6)), F)}
    if cfg.get("head_dim"):
        meta["attention.key_length"] = meta["attention.value_length"] = (cfg["head_dim"], U)
    if "num_experts_per_tok" in cfg:
        meta["expert_count"] = (cfg.get("num_experts") or cfg["num_local_experts"], U)
        meta["expert_used_count"] = (cfg["num_experts_per_tok"], U)
    if "moe_intermediate_size" in cfg:
        meta["expert_feed_forward_length"] = (cfg["moe_intermediate_size"], U)
    if cfg.get("shared_expert_intermediate_size"):
        meta["expert_shared_feed_forward_length"] = (cfg["shared_expert_intermediate_size"], U)
    for k, v in (fields or {}).items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v

    weights = load_file(next(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors")))
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}  # (layer, GGUF part) -> expert -> weight
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for name, w in weights.items():
        w = np.asarray(w, np.float32)
        if name in top:
            out[top[name]] = w
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight", name)
        if m:
            experts.setdefault((m[1], _EXPERT[m[3]]), {})[int(m[2])] = w
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
        base = f"blk.{m[1]}.{_ATTN[m[2]]}"
        if arch == "llama" and m[2] in ("self_attn.q_proj", "self_attn.k_proj"):
            w = llama_cpp_rows(w, nh if m[2] == "self_attn.q_proj" else nkv)
        if m[2] == "mlp.shared_expert_gate":
            w = w.reshape(-1)
        out[f"{base}.{m[3]}"] = w
    for (layer, part), by_e in sorted(experts.items()):
        if per_expert:
            out.update({f"blk.{layer}.{part}.{e}.weight": w for e, w in sorted(by_e.items())})
        else:
            out[f"blk.{layer}.{part}_exps.weight"] = np.stack([by_e[e] for e in sorted(by_e)])
    skip = set(skip)

    def tensors():
        for name in sorted(out, key=_gguf_order):
            if name in skip:
                continue
            w = out[name]
            ty = T.F32 if w.ndim == 1 else types(name)
            if ty == T.F32:
                yield name, w, ty
            else:  # blocks along the innermost dimension, each row (each expert's) on its own
                yield name, encode(w.reshape(-1, w.shape[-1]), ty).reshape(*w.shape[:-1], -1), ty

    return write_gguf(path, arch, [(f"{arch}.{k}", v, vt, None) for k, (v, vt) in meta.items()], tensors())


def _gguf_order(name: str):
    """Top tensors first, then layer by layer (llama.cpp's order; the loader must not depend on it)."""
    parts = name.split(".")
    return (int(parts[1]), name) if parts[0] == "blk" else (-1, name)
