"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or grammar.

`StructuredOutputs` (plain data, in SamplingParams.structured_outputs) says what to match;
`slotserve.structured.grammar` compiles it with llguidance, caches compiled grammars and keeps
each sequence's matcher. The runner masks the logits of constrained rows in the batched
sampler (see `slotserve.runner.sampler`).
"""

from slotserve.structured.params import StructuredOutputs, from_response_format

__all__ = ["StructuredOutputs", "from_response_format"]
