"""ModelConfig from a GGUF file's `{arch}.*` metadata and tensor shapes."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from slotserve.config import ModelConfig
from slotserve.config_gate import RopeScaling, UnsupportedConfig, check_gguf_keys
from slotserve.layer_windows import gguf_layer_windows
from slotserve.loader.gguf_dequant import dequantize
from slotserve.loader.gguf_reader import GGUFTensor
from slotserve.loader.gguf_vocab import gguf_eos_token_ids
from slotserve.loader.validation import ModelFileError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
# GGUF architecture -> ModelConfig.architecture (the family, model/families.py), where they differ.
FAMILY_OF_ARCH = {"gemma3": "gemma3_text"}


def model_config(
    meta: dict[str, Any], tensors: list[GGUFTensor], name: str = "model",
    path: str = "GGUF file",
) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata; tied embeddings when there is no `output.weight`.

    A missing or mistyped key raises ModelFileError naming `path`; so does an `{arch}.*` key
    the model would not be computed with (config_gate.check_gguf_keys: nothing is ignored).
    """
    key = _ArchKeys(path, meta, _architecture(path, meta))
    shapes = {t.name: t.shape for t in tensors}
    vocab_size = _vocab_size(path, shapes)
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = _head_dim(key, hidden, heads)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    # NOTE: the keys below are read in this order, so a file with several problems names the
    # same one first as before.
    config = ModelConfig(
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
        architecture=FAMILY_OF_ARCH.get(key.arch, key.arch),
        name=name,
        sliding_windows=_sliding_windows(path, meta, key.arch, key("block_count")),
        rope_scaling=_rope_scaling(key, tensors, head_dim),
    )
    if key.arch == "gemma3":
        config = dataclasses.replace(config, **_gemma3_fields(key, config))
    if key.arch == "gemma2":
        config = dataclasses.replace(config, **_gemma2_fields(key, config))
    try:  # NOTE: after the keys it reads: a missing key is named as missing first
        check_gguf_keys(meta, key.arch)
    except UnsupportedConfig as exc:
        raise ModelFileError(path, str(exc)) from None
    return config


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


# Gemma 3 as llama.cpp computes a `gemma3` file (llama-model.cpp, LLM_ARCH_GEMMA3): its 62-layer
# model (27B) scales queries by (hidden / heads) ** -0.5, every other one by head_dim ** -0.5.
GEMMA3_27B_LAYERS = 62
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # the sliding layers' RoPE base unless rope.freq_base_swa


def _gemma3_fields(key: _ArchKeys, config: ModelConfig) -> dict[str, Any]:
    """What a `gemma3` file's metadata says beyond the Llama keys, as llama.cpp reads it:
    GeGLU (tanh GELU), the sliding layers' RoPE base, the query scale, the final soft-cap.

    NOTE: the norms' +1 is undone where the weights are converted (gguf.py); the windows
    (every 6th layer global) come from layer_windows.gguf_layer_windows.
    """
    if key.present("attn_logit_softcapping"):  # NOTE: Gemma 3 has none; llama.cpp reads none
        raise ModelFileError(key.path, f"gemma3.attn_logit_softcapping="
                                       f"{key.meta['gemma3.attn_logit_softcapping']!r}: "
                                       "attention soft-capping is not part of Gemma 3")
    scalar = (config.hidden_size / config.num_attention_heads
              if config.num_hidden_layers == GEMMA3_27B_LAYERS else config.head_dim)
    # NOTE: convert_hf_to_gguf writes final_logit_softcapping only when the HF config sets
    # it; HF's own GGUF loader drops the key, which would compute a different model.
    cap = (float(key("final_logit_softcapping", kind=float))
           if key.present("final_logit_softcapping") else None)
    return dict(
        hidden_act="gelu_pytorch_tanh",
        local_rope_theta=float(key("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE, kind=float)),
        query_pre_attn_scalar=float(scalar),
        final_logit_softcapping=cap,
    )


# Gemma 2 as llama.cpp computes a `gemma2` file (LLM_ARCH_GEMMA2): its 46-layer model (27B)
# scales queries by (hidden / heads) ** -0.5, the others by head_dim ** -0.5; both soft-caps
# always on, 50 and 30 unless the file says otherwise (HF's Gemma2Config defaults too).
GEMMA2_27B_LAYERS = 46
GEMMA2_ATTN_SOFTCAP, GEMMA2_FINAL_SOFTCAP = 50.0, 30.0


def _gemma2_fields(key: _ArchKeys, config: ModelConfig) -> dict[str, Any]:
    """What a `gemma2` file's metadata says beyond the Llama keys, as llama.cpp reads it:
    GeGLU (tanh GELU), the query scale, attention and final logit soft-caps.

    NOTE: the norms' +1 is undone where the weights are converted (gguf.py); the windows
    (every 2nd layer global) come from layer_windows.gguf_layer_windows.
    """
    scalar = (config.hidden_size / config.num_attention_heads
              if config.num_hidden_layers == GEMMA2_27B_LAYERS else config.head_dim)
    return dict(
        hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=float(scalar),
        attn_logit_softcapping=float(key("attn_logit_softcapping", GEMMA2_ATTN_SOFTCAP,
                                         kind=float)),
        final_logit_softcapping=float(key("final_logit_softcapping", GEMMA2_FINAL_SOFTCAP,
                                          kind=float)),
    )


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
    if key("attention.value_length", head_dim) != head_dim:
        raise ModelFileError(key.path, f"{key.arch}.attention.value_length "
                                       f"{key.meta[key.arch + '.attention.value_length']!r} "
                                       f"!= key_length {head_dim}: unsupported")
    return head_dim


# The GGUF tensors that are config, not weights (the loader reads them here, maps no name).
LONGROPE_TENSORS = ("rope_factors_short.weight", "rope_factors_long.weight")
CONFIG_TENSORS = ("rope_freqs.weight", *LONGROPE_TENSORS)
# `{arch}.rope.scaling.type` values computed as llama.cpp does (none: plain RoPE).
GGUF_ROPE_SCALING = ("none", "linear")


def _rope_scaling(key: _ArchKeys, tensors: list[GGUFTensor], head_dim: int
                  ) -> RopeScaling | None:
    """The RoPE scaling of a GGUF file, as llama.cpp applies it: linear (positions /
    `rope.scaling.factor`, overridden by the older `rope.scale_linear`) unless
    `{arch}.rope.scaling.type` is "none" (llama.cpp's type when the key is absent is
    linear), and the `rope_freqs` tensor (frequency i / factor i: convert_hf_to_gguf writes
    Llama 3's llama3 scaling so); Phi-3's LongRoPE (`_phi3_longrope`). Other types (yarn,
    ...) are refused: a ModelFileError naming the key.
    """
    longrope = [t for t in tensors if t.name in LONGROPE_TENSORS]
    if longrope or key.arch == "phi3":
        return _phi3_longrope(key, tensors, head_dim)
    kind = key.meta.get(f"{key.arch}.rope.scaling.type", "linear")
    if kind not in GGUF_ROPE_SCALING:
        raise ModelFileError(key.path, f"{key.arch}.rope.scaling.type={kind!r}: unsupported "
                                       f"RoPE scaling (supported from GGUF: "
                                       f"{', '.join(GGUF_ROPE_SCALING)})")
    attn_factor = key.meta.get(f"{key.arch}.rope.scaling.attn_factor", 1.0)
    if attn_factor != 1.0:  # NOTE: llama.cpp scales cos/sin by it whatever the type
        raise ModelFileError(key.path, f"{key.arch}.rope.scaling.attn_factor={attn_factor!r}: "
                                       "a RoPE attention factor is not supported from GGUF")
    factor = _linear_factor(key) if kind == "linear" else 1.0
    factors = [t for t in tensors if t.name == "rope_freqs.weight"]
    if factors and factor != 1.0:
        raise ModelFileError(key.path, f"rope_freqs.weight with a linear RoPE factor {factor}: "
                                       "both scalings at once are not supported")
    if factors:
        return RopeScaling("freq_factors", freq_factors=_freq_factors(key.path, factors[0],
                                                                      head_dim))
    return None if factor == 1.0 else RopeScaling("linear", factor=factor)


def _linear_factor(key: _ArchKeys) -> float:
    """llama.cpp's linear RoPE factor: `rope.scaling.factor`, then `rope.scale_linear` over
    it, else 1 (positions are divided by it). A file that names the linear type must give
    its factor (missing: a ModelFileError, as before)."""
    if key.present("rope.scaling.type") and not key.present("rope.scale_linear"):
        return float(key("rope.scaling.factor", kind=float))
    factor = 1.0
    for suffix in ("rope.scaling.factor", "rope.scale_linear"):
        if key.present(suffix):
            factor = float(key(suffix, kind=float))
    return factor


def _freq_factors(path: str, tensor: GGUFTensor, head_dim: int) -> tuple[float, ...]:
    if tensor.shape != (head_dim // 2,):
        raise ModelFileError(path, f"wrong shape for {tensor.name}: {tensor.shape}, "
                                   f"expected ({head_dim // 2},)")
    values = dequantize(tensor.data, tensor.tensor_type).numpy().reshape(-1)
    if not (np.isfinite(values).all() and (values > 0).all()):
        raise ModelFileError(path, f"{tensor.name} must hold positive finite factors")
    return tuple(float(v) for v in values)


def _phi3_longrope(key: _ArchKeys, tensors: list[GGUFTensor], head_dim: int
                   ) -> RopeScaling | None:
    """Phi-3's RoPE from GGUF: plain, or LongRoPE when convert_hf_to_gguf wrote its factors
    (`rope_factors_short` / `_long` tensors, `rope.scaling.original_context_length`, and
    `rope.scaling.attn_factor` = HF's default attention factor). Computed as HF computes the
    checkpoint it came from (model/rope.py: short factors below the original context, long
    ones from it on); anything else is a ModelFileError naming the key or tensor.

    NOTE: llama.cpp picks one factor set per context size instead (long when n_ctx exceeds
    the original context); both agree on sequences up to original_context_length.
    """
    kind = key.meta.get(f"{key.arch}.rope.scaling.type", "none")
    if key.arch != "phi3":
        raise ModelFileError(key.path, f"LongRoPE factors ({', '.join(LONGROPE_TENSORS)}) "
                                       f"in a {key.arch!r} file: supported only for phi3")
    if kind not in ("none", "longrope"):
        raise ModelFileError(key.path, f"phi3.rope.scaling.type={kind!r}: unsupported "
                                       "(Phi-3 from GGUF: plain RoPE or LongRoPE)")
    if any(t.name == "rope_freqs.weight" for t in tensors):
        raise ModelFileError(key.path, "rope_freqs.weight in a phi3 file: unsupported")
    factors = {t.name: t for t in tensors if t.name in LONGROPE_TENSORS}
    attn_factor = key.meta.get(f"{key.arch}.rope.scaling.attn_factor", 1.0)
    for suffix in ("rope.scaling.factor", "rope.scale_linear"):
        if key.present(suffix):  # NOTE: convert_hf_to_gguf writes neither for Phi-3
            raise ModelFileError(key.path, f"phi3.{suffix}={key.meta['phi3.' + suffix]!r}: "
                                           "a linear RoPE factor is not supported for phi3")
    if not factors:
        if attn_factor != 1.0 or kind != "none":
            raise ModelFileError(key.path, f"{key.arch}.rope.scaling.attn_factor="
                                           f"{attn_factor!r} without LongRoPE factors: "
                                           "unsupported")
        return None
    missing = [name for name in LONGROPE_TENSORS if name not in factors]
    if missing:
        raise ModelFileError(key.path, f"missing tensor {missing[0]} (LongRoPE needs both)")
    original = key("rope.scaling.original_context_length")
    factor = key("context_length") / original
    attention = float(key("rope.scaling.attn_factor", kind=float))
    hf_default = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    # NOTE: the file holds HF's default as a float32: then HF's own value is used (exact)
    same = math.isclose(attention, hf_default, rel_tol=1e-6)
    return RopeScaling(
        "longrope", factor=factor, original_max_position_embeddings=original,
        attention_factor=None if same else attention,
        short_factor=_freq_factors(key.path, factors["rope_factors_short.weight"], head_dim),
        long_factor=_freq_factors(key.path, factors["rope_factors_long.weight"], head_dim))


def _sliding_windows(path: str, meta: dict[str, Any], arch: str, layers: int):
    """Each layer's sliding window, as llama.cpp applies `{arch}.attention.sliding_window`
    (Phi-3: on every layer, as HF's Phi-3 applies the checkpoint's `sliding_window`).

    NOTE: llama.cpp currently turns Phi-3's window off (with a warning that results may
    suffer); the file holds the HF config's `sliding_window`, so here the model computes as
    the checkpoint it was converted from (HF's Phi-3 applies it on every layer).
    """
    if arch == "phi3":
        if meta.get("phi3.attention.sliding_window_pattern") is not None:
            raise ModelFileError(path, "phi3.attention.sliding_window_pattern: Phi-3's window "
                                       "is on every layer; a pattern is not supported")
        window = meta.get("phi3.attention.sliding_window")
        if window is None:
            return ()
        if type(window) is not int or window < 1:
            raise ModelFileError(path, f"phi3.attention.sliding_window={window!r}: must be "
                                       "a positive integer")
        return (window,) * layers
    try:
        return gguf_layer_windows(meta, arch, layers)
    except ValueError as exc:
        raise ModelFileError(path, str(exc)) from None


def _eos_token_ids(path: str, meta: dict[str, Any]) -> tuple[int, ...]:
    try:
        return gguf_eos_token_ids(meta)
    except (TypeError, ValueError) as exc:
        raise ModelFileError(path, f"bad end-of-generation token metadata: {exc}") from None
