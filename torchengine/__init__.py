"""torchengine: the torch backend (CUDA through Triton kernels and CUDA graphs; CPU for tests and small serving).

- `tp_runner.create_runner`: the `enginecore.runner.ModelRunner` of `--backend torch`: a `runner.TorchModelRunner`,
  or with `--tensor-parallel-size N` `tp_runner.TensorParallelRunner`, rank 0 of N processes.
- `model`: one Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) with pluggable attention.
- `attention`: the paged-KV attention backends (torch for CPU, triton for CUDA, reference).
- `sampler`: `enginecore.sampling_ref` semantics on the device.
- `cuda_graph`: decode steps captured per bucket.
- `cpu_layers`: the model's layers bound to the one-call C layers of `cpu_kernels`.
- `tensor_parallel` / `distributed`: the model's shards, the ranks' process group and processes.

Importing this package imports nothing heavy; the modules import torch.
"""
