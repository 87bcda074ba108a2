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


def test_stack_checks_a_step_before_writing_anything(cpu_ops):
    """The layers run on raw pointers: the stack checks token ids, positions, slots, tables
    and caches on entry."""
    engine = tiny_engine(tiny_hf_model(), block_size=16)
    model, caches = engine.runner.model, engine.runner.kv_caches
    flat = [cache for kv_cache in caches for cache in kv_cache]
    num_slots = flat[0].shape[0] * flat[0].shape[1]
    vocab, max_positions = model.config.vocab_size, model.rotary.cos.shape[0]
    before = [cache.clone() for cache in flat]

    def forward(slots, tables, lens, kv=flat, ids=(5,), positions=(3,)):
        return model.decode_stack.forward(torch.tensor(ids), torch.tensor(positions), kv,
                                          torch.tensor(slots), torch.tensor(tables),
                                          torch.tensor(lens))

    with pytest.raises(RuntimeError, match="slot out of range"):
        forward([num_slots], [[0]], [4])
    with pytest.raises(RuntimeError, match="block id out of range"):
        forward([3], [[flat[0].shape[0]]], [4])
    with pytest.raises(RuntimeError, match="bad context length"):
        forward([3], [[0]], [17])
    with pytest.raises(RuntimeError, match="one k and one v cache per layer"):
        forward([3], [[0]], [4], kv=flat[:-1])
    for bad_id in (-1, vocab):
        with pytest.raises(RuntimeError, match=f"token id out of range: {bad_id}"):
            forward([3], [[0]], [4], ids=(bad_id,))
    for bad_position in (-1, max_positions):
        with pytest.raises(RuntimeError, match=f"position out of range: {bad_position}"):
            forward([3], [[0]], [4], positions=(bad_position,))
    with pytest.raises(RuntimeError, match="input_ids and positions must be"):
        forward([3], [[0]], [4], positions=(3, 4))
    assert all(torch.equal(a, b) for a, b in zip(flat, before))
    # the same step, checked, runs
    assert forward([3], [[0]], [4]).shape == (1, model.config.hidden_size)


def test_stack_rejects_layers_of_the_wrong_shape(cpu_ops):
    hidden, heads, kv_heads, head_dim = 8, 2, 1, 4
    stack = cpu_ops.DecodeStack(heads, kv_heads, head_dim, 1e-6, 0.5, torch.ones(hidden))
    linear = lambda i, o: cpu_ops.linear_weights("panel", cpu_ops.pack_panels(torch.zeros(o, i)),
                                                out_features=o)
    qkv, o, gate_up = linear(hidden, 16), linear(8, hidden), linear(hidden, 12)
    with pytest.raises(RuntimeError, match="takes 5 inputs, not 6"):
        stack.add_layer(torch.ones(hidden), torch.ones(hidden), qkv, o, gate_up, linear(5, hidden))
    with pytest.raises(RuntimeError, match="gives 12 outputs where 16 are needed"):
        stack.add_layer(torch.ones(hidden), torch.ones(hidden), gate_up, o, gate_up,
                        linear(6, hidden))
    stack.add_layer(torch.ones(hidden), torch.ones(hidden), qkv, o, gate_up, linear(6, hidden))
    one = torch.tensor([0])
    with pytest.raises(RuntimeError, match="set_lookup_tables first"):
        stack.forward(one, one, [], one, one.view(1, 1), one + 1)
    with pytest.raises(RuntimeError, match=r"embedding must be \(V, H\)"):
        stack.set_lookup_tables(torch.zeros(10, hidden + 1), torch.zeros(5, 2), torch.zeros(5, 2))
    with pytest.raises(RuntimeError, match=r"cos and sin must be \(max positions, hd/2\)"):
        stack.set_lookup_tables(torch.zeros(10, hidden), torch.zeros(5, 2), torch.zeros(6, 2))
    many = cpu_ops.DecodeStack(257, 1, 2, 1e-6, 0.5, torch.ones(hidden))  # attention's bound
    with pytest.raises(RuntimeError, match="at most 256"):
        many.add_layer(torch.ones(hidden), torch.ones(hidden), linear(hidden, 518),
                       linear(514, hidden), gate_up, linear(6, hidden))
