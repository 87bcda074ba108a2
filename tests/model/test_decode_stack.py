"""The C++ DecodeStack (csrc/decode_stack.cpp) equals the model's Python layers on the same kernels.

It runs the decoder layers of all-decode iterations in one call; whole models against HF
(through the stack) are in test_vs_hf.py.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from slotserve import SamplingParams
from slotserve.model import linear_kernels
from tests.conftest import random_prompts, tiny_engine, tiny_hf_model


def run_comparing_stack_and_python(engine, prompts, max_tokens: int) -> int:
    """Run the engine; every forward runs twice, Python layers then stack, and must agree.

    Returns how many forwards were all-decode (those the stack runs).
    """
    model = engine.runner.model
    stack, forward = model.decode_stack, model.forward
    decode_only_forwards = 0

    def both(input_ids, positions, kv_caches, meta):
        nonlocal decode_only_forwards
        model.decode_stack = None
        expected = forward(input_ids, positions, kv_caches, meta)
        model.decode_stack = stack  # writes the same K/V to the same slots again
        got = forward(input_ids, positions, kv_caches, meta)
        assert torch.equal(got, expected)
        decode_only_forwards += meta.decode_only
        return got

    model.forward = both
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    return decode_only_forwards


@pytest.mark.parametrize("kind,quantization,linears", [
    ("llama", None, "auto"),   # fp32 weight panels (the default on CPUs with AVX-512)
    ("qwen2", None, "auto"),   # qkv bias, added after the panel kernel
    ("llama", None, "mkl"),    # fp32, MKL's packed GEMM
    ("qwen2", None, "mkl"),    # qkv bias, passed to MKL's op
    ("qwen2", None, "plain"),  # no MKL: plain torch.mm / addmm
    ("qwen2", "int8", "auto"),  # the fused int8 kernel, bias added after
])
def test_stack_equals_python_layers_bit_for_bit(cpu_ops, monkeypatch, kind, quantization,
                                                linears):
    if linears == "plain":
        monkeypatch.setattr(linear_kernels, "mkl_packed_available", lambda: False)
    engine = tiny_engine(tiny_hf_model(kind), quantization=quantization, block_size=16,
                         kernels="auto" if linears == "auto" else "mkl")
    assert engine.runner.model.decode_stack is not None

    # contexts of 3-70 tokens growing by 24: tables of 1 to 6 blocks, crossing block ends
    decode_only = run_comparing_stack_and_python(engine, random_prompts(5), max_tokens=24)

    assert decode_only >= 15


def test_stack_follows_the_kernel_choice(cpu_ops):
    hf = tiny_hf_model()
    fused, reference = tiny_engine(hf), tiny_engine(hf, kernels="reference")
    assert reference.runner.model.decode_stack is None
    assert fused.runner.model.decode_stack is not None
    # a KernelSet without the stack (benchmarks/fused_ops.py's "python layers")...
    no_stack = replace(fused.runner.kernels, decode_stack=False)
    python_layers = tiny_engine(hf, kernel_set=no_stack).runner.model
    assert python_layers.decode_stack is None and python_layers.layers[0].mlp.ops is cpu_ops
    # ...and without the fused layer ops ("torch ops"): the linears keep their kernel
    torch_ops = tiny_engine(hf, kernel_set=replace(no_stack, fused_layers=False)).runner
    assert torch_ops.model.decode_stack is None and torch_ops.model.layers[0].mlp.ops is None
    assert not torch_ops.fused_cpu_ops and torch_ops.kernels.linear == fused.runner.kernels.linear


def test_linear_weights_reject_bad_kinds(cpu_ops):
    with pytest.raises(RuntimeError, match="plain, mkl, int8 or panel"):
        cpu_ops.linear_weights("fp8", torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match="needs out_features"):
        cpu_ops.linear_weights("panel", cpu_ops.pack_panels(torch.zeros(2, 2)))
    with pytest.raises(RuntimeError, match="needs its second tensor"):
        cpu_ops.linear_weights("int8", torch.zeros(2, 2, dtype=torch.int8))
