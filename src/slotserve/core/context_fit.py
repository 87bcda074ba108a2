"""The one "prompt + one output token must fit in the context" rule, for the scheduler,
the AsyncEngine's front check and the server's 400 (the same message everywhere)."""

from __future__ import annotations


class ContextOverflowError(ValueError):
    """A prompt that can never fit with one output token in `limit` tokens per sequence."""

    def __init__(self, message: str, num_tokens: int, limit: int) -> None:
        super().__init__(message)
        self.num_tokens = num_tokens
        self.limit = limit


def max_prompt_tokens(limit: int) -> int:
    """The longest prompt a sequence of at most `limit` tokens can hold: one output token
    must fit after it."""
    return limit - 1


def check_fits_context(num_tokens: int, limit: int, *, field: str = "prompt",
                       holder: str = "this server", why: str = "") -> None:
    """ContextOverflowError (a ValueError) unless a prompt of num_tokens tokens and one output
    token fit in `limit` tokens per sequence.

    field: what the message calls the prompt ("prompt", "messages"); holder: who has the
    limit ("this server", "this engine"); why: where the limit comes from, in the message
    (" (max_model_len=..., ...)").
    """
    if num_tokens > max_prompt_tokens(limit):
        raise ContextOverflowError(
            f"{field} has {num_tokens} tokens, but {holder} fits at most {limit} tokens per "
            f"sequence{why}; the prompt and at least one output token must fit",
            num_tokens, limit)
