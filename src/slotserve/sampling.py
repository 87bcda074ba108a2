"""SamplingParams: how one request picks its tokens and when it stops.

Validated at construction: a bad value raises ValueError naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (vLLM's names and meanings).

    temperature: 0 means greedy. top_k: 0 or -1 disables. top_p in (0, 1]. min_p in [0, 1].
    seed: makes this request's sampling reproducible whatever else is in the batch.
    stop: strings that end generation; the text is cut before the stop string.
    stop_token_ids: token ids that end generation (kept in token ids, not in text).
    logprobs: number of top log-probabilities returned at each sampled position (None: none).
    n: completions per prompt (the offline API and the server fan them out).
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
        self._validate()

    def _validate(self) -> None:
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
               f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(_is_number(self.temperature) and self.temperature >= 0, "temperature",
               f"must be >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and (self.top_k >= 0 or self.top_k == -1), "top_k",
               f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p",
               f"must be in [0, 1], got {self.min_p!r}")
        _check(self.seed is None or _is_int(self.seed), "seed",
               f"must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               "logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        _check(_is_int(self.n) and 1 <= self.n <= 128, "n",
               f"must be an integer in [1, 128], got {self.n!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_choice(self, index: int) -> SamplingParams:
        """Params for the index-th of n completions: one completion each, distinct seeds."""
        from dataclasses import replace

        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def _as_tuple(value: object, name: str, expected: str) -> tuple:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return tuple(value)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
