"""enginecore: the shared layer (scheduler, paged-KV block table, model loading, offline API).

Pure Python + numpy: importing it never imports jax or torch.
"""

from enginecore.config import EngineArgs, EngineConfig
from enginecore.llm import LLM
from enginecore.outputs import CompletionOutput, RequestOutput
from enginecore.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineArgs", "EngineConfig", "__version__"]
