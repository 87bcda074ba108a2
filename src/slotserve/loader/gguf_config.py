"""ModelConfig from a GGUF file's `{arch}.*` metadata and tensor shapes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from slotserve.config import ModelConfig
from slotserve.layer_windows import gguf_layer_windows
from slotserve.loader.gguf_reader import GGUFTensor
from slotserve.loader.gguf_vocab import gguf_eos_token_ids
from slotserve.loader.validation import ModelFileError

SUPPORTED_ARCHS = ("llama", "qwen2")


def model_config(
    meta: dict[str, Any], tensors: list[GGUFTensor], name: str = "model",
    path: str = "GGUF file",
) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; tied embeddings when there is no `output.weight`.

    A missing or mistyped key raises ModelFileError naming `path`.
    """
    key = _ArchKeys(path, meta, _architecture(path, meta))
    shapes = {t.name: t.shape for t in tensors}
    vocab_size = _vocab_size(path, shapes)
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = _head_dim(key, hidden, heads)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    # NOTE: the keys below are read in this order, so a file with several problems names the
    # same one first as before.
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", kind=float)),
        rope_theta=float(key("rope.freq_base", 10000.0, kind=float)),
        max_position_embeddings=key("context_length", 2048),
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias=key.arch == "qwen2",
        bos_token_id=bos if type(bos) is int else None,  # NOTE: checked with the tokenizer
        eos_token_ids=_eos_token_ids(path, meta),
        architecture=key.arch,
        name=name,
        sliding_windows=_sliding_windows(path, meta, key.arch, key("block_count")),
    )


@dataclass(frozen=True)
class _ArchKeys:
    """The `{arch}.*` metadata keys of one file, each read as a positive number."""

    path: str
    meta: dict[str, Any]
    arch: str

    def __call__(self, suffix: str, default: Any = None, kind: type = int) -> Any:
        """`{arch}.{suffix}` (or `default`): a positive int, or any positive finite number
        for `kind=float`; a ModelFileError naming the file otherwise."""
        value = self.meta.get(f"{self.arch}.{suffix}", default)
        if value is None:
            raise ModelFileError(self.path, f"missing key {self.arch}.{suffix}")
        number = type(value) in (int, float) if kind is float else type(value) is int
        if not number or not math.isfinite(value) or value <= 0:
            raise ModelFileError(self.path, f"{self.arch}.{suffix} must be a positive "
                                            f"{'number' if kind is float else 'integer'}, "
                                            f"not {value!r}")
        return value

    def present(self, suffix: str) -> bool:
        return f"{self.arch}.{suffix}" in self.meta


def _architecture(path: str, meta: dict[str, Any]) -> str:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelFileError(path, f"unsupported GGUF architecture {arch!r} "
                                   f"(supported: {SUPPORTED_ARCHS})")
    return arch


def _vocab_size(path: str, shapes: dict[str, tuple[int, ...]]) -> int:
    """The rows of the 2-D `token_embd.weight` (its ne1)."""
    embedding = shapes.get("token_embd.weight")
    if embedding is None or len(embedding) != 2:
        raise ModelFileError(path, "missing tensor token_embd.weight (2-D)" if embedding is None
                             else f"wrong shape for token_embd.weight: {embedding}")
    return embedding[1]


def _head_dim(key: _ArchKeys, hidden: int, heads: int) -> int:
    """`attention.key_length`, else hidden / heads; the rotary embedding must span all of it."""
    if not key.present("attention.key_length") and hidden % heads:
        raise ModelFileError(key.path, f"{key.arch}.embedding_length {hidden} is not a multiple "
                                       f"of {key.arch}.attention.head_count {heads}")
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ModelFileError(key.path, "partial rotary embeddings (rope.dimension_count != "
                                       "head_dim) unsupported")
    return head_dim


def _sliding_windows(path: str, meta: dict[str, Any], arch: str, layers: int):
    """Each layer's sliding window, as llama.cpp applies `{arch}.attention.sliding_window`."""
    try:
        return gguf_layer_windows(meta, arch, layers)
    except ValueError as exc:
        raise ModelFileError(path, str(exc)) from None


def _eos_token_ids(path: str, meta: dict[str, Any]) -> tuple[int, ...]:
    try:
        return gguf_eos_token_ids(meta)
    except (TypeError, ValueError) as exc:
        raise ModelFileError(path, f"bad end-of-generation token metadata: {exc}") from None
