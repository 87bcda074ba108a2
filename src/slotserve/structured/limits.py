"""Size caps on a constraint (`StructuredLimits`): what a server accepts before compiling.

A grammar's compile time and memory grow with its size (measured with llguidance 1.9 on 2
cores: a 67 KB JSON schema 0.07 s, a 337 KB one 0.9 s and about 40 MB), and each completion
of a constrained request computes a mask every step; so the spec's size in bytes and the
number of constrained completions are bounded. llguidance's own limits
(`grammar.PARSER_LIMITS`) bound what a small spec can cost (`c{1000000}` is 11 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from slotserve.structured.params import StructuredOutputs
from slotserve.value_checks import is_int

DEFAULT_MAX_SCHEMA_BYTES = 128 << 10
DEFAULT_MAX_REGEX_BYTES = 16 << 10
DEFAULT_MAX_GRAMMAR_BYTES = 64 << 10
DEFAULT_MAX_CHOICES = 1024
DEFAULT_MAX_CHOICE_BYTES = 1024
DEFAULT_MAX_CONSTRAINED_N = 16


@dataclass(frozen=True)
class StructuredLimits:
    """Caps on a constrained request; past one the request gets 400 naming its field.

    max_schema_bytes: a JSON schema's size (compact JSON text, UTF-8 bytes); the schema a
    chat request's `tools` make counts too.
    max_regex_bytes / max_grammar_bytes: a regex's / a Lark or GBNF grammar's UTF-8 bytes.
    max_choices / max_choice_bytes: how many choices, and the UTF-8 bytes of each.
    max_constrained_n: `n` (completions) of a constrained request: each has its own matcher
    and computes a mask every step.
    """

    max_schema_bytes: int = DEFAULT_MAX_SCHEMA_BYTES
    max_regex_bytes: int = DEFAULT_MAX_REGEX_BYTES
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    max_choices: int = DEFAULT_MAX_CHOICES
    max_choice_bytes: int = DEFAULT_MAX_CHOICE_BYTES
    max_constrained_n: int = DEFAULT_MAX_CONSTRAINED_N

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{f.name} must be an integer >= 1, got {value!r}")

    def check(self, spec: StructuredOutputs) -> None:
        """ValueError "structured_outputs.<kind>: ..." if `spec` is past a size cap (the
        server renames it to the request's field, see protocol.structured_error)."""
        kind = spec.kind
        if kind == "choice":
            self._check_choices(spec.choice)
            return
        cap, flag = {"json": (self.max_schema_bytes, "--max-schema-bytes"),
                     "regex": (self.max_regex_bytes, "--max-regex-bytes"),
                     "grammar": (self.max_grammar_bytes, "--max-grammar-bytes")
                     }.get(kind, (None, None))
        if cap is None:
            return  # json_object: a fixed grammar
        size = _utf8_size(spec.key[1])
        if size > cap:
            raise ValueError(f"structured_outputs.{kind}: the {_NOUNS[kind]} is {size} bytes; "
                             f"this server accepts at most {cap} ({flag})")

    def _check_choices(self, choices: tuple[str, ...]) -> None:
        if len(choices) > self.max_choices:
            raise ValueError(f"structured_outputs.choice: {len(choices)} choices; this server "
                             f"accepts at most {self.max_choices} (--max-choices)")
        for index, choice in enumerate(choices):
            size = _utf8_size(choice)
            if size > self.max_choice_bytes:
                raise ValueError(f"structured_outputs.choice: choice {index} is {size} bytes; "
                                 f"this server accepts at most {self.max_choice_bytes} "
                                 "(--max-choice-bytes)")

    def check_n(self, n: int) -> None:
        """ValueError naming `n` if a constrained request asks for more completions."""
        if n > self.max_constrained_n:
            raise ValueError(f"n: {n} completions of a constrained request; this server "
                             f"allows at most {self.max_constrained_n} (--max-constrained-n)")


_NOUNS = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))
