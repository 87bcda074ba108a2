"""The config gate: every HF config key that changes a model's math, implemented or refused.

`GATE` is one table (data, not branches): per key, the model_types whose HF class reads it
and which of its values are computed exactly as HF computes them. `check_hf_config(cfg)`
walks it and raises `UnsupportedConfig` (a ValueError naming the key and value) for the first
value that is not; the loaders turn that into a ModelFileError naming the file. Nothing that
HF would read is silently computed differently: a key is either implemented or refused.
A key HF's class for the model_type does not read is ignored, as HF ignores it.

It also parses what the model needs from those keys: `rope_settings(cfg)` (RoPE base and
scaling, and Gemma 3's local base) and `family_value(cfg, key)` (a key with HF's default for
the model_type).

No torch and no slotserve import but layer_windows and value_checks: config.py (below core/)
reads HF configs with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slotserve.layer_windows import hf_layer_windows
from slotserve.value_checks import is_finite_number

# The HF model_types served (their HF classes are the reference) -> HF's defaults for the keys
# below where config.json leaves them out (HF's config classes' defaults).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0},
    "mistral": {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0},
    "qwen2": {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0},
    "qwen3": {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0},
    "phi3": {"hidden_act": "silu", "tie_word_embeddings": False, "rope_theta": 10000.0,
             "original_max_position_embeddings": 4096},
    "gemma2": {"hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
               "rope_theta": 10000.0, "head_dim": 256, "query_pre_attn_scalar": 256,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                    "head_dim": 256, "query_pre_attn_scalar": 256,
                    "attn_logit_softcapping": None, "final_logit_softcapping": None},
}
SUPPORTED_MODEL_TYPES = tuple(FAMILY_DEFAULTS)
# The MLP activations computed exactly (HF's ACT2FN names; model/layers.py's ACTIVATIONS).
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh")
# RoPE types computed as HF's ROPE_INIT_FUNCTIONS computes them (model/rope.py).
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
GEMMA = ("gemma2", "gemma3_text")
SILU_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


class UnsupportedConfig(ValueError):
    """A config key whose value slotserve does not compute as HF does (or that is malformed).

    The message names the key and its value."""

    def __init__(self, key: str, value: Any, why: str, message: str | None = None) -> None:
        self.key, self.value = key, value
        super().__init__(message or f"{key}={value!r}: {why}")


@dataclass(frozen=True)
class RopeScaling:
    """One RoPE scaling, as HF's `rope_parameters` / `rope_scaling` names it (model/rope.py
    computes it). Only the fields of its `rope_type` matter; lists are tuples."""

    rope_type: str = "default"
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    attention_factor: float | None = None  # yarn, longrope
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] = ()  # longrope
    long_factor: tuple[float, ...] = ()  # longrope
    # "freq_factors" (GGUF only: llama.cpp's rope_freqs tensor, which convert_hf_to_gguf
    # writes for Llama 3.x): frequency i is divided by freq_factors[i], as llama.cpp does
    freq_factors: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor", "freq_factors"):  # NOTE: JSON (the cache)
            object.__setattr__(self, name, tuple(getattr(self, name)))


@dataclass(frozen=True)
class RopeSettings:
    """What a model's RoPE needs: the base, the scaling (None: plain RoPE) and Gemma 3's
    sliding layers' own base (None: every layer rotates alike)."""

    theta: float
    scaling: RopeScaling | None = None
    local_theta: float | None = None


@dataclass(frozen=True)
class GateKey:
    """One config key: which model_types' HF classes read it, and its check.

    check(value, cfg) -> None when the value is computed exactly, else why it is refused.
    """

    key: str
    read_by: tuple[str, ...] | None  # None: every supported model_type
    check: Callable[[Any, dict[str, Any]], str | None]
    what: str = ""
    always_check: bool = False  # checked even when the key is absent (value: the default)


def _implemented(_value: Any, _cfg: dict[str, Any]) -> str | None:
    return None


def _refused_if_set(why: str) -> Callable[[Any, dict[str, Any]], str | None]:
    return lambda value, _cfg: why if value not in (None, False, {}, []) else None


def _boolean(value: Any, _cfg: dict[str, Any]) -> str | None:
    return None if isinstance(value, bool) else "must be true or false"


def _positive_number_or_none(value: Any, _cfg: dict[str, Any]) -> str | None:
    if value is None or _positive_number(value):
        return None
    return "must be a positive number or null"


def _positive_number(value: Any) -> bool:
    return is_finite_number(value) and value > 0


def _activation(value: Any, _cfg: dict[str, Any]) -> str | None:
    if value in ACTIVATIONS:
        return None
    return f"unsupported activation (supported: {', '.join(ACTIVATIONS)})"


def _full_rotary(value: Any, _cfg: dict[str, Any]) -> str | None:
    if value is None or value == 1.0:
        return None
    return "partial rotary embeddings are not supported"


def _rope(_value: Any, cfg: dict[str, Any]) -> str | None:
    rope_settings(cfg)  # NOTE: raises UnsupportedConfig naming the sub-key
    return None


def _windows(_value: Any, cfg: dict[str, Any]) -> str | None:
    # NOTE: sliding windows are implemented in every attention path (issue 30, H6's
    # layer_windows); hf_layer_windows refuses what it cannot place (unknown families, bad
    # layer_types). This is the one entry that says so.
    try:
        hf_layer_windows(cfg)
    except ValueError as exc:  # its message names the key and value
        raise UnsupportedConfig("sliding_window", cfg.get("sliding_window"), str(exc),
                                message=str(exc)) from None
    return None


def _gemma3_attn_softcap(value: Any, _cfg: dict[str, Any]) -> str | None:
    if value is None:
        return None
    return ("Gemma 3 with attention soft-capping is not supported (HF's Gemma 3 keeps the "
            "value but does not apply it)")


GATE: tuple[GateKey, ...] = (
    GateKey("model_type", None, _implemented, "which family's block (model/families.py)"),
    GateKey("rope_parameters", None, _rope, "RoPE base and scaling (model/rope.py)",
            always_check=True),
    GateKey("rope_scaling", None, _rope, "RoPE scaling, the pre-v5 name"),
    GateKey("rope_theta", None, _rope, "RoPE base"),
    GateKey("rope_local_base_freq", ("gemma3_text",), _rope, "sliding layers' RoPE base"),
    GateKey("partial_rotary_factor", None, _full_rotary, "rotated share of each head"),
    GateKey("original_max_position_embeddings", ("phi3",), _rope, "longrope's switch point"),
    GateKey("sliding_window", None, _windows, "per-layer sliding windows", always_check=True),
    GateKey("use_sliding_window", None, _windows, "per-layer sliding windows"),
    GateKey("max_window_layers", None, _windows, "per-layer sliding windows"),
    GateKey("layer_types", None, _windows, "per-layer sliding windows"),
    GateKey("attention_bias", ("llama", "qwen3", "gemma2", "gemma3_text"), _boolean,
            "bias on q/k/v and o projections"),
    GateKey("mlp_bias", ("llama",), _boolean, "bias on gate/up/down projections"),
    GateKey("head_dim", None, _implemented, "per-head size (may differ from hidden / heads)"),
    GateKey("hidden_act", SILU_FAMILIES, _activation, "the MLP's activation",
            always_check=True),
    GateKey("hidden_activation", GEMMA, _activation, "the MLP's activation (Gemma)",
            always_check=True),
    GateKey("attn_logit_softcapping", ("gemma2",), _positive_number_or_none,
            "tanh soft-cap of attention scores"),
    GateKey("attn_logit_softcapping", ("gemma3_text",), _gemma3_attn_softcap,
            "tanh soft-cap of attention scores"),
    GateKey("final_logit_softcapping", GEMMA, _positive_number_or_none,
            "tanh soft-cap of the logits"),
    GateKey("query_pre_attn_scalar", GEMMA, _positive_number_or_none,
            "attention scale = query_pre_attn_scalar ** -0.5"),
    GateKey("use_bidirectional_attention", GEMMA,
            _refused_if_set("bidirectional attention is not supported (causal decoders only)"),
            "attention direction"),
    GateKey("tie_word_embeddings", None, _boolean, "LM head = embeddings"),
    GateKey("quantization_config", None,
            _refused_if_set("pre-quantized HF checkpoints are not supported (load a float "
                            "checkpoint or a GGUF file)"), "quantized weights"),
)


def check_hf_config(cfg: dict[str, Any]) -> None:
    """UnsupportedConfig for the first key of `cfg` (an HF config.json dict) in GATE that its
    model_type reads with a value not computed exactly; also an unsupported model_type."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfig("model_type", model_type,
                                f"unsupported model_type (supported: "
                                f"{', '.join(SUPPORTED_MODEL_TYPES)})")
    for entry in GATE:
        if entry.read_by is not None and model_type not in entry.read_by:
            continue
        if entry.key not in cfg and not entry.always_check:
            continue
        value = family_value(cfg, entry.key)
        why = entry.check(value, cfg)
        if why is not None:
            raise UnsupportedConfig(entry.key, value, why)


# -- GGUF ------------------------------------------------------------------------------------

# The `{arch}.*` metadata keys of a GGUF file, by what the loader does with them (gguf_config
# reads the first group, and refuses values it does not compute as llama.cpp / HF do). A key
# in neither group is refused: it may change the math (MoE experts, attention scale, clamps,
# YaRN's parameters, ALiBi, parallel residuals, ...), and nothing is silently ignored.
GGUF_READ_KEYS = (
    "context_length", "embedding_length", "block_count", "feed_forward_length",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "rope.freq_base",
    "rope.dimension_count", "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear",
    "rope.scaling.attn_factor", "attention.sliding_window",
    "attention.sliding_window_pattern")
# Keys that cannot change the computation here: the vocabulary size (the embedding table's
# rows are), and RoPE scaling's bookkeeping (`original_context_length` is read where a
# scaling needs it: Phi-3's longrope; `finetuned` is informational).
GGUF_HARMLESS_KEYS = ("vocab_size", "rope.scaling.original_context_length",
                      "rope.scaling.finetuned")
# Per architecture, the keys its family reads beyond those.
GGUF_FAMILY_KEYS: dict[str, tuple[str, ...]] = {
    "gemma2": ("attn_logit_softcapping", "final_logit_softcapping"),
    "gemma3": ("attn_logit_softcapping", "final_logit_softcapping", "rope.freq_base_swa"),
}


def check_gguf_keys(meta: dict[str, Any], arch: str) -> None:
    """UnsupportedConfig naming the first `{arch}.*` key of a GGUF file's metadata that the
    loader neither reads nor knows to be harmless (see GGUF_READ_KEYS)."""
    known = {*GGUF_READ_KEYS, *GGUF_HARMLESS_KEYS, *GGUF_FAMILY_KEYS.get(arch, ())}
    prefix = f"{arch}."
    for key, value in meta.items():
        if key.startswith(prefix) and key[len(prefix):] not in known:
            shown = value if not isinstance(value, list) else f"[{len(value)} values]"
            raise UnsupportedConfig(key, shown, f"a GGUF key that {arch!r} models are not "
                                                "computed with here (it may change the "
                                                "model's math): refused")


def family_value(cfg: dict[str, Any], key: str, default: Any = None) -> Any:
    """cfg[key], else HF's default for the model_type, else `default`."""
    if key in cfg:
        return cfg[key]
    return FAMILY_DEFAULTS.get(cfg.get("model_type", "llama"), {}).get(key, default)


# -- RoPE -------------------------------------------------------------------------------------

_ROPE_FIELDS = {f for f in RopeScaling.__dataclass_fields__} - {"rope_type", "freq_factors"}
# Keys HF's rope_parameters may hold that change nothing here ("type": the old rope_type).
_ROPE_IGNORED = {"rope_theta", "rope_type", "type", "partial_rotary_factor"}
_ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                  "yarn": (), "longrope": ("short_factor", "long_factor")}
_LAYER_KINDS = ("sliding_attention", "full_attention")


def rope_settings(cfg: dict[str, Any]) -> RopeSettings:
    """The RoPE of an HF config dict, old (`rope_theta` + `rope_scaling`) or v5
    (`rope_parameters`, per layer type for Gemma 3) spelling. UnsupportedConfig naming the
    key for a type or sub-key not computed as HF does."""
    model_type = cfg.get("model_type", "llama")
    params = cfg.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise UnsupportedConfig("rope_parameters", params, "must be an object")
    old = cfg.get("rope_scaling")
    if old is not None and not isinstance(old, dict):
        raise UnsupportedConfig("rope_scaling", old, "must be an object or null")
    local_theta = None
    if params and set(params) <= set(_LAYER_KINDS):  # v5, per layer type (Gemma 3)
        if model_type != "gemma3_text":
            raise UnsupportedConfig("rope_parameters", params,
                                    "per-layer-type RoPE is supported for Gemma 3 only")
        local = dict(params.get("sliding_attention") or {})
        if _rope_type(local, "rope_parameters.sliding_attention", model_type) != "default":
            raise UnsupportedConfig("rope_parameters.sliding_attention", local,
                                    "scaled RoPE on Gemma 3's sliding layers is not supported")
        local_theta = _theta(local.get("rope_theta",
                                       family_value(cfg, "rope_local_base_freq")),
                             "rope_parameters.sliding_attention.rope_theta")
        # NOTE: HF's Gemma3TextConfig merges a rope_scaling into the global layers' params
        params = {**(params.get("full_attention") or {}), **(old or {})}
        where = "rope_parameters.full_attention"
    else:
        # NOTE: as HF's convert_rope_params_to_dict: a (non-empty) rope_scaling wins
        where = "rope_scaling" if old else "rope_parameters"
        params = dict(old or params or {})
        if model_type == "gemma3_text":
            local_theta = _theta(family_value(cfg, "rope_local_base_freq"),
                                 "rope_local_base_freq")
    theta = _theta(params.get("rope_theta", family_value(cfg, "rope_theta", 10000.0)),
                   f"{where}.rope_theta" if "rope_theta" in params else "rope_theta")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if _full_rotary(partial, cfg):
        raise UnsupportedConfig(f"{where}.partial_rotary_factor", partial,
                                "partial rotary embeddings are not supported")
    return RopeSettings(theta, _scaling(cfg, params, where), local_theta)


def _rope_type(params: dict[str, Any], where: str, model_type: str) -> str:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if model_type == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # NOTE: HF's Phi3Config renames the old names
    if rope_type not in ROPE_TYPES:
        raise UnsupportedConfig(f"{where}.rope_type", rope_type,
                                f"unsupported RoPE type (supported: {', '.join(ROPE_TYPES)})")
    return rope_type


def _scaling(cfg: dict[str, Any], params: dict[str, Any], where: str) -> RopeScaling | None:
    rope_type = _rope_type(params, where, cfg.get("model_type", "llama"))
    if rope_type == "default":
        return None
    unknown = sorted(set(params) - _ROPE_FIELDS - _ROPE_IGNORED)
    if unknown:
        raise UnsupportedConfig(f"{where}.{unknown[0]}", params[unknown[0]],
                                f"unknown key of {rope_type} RoPE scaling")
    values = {k: params[k] for k in _ROPE_FIELDS if params.get(k) is not None}
    if rope_type in ("llama3", "yarn", "longrope"):
        # NOTE: as HF's standardize_rope_params: a top-level original_max_position_embeddings
        # (Phi-3's config always has one, default 4096) wins, else the scaling's own, else
        # max_position_embeddings
        top = family_value(cfg, "original_max_position_embeddings")
        if top is not None:
            values["original_max_position_embeddings"] = top
        values.setdefault("original_max_position_embeddings",
                          cfg.get("max_position_embeddings", 2048))
    for key in _ROPE_REQUIRED[rope_type]:
        if key not in values:
            raise UnsupportedConfig(f"{where}.{key}", None, f"{rope_type} RoPE needs it")
    for key, value in values.items():
        if key in ("short_factor", "long_factor"):
            if not isinstance(value, list | tuple) or not all(_positive_number(v)
                                                              for v in value):
                raise UnsupportedConfig(f"{where}.{key}", value,
                                        "must be a list of positive numbers")
        elif key == "truncate":
            if not isinstance(value, bool):
                raise UnsupportedConfig(f"{where}.{key}", value, "must be true or false")
        elif not _positive_number(value):
            raise UnsupportedConfig(f"{where}.{key}", value, "must be a positive number")
    if rope_type == "longrope":
        half = (family_value(cfg, "head_dim")
                or cfg.get("hidden_size", 0) // max(cfg.get("num_attention_heads", 1), 1)) // 2
        for key in ("short_factor", "long_factor"):
            if len(values[key]) != half:
                raise UnsupportedConfig(f"{where}.{key}", values[key],
                                        f"needs head_dim / 2 = {half} values")
    if rope_type in ("yarn", "longrope") and "factor" not in values:
        # NOTE: HF: max_position_embeddings / original_max_position_embeddings
        values["factor"] = (cfg.get("max_position_embeddings", 2048)
                            / values["original_max_position_embeddings"])
    return RopeScaling(rope_type=rope_type, **values)


def _theta(value: Any, key: str) -> float:
    if not _positive_number(value):
        raise UnsupportedConfig(key, value, "must be a positive number")
    return float(value)


def rope_scaling_from_json(value: Any) -> RopeScaling | None:
    """A RopeScaling back from its dataclasses.asdict form (the converted-model cache)."""
    if value is None or isinstance(value, RopeScaling):
        return value
    return RopeScaling(**value)


__all__ = ["GATE", "GateKey", "RopeScaling", "RopeSettings", "UnsupportedConfig",
           "check_gguf_keys", "check_hf_config", "family_value", "rope_settings"]
