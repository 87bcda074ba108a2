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
    cpu_class,
    cpu_has_avx512_bf16,
    kernels_for,
    resolve_kernels,
)
from slotserve.model.layers import Linear
from slotserve.model.linear_kernels import (
    Bf16PanelLinear,
    bf16_panel_kernel_available,
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
    reason = f"auto: {kernels.cpu_class} class"  # amx or avx512bf16
    assert (kernels.weights, kernels.reason, kernels.linear) == ("bf16", reason, "bf16_panel")
    assert kernels.describe().startswith(f"bf16 weights ({reason}); linears: bf16 ")
    assert linear_kernels_of(engine) == {Bf16PanelLinear}
    assert engine.runner.model.decode_stack is not None


def test_avx512_bf16_forced_off_widens_bf16_weights(tiny_llama, cpu_ops, monkeypatch):
    """The older switch is the avx512 class: bf16 weights widened, no vdpbf16ps / AMX."""
    if not (cpu_has_avx512_bf16() and bf16_panel_kernel_available(cpu_ops)):
        pytest.skip("this CPU (or its kernel build) has no AVX512_BF16")
    monkeypatch.setenv(NO_BF16_ENV, "1")
    assert not cpu_has_avx512_bf16()
    engine = tiny_engine(tiny_llama, quantization="auto")
    kernels = engine.runner.kernels
    assert (kernels.weights, kernels.reason, kernels.cpu_class) == (
        "bf16", "auto: avx512 class", "avx512")
    assert (kernels.amx_min_rows, kernels.dot_min_rows) == (0, 0)
    assert kernels.describe().startswith("bf16 weights (auto: avx512 class); linears: bf16 "
                                         "weight panels, fp32 activations (fused")


def test_auto_is_fp32_on_the_avx2_class_without_the_kernels(monkeypatch):
    monkeypatch.setattr(kernels_module, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    kernels = resolve_kernels(kernels="reference", quantization="auto")
    assert (kernels.weights, kernels.reason) == ("fp32", "auto: kernels=reference")
    monkeypatch.setattr(kernels_module.cpu_ops, "load_cpu_ops", lambda march: None)
    kernels = resolve_kernels(quantization="auto")
    # NOTE: with its kernels built the avx2 class's auto is bf16 (tests/model/test_avx2_panels.py)
    assert (kernels.weights, kernels.reason, kernels.cpu_class) == (
        "fp32", "auto: the fused bf16 kernels are not built", "avx2")
    # the same kernels as asking for fp32 (only the reason differs)
    assert replace(kernels, reason="") == replace(resolve_kernels(quantization="none"),
                                                  reason="")


def test_auto_falls_back_to_fp32_without_the_bf16_kernels(monkeypatch):
    monkeypatch.setattr(kernels_module, "_cpu_flags", lambda: frozenset(
        {"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"}))
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
    cpu = cpu_class()
    assert kernels_for(EngineConfig(kernels="reference", quantization="none")) == replace(
        REFERENCE, reason="quantization=none", cpu_class=cpu.name, cpu_reason=cpu.reason)


def test_a_kernel_set_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="linear"):
        KernelSet(linear="int4")
    with pytest.raises(ValueError, match="fused kernels"):
        KernelSet(linear="panel")  # no ops
    with pytest.raises(ValueError, match="fused_layers"):
        KernelSet(linear="reference", ops=object(), decode_stack=True)
