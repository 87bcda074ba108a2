"""slotserve: continuous batching over a paged KV cache, readable end to end."""

from slotserve.engine.llm import LLM
from slotserve.engine.outputs import CompletionOutput, RequestOutput
from slotserve.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
