"""A GGUF file's vocabulary (`tokenizer.ggml.*`) as a `tokenizers` byte-level BPE, with the
pre-tokenizer llama.cpp uses for the file's `tokenizer.ggml.pre`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4

# llama.cpp also ends generation on these control tokens, whatever `eos_token_id` says.
EOG_TEXTS = frozenset(
    {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
     "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>"}
)

# Split regexes for byte-level BPE vocabularies, by `tokenizer.ggml.pre` (as in llama.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = ("default", "gpt2", "gpt-2")
_LLAMA3_PRE = ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen")
SUPPORTED_PRE = ("smollm", *_GPT2_PRE, *_LLAMA3_PRE, *_QWEN2_PRE)


def gguf_eos_token_ids(meta: Mapping[str, Any]) -> tuple[int, ...]:
    """End-of-generation ids: eos, eot, eom, then control tokens llama.cpp also stops on."""
    ids = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    ids += [i for i, (tok, kind) in enumerate(zip(tokens, types))
            if kind == TOKEN_CONTROL and tok in EOG_TEXTS]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> Backend:
    """Byte-level BPE over the GGUF token list (already in GPT-2's byte-to-unicode spelling)."""
    vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}  # first id wins on duplicates
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                 ignore_merges=(pre in _LLAMA3_PRE)))
    backend.pre_tokenizer = _pre_tokenizer(pre)
    if pre in _QWEN2_PRE:
        backend.normalizer = normalizers.NFC()
    backend.decoder = decoders.ByteLevel()
    return backend


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's split rules for `tokenizer.ggml.pre`, as HF pre-tokenizers."""
    if pre == "smollm":
        # NOTE: SmolLM2's tokenizer.json: every digit on its own, then GPT-2's regex.
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre is None or pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT if pre in _QWEN2_PRE else None
    if split is None:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r} (supported: {', '.join(SUPPORTED_PRE)}); "
            "load the model's Hugging Face directory instead"
        )
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def add_gguf_special_tokens(backend: Backend, tokens: list[str], types: Sequence[int]) -> None:
    """Control tokens become special tokens, user-defined ones plain added tokens (kept whole)."""
    control = [t for t, k in zip(tokens, types) if k == TOKEN_CONTROL]
    user = [t for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
