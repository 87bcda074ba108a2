"""The config gate (slotserve/config_gate.py): every HF config key that changes the math is
either computed exactly as HF computes it or refused at load with a ModelFileError naming
the key and value; none is ignored. The table below walks every key of the gate's table.
Also: a named dtype keeps fp32 weights under quantization="auto"."""

from __future__ import annotations

import json
import os

import pytest

from slotserve.config_gate import GATE
from slotserve.loader import ModelFileError, load_model
from slotserve.model import kernels as kernels_module
from slotserve.model import linear_kernels
from slotserve.model.kernels import resolve_kernels
from tests.model.test_families import (
    FAMILY_CONFIGS,
    PROMPTS,
    assert_greedy_matches_hf,
    load_llm,
    save_hf,
    tiny_hf,
)
from tests.model.test_rope_scaling import SCALINGS

# Keys whose values are checked exactly against HF elsewhere: key -> where (each must be
# set there; checked below). Family tiny models: test_families.py; RoPE: test_rope_scaling;
# windows: H6's tests/model/test_sliding_window.py (Mistral, Qwen2) and the Gemma models.
EXACT_ELSEWHERE = {
    "model_type": "every test of tests/model",
    "rope_parameters": "test_rope_scaling (v5 configs, as save_pretrained writes them)",
    "rope_theta": "test_families (gemma3_text)",
    "rope_local_base_freq": "test_families (gemma3_text)",
    "original_max_position_embeddings": "test_families (phi3 longrope)",
    "sliding_window": "test_families (gemma2, gemma3_text), test_sliding_window",
    "layer_types": "test_families (gemma2, gemma3_text)",
    "use_sliding_window": "test_sliding_window (qwen2)",
    "max_window_layers": "test_sliding_window (qwen2)",
    "attention_bias": "test_families (llama)",
    "mlp_bias": "test_families (llama)",
    "head_dim": "test_families (qwen3, gemma: 32 with hidden 64 / 4 heads)",
    "hidden_activation": "test_families (gemma2, gemma3_text: gelu_pytorch_tanh)",
    "attn_logit_softcapping": "test_families (gemma2)",
    "final_logit_softcapping": "test_families (gemma2, gemma3_text)",
    "query_pre_attn_scalar": "test_families (gemma2, gemma3_text)",
    "tie_word_embeddings": "test_families (gemma: tied), test_vs_hf (tiny_llama_tied)",
}
# Keys computed exactly and run here (config.json edited as older transformers wrote it).
EXACT_HERE = ("hidden_act", "rope_scaling")
# (model_type, key, value, what the message shows, keys dropped first): each refused at
# load with a ModelFileError naming the key and its value. Keys are dropped where HF would
# not read the edited one (a v5 rope_parameters' rope_theta wins over a top-level one; a
# layer_types list wins over max_window_layers).
REFUSED = [
    ("llama", "model_type", "gpt2", "model_type='gpt2'", ()),
    ("llama", "rope_scaling", {"rope_type": "proportional", "factor": 2.0},
     "rope_scaling.rope_type='proportional'", ()),
    ("llama", "rope_scaling", {"rope_type": "linear", "factor": 2.0, "bogus": 1},
     "rope_scaling.bogus=1", ()),
    ("llama", "rope_scaling", {"rope_type": "llama3", "factor": 8.0},
     "rope_scaling.low_freq_factor=None", ()),
    ("llama", "rope_scaling", {"rope_type": "linear", "factor": -2.0},
     "rope_scaling.factor=-2.0", ()),
    ("llama", "rope_parameters", {"rope_type": "linear", "factor": 2.0,
                                  "partial_rotary_factor": 0.5, "rope_theta": 1e4},
     "rope_parameters.partial_rotary_factor=0.5", ()),
    ("llama", "rope_theta", -1.0, "rope_theta=-1.0", ("rope_parameters",)),
    # an integer past a float's range (JSON allows it): refused, not an OverflowError
    ("llama", "rope_theta", 10**400, "rope_theta=1000", ("rope_parameters",)),
    ("gemma3_text", "rope_local_base_freq", 0, "rope_local_base_freq=0",
     ("rope_parameters",)),
    ("phi3", "partial_rotary_factor", 0.75, "partial_rotary_factor=0.75", ()),
    ("phi3", "rope_scaling", {"rope_type": "longrope", "short_factor": [1.0] * 3,
                              "long_factor": [1.0] * 8},
     "rope_scaling.short_factor=[1.0, 1.0, 1.0]", ()),
    ("phi3", "original_max_position_embeddings", "4k",
     "original_max_position_embeddings='4k'", ()),
    ("mistral", "sliding_window", -3, "sliding_window", ()),
    ("qwen3", "max_window_layers", -1, "max_window_layers", ("layer_types",)),
    ("gemma2", "layer_types", ["sliding_attention", "chunked_attention"],
     "'chunked_attention'", ()),
    ("llama", "attention_bias", "yes", "attention_bias='yes'", ()),
    ("llama", "mlp_bias", 1, "mlp_bias=1", ()),
    ("llama", "head_dim", -4, "head_dim", ()),
    ("llama", "hidden_act", "relu", "hidden_act='relu'", ()),
    ("gemma2", "hidden_activation", "relu", "hidden_activation='relu'", ()),
    ("gemma2", "attn_logit_softcapping", -50.0, "attn_logit_softcapping=-50.0", ()),
    ("gemma3_text", "attn_logit_softcapping", 50.0, "attn_logit_softcapping=50.0", ()),
    ("gemma2", "final_logit_softcapping", "30", "final_logit_softcapping='30'", ()),
    ("gemma3_text", "query_pre_attn_scalar", 0, "query_pre_attn_scalar=0", ()),
    ("gemma3_text", "use_bidirectional_attention", True, "use_bidirectional_attention=True",
     ()),
    ("llama", "tie_word_embeddings", "no", "tie_word_embeddings='no'", ()),
    ("llama", "quantization_config", {"quant_method": "gptq", "bits": 4},
     "quantization_config=", ()),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """model_type -> (HF model, its saved directory)."""
    out = {}
    for model_type in ("llama", "mistral", "qwen3", "gemma2", "gemma3_text", "phi3"):
        model = tiny_hf(model_type, seed=50, **FAMILY_CONFIGS.get(model_type, {}))
        out[model_type] = (model, save_hf(model, tmp_path_factory.mktemp(model_type)))
    return out


def edited_copy(src: str, dst, edit) -> str:
    """A copy of the saved model directory `src` at `dst` with config.json edited by `edit`
    (the weights linked, not copied)."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "config.json":
            os.symlink(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


def test_the_table_walks_every_key_of_the_gate():
    gate_keys = {entry.key for entry in GATE}
    covered = set(EXACT_ELSEWHERE) | set(EXACT_HERE) | {case[1] for case in REFUSED}
    assert gate_keys <= covered, sorted(gate_keys - covered)


def test_the_keys_checked_elsewhere_are_set_there():
    """EXACT_ELSEWHERE is not a promise: the tiny models of those tests set these keys."""
    set_there = {k for overrides in FAMILY_CONFIGS.values() for k in overrides}
    for key in ("rope_local_base_freq", "original_max_position_embeddings", "sliding_window",
                "layer_types", "attention_bias", "mlp_bias", "head_dim",
                "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        assert key in set_there, key
    assert {s["rope_type"] for s in SCALINGS.values()} >= {"linear", "dynamic", "llama3",
                                                            "yarn", "longrope"}


@pytest.mark.parametrize(("model_type", "key", "value", "shown", "dropped"), REFUSED,
                         ids=[f"{case[0]}-{case[1]}-{i}" for i, case in enumerate(REFUSED)])
def test_refused_at_load_naming_key_and_value(saved, tmp_path, model_type, key, value, shown,
                                              dropped):
    def edit(cfg):
        for name in dropped:
            cfg.pop(name, None)
        cfg[key] = value

    path = edited_copy(saved[model_type][1], tmp_path / "m", edit)
    with pytest.raises(ModelFileError) as info:
        load_model(path)
    message = str(info.value)
    assert "config.json" in message and key in message and shown in message, message


def test_old_format_rope_scaling_is_exact(saved, tmp_path):
    """config.json as transformers 4.x wrote it (rope_theta + rope_scaling, not
    rope_parameters): the same llama3 RoPE as HF's own model of it."""
    import transformers

    model = tiny_hf("llama", seed=51, rope_scaling=dict(SCALINGS["llama3"]))
    src = save_hf(model, tmp_path / "v5")

    def to_v4(cfg):
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params.pop("rope_theta")
        cfg["rope_scaling"] = params

    path = edited_copy(src, tmp_path / "v4", to_v4)
    hf_v4 = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert hf_v4.config.rope_parameters["rope_type"] == "llama3"
    assert_greedy_matches_hf(hf_v4, load_llm(path), prompts=PROMPTS[:3])


def test_old_format_gemma3_rope_is_exact(tmp_path):
    """Gemma 3 as its Hub configs spell it: rope_theta, rope_local_base_freq, rope_scaling
    (the global layers' only)."""
    import transformers

    overrides = dict(FAMILY_CONFIGS["gemma3_text"])
    model = tiny_hf("gemma3_text", seed=52, **overrides)
    src = save_hf(model, tmp_path / "v5")

    def to_v4(cfg):
        params = cfg.pop("rope_parameters")
        cfg["rope_theta"] = params["full_attention"].pop("rope_theta")
        cfg["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        cfg["rope_scaling"] = params["full_attention"]

    path = edited_copy(src, tmp_path / "v4", to_v4)
    hf_v4 = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert hf_v4.config.rope_parameters["sliding_attention"]["rope_theta"] == 100.0
    assert_greedy_matches_hf(hf_v4, load_llm(path), prompts=PROMPTS[:3])


def test_gelu_mlp_is_exact(tmp_path):
    """hidden_act gelu (exact erf GELU) on a Llama: HF's tokens."""
    model = tiny_hf("llama", seed=53, hidden_act="gelu")
    assert_greedy_matches_hf(model, load_llm(save_hf(model, tmp_path)), prompts=PROMPTS[:3])


# -- the dtype ---------------------------------------------------------------------------------


@pytest.fixture
def bf16_cpu(monkeypatch):
    """This CPU taken to have AVX512_BF16 and the bf16 panel kernel built."""
    monkeypatch.setattr(kernels_module, "_cpu_flags", lambda: frozenset(  # its CPU class
        {"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"}))
    monkeypatch.setattr(linear_kernels, "bf16_panel_kernel_available", lambda ops: True)


def test_auto_quantization_keeps_fp32_weights_when_a_dtype_is_named(bf16_cpu):
    assert resolve_kernels("auto", "auto", "cpu", None).weights == "bf16"
    assert resolve_kernels("auto", "auto", "cpu", "auto").weights == "bf16"
    named = resolve_kernels("auto", "auto", "cpu", "float32")
    assert named.weights == "fp32" and "dtype=float32" in named.reason
    assert resolve_kernels("auto", "bf16", "cpu", "float32").weights == "bf16"  # asked for


def test_llm_with_dtype_float32_computes_in_fp32(saved, bf16_cpu):
    from slotserve import LLM

    runner = LLM(saved["llama"][1], dtype="float32", num_blocks=32).engine.runner
    assert runner.kernels.weights == "fp32"
    assert runner.kernels.linear not in ("bf16_panel", "bf16_rounded")
    assert all(p.dtype.is_floating_point and p.dtype == runner.dtype
               for p in runner.model.parameters())
