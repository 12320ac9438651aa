"""A torchengine `Transformer`'s layers bound to the one-call C layers (`cpu_kernels.torch_ops`' `decode_layers`
and `step_layers`): the torch backend's load-time transform onto them.

It reads the model's structure (its linears, norms, RoPE tables and attention backend), so it lives here, above
`torchengine.model`, `torchengine.quant` and `torchengine.attention`; `cpu_kernels` itself imports no backend.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

# names read off the module at each call (`torch_ops.lib()`): patching torch_ops.lib reaches this code too
from cpu_kernels import torch_ops
from torchengine.model import MLP


def _linear_parts(m) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, int] | None:
    """(float32 weight panels, bias, 4-bit blocks or None, their row limit) of a decoder linear the C layers can
    run, from its `decode_parts()` (`torchengine.cpu_transform.CpuLinear`: its `qx` panels go separately, QX_BDOT's
    have no float32 panels: None; `torchengine.quant.Int4Linear` on this library's Q4 kernel); None for any other
    module (then the model runs as usual)."""
    parts = getattr(m, "decode_parts", None)
    return None if parts is None else parts()


class DecodeLayers:
    """Every layer of a decode step (each token its request's only query token) in one C call, `decode_layers`
    (`step`: of any step, `step_layers`): the kernels the Python layers call, in their order, so the hidden states
    are bit-identical to `Transformer.forward`'s with these kernels (`torchengine.cpu_transform`'s modules, whose
    buffers it reads); ~15 Python-level calls a layer fewer (a step of 15 decodes and a 126-token prompt chunk of
    the embedded model: 156-174 -> 150-151 ms in float32, 91-108 -> 85-86 ms in bfloat16).

    `bind` returns None where the model or its attention is not the float32 kernels' path (other dtypes,
    torch's own 4-bit kernel, tensor parallelism, another attention backend, a Mixture-of-Experts layer: the C
    layers have a dense MLP only); then the model runs as usual.
    `--quantization gguf`'s Q4 linears run here as `Int4Linear` runs them; q/k norms (Qwen3) as the C rms_norm.
    """

    def __init__(self, lib: ctypes.CDLL, model, backend, kv_caches):
        self.lib, self.model = lib, model
        arch = model.arch
        a0 = model.layers[0].attn
        self.dims = (arch.hidden_size, a0.num_heads, a0.num_kv_heads, a0.head_dim, arch.intermediate_size)
        self.eps, self.scale, self.window = arch.rms_norm_eps, backend.sm_scale, backend.sliding_window or 0
        self.kv_caches = kv_caches  # the list bound (the runner allocates a new one when it resizes the cache)
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        self.layers = (torch_ops._DecodeLayer * len(model.layers))()
        self.qx = []  # the qx panels the structs point to, kept alive with them
        for c, ly, (kc, vc) in zip(self.layers, model.layers, kv_caches):
            mods = dict(zip(torch_ops._LINEARS,
                            (ly.attn.qkv_proj, ly.attn.o_proj, ly.mlp.gate_up_proj, ly.mlp.down_proj)))
            parts = {name: _linear_parts(m) for name, m in mods.items()}
            c.attn_norm, c.mlp_norm = ptr(ly.attn_norm.weight), ptr(ly.mlp_norm.weight)
            c.key_cache, c.value_cache, c.qkv_b = ptr(kc), ptr(vc), ptr(parts["qkv"][1])
            if ly.attn.q_norm is not None:
                c.q_norm, c.k_norm = ptr(ly.attn.q_norm.weight), ptr(ly.attn.k_norm.weight)
            for name, (w, _, q4, rows) in parts.items():
                setattr(c, f"{name}_w", ptr(w))
                setattr(c, f"{name}_q4", ptr(q4))
                setattr(c, f"{name}_rows", rows)
            # each linear's qx panels (a GGUF file's blocks or a bfloat16 checkpoint's halves of the same float32
            # weights), where it has them, for steps of up to the fewest rows their kinds take
            c.qx_rows, limits = 0, torch_ops.qx_max_rows()
            for name, m in mods.items():
                t = getattr(m, "qx", None)
                if t is not None and torch_ops._qx_shape_ok(t, m.out_features, m.in_features, m.qx_kind):
                    setattr(c, f"{name}_qx", ptr(t))
                    setattr(c, f"{name}_qx_kind", m.qx_kind)
                    c.qx_rows = min(c.qx_rows or limits[m.qx_kind], limits[m.qx_kind])
                    self.qx.append(t)

    @classmethod
    def bind(cls, model, backend, kv_caches) -> "DecodeLayers | None":
        lib_ = torch_ops.lib()
        # the attention: `torchengine.attention.TorchAttention` on these kernels (`lib`), whose groups `step` reads
        if (lib_ is None or model.tp_size != 1 or getattr(backend, "lib", None) is None
                or len(kv_caches) != len(model.layers)
                or not all(isinstance(ly.mlp, MLP) for ly in model.layers)):
            return None
        f32 = lambda t: t is None or (t.dtype == torch.float32 and t.is_cpu and t.is_contiguous())  # noqa: E731
        for ly, (kc, vc) in zip(model.layers, kv_caches):
            parts = [_linear_parts(m) for m in (ly.attn.qkv_proj, ly.attn.o_proj, ly.mlp.gate_up_proj,
                                                 ly.mlp.down_proj)]
            if not all(p is not None and f32(p[0]) and f32(p[1]) for p in parts) or any(p[1] is not None
                                                                                      for p in parts[1:]):
                return None
            norms = (ly.attn_norm, ly.mlp_norm, ly.attn.q_norm, ly.attn.k_norm)
            if not all(n is None or f32(n.weight) for n in norms):
                return None
            if not (kc.dtype == vc.dtype == kv_caches[0][0].dtype in torch_ops.KV_TYPES and kc.is_contiguous()
                    and vc.is_contiguous() and kc.is_cpu):
                return None
        if not (f32(model.rope_cos) and f32(model.rope_sin)):
            return None
        return cls(lib_, model, backend, kv_caches)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, kv_lens: np.ndarray,
                 block_tables: np.ndarray) -> torch.Tensor:
        """x [T, H] the embeddings (float32, contiguous), positions / slots [T] int64, kv_lens [>= T] int32 and
        block_tables [>= T, P] int32 (C-contiguous numpy, the step's) -> hidden [T, H], before the final norm."""
        T = x.shape[0]
        H, Hq, Hkv, D, I = self.dims
        assert x.is_contiguous() and positions.dtype == slots.dtype == torch.int64
        assert kv_lens.dtype == block_tables.dtype == np.int32 and block_tables.flags.c_contiguous
        assert len(kv_lens) >= T and block_tables.shape[0] >= T
        ws = torch.empty(self.lib.decode_workspace(T, H, Hq, Hkv, D, I), dtype=torch.float32)
        out = torch.empty((T, H), dtype=torch.float32)
        torch_ops._check(self.lib.decode_layers(
            ctypes.addressof(self.layers), len(self.layers), x.data_ptr(), T, positions.data_ptr(),
            self.model.rope_cos.shape[0], self.model.rope_cos.data_ptr(),
            self.model.rope_sin.data_ptr(), slots.data_ptr(), kv_lens.ctypes.data, block_tables.ctypes.data,
            block_tables.shape[1], self.kv_caches[0][0].shape[1], H, Hq, Hkv, D, I, self.eps, self.scale,
            self.window, ws.data_ptr(), out.data_ptr(), torch.get_num_threads(),
            torch_ops.KV_TYPES[self.kv_caches[0][0].dtype]),
            "decode_layers")
        return out

    def step(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, decode, prefill,
             keep: np.ndarray | None) -> torch.Tensor:
        """Any step (`step_layers`): x [T, H] the embeddings, positions / slots [T] int64; `decode` and `prefill`
        the attention's C groups (`torchengine.attention.DecodeGroup`, `PrefillGroup`: CPU tensors, contiguous;
        None: no such rows); keep [S] int64 (numpy; None: every row) -> hidden [S or T, H], before the final
        norm."""
        T = x.shape[0]
        H, Hq, Hkv, D, I = self.dims
        assert x.is_contiguous() and positions.dtype == slots.dtype == torch.int64
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        dec = (None,) * 3 if decode is None else (decode.tokens, decode.kv_lens, decode.block_tables)
        pre = (None,) * 4 if prefill is None else (prefill.q_start, prefill.q_lens, prefill.kv_lens,
                                                    prefill.block_tables)
        ws = torch.empty(self.lib.decode_workspace(T, H, Hq, Hkv, D, I), dtype=torch.float32)
        out = torch.empty((T if keep is None else len(keep), H), dtype=torch.float32)
        torch_ops._check(self.lib.step_layers(
            ctypes.addressof(self.layers), len(self.layers), x.data_ptr(), T, positions.data_ptr(),
            self.model.rope_cos.shape[0], self.model.rope_cos.data_ptr(), self.model.rope_sin.data_ptr(),
            slots.data_ptr(), 0 if decode is None else dec[0].shape[0], *map(ptr, dec),
            1 if decode is None else dec[2].shape[1], 0 if prefill is None else pre[0].shape[0], *map(ptr, pre),
            1 if prefill is None else pre[3].shape[1], None if keep is None else keep.ctypes.data,
            0 if keep is None else len(keep), self.kv_caches[0][0].shape[1], H, Hq, Hkv, D, I, self.eps, self.scale,
            self.window, ws.data_ptr(), out.data_ptr(), torch.get_num_threads(),
            torch_ops.KV_TYPES[self.kv_caches[0][0].dtype]),
            "step_layers")
        return out
