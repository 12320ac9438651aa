"""The CPU kernel wing: AVX2 / AVX-512 C kernels for x86-64, beside `pallas_kernels` (TPU) and `triton_kernels`
(GPU).

- `csrc/`: the C sources by topic, `cpu_kernels.h` (their one interface) and `xla_ffi.cc` (the XLA FFI shim);
- `build`: which sources each backend builds and with which flags (built on first use, cached by hash);
- `torch_ops`: the ctypes bindings the torch backend calls; `jax_ops`: the XLA custom calls the jax backend calls;
- `layout`: the weights' packed forms (float32 panels, GGUF blocks and 16-bit halves as stored: `qx`);
- `memory`: huge-page weight buffers, a KV cache committed in the background;
- `reference`: numpy references the kernels are tested against.

The backends reach these kernels only at load time, by transforms (see docs/design-notes.md); whatever they do
not cover runs on the generic torch / XLA path. `XLASERVE_CPU_KERNELS=off` turns the wing off.
"""
