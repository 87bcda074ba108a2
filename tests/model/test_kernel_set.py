"""KernelSet (model/kernels.py): resolved once from the config, and quantization="auto"."""

from __future__ import annotations

from dataclasses import replace

import pytest

from slotserve.config import DEFAULT_QUANTIZATION, EngineConfig
from slotserve.model import kernels as kernels_module
from slotserve.model.kernels import (
    NO_BF16_ENV,
    REFERENCE,
    KernelSet,
    cpu_has_avx512_bf16,
    kernels_for,
    resolve_kernels,
)
from slotserve.model.layers import Linear
from slotserve.model.linear_kernels import (
    Bf16PanelLinear,
    bf16_panel_kernel_available,
    panel_kernel_available,
)
from tests.conftest import tiny_engine


def linear_kernels_of(engine) -> set[type]:
    return {type(m.kernel) for m in engine.runner.model.modules() if isinstance(m, Linear)}


def test_the_default_is_auto_and_none_is_fp32():
    assert EngineConfig().quantization == DEFAULT_QUANTIZATION == "auto"
    # None, the fp32 spelling before "auto", still means fp32
    assert EngineConfig(quantization=None) == EngineConfig(quantization="none")
    with pytest.raises(ValueError, match="CPU"):
        EngineConfig(device="cuda", quantization="bf16")
    # auto is no error on CUDA: it resolves to the model's dtype there
    assert resolve_kernels(device="cuda", quantization="auto").weights == "bfloat16"


def test_auto_picks_bf16_where_the_cpu_has_avx512_bf16(tiny_llama, cpu_ops):
    if not (cpu_has_avx512_bf16() and bf16_panel_kernel_available(cpu_ops)):
        pytest.skip("this CPU (or its kernel build) has no AVX512_BF16")
    engine = tiny_engine(tiny_llama, quantization="auto")
    kernels = engine.runner.kernels
    assert (kernels.weights, kernels.reason, kernels.linear) == (
        "bf16", "auto: AVX512_BF16", "bf16_panel")
    assert kernels.describe().startswith("bf16 weights (auto: AVX512_BF16); linears: bf16 ")
    assert linear_kernels_of(engine) == {Bf16PanelLinear}
    assert engine.runner.model.decode_stack is not None


def test_auto_falls_back_to_fp32_when_avx512_bf16_is_forced_off(tiny_llama, cpu_ops,
                                                                monkeypatch):
    monkeypatch.setenv(NO_BF16_ENV, "1")
    assert not cpu_has_avx512_bf16()
    engine = tiny_engine(tiny_llama, quantization="auto")
    kernels = engine.runner.kernels
    assert (kernels.weights, kernels.reason) == ("fp32", "auto: no AVX512_BF16")
    assert kernels.describe().startswith("fp32 weights (auto: no AVX512_BF16); linears: fp32")
    # the same kernels as asking for fp32 (only the reason differs)
    assert replace(kernels, reason="") == replace(resolve_kernels(quantization="none"),
                                                  reason="")
    if panel_kernel_available(cpu_ops):
        assert kernels.linear == "panel"


def test_auto_falls_back_to_fp32_without_the_bf16_kernels(monkeypatch):
    monkeypatch.setattr(kernels_module, "cpu_has_avx512_bf16", lambda: True)
    assert resolve_kernels(kernels="reference", quantization="auto").weights == "fp32"
    assert resolve_kernels(kernels="mkl", quantization="auto").reason == "auto: kernels=mkl"
    monkeypatch.setattr(kernels_module.linear_kernels, "bf16_panel_kernel_available",
                        lambda ops: False)
    resolved = resolve_kernels(quantization="auto")
    assert (resolved.weights, resolved.reason) == (
        "fp32", "auto: the fused bf16 kernels are not built")


def test_the_config_resolves_to_one_kernel_set(cpu_ops):
    config = EngineConfig(quantization="int8")
    assert kernels_for(config) == kernels_for(config)
    assert kernels_for(config).linear == "int8"
    assert kernels_for(EngineConfig(kernels="reference", quantization="none")) == replace(
        REFERENCE, reason="quantization=none")


def test_a_kernel_set_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="linear"):
        KernelSet(linear="int4")
    with pytest.raises(ValueError, match="fused kernels"):
        KernelSet(linear="panel")  # no ops
    with pytest.raises(ValueError, match="fused_layers"):
        KernelSet(linear="reference", ops=object(), decode_stack=True)
