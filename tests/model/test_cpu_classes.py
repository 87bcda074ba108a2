"""CPU classes (model/kernels.py): detected from the CPU's flags, forced down by
SLOTSERVE_CPU_ISA, and each class's linear kernels against the plain torch reference on
this machine (every class at or below this CPU's; the avx2 class in a build of its own,
without AVX-512: its first run compiles it).

Tolerances as tests/model/test_bf16_kernels.py's: fp32 sums (1e-5) over the values each
kernel multiplies (bf16-rounded weights, and x rounded to bf16 where vdpbf16ps or AMX runs);
int8 against its own dequantized weights (int16 activations: 1e-3).
"""

from __future__ import annotations

import pytest
import torch

from slotserve.model import linear_kernels
from slotserve.model.kernels import (
    CPU_CLASSES,
    CPU_ISA_ENV,
    NO_BF16_ENV,
    _cpu_flags,
    cpu_class,
    detect_cpu_class,
    resolve_kernels,
)
from slotserve.model.linear_kernels import bf16_round
from tests.conftest import random_prompts, tiny_engine, tiny_hf_model
from tests.model.test_decode_stack import run_comparing_stack_and_python

FP32_SLACK = 1e-5
# The classes this machine can run (generic left out: a build of its own, no kernel of its
# own to test: the avx2 class's choices without AVX2's autovectorisation).
HERE = detect_cpu_class(_cpu_flags())
RUNNABLE = list(CPU_CLASSES[1:CPU_CLASSES.index(HERE) + 1])
AVX512 = ["avx512f", "avx512bw"]


@pytest.fixture(autouse=True)
def no_forcing(monkeypatch):
    """Each test starts from the CPU's own class (the variables unset)."""
    monkeypatch.delenv(CPU_ISA_ENV, raising=False)
    monkeypatch.delenv(NO_BF16_ENV, raising=False)


@pytest.mark.parametrize("flags,expected", [
    ([], "generic"),
    (["avx2"], "generic"),  # FMA missing
    (["avx2", "fma"], "avx2"),
    (["avx2", "fma", "avx512f"], "avx2"),  # BW missing (the int8 kernel's)
    (["avx2", "fma", *AVX512], "avx512"),
    (["avx2", "fma", *AVX512, "avx512_bf16"], "avx512bf16"),
    (["avx2", "fma", *AVX512, "avx512_bf16", "amx_bf16", "amx_tile"], "amx"),
    (["avx2", "fma", *AVX512, "amx_bf16", "amx_tile"], "avx512"),  # no AVX512_BF16
])
def test_the_class_is_the_highest_whose_flags_the_cpu_lists(flags, expected):
    assert detect_cpu_class(frozenset(flags)) == expected


def test_the_variable_forces_a_class_down_and_names_itself(monkeypatch):
    assert cpu_class().name == HERE and cpu_class().reason == "from the CPU's flags"
    monkeypatch.setenv(CPU_ISA_ENV, "generic")
    forced = cpu_class()
    assert forced.name == "generic" and forced.reason.startswith(f"{CPU_ISA_ENV}=generic")
    monkeypatch.setenv(CPU_ISA_ENV, HERE.upper())  # the CPU's own, any case
    assert cpu_class().reason == f"{CPU_ISA_ENV}={HERE}, the CPU's own"
    monkeypatch.setenv(CPU_ISA_ENV, "avx-9000")
    with pytest.raises(ValueError, match=f"{CPU_ISA_ENV}='avx-9000': must be one of"):
        cpu_class()


@pytest.mark.parametrize("above", ["amx", "avx512bf16", "avx512"])
def test_a_class_above_the_cpus_is_an_error(monkeypatch, above):
    # a CPU of class avx2 (whatever this one is)
    monkeypatch.setattr("slotserve.model.kernels._cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setenv(CPU_ISA_ENV, above)
    with pytest.raises(ValueError, match=f"{CPU_ISA_ENV}={above}: this CPU is of class avx2"):
        resolve_kernels(quantization="auto")


def test_an_engine_refuses_an_unavailable_class(tiny_llama, monkeypatch):
    if HERE == "amx":
        pytest.skip("no class above amx")
    monkeypatch.setenv(CPU_ISA_ENV, "amx")
    with pytest.raises(ValueError, match=f"{CPU_ISA_ENV}=amx"):
        tiny_engine(tiny_llama, quantization="auto")


def test_the_older_no_bf16_switch_is_the_avx512_class(monkeypatch):
    monkeypatch.setenv(NO_BF16_ENV, "1")
    expected = "avx512" if HERE in ("avx512bf16", "amx") else HERE
    assert cpu_class().name == expected


# What each class runs (resolve_kernels with the class forced), by quantization.
EXPECTED_LINEARS = {
    "avx2": {"none": "panel", "bf16": "bf16_panel", "int8": "int8"},
    "avx512": {"none": "panel", "bf16": "bf16_panel", "int8": "int8"},
    "avx512bf16": {"none": "panel", "bf16": "bf16_panel", "int8": "int8"},
    "amx": {"none": "panel", "bf16": "bf16_panel", "int8": "int8"},
}


def class_kernels(cpu: str, quantization: str):
    kernels = resolve_kernels(quantization=quantization, cpu_isa=cpu)
    assert kernels.ops is not None, "the fused kernels did not build for this class"
    return kernels


@pytest.mark.parametrize("cpu", RUNNABLE)
@pytest.mark.parametrize("quantization", ["none", "bf16", "int8"])
def test_each_class_resolves_to_its_kernels_and_says_so(cpu, quantization):
    kernels = class_kernels(cpu, quantization)
    assert kernels.linear == EXPECTED_LINEARS[cpu][quantization]
    assert kernels.cpu_class == cpu
    assert kernels.describe().endswith(f"; CPU class {cpu} ({kernels.cpu_reason})")
    many_rows = (kernels.amx_min_rows, kernels.dot_min_rows)
    if quantization != "bf16" or cpu in ("avx2", "avx512"):
        assert many_rows == (0, 0)
    elif cpu == "avx512bf16":
        assert many_rows == (0, linear_kernels.BF16_DOT_MIN_ROWS)
        assert "vdpbf16ps" in kernels.describe()
    else:  # amx: the tiles where the OS grants them, else vdpbf16ps
        assert many_rows in ((linear_kernels.BF16_AMX_MIN_ROWS, 0),
                             (0, linear_kernels.BF16_DOT_MIN_ROWS))


def product64(x, weight, bias=None):
    y = x.double() @ weight.double()
    return (y if bias is None else y + bias.double()).float()


def class_linear(cpu: str, quantization: str, weight, bias):
    kernels = class_kernels(cpu, quantization)
    return kernels, kernels.linear_factory()(weight, bias)


def expected_output(kernels, kernel, x, weight, bias):
    """The plain product over what the kernel multiplies, and its tolerance."""
    rows = x.shape[0]
    if kernels.weights == "int8":
        return product64(x, kernel.dequantized(), bias), 1e-3
    if kernels.weights == "fp32":
        return product64(x, weight, bias), FP32_SLACK
    rounds_x = (0 < kernels.dot_min_rows <= rows or
                (0 < kernels.amx_min_rows <= rows and kernels.ops.amx_bf16_usable()))
    return product64(x.bfloat16().float() if rounds_x else x, bf16_round(weight), bias), \
        FP32_SLACK


@pytest.mark.parametrize("cpu", RUNNABLE)
@pytest.mark.parametrize("quantization", ["none", "bf16", "int8"])
@pytest.mark.parametrize("rows", [1, 5, 16, 64])
def test_each_class_matches_the_torch_reference(cpu, quantization, rows):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(95, 200, generator=gen) * 0.05  # odd inputs, a part-filled panel
    bias = torch.randn(200, generator=gen)
    x = torch.randn(rows, 95, generator=gen)
    kernels, kernel = class_linear(cpu, quantization, weight, bias)
    expected, tolerance = expected_output(kernels, kernel, x, weight, bias)
    torch.testing.assert_close(kernel(x), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("cpu", RUNNABLE)
@pytest.mark.parametrize("quantization", ["none", "bf16", "int8"])
def test_each_class_is_batch_invariant(cpu, quantization):
    """A row's result does not depend on its batch, bit for bit: within a mode (AMX from
    its threshold on), and at every size where the class has no threshold."""
    kernels, kernel = class_linear(cpu, quantization, torch.randn(576, 96) * 0.05, None)
    if kernels.linear in ("mkl", "bf16_rounded"):  # the avx2 class's fp32 and bf16 linears
        pytest.skip("MKL's GEMM (also torch's matmul) blocks by the batch's size")
    x = torch.randn(64, 576, generator=torch.Generator().manual_seed(1))
    full = kernel(x)
    lowest = max(kernels.amx_min_rows, kernels.dot_min_rows, 1)
    for rows in sorted({lowest, lowest + 1, 5, 12, 13, 33}):
        if rows >= lowest:
            assert torch.equal(kernel(x[:rows]), full[:rows]), rows
            assert torch.equal(kernel(x[-rows:]), full[-rows:]), rows


@pytest.mark.parametrize("dot_min_rows", [1, 3])  # 3: decode batches below and above it
def test_the_decode_stack_runs_vdpbf16ps_as_the_python_layers(cpu_ops, monkeypatch,
                                                              dot_min_rows):
    if not cpu_ops.panel_bf16_vectorised()[1]:
        pytest.skip("no AVX512_BF16 here")
    monkeypatch.setattr(linear_kernels, "BF16_DOT_MIN_ROWS", dot_min_rows)
    monkeypatch.setenv(CPU_ISA_ENV, "avx512bf16")
    engine = tiny_engine(tiny_hf_model("qwen2"), quantization="bf16", block_size=16)
    assert engine.runner.kernels.dot_min_rows == dot_min_rows
    assert engine.runner.model.decode_stack is not None
    decode_only = run_comparing_stack_and_python(engine, random_prompts(5), max_tokens=24)
    assert decode_only >= 15


def test_the_dot_threshold_and_amx_exclude_each_other(cpu_ops):
    with pytest.raises(ValueError, match="at most one"):
        linear_kernels.Bf16PanelLinear(torch.randn(8, 32), None, cpu_ops, amx_min_rows=16,
                                       dot_min_rows=1)
