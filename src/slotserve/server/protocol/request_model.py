"""The strict base of every request model, and the bounded log of the fields it ignores."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, PrivateAttr, model_validator

# Ignored request fields: the first this many distinct names are logged, each cut to this
# many characters (a client choosing the names cannot flood the log).
MAX_LOGGED_IGNORED_FIELDS = 64
MAX_IGNORED_FIELD_CHARS = 64

logger = logging.getLogger("slotserve.server")



class IgnoredFields:
    """Request fields the server ignored, each name logged once per process at WARNING
    (vLLM's message); requests that carry them are served as usual.

    NOTE: bounded: the first `max_names` distinct names (each cut to `max_chars`) are
    logged, then one line says that later ones are not. Thread-safe.
    """

    def __init__(self, max_names: int = MAX_LOGGED_IGNORED_FIELDS,
                 max_chars: int = MAX_IGNORED_FIELD_CHARS) -> None:
        self.max_names = max_names
        self.max_chars = max_chars
        self.logged: set[str] = set()
        self._full_noted = False
        self._lock = threading.Lock()

    def note(self, names: Iterable[str]) -> None:
        """Log the names not logged before (within the bound)."""
        new: list[str] = []
        now_full = False
        with self._lock:
            for name in names:
                name = name[:self.max_chars]
                if name in self.logged:
                    continue
                if len(self.logged) >= self.max_names:
                    now_full, self._full_noted = not self._full_noted, True
                    break
                self.logged.add(name)
                new.append(name)
        if new:  # NOTE: repr() escapes control characters (no forged log lines)
            logger.warning("The following fields were present in the request but ignored: "
                           "{%s}", ", ".join(map(repr, new)))
        if now_full:
            logger.warning("more than %d distinct ignored request fields: later ones are not "
                           "logged", self.max_names)


IGNORED_FIELDS = IgnoredFields()


class RequestModel(BaseModel):
    """A request body or a part of one: strict types; fields it does not declare, and the
    declared ones in `unused_fields` when set, are ignored and reported to IGNORED_FIELDS
    (as `<field_prefix><name>`).

    refused_fields: known fields (OpenAI's, vLLM's) that this server does not implement and
    that would change the output: name -> the values that change nothing (null and the
    default). Given another value, the field's name goes to `refused` (not to the log);
    whoever turns the body into engine work answers 400 naming it. A field the model
    declares is never refused here (it is implemented).
    """

    model_config = ConfigDict(strict=True, extra="ignore")

    unused_fields: ClassVar[frozenset[str]] = frozenset()
    field_prefix: ClassVar[str] = ""
    refused_fields: ClassVar[dict[str, tuple[Any, ...]]] = {}
    _refused: list[str] = PrivateAttr(default_factory=list)

    @property
    def refused(self) -> list[str]:
        """The refused fields this body set to a value that would change the output."""
        return self._refused

    @model_validator(mode="wrap")
    @classmethod
    def _report_ignored(cls, data: Any, handler):
        model = handler(data)  # NOTE: an invalid body is a 400; nothing to report
        if isinstance(data, dict):
            refused = [name for name, value in data.items() if name not in cls.model_fields
                       and name in cls.refused_fields
                       and not _is_one_of(value, cls.refused_fields[name])]
            model._refused = refused
            ignored = [name for name, value in data.items() if name not in refused and (
                name not in cls.model_fields
                or (name in cls.unused_fields and value is not None))]
            if ignored:
                IGNORED_FIELDS.note(f"{cls.field_prefix}{name}" for name in ignored)
        return model



def _is_one_of(value: Any, harmless: tuple[Any, ...]) -> bool:
    """value is None or equal to one of `harmless` with the same type (false is not 0)."""
    return value is None or any(type(value) is type(h) and value == h for h in harmless)
