"""quantization="auto" for a GGUF file the user names: the file's own types (issue 31).

A llama.cpp user's Q4_K_M file is served as Q4_K_M, at its size: under auto the engine loads
its quantized linears in their blocks (no fp32 copy, no fp32 cache) and runs the block
kernels, exactly as quantization="gguf" does. The embedded default model (model=None) keeps
its class's default, and a named dtype or kernels="reference" keep theirs.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from slotserve.config import engine_config
from slotserve.engine.llm import LLM
from slotserve.engine.llm_engine import LLMEngine
from slotserve.loader import default_model_path, load_model
from slotserve.loader.gguf_blocks import GGUFBlockTensor
from slotserve.model import linear_kernels
from slotserve.model.kernels import keeps_gguf_blocks
from slotserve.model.layers import Linear
from slotserve.sampling import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.mark.parametrize(("settings", "kept"), [
    (dict(quantization="gguf"), True),
    (dict(quantization="auto"), True),
    (dict(quantization="auto", model=None), False),  # the embedded default: its class's
    (dict(quantization="auto", dtype="float32"), False),  # a named dtype keeps its weights
    (dict(quantization="auto", kernels="reference"), False),
    (dict(quantization="none"), False),
    (dict(quantization="bf16"), False),
    (dict(quantization="int8"), False),
])
def test_which_settings_keep_the_blocks(settings, kept):
    settings = {"model": default_model_path(), **settings}
    assert keeps_gguf_blocks(engine_config(**settings)) is kept


def test_an_hf_directory_under_auto_keeps_no_blocks(tmp_path):
    assert not keeps_gguf_blocks(engine_config(model=str(tmp_path), quantization="auto"))


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Settings of a small engine whose GGUF cache lives in a fresh directory."""
    cache = tmp_path_factory.mktemp("cache")
    return cache, dict(max_num_seqs=4, num_blocks=64)


def test_auto_on_a_named_gguf_serves_its_blocks_as_gguf_does(small, cpu_ops, monkeypatch):
    if not linear_kernels.gguf_block_kernel_available(cpu_ops):
        pytest.skip("no vectorised GGUF block kernel on this CPU")
    cache, settings = small
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(cache))
    path = default_model_path()
    auto = LLM(path, quantization="auto", **settings)
    kernels = auto.engine.runner.kernels
    assert kernels.weights == "gguf" and "Q4_1" in kernels.gguf_types
    assert "quantization=auto: the file's own types" in kernels.reason
    assert not any(os.scandir(cache)), "a quantized GGUF under auto wrote an fp32 cache"
    explicit = LLM(path, quantization="gguf", **settings)
    assert _greedy(auto) == _greedy(explicit)
    auto.engine.check_integrity()


def test_auto_on_the_default_model_keeps_the_class_default(small, cpu_ops):
    _, settings = small
    kernels = LLM(quantization="auto", **settings).engine.runner.kernels
    assert kernels.weights != "gguf" and kernels.reason.startswith("auto:")
    named = dataclasses.replace(engine_config(quantization="auto", **settings),
                                model=default_model_path(), dtype="float32")
    assert not keeps_gguf_blocks(named)


@pytest.mark.parametrize("quantization", ["none", "bf16", "int8"])
def test_other_quantizations_read_the_blocks_one_weight_at_a_time(quantization, small,
                                                                  tmp_path, monkeypatch):
    """A quantized GGUF under none/bf16/int8: its blocks are read and each weight
    dequantized as the model loads it (KernelSet.prepare_weight) but the embedding table,
    looked up in its blocks: no fp32 cache is written, and the engine is the one built from
    the whole file converted to fp32 (the same values: the same tokens)."""
    _, settings = small
    monkeypatch.setenv("SLOTSERVE_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    lazy = LLM(path, quantization=quantization, **settings)
    assert lazy.engine.runner.kernels.weights != "gguf"
    assert not any(os.scandir(tmp_path)), f"{quantization} wrote an fp32 cache"
    # the table's tokens looked up in its blocks: the fp32 table's rows, at the blocks' size
    assert isinstance(lazy.engine.runner.model.embed_tokens, linear_kernels.BlockEmbedding)
    whole = load_model(path, use_cache=False)
    assert not any(isinstance(w, GGUFBlockTensor) for w in whole.weights.values())
    config = engine_config(path, quantization=quantization, **settings)
    eager = LLM(engine=LLMEngine(config, whole.config, whole.weights, whole.tokenizer))
    pairs = list(zip(_kernels(lazy), _kernels(eager), strict=True))
    assert len(pairs) == 30 * 4 + 1  # every linear of SmolLM2's 30 layers, and the head
    for a, b in pairs:
        assert type(a) is type(b)
        for name, value in vars(a).items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, getattr(b, name)), (type(a).__name__, name)
    assert _greedy(lazy) == _greedy(eager)
    lazy.engine.check_integrity()


def _kernels(llm: LLM) -> list:
    return [m.kernel for m in llm.engine.runner.model.modules()
            if isinstance(m, Linear) and m.kernel is not None]
