"""SamplingParams: how one request picks its tokens and when it stops.

Validated at construction: a bad value raises ValueError naming the field. Every value that
passes is safe for the sampler's tensors (see the limits on `SamplingParams`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from slotserve.structured.params import StructuredOutputs

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing float32 logits by them
# would overflow, and the distribution they ask for is the argmax anyway.
GREEDY_BELOW_TEMPERATURE = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (vLLM's names and meanings).

    temperature: finite, >= 0; below 1e-5 (0 included) means greedy. Very large values are
        allowed (the sampler clamps them to float32's largest; the distribution is then uniform
        over the kept tokens).
    top_k: 0 or -1 disables; any positive integer, values at or above the vocabulary keep it all.
    top_p in (0, 1]: the most likely token always stays, however small top_p is.
    min_p in [0, 1]: min_p = 1 keeps the most likely token(s) only.
    seed: an int64 (negative seeds included, as vLLM and the OpenAI API take any int64); makes
        this request's sampling reproducible whatever else is in the batch.
    stop: non-empty strings that end generation; the text is cut before the stop string.
    stop_token_ids: token ids (non-negative int64s) that end generation (kept in token ids).
    logprobs: number of top log-probabilities returned at each sampled position (None: none).
    n: completions per prompt (the offline API and the server fan them out).
    structured_outputs: a StructuredOutputs (or a dict of its fields): the output must match
        a JSON schema, any JSON object, a regex, one of a list of strings or a grammar. Its
        shape is checked here; the engine compiles it at add_request (ValueError if rejected).
    max_tokens: an integer in [1, 2**63 - 1] (the engine also caps by the model length).
    min_tokens: an integer in [0, max_tokens] (vLLM's): until a completion has this many
        tokens, EOS and stop_token_ids cannot be sampled and no stop (token or string) ends
        it; only the length caps do.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    min_tokens: int = 0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Normalise: accept a single string / list for stop and a list for stop_token_ids.
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", _as_tuple(stop, "stop", "a string or a list of strings"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(
            self.stop_token_ids or (), "stop_token_ids", "a list of integers"))
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs",
                               StructuredOutputs.from_dict(self.structured_outputs))
        self._validate()

    def _validate(self) -> None:
        _check(_is_int(self.max_tokens) and 1 <= self.max_tokens <= INT64_MAX, "max_tokens",
               f"must be an integer in [1, 2**63 - 1], got {self.max_tokens!r}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", f"must be an integer in [0, max_tokens ({self.max_tokens})], "
               f"got {self.min_tokens!r}")
        _check(_is_finite(self.temperature) and self.temperature >= 0, "temperature",
               f"must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_finite(self.top_p) and 0 < self.top_p <= 1, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k",
               f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(_is_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p",
               f"must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX),
               "seed", f"must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings")
        _check(all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids),
               "stop_token_ids", "must be integers in [0, 2**63 - 1]")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               "logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        _check(_is_int(self.n) and 1 <= self.n <= 128, "n",
               f"must be an integer in [1, 128], got {self.n!r}")
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputs), "structured_outputs",
               f"must be a StructuredOutputs or a dict, got {self.structured_outputs!r}")

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature 0, or so small that it means the same."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def for_choice(self, index: int) -> SamplingParams:
        """Params for the index-th of n completions: one completion each, distinct seeds.

        NOTE: seed + index wraps around within int64 (seed 2**63 - 1, index 1 -> -2**63), so
        every valid seed gives n valid and distinct seeds.
        """
        seed = None if self.seed is None else _wrap_int64(self.seed + index)
        return replace(self, n=1, seed=seed)


def _as_tuple(value: object, name: str, expected: str) -> tuple:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return tuple(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    """A real number (not a bool) that a float holds finitely: no NaN, no inf, no int past 1e308."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _wrap_int64(value: int) -> int:
    return (value - INT64_MIN) % 2**64 + INT64_MIN


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
