"""Streaming detokenization: output token ids -> text deltas that never split a character."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slotserve.loader.tokenizer import Tokenizer

# Tokens of context decoded before the new ones (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas, one request at a time.

    Each `add` decodes only a small window: the tokens from `prefix_offset` (already emitted,
    kept as context so spacing and merges come out right) to the end, and subtracts the text of
    the window's already-emitted part (vLLM's prefix_offset / read_offset scheme).

    NOTE: a delta never ends in a partial UTF-8 character: while the window's text ends in
    U+FFFD the new tokens are held back. So `"".join(deltas) + flush()` equals
    `tokenizer.decode(output_ids)`; `flush()` only returns text when the output ends inside a
    character (or in a real U+FFFD).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids or [])
        self._num_prompt = len(self._ids)
        self.read_offset = len(self._ids)  # ids before this are emitted
        self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, 0)  # window start
        self._pieces: list[str] = []

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Append output tokens; return the text they complete ("" while held back)."""
        self._ids.extend(new_token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        return self._emit(new_text[len(prefix_text):])

    def flush(self) -> str:
        """Emit whatever is held back (the output ended inside a character); "" otherwise."""
        if self.read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self._ids))
        return self._emit(new_text[len(prefix_text):])

    @property
    def text(self) -> str:
        """All output text emitted so far (the concatenation of the deltas)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_prompt:]

    def _emit(self, delta: str) -> str:
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        self._pieces.append(delta)
        return delta

    def _decode(self, start: int, stop: int) -> str:
        if start >= stop:
            return ""
        return self.tokenizer.decode(self._ids[start:stop], self.skip_special_tokens)
