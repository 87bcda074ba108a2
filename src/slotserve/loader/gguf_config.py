"""ModelConfig from a GGUF file's `{arch}.*` metadata and tensor shapes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from slotserve.config import ModelConfig
from slotserve.config_gate import RopeScaling
from slotserve.layer_windows import gguf_layer_windows
from slotserve.loader.gguf_dequant import dequantize
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
        rope_scaling=_rope_scaling(key, tensors, head_dim),
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


# The GGUF tensors that are config, not weights (the loader reads them here, maps no name).
CONFIG_TENSORS = ("rope_freqs.weight",)
# `{arch}.rope.scaling.type` values computed as llama.cpp does (none: plain RoPE).
GGUF_ROPE_SCALING = ("none", "linear")


def _rope_scaling(key: _ArchKeys, tensors: list[GGUFTensor], head_dim: int
                  ) -> RopeScaling | None:
    """The RoPE scaling of a GGUF file, as llama.cpp applies it: `{arch}.rope.scaling.type`
    linear (positions / `rope.scaling.factor`; the older `rope.scale_linear` too) and the
    `rope_freqs` tensor (frequency i / factor i: convert_hf_to_gguf writes Llama 3's llama3
    scaling so). Other types (yarn, longrope) are refused: a ModelFileError naming the key.
    """
    kind = key.meta.get(f"{key.arch}.rope.scaling.type", "none")
    if kind not in GGUF_ROPE_SCALING:
        raise ModelFileError(key.path, f"{key.arch}.rope.scaling.type={kind!r}: unsupported "
                                       f"RoPE scaling (supported from GGUF: "
                                       f"{', '.join(GGUF_ROPE_SCALING)})")
    attn_factor = key.meta.get(f"{key.arch}.rope.scaling.attn_factor", 1.0)
    if attn_factor != 1.0:  # NOTE: llama.cpp scales cos/sin by it whatever the type
        raise ModelFileError(key.path, f"{key.arch}.rope.scaling.attn_factor={attn_factor!r}: "
                                       "a RoPE attention factor is not supported from GGUF")
    factors = [t for t in tensors if t.name == "rope_freqs.weight"]
    if factors and kind != "none":
        raise ModelFileError(key.path, f"rope_freqs.weight with {key.arch}.rope.scaling.type="
                                       f"{kind!r}: both scalings at once are not supported")
    if factors:
        return RopeScaling("freq_factors", freq_factors=_freq_factors(key.path, factors[0],
                                                                      head_dim))
    if kind == "linear" or key.present("rope.scale_linear"):
        suffix = "rope.scaling.factor" if kind == "linear" else "rope.scale_linear"
        factor = float(key(suffix, kind=float))
        return None if factor == 1.0 else RopeScaling("linear", factor=factor)
    return None


def _freq_factors(path: str, tensor: GGUFTensor, head_dim: int) -> tuple[float, ...]:
    if tensor.shape != (head_dim // 2,):
        raise ModelFileError(path, f"wrong shape for rope_freqs.weight: {tensor.shape}, "
                                   f"expected ({head_dim // 2},)")
    values = dequantize(tensor.data, tensor.tensor_type).numpy().reshape(-1)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ModelFileError(path, "rope_freqs.weight must hold positive finite factors")
    return tuple(float(v) for v in values)


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
