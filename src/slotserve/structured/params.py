"""StructuredOutputs: what a constrained request's output must match (vLLM's names).

Plain data, no grammar engine: it is validated for shape here (exactly one kind, the right
types); whether the grammar engine accepts it is checked when the engine compiles it
(`slotserve.structured.grammar.GrammarCompiler`), at `add_request` time.
"""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, fields

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of:

    json: a JSON schema (a dict, or its JSON text); stored as compact JSON text, so that equal
        schemas share one compiled grammar and the params stay hashable. NOTE: key order is
        kept, not sorted: the output's properties come in the schema's order.
    json_object: True: any JSON object (OpenAI's response_format {"type": "json_object"}).
    regex: a regular expression (Rust `regex` syntax) the whole output must match.
    choice: the output is exactly one of these strings (a non-empty list of strings).
    grammar: a Lark grammar (llguidance's syntax) or a GBNF grammar (llama.cpp's).
    """

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in KINDS if _is_set(getattr(self, name))]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(KINDS)}; got {', '.join(given) or 'none'}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a boolean, "
                             f"got {self.json_object!r}")
        if self.json is not None:
            object.__setattr__(self, "json", _compact_schema(self.json))
        if self.regex is not None:
            _check_text(self.regex, "regex")
        if self.grammar is not None:
            _check_text(self.grammar, "grammar")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))

    @property
    def kind(self) -> str:
        """The one field that is set ("json", "json_object", "regex", "choice", "grammar")."""
        return next(name for name in KINDS if _is_set(getattr(self, name)))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec text): equal keys compile to the same grammar (the cache's key)."""
        kind = self.kind
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, jsonlib.dumps(list(self.choice))
        return kind, getattr(self, kind)

    @classmethod
    def from_dict(cls, value: dict) -> StructuredOutputs:
        """From a dict of these fields (ValueError naming an unknown field)."""
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown field(s) {', '.join(unknown)}; "
                             f"expected one of {', '.join(KINDS)}")
        return cls(**value)


def _is_set(value: object) -> bool:
    return value is not None and value is not False


def _compact_schema(schema: object) -> str:
    if isinstance(schema, str):
        try:
            schema = jsonlib.loads(schema)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("structured_outputs.json must be a JSON schema (an object), got "
                         f"{type(schema).__name__}")
    try:
        return jsonlib.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs.json is not JSON-serialisable: {exc}") from None


def _check_text(value: object, name: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")


def _choices(value: object) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"structured_outputs.choice must be a list of strings, got {value!r}")
    choices = tuple(value)
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                         f"strings, got {value!r}")
    return choices


def from_response_format(value: object) -> StructuredOutputs | None:
    """OpenAI's `response_format` -> StructuredOutputs (None for {"type": "text"} or None).

    {"type": "json_object"} -> any JSON object; {"type": "json_schema", "json_schema":
    {"name": ..., "schema": {...}, "strict": ...}} -> that schema (always enforced, strict or
    not: the grammar allows nothing else). ValueError naming the response_format field.
    """
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"response_format must be an object, got {type(value).__name__}")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise ValueError("response_format.type must be one of 'text', 'json_object', "
                         f"'json_schema', got {kind!r}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise ValueError("response_format.json_schema must be an object with a 'schema'")
    try:
        return StructuredOutputs(json=spec["schema"])
    except ValueError as exc:
        raise ValueError(str(exc).replace("structured_outputs.json",
                                          "response_format.json_schema.schema")) from None
