"""Write a resolved model back out as a Hugging Face folder (tests, benchmarks, `jaxengine.checkpoint`).

It sits above both `model_loader` (the weights) and `tokenizer` (the tokenizer files), which import
neither this module nor each other's writers.
"""

from __future__ import annotations

import json
import os

import numpy as np

from enginecore.model_loader import ModelSource
from enginecore.tokenizer import load_tokenizer


def _np_dtype(name: str):
    """numpy dtype of a dtype name; bfloat16 comes from ml_dtypes (numpy does not know the name)."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def save_hf_folder(src: ModelSource, out_dir: str, dtype: str = "float32") -> str:
    """Write config.json + model.safetensors + tokenizer files for `src` into out_dir."""
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        d = src.config.to_hf_dict()
        d["torch_dtype"] = dtype
        json.dump(d, f, indent=2)
    weights = {}
    for name, arr in src.iter_weights():
        if name == "lm_head.weight" and src.config.tie_word_embeddings:
            continue
        weights[name] = np.ascontiguousarray(arr.astype(_np_dtype(dtype)))
    save_file(weights, os.path.join(out_dir, "model.safetensors"))
    tok = load_tokenizer(src)
    tok.hf.save_pretrained(out_dir)
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": list(tok.eos_token_ids)}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f)
    return out_dir
