"""jaxserve: serve large language models with JAX, speaking vLLM's language."""

__version__ = "0.1.0"
