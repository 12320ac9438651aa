"""torchengine: the torch backend (CUDA through Triton kernels and CUDA graphs; CPU for tests and small serving).

- `runner.TorchModelRunner`: the `enginecore.runner.ModelRunner` of `--backend torch`.
- `model`: one Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) with pluggable attention.
- `attention`: the paged-KV attention backends (torch for CPU, triton for CUDA, reference).
- `sampler`: `enginecore.sampling_ref` semantics on the device.
- `cuda_graph`: decode steps captured per bucket.
- `tensor_parallel` / `distributed`: `--tensor-parallel-size`, one process per rank.

Importing this package imports nothing heavy; the modules import torch.
"""
