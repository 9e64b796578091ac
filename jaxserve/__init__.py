"""jaxserve: serve large language models with JAX, speaking vLLM's language."""

from jaxserve.llm import LLM
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
