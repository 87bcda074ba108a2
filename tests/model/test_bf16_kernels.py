"""bf16 weight panels (quantization="bf16") against the fp32 / float64 references.

Tolerances, from bf16's rounding (8 significant bits, 7 stored: round to nearest even leaves a
relative error of at most 2^-8 per value, the unit roundoff):
- fp32 activations (the mode quantization="bf16" runs): the kernel multiplies the
  bf16-rounded weights in fp32 in the fp32 panels' order, so it must equal panel_linear over
  bf16(W) to the last bit, and a float64 product over bf16(W) within fp32 summation error
  (1e-5 here). Against the unrounded W: |error| <= 2^-8 * sum_k |x_k| |W_kj| per output (the
  bound of each weight's rounding), plus the same fp32 slack.
- bf16 activations (vdpbf16ps at any size, AMX from BF16_AMX_MIN_ROWS rows): x is rounded
  too (another 2^-8 per product); the products of two bf16 are exact in fp32, so against
  float64 over bf16(x) and bf16(W) only fp32 summation error is left: 1e-5 here.
"""

from __future__ import annotations

import pytest
import torch

from slotserve import SamplingParams
from slotserve.config import EngineConfig
from slotserve.model import linear_kernels
from slotserve.model.kernels import resolve_kernels
from slotserve.model.layers import Linear
from slotserve.model.linear_kernels import (
    Bf16PanelLinear,
    Bf16RoundedLinear,
    bf16_round,
)
from tests.conftest import random_prompts, tiny_engine, tiny_hf_model, tiny_llm
from tests.model.test_decode_stack import run_comparing_stack_and_python
from tests.model.test_vs_hf import hf_greedy

BF16_RELATIVE = 2.0 ** -8  # bf16 round to nearest even: half a unit in the 8th bit
FP32_SLACK = 1e-5


def random_linear(in_features: int, out_features: int, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(in_features, out_features, generator=gen) * 0.05
    b = torch.randn(out_features, generator=gen) if bias else None
    return weight, b


def product64(x, weight, bias=None):
    y = x.double() @ weight.double()
    return (y if bias is None else y + bias.double()).float()


@pytest.fixture
def plain_loops(cpu_ops):
    """The kernels' plain-loop fallbacks forced on: what a CPU without AVX-512 runs."""
    cpu_ops.set_force_plain_loops(True)
    yield cpu_ops
    cpu_ops.set_force_plain_loops(False)


# in 95 and 3: odd input counts (the last input pair half empty); out 200: a last panel of
# 8 outputs; 40: one full panel and one of 8; rows: empty, one tile of 1-12, even tiles.
@pytest.mark.parametrize("rows", [0, 1, 2, 7, 12, 13, 64, 130])
@pytest.mark.parametrize("in_features,out_features", [(95, 200), (96, 40), (3, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_panels_equal_fp32_panels_over_rounded_weights(cpu_ops, rows, in_features,
                                                            out_features, bias):
    weight, b = random_linear(in_features, out_features, bias, seed=in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    out = Bf16PanelLinear(weight, b, cpu_ops)(x)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    rounded = bf16_round(weight)
    fp32_panels = cpu_ops.panel_linear(x, cpu_ops.pack_panels(rounded.t().contiguous()),
                                       out_features)
    expected = fp32_panels if b is None else fp32_panels + b
    assert torch.equal(out, expected)
    torch.testing.assert_close(out, product64(x, rounded, b), atol=FP32_SLACK, rtol=FP32_SLACK)
    # ...and within bf16's rounding of the product with the unrounded weights
    bound = BF16_RELATIVE * (x.double().abs() @ weight.double().abs()) + FP32_SLACK
    assert ((out.double() - product64(x, weight, b).double()).abs() <= bound).all()


@pytest.mark.parametrize("rows", [1, 5, 13, 64])
@pytest.mark.parametrize("in_features", [95, 576])
def test_bf16_activation_mode_equals_the_rounded_product(cpu_ops, rows, in_features):
    weight, b = random_linear(in_features, 72, True, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    out = Bf16PanelLinear(weight, b, cpu_ops, bf16_activations=True)(x)
    expected = product64(x.bfloat16().float(), bf16_round(weight), b)
    torch.testing.assert_close(out, expected, atol=FP32_SLACK, rtol=FP32_SLACK)


@pytest.mark.parametrize("bf16_activations", [False, True])
def test_bf16_panels_rows_do_not_depend_on_the_batch(cpu_ops, bf16_activations):
    """Both modes sum each output in one fixed order whatever the tile: bit for bit."""
    weight, _ = random_linear(576, 96, False)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(1))
    kernel = Bf16PanelLinear(weight, None, cpu_ops, bf16_activations=bf16_activations)
    full = kernel(x)
    for rows in (1, 2, 5, 7, 12, 13, 33):
        assert torch.equal(kernel(x[:rows]), full[:rows]), rows
        assert torch.equal(kernel(x[-rows:]), full[-rows:]), rows


@pytest.mark.parametrize("bf16_activations", [False, True])
@pytest.mark.parametrize("rows", [1, 13])
def test_plain_loop_fallbacks_agree_with_the_vectorised_kernels(cpu_ops, bf16_activations,
                                                                rows):
    weight, b = random_linear(95, 200, True)
    x = torch.randn(rows, 95, generator=torch.Generator().manual_seed(rows))
    kernel = Bf16PanelLinear(weight, b, cpu_ops, bf16_activations=bf16_activations)
    vectorised = kernel(x)
    cpu_ops.set_force_plain_loops(True)
    try:
        assert cpu_ops.panel_bf16_vectorised() == (False, False)
        plain = kernel(x)
    finally:
        cpu_ops.set_force_plain_loops(False)
    if bf16_activations:  # vdpbf16ps adds its two exact products in its own order
        torch.testing.assert_close(plain, vectorised, atol=FP32_SLACK, rtol=FP32_SLACK)
    else:  # fma after fma, in the same order
        assert torch.equal(plain, vectorised)


@pytest.fixture
def amx_ops(cpu_ops):
    """The kernels, where AMX-BF16 is usable (built with it, and allowed by the OS)."""
    if not cpu_ops.amx_bf16_usable():
        pytest.skip("AMX-BF16 not usable here")
    return cpu_ops


@pytest.mark.parametrize("rows", [1, 16, 17, 33, 64, 130])
@pytest.mark.parametrize("in_features,out_features", [(95, 200), (576, 40), (1536, 32), (2048, 64)])
def test_amx_equals_the_rounded_product(amx_ops, rows, in_features, out_features):
    weight, _ = random_linear(in_features, out_features, False, seed=rows)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    panels = amx_ops.pack_panels_bf16(weight.t().contiguous())
    out = amx_ops.panel_linear_bf16_amx(x, panels, out_features)
    expected = product64(x.bfloat16().float(), bf16_round(weight))
    torch.testing.assert_close(out, expected, atol=FP32_SLACK, rtol=FP32_SLACK)


def test_amx_rows_do_not_depend_on_the_batch_among_amx_calls(amx_ops):
    weight, _ = random_linear(576, 96, False)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(1))
    kernel = Bf16PanelLinear(weight, None, amx_ops, amx_min_rows=16)
    full = kernel(x)
    for rows in (16, 17, 33, 40):
        assert torch.equal(kernel(x[:rows]), full[:rows]), rows
        assert torch.equal(kernel(x[-rows:]), full[-rows:]), rows
    # below the threshold: the fp32-activation mode, within bf16's rounding of x
    bound = BF16_RELATIVE * (x[:15].double().abs() @ bf16_round(weight).double().abs())
    assert ((kernel(x[:15]).double() - full[:15].double()).abs() <= bound + FP32_SLACK).all()


def test_amx_forced_off_falls_back_to_widening(plain_loops):
    assert not plain_loops.amx_bf16_usable()
    weight, b = random_linear(95, 40, True)
    x = torch.randn(20, 95, generator=torch.Generator().manual_seed(3))
    with_amx = Bf16PanelLinear(weight, b, plain_loops, amx_min_rows=16)
    assert torch.equal(with_amx(x), Bf16PanelLinear(weight, b, plain_loops)(x))
    with pytest.raises(RuntimeError, match="AMX"):
        plain_loops.panel_linear_bf16_amx(x, with_amx.panels, 40)


def test_bf16_panels_check_their_inputs(cpu_ops):
    panels = cpu_ops.pack_panels_bf16(torch.randn(40, 8))  # 2 panels: 33-64 outputs fit
    # 4 input pairs, padded to 16 (the AMX tile's); so in_features is checked up to 32
    assert panels.dtype == torch.bfloat16 and panels.shape == (2, 16, 64)
    with pytest.raises(RuntimeError, match="out_features"):
        cpu_ops.panel_linear_bf16(torch.randn(1, 8), panels, 70)
    with pytest.raises(RuntimeError, match="in_features"):
        cpu_ops.panel_linear_bf16(torch.randn(1, 40), panels, 40)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_ops.panel_linear_bf16(torch.randn(1, 8), panels.float(), 40)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_ops.panel_linear_bf16(torch.randn(1, 8).double(), panels, 40)


def test_bf16_quantization_swaps_in_bf16_panels_and_releases_fp32(tiny_llama, cpu_ops):
    engine = tiny_engine(tiny_llama, quantization="bf16")
    assert engine.runner.linear_kernel.startswith("bf16 weight panels")
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(isinstance(m.kernel, Bf16PanelLinear) for m in linears)
    assert all("weight" not in dict(m.named_parameters()) for m in linears)
    assert all(m.kernel.panels.dtype == torch.bfloat16 for m in linears)
    assert engine.runner.model.decode_stack is not None


def test_bf16_quantization_falls_back_to_the_torch_reference(tiny_llama, plain_loops):
    reference = tiny_engine(tiny_llama, quantization="bf16", kernels="reference")
    assert reference.runner.linear_kernel == "bf16-rounded weights (torch reference)"
    # the fused kernels built but without their vectorised bf16 code: the same reference
    fallback = tiny_engine(tiny_llama, quantization="bf16")
    assert fallback.runner.linear_kernel.startswith("bf16-rounded weights (torch reference)")
    assert all(isinstance(m.kernel, Bf16RoundedLinear)
               for m in fallback.runner.model.modules() if isinstance(m, Linear))


# qwen2: qkv bias added after the kernel; amx_min_rows 2: decode batches of 2-5 on AMX
@pytest.mark.parametrize("kind,amx_min_rows", [("llama", 16), ("qwen2", 16), ("qwen2", 2)])
def test_decode_stack_with_bf16_panels_equals_python_layers(cpu_ops, monkeypatch, kind,
                                                            amx_min_rows):
    monkeypatch.setattr(linear_kernels, "BF16_AMX_MIN_ROWS", amx_min_rows)
    engine = tiny_engine(tiny_hf_model(kind), quantization="bf16", block_size=16)
    assert engine.runner.model.decode_stack is not None
    decode_only = run_comparing_stack_and_python(engine, random_prompts(5), max_tokens=24)
    assert decode_only >= 15


def rounded_hf_model(kind: str):
    """The HF model with its linear layers' weights rounded to bf16 (embeddings, norms and
    the untied LM head's input side as ours: only Linear weights are rounded)."""
    model = tiny_hf_model(kind)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2 and "embed_tokens" not in name:
                param.copy_(bf16_round(param))
    return model


@pytest.mark.parametrize("kernels", ["auto", "reference"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # untied: the embedding stays fp32
def test_bf16_greedy_matches_hf_over_rounded_weights(monkeypatch, kind, kernels):
    """The fp32-activation path (AMX and vdpbf16ps off: they round x too) equals HF over
    bf16(W)."""
    monkeypatch.setattr(linear_kernels, "BF16_AMX_MIN_ROWS", 0)
    monkeypatch.setattr(linear_kernels, "BF16_DOT_MIN_ROWS", 0)
    prompts = random_prompts(6, min_len=3, max_len=40, seed=3)
    llm = tiny_llm(tiny_hf_model(kind), block_size=8, num_blocks=128, kernels=kernels,
                   quantization="bf16")
    hf = rounded_hf_model(kind)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0,
                                                   ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(hf, prompt, 20)
    llm.engine.check_integrity()


def test_bf16_quantization_settings_are_checked(tiny_llama):
    with pytest.raises(ValueError, match="CPU"):
        EngineConfig(device="cuda", quantization="bf16")
    with pytest.raises(ValueError, match="bf16"):
        resolve_kernels(quantization="bf16", dtype="bfloat16")


def test_bf16_greedy_agreement_on_smollm2():
    """The quality bar of quantization="bf16" (97% teacher-forced, benchmarks/int8_quality.py
    over 32 prompts), on a smaller sample."""
    from slotserve.engine.llm import engine_config
    from slotserve.engine.llm_engine import LLMEngine
    from slotserve.lab.quality import greedy_agreement
    from slotserve.lab.workload import generate_workload
    from slotserve.loader import load_model

    loaded = load_model()
    prompts = generate_workload(6, prompts="chat", seed=1).chat_prompt_ids(loaded.tokenizer)

    def engine(**kwargs):
        config = engine_config(max_num_seqs=8, num_blocks=128, **kwargs)
        return LLMEngine(config, loaded.config, loaded.weights, loaded.tokenizer)

    agreement = greedy_agreement(engine(quantization="none"), engine(quantization="bf16"),
                                 prompts, 32)
    assert agreement.tokens == 6 * 32
    assert agreement.teacher_forced >= 0.97, agreement
