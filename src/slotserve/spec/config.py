"""`SpeculativeConfig`: vLLM's `--speculative-config` JSON form, validated (no torch).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5}
    {"method": "suffix", "num_speculative_tokens": "auto"}

num_speculative_tokens: an integer in [1, MAX_SPECULATIVE_TOKENS] (a fixed number per
sequence and iteration, fewer when the proposer has fewer or the budget is short), or "auto"
(the default when speculation is on): the scheduler picks each sequence's number every
iteration from the step-cost model and the sequence's observed acceptance, at most
AUTO_MAX_SPECULATIVE_TOKENS (spec/planner.py).
ngram: prompt_lookup_min and prompt_lookup_max bound the matched n-gram's length; as vLLM,
both default to 5 and one given alone sets the other.
suffix: suffix_decoding_max_tree_depth (24), suffix_decoding_max_cached_requests (1000:
vLLM's default is 10000, but each cached output costs Python objects here),
suffix_decoding_max_spec_factor (1.0), suffix_decoding_min_token_prob (0.1), as vLLM's.

A bad value raises ValueError naming the key.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from slotserve.value_checks import is_finite_number, is_int

METHODS = ("ngram", "suffix")
MAX_SPECULATIVE_TOKENS = 32  # a verification's rows: more would only cost (bounded work)
AUTO_MAX_SPECULATIVE_TOKENS = 16  # what "auto" may pick per sequence and iteration
MAX_NGRAM = 64
MAX_TREE_DEPTH = 256
MAX_CACHED_REQUESTS = 100_000
MAX_SPEC_FACTOR = 64.0

_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
         "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
_SUFFIX_KEYS = tuple(k for k in _KEYS if k.startswith("suffix_decoding_"))


@dataclass(frozen=True)
class SpeculativeConfig:
    """One speculation setting (see the module docstring); build with `parse`."""

    method: str
    num_speculative_tokens: int | str = "auto"  # an int, or "auto"
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1

    @property
    def auto(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @property
    def max_tokens(self) -> int:
        """Most draft tokens of one sequence in one iteration."""
        return AUTO_MAX_SPECULATIVE_TOKENS if self.auto else int(self.num_speculative_tokens)

    def to_json(self) -> str:
        """The canonical JSON text (sorted keys, the method's own; what EngineConfig stores)."""
        foreign = _SUFFIX_KEYS if self.method == "ngram" else _NGRAM_KEYS
        fields = {k: v for k, v in asdict(self).items() if k not in foreign}
        return json.dumps(fields, sort_keys=True)


def parse(value: Any) -> SpeculativeConfig | None:
    """A SpeculativeConfig from JSON text, a dict or a SpeculativeConfig; None for None or
    an empty text ("" / "null": speculation off). ValueError naming the key otherwise."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if value.strip() in ("", "null", "None"):
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config: not valid JSON ({exc.msg})") from None
        if value is None:
            return None
    if not isinstance(value, dict):
        raise ValueError("speculative_config must be a JSON object such as "
                         '{"method": "ngram", "num_speculative_tokens": 4}, got '
                         f"{type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; known: "
                         f"{', '.join(_KEYS)}")
    method = value.get("method")
    if method not in METHODS:
        raise ValueError(f"speculative_config: method must be one of {METHODS}, "
                         f"got {method!r}")
    foreign = [k for k in value if k in (_SUFFIX_KEYS if method == "ngram" else _NGRAM_KEYS)]
    if foreign:
        raise ValueError(f"speculative_config: {foreign[0]} does not apply to method "
                         f"{method!r}")
    fields = {k: v for k, v in value.items() if k != "method"}
    _check_num_tokens(fields.get("num_speculative_tokens", "auto"))
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        _check_int(fields, key, 1, MAX_NGRAM)
    if "prompt_lookup_min" in fields and "prompt_lookup_max" not in fields:
        fields["prompt_lookup_max"] = fields["prompt_lookup_min"]
    if "prompt_lookup_max" in fields and "prompt_lookup_min" not in fields:
        fields["prompt_lookup_min"] = fields["prompt_lookup_max"]
    _check_int(fields, "suffix_decoding_max_tree_depth", 1, MAX_TREE_DEPTH)
    _check_int(fields, "suffix_decoding_max_cached_requests", 0, MAX_CACHED_REQUESTS)
    _check_number(fields, "suffix_decoding_max_spec_factor", 0.0, MAX_SPEC_FACTOR, low_open=True)
    _check_number(fields, "suffix_decoding_min_token_prob", 0.0, 1.0)
    config = SpeculativeConfig(method=method, **fields)
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise ValueError("speculative_config: prompt_lookup_min must be <= prompt_lookup_max, "
                         f"got {config.prompt_lookup_min} > {config.prompt_lookup_max}")
    return config


def _check_num_tokens(value: Any) -> None:
    if value == "auto":
        return
    if not is_int(value) or not 1 <= value <= MAX_SPECULATIVE_TOKENS:
        raise ValueError("speculative_config: num_speculative_tokens must be \"auto\" or an "
                         f"integer in [1, {MAX_SPECULATIVE_TOKENS}], got {value!r}")


def _check_int(fields: dict, key: str, low: int, high: int) -> None:
    if key in fields and (not is_int(fields[key]) or not low <= fields[key] <= high):
        raise ValueError(f"speculative_config: {key} must be an integer in [{low}, {high}], "
                         f"got {fields[key]!r}")


def _check_number(fields: dict, key: str, low: float, high: float,
                  low_open: bool = False) -> None:
    if key not in fields:
        return
    value = fields[key]
    ok = (is_finite_number(value) and (low < value if low_open else low <= value)
          and value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ValueError(f"speculative_config: {key} must be a number in {interval}, "
                         f"got {value!r}")
    fields[key] = float(value)
