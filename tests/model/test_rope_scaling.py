"""RoPE scaling as HF computes it: model/rope.py's frequencies equal HF's
ROPE_INIT_FUNCTIONS bit for bit, and a tiny Llama with each scaling gives HF's greedy tokens
(fp32 path, ragged prompts, chunked prefill, fused and reference kernels). Phi-3's longrope
end to end is in test_families.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from slotserve.config_gate import rope_settings
from slotserve.model import rope
from tests.model.test_families import (
    PROMPTS,
    assert_greedy_matches_hf,
    load_llm,
    save_hf,
    tiny_hf,
)
from tests.model.test_vs_hf import hf_greedy

# Small original lengths, so the prompts (to 56 positions) reach the scaled frequencies.
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
                    "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0,
                    "truncate": False},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64,
                 "short_factor": [1.0 + 0.2 * i for i in range(8)],
                 "long_factor": [4.0 + i for i in range(8)]},
}


def hf_config(scaling: dict, model_type: str = "llama", **kw):
    import transformers

    cfg = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256, rope_theta=5000.0, rope_scaling=dict(scaling), **kw)
    return transformers.AutoConfig.for_model(model_type, **cfg)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_inv_freq_equals_hf(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # NOTE: Phi-3's top-level original_max_position_embeddings wins over the scaling's
    extra = dict(original_max_position_embeddings=64) if name == "longrope" else {}
    config = hf_config(SCALINGS[name], "phi3" if name == "longrope" else "llama", **extra)
    settings = rope_settings(config.to_dict())
    scaling = settings.scaling
    hf_init = ROPE_INIT_FUNCTIONS[scaling.rope_type]
    if scaling.rope_type == "longrope":
        short, long, factor = rope.longrope_inv_freqs(16, settings.theta, scaling, 256)
        hf_short, hf_factor = hf_init(config, None)
        hf_long, _ = hf_init(config, None, seq_len=65)
        assert torch.equal(short, hf_short) and torch.equal(long, hf_long)
    else:
        inv_freq, factor = rope.INV_FREQ[scaling.rope_type](16, settings.theta, scaling, 256)
        hf_inv_freq, hf_factor = hf_init(config, None)
        assert torch.equal(inv_freq, hf_inv_freq)
    assert factor == hf_factor


def test_yarn_attention_factor_scales_cos_and_sin():
    settings = rope_settings(hf_config(SCALINGS["yarn"]).to_dict())
    inv_freq, factor = rope.yarn_inv_freq(16, settings.theta, settings.scaling, 256)
    assert factor > 1.0
    cos, sin = rope.rope_tables(16, 256, settings.theta, settings.scaling)
    angles = torch.arange(256).float()[:, None] * inv_freq[None, :]
    assert torch.equal(cos, angles.cos() * factor) and torch.equal(sin, angles.sin() * factor)


def test_longrope_short_factors_below_the_original_length_long_from_it():
    settings = rope_settings(hf_config(SCALINGS["longrope"], "phi3",
                                       original_max_position_embeddings=64).to_dict())
    short, long, factor = rope.longrope_inv_freqs(16, settings.theta, settings.scaling, 256)
    cos, _ = rope.rope_tables(16, 256, settings.theta, settings.scaling)
    positions = torch.arange(256).float()[:, None]
    assert torch.equal(cos[:64], (positions[:64] * short).cos() * factor)
    assert torch.equal(cos[64:], (positions[64:] * long).cos() * factor)


def test_dynamic_equals_plain_rope_within_max_position_embeddings():
    """HF's dynamic NTK changes nothing until a sequence passes max_position_embeddings, which
    the engine's max_model_len never does."""
    settings = rope_settings(hf_config(SCALINGS["dynamic"]).to_dict())
    inv_freq, _ = rope.dynamic_inv_freq(16, settings.theta, settings.scaling, 256)
    assert torch.equal(inv_freq, rope.default_inv_freq(16, settings.theta)[0])


@pytest.fixture(scope="module")
def scaled_llamas(tmp_path_factory):
    """name -> (HF Llama with that scaling, its directory, HF's greedy tokens)."""
    models = {}
    for name in ("linear", "dynamic", "llama3", "yarn"):
        model = tiny_hf("llama", seed=40, rope_scaling=dict(SCALINGS[name]))
        path = save_hf(model, tmp_path_factory.mktemp(name))
        models[name] = (model, path, [hf_greedy(model, p, 12) for p in PROMPTS])
    return models


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("name", ["linear", "dynamic", "llama3", "yarn"])
def test_scaled_llama_greedy_matches_hf(scaled_llamas, name, kernels):
    hf_model, path, hf_tokens = scaled_llamas[name]
    llm = load_llm(path, kernels=kernels)
    assert llm.engine.model_config.rope_scaling.rope_type == name
    assert_greedy_matches_hf(hf_model, llm, hf_tokens=hf_tokens)


def test_the_scalings_change_hf_tokens(scaled_llamas):
    """The test above can fail: the same weights with plain RoPE give other tokens (dynamic
    aside: HF's dynamic is plain RoPE up to max_position_embeddings)."""
    plain = tiny_hf("llama", seed=40)
    plain_tokens = [hf_greedy(plain, p, 12) for p in PROMPTS]
    for name in ("linear", "llama3", "yarn"):
        model, _, hf_tokens = scaled_llamas[name]
        assert torch.equal(model.model.embed_tokens.weight, plain.model.embed_tokens.weight)
        assert hf_tokens != plain_tokens, name


# -- GGUF: rope_freqs (Llama 3.x as convert_hf_to_gguf writes it) and rope.scaling.* ----------


def llama3_rope_freqs(theta: float, dim: int, scaling: dict) -> np.ndarray:
    """The rope_freqs tensor convert_hf_to_gguf writes for a llama3-scaled Llama."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(path, model, rope_keys: dict, rope_freqs: np.ndarray | None = None) -> str:
    """`model` (a tiny HF Llama) as an F32 GGUF with these `llama.rope.*` keys."""
    from gguf import GGUFWriter

    from tests.model.test_loader import gguf_name, permute

    cfg = model.config
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    for key, value in rope_keys.items():
        (writer.add_string if isinstance(value, str) else writer.add_float32)(
            f"llama.{key}", value)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        w = tensor.float().numpy()
        part = name.split(".")[-2]
        writer.add_tensor(gguf_name(name), permute(w, heads[part]) if part in heads else w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private converted-model cache (never the user's ~/.cache)."""
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path / "cache"))


def test_gguf_rope_freqs_equals_hf_llama3(scaled_llamas, tmp_path, cache_dir):
    """A Llama 3 GGUF's rope_freqs (llama.cpp divides each frequency by its factor) gives the
    tokens of HF's llama3 model of the same weights; the converted-model cache keeps it."""
    from slotserve.loader import load_model

    hf_model, _, hf_tokens = scaled_llamas["llama3"]
    theta = hf_model.config.rope_parameters["rope_theta"]
    factors = llama3_rope_freqs(theta, 16, SCALINGS["llama3"])
    path = write_gguf(tmp_path / "llama3.gguf", hf_model, {}, factors)
    fresh = load_model(path, use_cache=False).config
    assert load_model(path).config == fresh and load_model(path).config == fresh  # cached
    assert fresh.rope_scaling.freq_factors == tuple(factors.tolist())
    llm = load_llm(path)
    assert llm.engine.model_config.rope_scaling.rope_type == "freq_factors"
    assert_greedy_matches_hf(hf_model, llm, hf_tokens=hf_tokens)


def test_gguf_linear_scaling_equals_hf(scaled_llamas, tmp_path, cache_dir):
    hf_model, _, hf_tokens = scaled_llamas["linear"]
    path = write_gguf(tmp_path / "linear.gguf", hf_model,
                      {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0})
    assert_greedy_matches_hf(hf_model, load_llm(path), hf_tokens=hf_tokens)


@pytest.mark.parametrize(("keys", "shown"), [
    ({"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0}, "rope.scaling.type='yarn'"),
    ({"rope.scaling.type": "linear"}, "llama.rope.scaling.factor"),
    ({"rope.scaling.attn_factor": 1.5}, "rope.scaling.attn_factor=1.5"),
])
def test_gguf_rope_scaling_not_computed_is_refused(scaled_llamas, tmp_path, keys, shown):
    from slotserve.loader import ModelFileError, load_model

    path = write_gguf(tmp_path / "m.gguf", scaled_llamas["linear"][0], keys)
    with pytest.raises(ModelFileError, match=shown.replace(".", r"\.")):
        load_model(path, use_cache=False)
