"""jaxengine: the JAX backend (TPU with the Pallas kernel, GPU and CPU through XLA).

- model.py: one Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) as pure
  functions over a params pytree with logical axes; forward scans over layers, in XLA's ops or
  the kernels its runner injects (`ModelKernels`).
- cpu_wing.py: the CPU kernels' weight layout (panels packed at load) and the `ModelKernels`
  the runner injects on a CPU.
- loader.py / checkpoint.py: numpy weights (HF names) or an orbax checkpoint straight into
  their NamedShardings.
- attention.py: ragged paged attention in XLA (the CPU/GPU path; Pallas contract and layout).
- sampler.py: the jitted sampler (enginecore.sampling_ref semantics).
- sharding.py: the ('data', 'model') mesh and the logical -> mesh axis rules.
- programs.py: the step's jitted programs (model, sample, prompt logprobs) and their packed inputs.
- runner.py: JaxModelRunner (enginecore.runner.ModelRunner); compilation.py: the
  compilation caches (JAX's persistent cache; serialized executables on CPU), compile counting and
  the recompilation guard; warmup.py: `xlaserve warmup`.
- multihost.py: one engine over several hosts (`--nnodes`, a TPU slice): jax.distributed, rank 0's runner
  calls to the other processes over its key-value store, their loop (`--headless`).
- aot.py: `xlaserve warmup --topology`: every program compiled for a TPU slice on a host
  without one (tpu_target.py: chips, topology names, libtpu's compile-only devices; hbm.py:
  the fit check against a chip's HBM; step_cost.py: FLOPs / bytes / roofline per program).

Importing this package does not import jax; the submodules do.
"""
