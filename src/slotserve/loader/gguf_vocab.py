"""A GGUF file's vocabulary (`tokenizer.ggml.*`) as a `tokenizers` backend: a byte-level BPE
(`tokenizer.ggml.model` "gpt2") with the pre-tokenizer llama.cpp uses for the file's
`tokenizer.ggml.pre`, or Gemma's SentencePiece BPE (`tokenizer.ggml.model` "llama" in a
`gemma3` file) built as HF transformers builds it from the same file."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL = 1
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


# The GGUF architectures whose SentencePiece vocabulary ("llama") is read, as Gemma's.
SENTENCEPIECE_ARCHS = ("gemma2", "gemma3")
SPM_SPACE = "\u2581"  # SentencePiece's visible space


def gemma_sentencepiece(tokens: list[str], types: Sequence[int], unk_token: str) -> Backend:
    """Gemma's SentencePiece BPE as a `tokenizers` BPE, as HF transformers builds it from a
    GGUF (its `gemma_tokenizer`: GemmaTokenizer over the file's vocabulary).

    - Tokens of two or more spaces are stored as spaces; the model looks them up as
      SentencePiece spaces ("\u2581\u2581"), so they are respelled first.
    - The file holds no merges: every split of a token into two vocabulary entries is a
      merge, ranked by the token's place in the file (Gemma's scores do not follow its merge
      order, the file's order does), then longer left part first (HF's `generate_merges`).
    - Spaces become "\u2581" (no prefix space: Gemma's `add_space_prefix` is false), unknown
      bytes fall back to the `<0xNN>` tokens, and decoding undoes both.
    Control tokens become special added tokens; user-defined ones (newline runs, tabs,
    `<start_of_image>`) plain added tokens where their spelling is in the vocabulary.
    """
    respelled = [SPM_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(respelled)}
    backend = Backend(models.BPE(vocab=vocab, merges=_merges_by_position(respelled, vocab),
                                 fuse_unk=True, unk_token=unk_token, dropout=None,
                                 byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", SPM_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace(SPM_SPACE, " "),
                                         decoders.ByteFallback(), decoders.Fuse()])
    control = [t for t, k in zip(tokens, types) if k == TOKEN_CONTROL]
    user = [t for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED and t in vocab]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return backend


# The GGUF architectures whose Llama-style SentencePiece vocabulary ("llama": Llama 2, Mistral
# v0.1, Phi-3) is read as HF transformers reads it from a GGUF; how each adds the prefix space.
LLAMA_SENTENCEPIECE_ARCHS = ("llama", "phi3")


def llama_sentencepiece(tokens: list[str], scores: Sequence[float], types: Sequence[int],
                        arch: str) -> Backend:
    """A Llama-style SentencePiece vocabulary (`tokenizer.ggml.model` "llama": merges implied by
    the scores, byte fallback, a prefix space) as HF transformers builds it from a GGUF
    (LlamaTokenizer over the file's vocabulary; for phi3 its `phi3_tokenizer`).

    - Merges: every split of a token into two vocabulary entries, ranked by the token's score
      (best first), then longer left part, then longer right part (HF's `generate_merges`).
    - The prefix space: llama: Metaspace prepended to the first word only ("first", HF's
      non-legacy Llama); phi3: a normalizer prepends it and spells every space as "\u2581"
      (Phi-3's tokenizer.json). Decoding drops one leading space again.
    Control tokens become special added tokens, user-defined ones plain added tokens.
    """
    if len(scores) != len(tokens):
        raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for "
                         f"{len(tokens)} tokens")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = Backend(models.BPE(vocab=vocab, merges=_merges_by_score(tokens, scores, vocab),
                                 fuse_unk=True, byte_fallback=True, dropout=None))
    if arch == "phi3":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPM_SPACE),
                                                   normalizers.Replace(" ", SPM_SPACE)])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPM_SPACE,
                                                         prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace(SPM_SPACE, " "),
                                         decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(content=" ", left=1)])
    control = [t for t, k in zip(tokens, types) if k == TOKEN_CONTROL]
    user = [t for t, k in zip(tokens, types) if k == TOKEN_USER_DEFINED and t in vocab]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return backend


def _merges_by_score(tokens: list[str], scores: Sequence[float], vocab: dict[str, int]
                     ) -> list[tuple[str, str]]:
    """transformers' `generate_merges(vocab, {token: score})`: each token's splits into two
    vocabulary entries (in vocabulary-id order), all sorted by (score, len(left),
    len(right)) descending, ties kept in file order (a stable sort)."""
    token_scores = dict(zip(tokens, scores))  # NOTE: a repeated token: its last score
    candidates = []
    for token, score in token_scores.items():
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))
                  if token[:cut] in vocab and token[cut:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        candidates += [(left, right, score) for left, right in splits]
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _merges_by_position(tokens: list[str], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) split of each token into two vocabulary entries, tokens in file
    order, each token's splits longest left part first.

    NOTE: the same list, in the same order, as transformers' `generate_merges(vocab,
    {token: -index})`: its sort key (-index, len(left), len(right)), descending, never ties.
    """
    merges = []
    for token in tokens:
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges
