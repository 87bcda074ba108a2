"""echo with max_tokens 0 on /v1/completions (OpenAI's and vLLM's way to score a text): the
answer is each prompt, with its logprobs when asked, and no generated output."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from slotserve.config import FinishReason
from slotserve.engine.outputs import CompletionOutput, RequestOutput
from slotserve.server import protocol as p
from slotserve.server.generation import Generations


class EchoOnlyGenerations(Generations):
    """Generations whose completions show no output: the engine runs each prompt with
    max_tokens 1 (the prefill computes the prompt's logprobs; CompletionRequest.echo_only)
    and this drops that token from the text, the logprobs and the usage.

    NOTE: every completion ends with finish_reason "length" (the budget of 0 tokens was
    reached), whatever ended the dropped token, as OpenAI answers max_tokens 0.
    """

    @property
    def finals(self) -> list[CompletionOutput]:
        return [without_output(c) for c in super().finals]

    async def completions(self, firsts: list[RequestOutput]
                          ) -> AsyncIterator[CompletionOutput]:
        async for c in super().completions(firsts):
            yield without_output(c)

    def usage_so_far(self) -> p.UsageInfo:
        return p.UsageInfo.of(sum(g.prompt_tokens for g in self.generations), 0,
                              sum(g.cached_tokens for g in self.generations))


def without_output(c: CompletionOutput) -> CompletionOutput:
    """`c` with no generated text, tokens nor logprobs; "length" once it finished."""
    return dataclasses.replace(
        c, text="", token_ids=[], logprobs=None if c.logprobs is None else [],
        delta_text="", delta_token_ids=[],
        finish_reason=FinishReason.LENGTH if c.finished else None)
