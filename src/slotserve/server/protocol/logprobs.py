"""The engine's logprobs (`list[dict[token_id, logprob]]`) in OpenAI's two response shapes,
and the bytes / text of a token (GPT-2's byte-level alphabet reversed)."""

from __future__ import annotations

import functools

from slotserve.server.protocol.responses import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    TopLogprob,
)

MIN_LOGPROB = -9999.0


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: vocabulary character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token stands for.

    Byte-level BPE spellings ("ĠParis") map back exactly; other vocabularies fall back to
    the UTF-8 of the token decoded alone.
    """
    spelling = tokenizer.id_to_token(token_id) if tokenizer is not None else None
    if spelling is None:
        return b""
    decoder = _byte_decoder()
    if all(ch in decoder for ch in spelling):
        return bytes(decoder[ch] for ch in spelling)
    return tokenizer.decode([token_id], skip_special_tokens=False).encode()


def token_text(tokenizer, token_id: int) -> str:
    """A token as text (U+FFFD where it holds part of a UTF-8 character)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]],
                        offset: int = 0) -> CompletionLogprobs:
    """The legacy completions shape. offset: text position of the first token."""
    result = CompletionLogprobs()
    for token_id, entry in zip(token_ids, logprobs):
        text = token_text(tokenizer, token_id)
        result.tokens.append(text)
        result.token_logprobs.append(_logprob(entry, token_id))
        result.top_logprobs.append(_top_by_text(tokenizer, entry, len(entry)))
        result.text_offset.append(offset)
        offset += len(text)
    return result


def echo_logprobs(tokenizer, prompt_ids: list[int],
                  entries: list[dict[int, float] | None], top_n: int) -> CompletionLogprobs:
    """The prompt's tokens in the legacy shape (echo with logprobs): the first token's
    logprob and top logprobs null (nothing comes before it), the others with their `top_n`
    most likely alternatives (the engine computed at least that many) and the token itself,
    as a sampled token's (OpenAI's: up to logprobs + 1 entries)."""
    result = CompletionLogprobs()
    offset = 0
    for token_id, entry in zip(prompt_ids, entries):
        text = token_text(tokenizer, token_id)
        result.tokens.append(text)
        result.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(_logprob(entry, token_id))
        top = _top_by_text(tokenizer, entry, top_n)
        top.setdefault(text, _logprob(entry, token_id))
        result.top_logprobs.append(top)
    return result


def _top_by_text(tokenizer, entry: dict[int, float], top_n: int) -> dict[str, float]:
    """The legacy shape's top logprobs: the `top_n` most likely tokens by their text.

    NOTE: tokens of the same text (byte pieces shown as U+FFFD) keep the most likely one's
    logprob, not the last one's."""
    top: dict[str, float] = {}
    for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]:
        top.setdefault(token_text(tokenizer, t), _finite(lp))
    return top


def join_logprobs(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    """`second` after `first` (its text offsets moved past first's text)."""
    shift = first.text_offset[-1] + len(first.tokens[-1]) if first.tokens else 0
    return CompletionLogprobs(tokens=first.tokens + second.tokens,
                              token_logprobs=first.token_logprobs + second.token_logprobs,
                              top_logprobs=first.top_logprobs + second.top_logprobs,
                              text_offset=first.text_offset + [o + shift
                                                               for o in second.text_offset])


def prompt_logprobs(tokenizer, prompt_ids: list[int], entries: list[dict[int, float] | None],
                    ranks: list[int | None], top_n: int
                    ) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's `prompt_logprobs`: per prompt token {token id: {logprob, rank, decoded_token}}
    with the token itself and the `top_n` most likely (None for the first token)."""
    result: list[dict[str, PromptLogprob] | None] = []
    for token_id, entry, rank in zip(prompt_ids, entries, ranks):
        if entry is None:
            result.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        shown = {t: PromptLogprob(logprob=_finite(lp), rank=i + 1,
                                  decoded_token=token_text(tokenizer, t))
                 for i, (t, lp) in enumerate(ranked)}
        if token_id not in shown:
            shown[token_id] = PromptLogprob(logprob=_logprob(entry, token_id), rank=rank,
                                            decoded_token=token_text(tokenizer, token_id))
        result.append({str(t): v for t, v in shown.items()})
    return result


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]],
                  top_n: int) -> ChatLogprobs:
    """The chat shape: each sampled token with its `top_n` most likely alternatives."""
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(ChatTokenLogprob(
            **_top_logprob(tokenizer, token_id, _logprob(entry, token_id)),
            top_logprobs=[TopLogprob(**_top_logprob(tokenizer, t, lp)) for t, lp in ranked]))
    return ChatLogprobs(content=content)


def _top_logprob(tokenizer, token_id: int, logprob: float) -> dict:
    logprob = _finite(logprob)
    raw = token_bytes(tokenizer, token_id) if tokenizer is not None else b""
    return {"token": token_text(tokenizer, token_id), "logprob": logprob, "bytes": list(raw)}


def _logprob(entry: dict[int, float], token_id: int) -> float:
    return _finite(entry.get(token_id, MIN_LOGPROB))


def _finite(logprob: float) -> float:
    """JSON has no -inf: clamp to MIN_LOGPROB (vLLM's convention)."""
    return max(logprob, MIN_LOGPROB)
