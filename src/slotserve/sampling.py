"""SamplingParams: how one request picks its tokens and when it stops.

Validated at construction: a bad value raises ValueError naming the field. Every value that
passes is safe for the sampler's tensors (see the limits on `SamplingParams`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

from slotserve.structured.params import StructuredOutputs
from slotserve.value_checks import is_finite_number, is_int

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing float32 logits by them
# would overflow, and the distribution they ask for is the argmax anyway.
GREEDY_BELOW_TEMPERATURE = 1e-5
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Penalties and logit shaping (OpenAI's and vLLM's bounds; the caps bound a request's work).
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's)
MAX_LOGIT_BIAS = 100.0  # |bias| (OpenAI's)
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's
MAX_ALLOWED_TOKEN_IDS = 262_144  # no vocabulary is larger (Gemma's: 262,144)
MAX_BAD_WORDS = 100
MAX_BAD_WORD_CHARS = 100


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
    prompt_logprobs: vLLM's: the top this many log-probabilities at every prompt position
        (and the prompt token's own), computed in the prefill (None: none). Only the first of
        n completions computes them (they are the prompt's); it bypasses the prefix cache.
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
    prompt_logprobs: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
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
        object.__setattr__(self, "logit_bias", _logit_bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _as_tuple(
                self.allowed_token_ids, "allowed_token_ids", "a list of integers"))
        object.__setattr__(self, "bad_words", _as_tuple(
            self.bad_words or (), "bad_words", "a list of strings"))
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs",
                               StructuredOutputs.from_dict(self.structured_outputs))
        self._validate()

    def _validate(self) -> None:
        _check(is_int(self.max_tokens) and 1 <= self.max_tokens <= INT64_MAX, "max_tokens",
               f"must be an integer in [1, 2**63 - 1], got {self.max_tokens!r}")
        _check(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", f"must be an integer in [0, max_tokens ({self.max_tokens})], "
               f"got {self.min_tokens!r}")
        _check(is_finite_number(self.temperature) and self.temperature >= 0, "temperature",
               f"must be a finite number >= 0, got {self.temperature!r}")
        _check(is_finite_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        _check(is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k",
               f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(is_finite_number(self.min_p) and 0 <= self.min_p <= 1, "min_p",
               f"must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or (is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX),
               "seed", f"must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings")
        _check(all(is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids),
               "stop_token_ids", "must be integers in [0, 2**63 - 1]")
        _check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               "logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        _check(self.prompt_logprobs is None
               or (is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
               "prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        _check(is_int(self.n) and 1 <= self.n <= 128, "n",
               f"must be an integer in [1, 128], got {self.n!r}")
        _check(self.structured_outputs is None
               or isinstance(self.structured_outputs, StructuredOutputs), "structured_outputs",
               f"must be a StructuredOutputs or a dict, got {self.structured_outputs!r}")
        self._validate_shaping()

    def _validate_shaping(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(is_finite_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY, name,
                   f"must be in [-2, 2], got {value!r}")
        _check(is_finite_number(self.repetition_penalty) and self.repetition_penalty > 0,
               "repetition_penalty", f"must be a finite number > 0, got "
               f"{self.repetition_penalty!r}")
        allowed = self.allowed_token_ids
        if allowed is not None:
            _check(0 < len(allowed) <= MAX_ALLOWED_TOKEN_IDS, "allowed_token_ids",
                   f"must hold 1 to {MAX_ALLOWED_TOKEN_IDS} token ids, got {len(allowed)}")
            _check(all(is_int(t) and 0 <= t <= INT64_MAX for t in allowed),
                   "allowed_token_ids", "must be integers in [0, 2**63 - 1]")
        _check(len(self.bad_words) <= MAX_BAD_WORDS, "bad_words",
               f"at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}")
        _check(all(isinstance(w, str) and w.strip() and len(w) <= MAX_BAD_WORD_CHARS
                   for w in self.bad_words), "bad_words",
               f"must be strings of 1 to {MAX_BAD_WORD_CHARS} characters, not only spaces")

    @property
    def penalized(self) -> bool:
        """Whether a presence, frequency or repetition penalty applies."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def shapes_logits(self) -> bool:
        """Whether penalties, logit_bias, allowed_token_ids or bad_words change the logits."""
        return bool(self.penalized or self.logit_bias or self.bad_words
                    or self.allowed_token_ids is not None)

    @cached_property
    def stop_token_set(self) -> frozenset[int]:
        """stop_token_ids as a set, built once per params (each of n completions has its
        own, `for_choice`): the engine tests every new token against it.

        NOTE: cached in the instance's __dict__ (a frozen dataclass allows that), so it is
        neither a field nor part of equality or the hash."""
        return frozenset(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature 0, or so small that it means the same."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    def for_choice(self, index: int) -> SamplingParams:
        """Params for the index-th of n completions: one completion each, distinct seeds.

        NOTE: seed + index wraps around within int64 (seed 2**63 - 1, index 1 -> -2**63), so
        every valid seed gives n valid and distinct seeds.
        NOTE: only completion 0 keeps prompt_logprobs: they are the prompt's, the same for all.
        """
        seed = None if self.seed is None else _wrap_int64(self.seed + index)
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return replace(self, n=1, seed=seed, prompt_logprobs=prompt_logprobs)


def _as_tuple(value: object, name: str, expected: str) -> tuple:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return tuple(value)


def _logit_bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs sorted by id, from a mapping (int ids or strings of
    ASCII digits, as JSON keys) or from pairs (what this returns: `replace` passes it again).
    ValueError naming logit_bias: a bad key or value, an id given twice, too many entries."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else _as_tuple(
        value, "logit_bias", "a dict of token id -> bias")
    pairs: dict[int, float] = {}
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {_brief(item)}")
        key, bias = item
        token = _token_id_key(key)
        _check(token not in pairs, "logit_bias", f"gives token {token} twice")
        _check(is_finite_number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS, "logit_bias",
               f"biases must be numbers in [-100, 100], got {_brief(bias)} for token {token}")
        pairs[token] = float(bias)
        _check(len(pairs) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias",
               f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    return tuple(sorted(pairs.items()))


def _token_id_key(key: object) -> int:
    """A logit_bias key: an int, or a string of at most 19 ASCII digits (JSON's keys)."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19:
        key = int(key)
    _check(is_int(key) and 0 <= key <= INT64_MAX, "logit_bias",
           f"keys must be token ids (integers >= 0, or strings of digits), got {_brief(key)}")
    return key


def _brief(value: object, limit: int = 40) -> str:
    """repr(value), cut to `limit` characters (error messages quote client input)."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's 4300-digit str limit
        return f"an {type(value).__name__} too long to show"
    return text if len(text) <= limit else text[:limit] + "..."


def _wrap_int64(value: int) -> int:
    return (value - INT64_MIN) % 2**64 + INT64_MIN


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
