"""Tokenizer: a `tokenizers.Tokenizer`, BOS/EOS rules and a chat template.

A tokenizer comes from one of two places:

- a GGUF file's `tokenizer.ggml.*` metadata (`Tokenizer.from_gguf_metadata`): a byte-level BPE
  is rebuilt from the token list and the merges, with the pre-tokenizer llama.cpp uses for the
  file's `tokenizer.ggml.pre`, or Gemma's SentencePiece BPE from its token list;
- a Hugging Face model directory (`Tokenizer.from_hf_dir`): `tokenizer.json` and
  `tokenizer_config.json`.

`save` / `load` write and read the same thing as `tokenizer.json` + `tokenizer_meta.json`.
The pieces live beside it: `gguf_vocab` (a GGUF vocabulary -> a `tokenizers` backend),
`chat_template` (the sandboxed Jinja environment HF templates expect) and `detokenize`
(the streaming detokenizer).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any

from tokenizers import Tokenizer as Backend

from slotserve.loader.chat_template import compiled_chat_template, hf_chat_template
from slotserve.loader.gguf_vocab import (
    LLAMA_SENTENCEPIECE_ARCHS,
    SENTENCEPIECE_ARCHS,
    add_gguf_special_tokens,
    byte_level_bpe,
    gemma_sentencepiece,
    gguf_eos_token_ids,
    llama_sentencepiece,
)

META_FILE = "tokenizer_meta.json"
BACKEND_FILE = "tokenizer.json"


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template.

    NOTE: `encode` never lets the backend's post-processor add tokens; BOS is prepended here,
    only when the model's metadata asks for it (`add_bos_token`), so GGUF and HF models behave
    alike. EOS is never appended.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF file's metadata (a dict of `tokenizer.ggml.*` keys and values).

        Byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`), Gemma's
        SentencePiece one (`"llama"` in a `gemma2` / `gemma3` file) and the Llama-style one
        (`"llama"` in a `llama` / `phi3` file: Llama 2, Mistral v0.1, Phi-3) are supported;
        BOS is prepended when `tokenizer.ggml.add_bos_token` says so (llama.cpp's and HF's
        default for a SentencePiece vocabulary: true).
        """
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        types = meta.get("tokenizer.ggml.token_type") or ()
        if kind == "gpt2":
            merges, pre = meta["tokenizer.ggml.merges"], meta.get("tokenizer.ggml.pre")
            backend = byte_level_bpe(tokens, merges, pre)
            add_gguf_special_tokens(backend, tokens, types)
            add_bos_default = False
        elif kind == "llama" and meta.get("general.architecture") in SENTENCEPIECE_ARCHS:
            if meta.get("tokenizer.ggml.add_space_prefix", False):
                raise ValueError("tokenizer.ggml.add_space_prefix=True: a SentencePiece prefix "
                                 "space is not supported (Gemma's vocabulary has none)")
            backend = gemma_sentencepiece(tokens, types, _unk_token(meta, tokens))
            add_bos_default = True
        elif kind == "llama" and meta.get("general.architecture") in LLAMA_SENTENCEPIECE_ARCHS:
            if meta.get("tokenizer.ggml.add_space_prefix", True) is not True:
                raise ValueError("tokenizer.ggml.add_space_prefix=False: a Llama-style "
                                 "SentencePiece vocabulary without its prefix space is not "
                                 "supported (HF transformers adds it whatever the file says)")
            backend = llama_sentencepiece(tokens, meta.get("tokenizer.ggml.scores") or [],
                                          types, meta["general.architecture"])
            add_bos_default = True
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer model {kind!r} for architecture "
                f"{meta.get('general.architecture')!r}: supported are byte-level BPE ('gpt2') "
                f"and SentencePiece ('llama') for "
                f"{', '.join(SENTENCEPIECE_ARCHS + LLAMA_SENTENCEPIECE_ARCHS)}; load the "
                "model's Hugging Face directory instead"
            )
        return cls(
            backend,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=gguf_eos_token_ids(meta),
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str, extra_eos_ids: Iterable[int] = ()) -> Tokenizer | None:
        """Build from a Hugging Face model directory; None when it has no `tokenizer.json`.

        `extra_eos_ids` (from config.json / generation_config.json) join the EOS token's id.
        """
        if not os.path.isfile(os.path.join(path, BACKEND_FILE)):
            return None
        backend = Backend.from_file(os.path.join(path, BACKEND_FILE))
        cfg = _read_json(os.path.join(path, "tokenizer_config.json")) or {}
        bos_id = _token_id(backend, cfg.get("bos_token"))
        eos_id = _token_id(backend, cfg.get("eos_token"))
        add_bos = cfg.get("add_bos_token")
        if add_bos is None:
            add_bos = _post_processor_adds_bos(backend, bos_id)
        eos = ([] if eos_id is None else [eos_id]) + list(extra_eos_ids)
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos,
            add_bos_token=bool(add_bos) and bos_id is not None,
            chat_template=hf_chat_template(path, cfg),
        )

    def save(self, folder: str) -> None:
        """Write `tokenizer.json` and `tokenizer_meta.json` into `folder`."""
        self.backend.save(os.path.join(folder, BACKEND_FILE))
        meta = {
            "bos_token_id": self._bos_token_id,
            "eos_token_ids": list(self._eos_token_ids),
            "add_bos_token": self.add_bos_token,
            "chat_template": self.chat_template,
        }
        with open(os.path.join(folder, META_FILE), "w", encoding="utf-8") as f:
            json.dump(meta, f)

    @classmethod
    def load(cls, folder: str) -> Tokenizer:
        """Read what `save` wrote."""
        backend = Backend.from_file(os.path.join(folder, BACKEND_FILE))
        meta = _read_json(os.path.join(folder, META_FILE))
        if meta is None:
            raise FileNotFoundError(os.path.join(folder, META_FILE))
        return cls(backend, **meta)

    # -- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; BOS first when `add_special_tokens` and the model adds BOS.

        Special tokens written in the text (e.g. `<|im_start|>`) become their ids. Lone
        surrogates (JSON allows "\\ud800") are encoded as U+FFFD.
        """
        try:
            ids = self._encode_ids(text)
        except TypeError:
            if not isinstance(text, str):
                raise
            ids = self._encode_ids(_replace_lone_surrogates(text))
        if add_special_tokens and self.add_bos_token and self._bos_token_id is not None:
            return [self._bos_token_id, *ids]
        return ids

    def _encode_ids(self, text: str) -> list[int]:
        # NOTE: the batch call releases the GIL while it tokenizes (`backend.encode` holds
        # it), so a long prompt tokenized in a server thread does not stall the event loop;
        # `_fast` skips the offsets, the ids are the same.
        return self.backend.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` (incomplete UTF-8 at either end shows as U+FFFD)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (byte-level spelling), None if out of range."""
        return self.backend.id_to_token(token_id)

    # -- properties --------------------------------------------------------------------------

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation; the model's EOS token first."""
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Vocabulary size, added tokens included (may be below the model's embedding rows)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> tuple[int, ...]:
        """Ids of the special (control) tokens, sorted; `decode` skips these by default."""
        added = self.backend.get_added_tokens_decoder()
        return tuple(sorted(i for i, tok in added.items() if tok.special))

    # -- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        chat_template: str | None = None, **kwargs: Any
    ) -> str:
        """The prompt text of a conversation, as HF's `apply_chat_template(tokenize=False)`.

        chat_template: a template used instead of the model's (HF's argument of that name;
        the server's `--chat-template`). Extra keyword arguments (`tools`, a request's
        `chat_template_kwargs` such as Qwen3's `enable_thinking`) are passed to the template.
        Raises ValueError when there is no chat template.
        """
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this model has no chat template; send a plain completion prompt "
                             "(or start the server with --chat-template)")
        context = {
            "bos_token": self._token_text(self._bos_token_id),
            "eos_token": self._token_text(self._eos_token_ids[0] if self._eos_token_ids else None),
            **kwargs,
        }
        return compiled_chat_template(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        chat_template: str | None = None, **kwargs: Any
    ) -> list[int]:
        """The prompt token ids of a conversation: the one prompt path of the server and
        the offline `LLM.chat`, as HF's `apply_chat_template(tokenize=True)`.

        NOTE: the template writes any BOS itself (`{{ bos_token }}`), so no special token is
        added when encoding its text: BOS appears exactly as often as the template writes it.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, chat_template, **kwargs)
        return self.encode(text, add_special_tokens=False)

    @cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token stands for (at least 1).

        Each token decoded alone; a token holding part of a character decodes to U+FFFD
        (3 bytes), more than the bytes it holds, so the bound stays an upper bound.
        """
        size = self.vocab_size
        texts = self.backend.decode_batch([[i] for i in range(size)], skip_special_tokens=False)
        return max([1, *(len(t.encode("utf-8", "surrogatepass")) for t in texts)])

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self.backend.id_to_token(token_id) or ""


def _unk_token(meta: Mapping[str, Any], tokens: list[str]) -> str:
    """The text of `tokenizer.ggml.unknown_token_id` (range-checked by the loader), else
    SentencePiece's `<unk>`."""
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    return tokens[unk] if type(unk) is int and 0 <= unk < len(tokens) else "<unk>"


def _replace_lone_surrogates(text: str) -> str:
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")



# -- HF directory pieces ---------------------------------------------------------------------


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_id(backend: Backend, token: str | dict[str, Any] | None) -> int | None:
    """Id of a tokenizer_config token entry (a string or an AddedToken dict)."""
    if isinstance(token, dict):
        token = token.get("content")
    return None if token is None else backend.token_to_id(token)


def _post_processor_adds_bos(backend: Backend, bos_id: int | None) -> bool:
    if bos_id is None:
        return False
    ids = backend.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_id
