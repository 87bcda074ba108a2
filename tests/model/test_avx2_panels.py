"""The weight panels' AVX2 tiles (csrc/panels.h), in the avx2 CPU class's own build (gcc
-march=x86-64-v3, as SLOTSERVE_CPU_ISA=avx2 selects): fp32 panels and bf16 panels widened
to fp32, against the torch reference, batch invariant to the bit, the same bits as the
AVX-512 tiles, and what the avx2 class runs.
"""

from __future__ import annotations

import pytest
import torch

from slotserve.model import kernels as kernel_choice
from slotserve.model import linear_kernels
from slotserve.model.cpu_ops import load_cpu_ops
from slotserve.model.linear_kernels import Bf16PanelLinear, PanelLinear, bf16_round
from tests.conftest import random_prompts, tiny_engine, tiny_hf_model
from tests.model.test_decode_stack import run_comparing_stack_and_python

SLACK = 1e-5  # fp32 sums against float64 ones (as tests/model/test_linear_kernels.py)
# Rows: none, 1-3 (one tile, the panel's 32 outputs at once), 5-6 (a tile over two halves of
# 16), 7, 13 (tiles of 3-5 rows walking the panel together, chunk by chunk) and 64 (11 tiles:
# groups of 4, 4 and 3).
ROWS = [0, 1, 2, 3, 5, 6, 7, 13, 64]
# (in, out): inputs no multiple of 8 or 2 (an odd input pair); 200 = 6 x 32 + 8 and 40 = 32 + 8:
# a last panel of 8 outputs (masked stores, no second half); 32 + 20: a second half of 4; 95
# and 64 inputs: chunks of 32 steps (inputs of fp32, pairs of bf16), the last one short.
SHAPES = [(95, 200), (96, 40), (3, 32), (64, 52)]


@pytest.fixture(scope="module")
def avx2_ops():
    if not kernel_choice.cpu_class().at_least("avx2"):
        pytest.skip("this CPU has no AVX2 + FMA")
    ops = load_cpu_ops(kernel_choice.cpu_class("avx2").march)
    if ops is None:
        pytest.skip("the avx2 class's kernels did not build")
    return ops


@pytest.fixture(autouse=True)
def no_forcing(monkeypatch):
    monkeypatch.delenv(kernel_choice.CPU_ISA_ENV, raising=False)
    monkeypatch.delenv(kernel_choice.NO_BF16_ENV, raising=False)


def random_linear(in_features: int, out_features: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(in_features, out_features, generator=gen) * 0.05  # (in, out)
    return weight, torch.randn(out_features, generator=gen)


def product64(x, weight, bias=None):
    y = x.double() @ weight.double()
    return (y if bias is None else y + bias.double()).float()


def test_the_avx2_build_runs_both_panel_kernels_vectorised(avx2_ops):
    # NOTE: before the AVX2 tiles, these were the plain loops (False, (False, False))
    assert avx2_ops.panel_linear_vectorised()
    assert avx2_ops.panel_bf16_vectorised() == (True, False)  # no vdpbf16ps without AVX-512


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("in_features,out_features", SHAPES)
def test_avx2_panels_match_the_reference(avx2_ops, rows, in_features, out_features):
    weight, bias = random_linear(in_features, out_features, seed=in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    fp32 = PanelLinear(weight, bias, avx2_ops)(x)
    torch.testing.assert_close(fp32, product64(x, weight, bias), atol=SLACK, rtol=SLACK)
    rounded = bf16_round(weight)
    bf16 = Bf16PanelLinear(weight, bias, avx2_ops)(x)
    torch.testing.assert_close(bf16, product64(x, rounded, bias), atol=SLACK, rtol=SLACK)
    # the widened bf16 panels: the fp32 panels' sums over the rounded weights, to the bit
    assert torch.equal(bf16, PanelLinear(rounded, bias, avx2_ops)(x))


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_avx2_panels_are_batch_invariant(avx2_ops, kind):
    """A row's output does not depend on its batch or tile, to the last bit."""
    weight, _ = random_linear(576, 96)
    make = PanelLinear if kind == "fp32" else Bf16PanelLinear
    kernel = make(weight, None, avx2_ops)
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(1))
    full = kernel(x)
    alone = torch.cat([kernel(x[i:i + 1]) for i in range(len(x))])
    assert torch.equal(full, alone)
    for rows in (2, 3, 5, 6, 7, 12, 13, 33):
        assert torch.equal(kernel(x[:rows]), full[:rows]), rows
        assert torch.equal(kernel(x[-rows:]), full[-rows:]), rows


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_avx2_panels_give_the_avx512_panels_bits(avx2_ops, cpu_ops, kind):
    """The same sums in the same order as the AVX-512 tiles (panels.h's NOTE): the classes
    differ in speed, not in results."""
    if cpu_ops is avx2_ops or not cpu_ops.panel_linear_vectorised():
        pytest.skip("no AVX-512 build of the panels here to compare with")
    weight, bias = random_linear(95, 200)
    make = PanelLinear if kind == "fp32" else Bf16PanelLinear
    for rows in (1, 2, 5, 13, 64):
        x = torch.randn(rows, 95, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(make(weight, bias, avx2_ops)(x), make(weight, bias, cpu_ops)(x))


def test_the_avx2_class_runs_the_panels(avx2_ops):
    fp32 = kernel_choice.resolve_kernels(quantization="none", cpu_isa="avx2")
    assert (fp32.linear, fp32.cpu_class) == ("panel", "avx2") and fp32.ops is avx2_ops
    bf16 = kernel_choice.resolve_kernels(quantization="bf16", cpu_isa="avx2")
    assert bf16.linear == "bf16_panel" and (bf16.amx_min_rows, bf16.dot_min_rows) == (0, 0)
    assert "bf16 weight panels, fp32 activations" in bf16.describe()
    auto = kernel_choice.resolve_kernels(quantization="auto", cpu_isa="avx2")
    assert (auto.weights, auto.reason, auto.linear) == ("bf16", "auto: avx2 class",
                                                        "bf16_panel")
    # kernels="mkl" still asks for MKL's GEMM
    mkl = kernel_choice.resolve_kernels(kernels="mkl", quantization="none", cpu_isa="avx2")
    assert mkl.linear == ("mkl" if linear_kernels.mkl_packed_available() else "reference")


@pytest.mark.parametrize("quantization", ["none", "bf16"])
def test_the_avx2_class_decodes_through_the_stack_as_the_python_layers(
        avx2_ops, monkeypatch, quantization):
    monkeypatch.setenv(kernel_choice.CPU_ISA_ENV, "avx2")
    engine = tiny_engine(tiny_hf_model("qwen2"), quantization=quantization, block_size=16)
    kernels = engine.runner.kernels
    assert kernels.ops is avx2_ops and kernels.linear in ("panel", "bf16_panel")
    assert engine.runner.model.decode_stack is not None
    decode_only = run_comparing_stack_and_python(engine, random_prompts(5), max_tokens=24)
    assert decode_only >= 15
