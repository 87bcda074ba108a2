"""quantization="int8" leaves the lm_head in bf16 (model/kernels.py's HEAD_UNDER_INT8), as
vLLM's quantization methods leave it unquantized: every other linear is int8, the head
multiplies by the bf16-rounded weights, and the start-up line says so."""

from __future__ import annotations

import pytest
import torch

from slotserve.model import linear_kernels as lk
from slotserve.model.kernels import KernelSet, resolve_kernels
from slotserve.model.layers import Linear
from tests.conftest import tiny_engine


@pytest.mark.parametrize("quantization, head", [("none", ""), ("bf16", ""), ("auto", "")])
def test_only_int8_gives_the_head_its_own_kernel(quantization, head):
    assert resolve_kernels(quantization=quantization).head_linear == head


def test_int8_head_is_bf16_and_said_so():
    fused = resolve_kernels(quantization="int8")
    reference = resolve_kernels(kernels="reference", quantization="int8")
    assert reference.linear == "int8_torch" and reference.head_linear == "bf16_rounded"
    assert fused.head_linear in ("bf16_panel", "bf16_rounded")
    for kernels in (fused, reference):
        assert "; lm_head: bf16" in kernels.describe_linears()
        assert kernels.describe().startswith("int8 weights")


def test_an_unknown_head_kernel_is_refused():
    with pytest.raises(ValueError, match="head_linear"):
        KernelSet(head_linear="int4")


@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_int8_model_runs_a_bf16_head_over_int8_layers(tiny_llama_tied, kernels):
    engine = tiny_engine(tiny_llama_tied, quantization="int8", kernels=kernels)
    model = engine.runner.model
    linears = {name: m.kernel for name, m in model.named_modules() if isinstance(m, Linear)}
    head = linears.pop("lm_head")
    assert isinstance(head, (lk.Bf16PanelLinear, lk.Bf16RoundedLinear))
    assert linears and all(isinstance(k, lk.Int8WeightOnlyLinear) for k in linears.values())
    # The head's logits: the hidden states times the bf16-rounded (tied) embedding.
    embed = tiny_llama_tied.get_input_embeddings().weight.detach()  # (V, H)
    hidden = torch.randn(3, embed.shape[1])
    want = hidden.double() @ lk.bf16_round(embed).double().t()
    got = model.compute_logits(hidden)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-4)
    # ...not the int8-rounded one (the two differ by more than the tolerance above).
    int8_head = lk.Int8WeightOnlyLinear(embed.t().contiguous(), None)
    assert (hidden @ int8_head.dequantized() - got).abs().max() > 1e-3
