"""RequestLookups: what the runner may ask the engine about a request it runs.

The plan (`SchedulerOutput`) carries ids, tokens and `SamplingParams`; a request's live
per-completion state (its grammar matcher, its penalties' token counts, its prompt-logprobs
accumulator) stays in the engine, which owns and advances it between iterations. The engine
hands the runner these read-only lookups once, at construction (`ModelRunner(lookups=...)`),
with the model's EOS ids that min_tokens keeps out; nothing is assigned to the runner later.

NOTE: a lookup is called on the engine's thread during `execute` (the grammar one also
hands its matcher to the runner's mask worker, which only reads it); it returns None for a
request it does not know or that needs nothing, and never raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slotserve.runner.logit_shaping import SequenceShaping
    from slotserve.runner.prompt_logprobs import PromptLogprobs
    from slotserve.structured.grammar import GrammarMatcher


def _nothing(request_id: str) -> None:
    """The lookup of a runner without an engine: no request needs anything."""
    return None


@dataclass(frozen=True)
class RequestLookups:
    """The engine's answers about a running request, by request (completion) id.

    grammar_of: its grammar matcher (structured outputs), or None if unconstrained.
    shaping_of: its penalties and logit shaping, or None if it has none.
    prompt_logprobs_of: its prompt-logprobs accumulator, or None if it asked for none.
    eos_token_ids: the model's EOS tokens, which the sampler masks while min_tokens holds.
    """

    grammar_of: Callable[[str], GrammarMatcher | None] = _nothing
    shaping_of: Callable[[str], SequenceShaping | None] = _nothing
    prompt_logprobs_of: Callable[[str], PromptLogprobs | None] = _nothing
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))


# A runner driven without an engine (tests, benchmarks): every request unconstrained.
NO_LOOKUPS = RequestLookups()
