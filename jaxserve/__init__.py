"""jaxserve: serve large language models with JAX, speaking vLLM's language.

`LLM` is imported lazily so that the host-side modules (scheduler, detokenizer, request
schemas) load without initialising JAX.
"""

import os

# jaxserve uses transformers for tokenizers and chat templates only, never its torch models: its
# "PyTorch was not found" advice at import would only puzzle a serving machine's user.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from jaxserve.beam_search import BeamSearchParams
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import (
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "RequestOutputKind",
    "BeamSearchParams",
    "RequestOutput",
    "CompletionOutput",
    "__version__",
]


def __getattr__(name: str):
    if name == "LLM":
        from jaxserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
