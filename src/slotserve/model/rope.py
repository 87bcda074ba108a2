"""RoPE frequencies and cos/sin tables, as HF transformers computes them.

One function per `rope_type` of HF's `modeling_rope_utils.ROPE_INIT_FUNCTIONS`, each giving
(inv_freq (hd/2,) float32, attention_factor) with HF's float32 arithmetic, and
`rope_tables`, the (positions, hd/2) cos/sin tables a model looks its tokens up in (HF's
rotary embedding's forward: float32 angles, cos/sin times the attention factor).

Where HF's result depends on more than a token's position, what is computed here:
- dynamic (NTK): HF recomputes inv_freq once a forward's sequence grows past
  max_position_embeddings; the engine never goes there (max_model_len is capped at it), and
  below it HF's dynamic frequencies are the ones computed here: exact.
- longrope (Phi-3): HF picks the long factors for a whole forward once its sequence is
  longer than original_max_position_embeddings (and its Phi-3 generate recomputes the cache
  on crossing). Here positions below it use the short factors and positions from it on the
  long ones (vLLM's choice): exact for sequences up to original_max_position_embeddings.
"""

from __future__ import annotations

import math

import torch

from slotserve.config_gate import RopeScaling


def _exponents(dim: int) -> torch.Tensor:
    """arange(0, dim, 2) / dim in float32, as HF writes it."""
    return torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim


def default_inv_freq(dim: int, base: float) -> tuple[torch.Tensor, float]:
    """Plain RoPE (HF's _compute_default_rope_parameters)."""
    return 1.0 / (base ** _exponents(dim)), 1.0


def linear_inv_freq(dim: int, base: float, s: RopeScaling, max_positions: int
                    ) -> tuple[torch.Tensor, float]:
    """Position interpolation: every frequency / factor."""
    inv_freq, _ = default_inv_freq(dim, base)
    return inv_freq / s.factor, 1.0


def dynamic_inv_freq(dim: int, base: float, s: RopeScaling, max_positions: int
                     ) -> tuple[torch.Tensor, float]:
    """Dynamic NTK at sequence lengths up to max_position_embeddings (see the module NOTE)."""
    seq_len = max_positions
    base = base * ((s.factor * seq_len / max_positions) - (s.factor - 1)) ** (dim / (dim - 2))
    return default_inv_freq(dim, base)[0], 1.0


def llama3_inv_freq(dim: int, base: float, s: RopeScaling, max_positions: int
                    ) -> tuple[torch.Tensor, float]:
    """Llama 3.1's frequency-dependent interpolation (HF's _compute_llama3_parameters)."""
    inv_freq, _ = default_inv_freq(dim, base)
    factor, low, high = s.factor, s.low_freq_factor, s.high_freq_factor
    old_context_len = s.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, s: RopeScaling, max_positions: int
                  ) -> tuple[torch.Tensor, float]:
    """YaRN (HF's _compute_yarn_parameters): interpolation ramped over the dimensions, and an
    attention factor that scales cos and sin."""
    factor = s.factor
    original = s.original_max_position_embeddings
    attention_factor = s.attention_factor
    if attention_factor is None:
        if s.mscale and s.mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, s.mscale)
                                     / yarn_mscale(factor, s.mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # NOTE: HF's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = (interpolation * (1 - extrapolation_factor)
                + extrapolation * extrapolation_factor)
    return inv_freq, attention_factor


def longrope_inv_freqs(dim: int, base: float, s: RopeScaling, max_positions: int
                       ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE (HF's _compute_longrope_parameters): (short inv_freq, long inv_freq,
    attention factor)."""
    factor, original = s.factor, s.original_max_position_embeddings
    attention_factor = s.attention_factor
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim

    def inv_freq(ext_factors: tuple[float, ...]) -> torch.Tensor:
        if len(ext_factors) != dim // 2:
            raise ValueError(f"longrope factors: {len(ext_factors)} values, the head needs "
                             f"{dim // 2}")
        return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * base ** shape)

    return inv_freq(s.short_factor), inv_freq(s.long_factor), attention_factor


def freq_factors_inv_freq(dim: int, base: float, s: RopeScaling, max_positions: int
                          ) -> tuple[torch.Tensor, float]:
    """GGUF's rope_freqs tensor (llama.cpp: frequency i / freq_factors[i]); convert_hf_to_gguf
    writes the factors of Llama 3's llama3 scaling there."""
    if len(s.freq_factors) != dim // 2:
        raise ValueError(f"rope_freqs: {len(s.freq_factors)} factors, the head needs {dim // 2}")
    inv_freq, _ = default_inv_freq(dim, base)
    return inv_freq / torch.tensor(s.freq_factors, dtype=torch.float32), 1.0


INV_FREQ = {"linear": linear_inv_freq, "dynamic": dynamic_inv_freq,
            "llama3": llama3_inv_freq, "yarn": yarn_inv_freq,
            "freq_factors": freq_factors_inv_freq}


def rope_tables(head_dim: int, max_positions: int, theta: float,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: (max_positions, head_dim / 2) float32, row p for position p, computed as HF's
    rotary embedding computes them (float32 angles; cos/sin x the attention factor)."""
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    if scaling is None:
        return _tables(positions, *default_inv_freq(head_dim, theta))
    if scaling.rope_type == "longrope":
        short, long, attention_factor = longrope_inv_freqs(head_dim, theta, scaling,
                                                           max_positions)
        original = scaling.original_max_position_embeddings
        cos, sin = _tables(positions, short, attention_factor)
        if max_positions > original:
            long_cos, long_sin = _tables(positions[original:], long, attention_factor)
            cos[original:], sin[original:] = long_cos, long_sin
        return cos, sin
    inv_freq, attention_factor = INV_FREQ[scaling.rope_type](head_dim, theta, scaling,
                                                             max_positions)
    return _tables(positions, inv_freq, attention_factor)


def _tables(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions[:, None] * inv_freq[None, :].float()  # (P, hd/2) float32, as HF
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor
