"""Sliding-window attention per layer, from an HF config dict or GGUF metadata.

A layer's window is an int w (the query at position i sees key j iff j <= i and i - j < w,
as transformers' `sliding_window_causal_mask_function` and llama.cpp's standard SWA mask
say) or None (full causal attention). A model's windows are one per layer; `()` when no
layer has one (the common case, and every ModelConfig built before windows existed).

Which layers get the window is each family's rule, as its HF config class computes it:
- mistral, phi3: every layer gets `sliding_window` (Mistral's default 4096 when the key is
  missing, Phi-3's None); `layer_types` is ignored, as HF's Mistral does;
- qwen2, qwen3: a window only with `use_sliding_window` (default False); then the layers
  `layer_types` names "sliding_attention", or without it layers i >= `max_window_layers`
  (default 28);
- gemma2 / gemma3_text: `layer_types`, else every layer but each 2nd (Gemma 2) or each
  `sliding_window_pattern`-th (Gemma 3, default 6) slides (window default 4096);
- llama: LlamaConfig has no window; HF ignores a `sliding_window` key, and so does this.
Any other model_type that names a window is refused (ValueError naming the key): nothing
is silently computed as full attention that HF would compute windowed.

No torch and no slotserve import but value_checks (which imports nothing): config.py (below
core/) reads HF configs with it.
"""

from __future__ import annotations

from typing import Any

from slotserve.value_checks import is_int

Windows = tuple["int | None", ...]

SLIDING, FULL = "sliding_attention", "full_attention"
# model_type -> the window HF's config class uses when `sliding_window` is missing.
DEFAULT_WINDOW = {"mistral": 4096, "phi3": None, "qwen2": 4096, "qwen3": 4096,
                  "gemma2": 4096, "gemma3_text": 4096}
# Every `pattern`-th layer (1-based) is global, the rest slide (HF's default layer_types).
GEMMA_PATTERN = {"gemma2": 2, "gemma3_text": 6}
QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28
# GGUF: the architectures whose sliding window llama.cpp (and HF's GGUF loader) applies, and
# their default pattern (every n-th layer global); llama and qwen2 files get none there.
GGUF_PATTERN = {"gemma2": 2, "gemma3": 6}
GGUF_NO_WINDOW = ("llama", "qwen2")


def hf_layer_windows(cfg: dict[str, Any]) -> Windows:
    """Per-layer windows of an HF `config.json` dict (see the module docstring), or () when
    every layer attends fully. ValueError naming the key for a bad or unknown window."""
    model_type = cfg.get("model_type", "llama")
    layers = cfg["num_hidden_layers"]
    if model_type == "llama":
        return ()
    if model_type not in DEFAULT_WINDOW:
        _refuse_unknown(cfg, model_type)
        return ()
    window = _window_value(cfg.get("sliding_window", DEFAULT_WINDOW[model_type]),
                           "sliding_window")
    if model_type in ("mistral", "phi3"):
        return normalized((window,) * layers)
    if model_type in ("qwen2", "qwen3"):
        return _qwen_windows(cfg, window, layers)
    types = cfg.get("layer_types")
    if types is None:
        pattern = GEMMA_PATTERN[model_type]
        if model_type == "gemma3_text":
            pattern = _positive_int(cfg.get("sliding_window_pattern", pattern),
                                    "sliding_window_pattern")
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    return _from_layer_types(types, window, layers)


def gguf_layer_windows(meta: dict[str, Any], arch: str, layers: int) -> Windows:
    """Per-layer windows of a GGUF file's `{arch}.*` metadata, as llama.cpp applies them:
    `{arch}.attention.sliding_window` on the layers of the architecture's pattern
    (`{arch}.attention.sliding_window_pattern`: an int n, every n-th layer global, or one
    bool per layer, True where it slides). ValueError naming the key otherwise."""
    window_key = f"{arch}.attention.sliding_window"
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    if arch in GGUF_NO_WINDOW:
        return ()  # NOTE: llama.cpp and HF read no window for these, whatever the file says
    if arch not in GGUF_PATTERN:
        for key in (window_key, pattern_key):
            if meta.get(key) is not None:
                raise ValueError(f"{key}={meta[key]!r}: sliding windows of GGUF architecture "
                                 f"{arch!r} are not supported")
        return ()
    if window_key not in meta:
        raise ValueError(f"missing key {window_key}")
    window = _window_value(meta[window_key], window_key)
    pattern = meta.get(pattern_key, GGUF_PATTERN[arch])
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(p, bool) for p in pattern):
            raise ValueError(f"{pattern_key} must be one bool per layer ({layers}), "
                             f"not {pattern!r}")
        slides = pattern
    else:
        pattern = _positive_int(pattern, pattern_key)
        slides = [bool((i + 1) % pattern) for i in range(layers)]
    return normalized(tuple(window if s else None for s in slides))


def normalized(windows: Windows) -> Windows:
    """() when no layer has a window (full attention everywhere), else the tuple as is."""
    return tuple(windows) if any(w is not None for w in windows) else ()


def layer_window(windows: Windows, layer: int) -> int | None:
    """The window of `layer` (None: full attention) in a model's per-layer windows."""
    return windows[layer] if windows else None


def uniform_window(windows: Windows) -> int | None:
    """The one window every layer has, or None (some layer attends fully, or they differ).

    NOTE: only then can a cache free the blocks before a sequence's last `window` positions:
    no layer reads them again (vLLM's sliding-window manager).
    """
    if windows and windows[0] is not None and all(w == windows[0] for w in windows):
        return windows[0]
    return None


def _qwen_windows(cfg: dict[str, Any], window: int | None, layers: int) -> Windows:
    if not cfg.get("use_sliding_window", False):
        window = None  # NOTE: HF's Qwen2Config drops the window unless use_sliding_window
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", QWEN_DEFAULT_MAX_WINDOW_LAYERS)
        if not is_int(first) or first < 0:
            raise ValueError(f"max_window_layers must be an integer >= 0, not {first!r}")
        if window is None:
            return ()
        types = [SLIDING if i >= first else FULL for i in range(layers)]
    return _from_layer_types(types, window, layers)


def _from_layer_types(types: Any, window: int | None, layers: int) -> Windows:
    if not isinstance(types, list) or len(types) != layers:
        raise ValueError(f"layer_types must list one type per layer ({layers}), not {types!r}")
    unknown = sorted({t for t in types if t not in (SLIDING, FULL)}, key=str)
    if unknown:
        raise ValueError(f"layer_types: unsupported attention type {unknown[0]!r} "
                         f"(supported: {SLIDING!r}, {FULL!r})")
    if SLIDING in types and window is None:
        # NOTE: HF raises here too (create_sliding_window_causal_mask needs a window)
        raise ValueError("layer_types has sliding_attention layers but there is no "
                         "sliding_window (null, or use_sliding_window false)")
    return normalized(tuple(window if t == SLIDING else None for t in types))


def _refuse_unknown(cfg: dict[str, Any], model_type: str) -> None:
    types = cfg.get("layer_types")
    for key, value in (("sliding_window", cfg.get("sliding_window")),
                       ("layer_types", types if types and SLIDING in types else None),
                       ("use_sliding_window", cfg.get("use_sliding_window") or None)):
        if value is not None:
            raise ValueError(f"{key}={value!r}: sliding windows of model_type {model_type!r} "
                             "are not supported")


def _window_value(value: Any, key: str) -> int | None:
    return None if value is None else _positive_int(value, key)


def _positive_int(value: Any, key: str) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"{key} must be a positive integer, not {value!r}")
    return value
