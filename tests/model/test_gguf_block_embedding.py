"""The token embedding of a GGUF served in its blocks is looked up in them (issue 31).

Under quantization=gguf the embedding table is never made fp32: a token's row is
dequantized from the packed blocks (the tied LM head's own, or the table's) when looked up,
by the Python model and by the C++ decode stack. A row is bit-equal to what the fp32 table
held before (BlockWeights.dequantize), so the model's outputs do not change.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from slotserve.config import engine_config
from slotserve.engine.llm_engine import LLMEngine
from slotserve.loader import default_model_path, load_model
from slotserve.loader.gguf_blocks import BLOCK_FORMATS, to_blocks
from slotserve.model.layers import Linear
from slotserve.model.linear_kernels import (
    BlockEmbedding,
    GGUFBlockLinear,
    SegmentedLinear,
)
from slotserve.model.llama import LlamaForCausalLM
from slotserve.sampling import SamplingParams
from tests.model.test_gguf_quant import raw_tensor

Q = GGMLQuantizationType


@pytest.mark.parametrize("qtype", list(BLOCK_FORMATS), ids=lambda q: q.name)
def test_rows_are_the_dequantized_table_to_the_bit(block_ops, qtype):
    rows, cols = 40, 512  # 40: the last panel of 16 rows is partly filled
    blocks = to_blocks(raw_tensor(qtype, rows, cols, seed=3), qtype, "token_embd.weight", "t")
    kernel = GGUFBlockLinear(blocks, None, block_ops)
    ids = torch.tensor([0, 39, 15, 16, 17, 31, 32, 5, 5])
    assert torch.equal(kernel.rows(ids), blocks.dequantize()[ids])
    assert kernel.rows(torch.tensor([], dtype=torch.int64)).shape == (0, cols)


def test_a_row_outside_the_table_is_refused(block_ops):
    blocks = to_blocks(raw_tensor(Q.Q8_0, 16, 64), Q.Q8_0, "token_embd.weight", "t")
    kernel = GGUFBlockLinear(blocks, None, block_ops)
    for bad in (16, -1):
        with pytest.raises(RuntimeError, match="outside"):
            kernel.rows(torch.tensor([bad]))


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = list(output.token_ids)
    engine.check_integrity()
    return [done[str(i)] for i in range(len(prompts))]


def test_the_default_model_looks_up_in_the_tied_heads_blocks(block_ops, monkeypatch):
    """SmolLM2 (tied, Q8_0 table): the embedding shares the LM head's kernel, and greedy
    tokens (prefill in Python, decodes on the stack) equal those of the fp32 table."""
    loaded = load_model(default_model_path(), keep_quantized=True)
    settings = engine_config(quantization="gguf", max_num_seqs=4, num_blocks=64)
    engine = LLMEngine(settings, loaded.config, loaded.weights, loaded.tokenizer)
    model = engine.runner.model
    assert isinstance(model.embed_tokens, BlockEmbedding)
    assert model.embed_tokens.kernel is model.lm_head.kernel
    assert model.decode_stack is not None
    prompts = [loaded.tokenizer.encode(text) for text in ("The capital of France is",
                                                          "def fibonacci(n):")]
    ours = _greedy(engine, prompts)
    monkeypatch.setattr(LlamaForCausalLM, "_looks_up_in_blocks", lambda self, table: False)
    again = load_model(default_model_path(), keep_quantized=True)
    table = LLMEngine(settings, again.config, again.weights, again.tokenizer)
    assert isinstance(table.runner.model.embed_tokens, torch.nn.Embedding)
    assert _greedy(table, prompts) == ours


def test_an_untied_table_gets_a_kernel_of_its_own(block_ops, tmp_path):
    """A tiny untied llama GGUF with a Q8_0 table and Q4_0 linears: the table stays in its
    blocks (its own kernel, not the head's) and the model's greedy tokens equal HF's-path
    reference with the fp32 table."""
    from tests.model.test_loader import tiny_hf, write_tiny_gguf

    path = tmp_path / "untied.gguf"
    write_tiny_gguf(path, tiny_hf("llama", tied=False, seed=5), "llama", [Q.Q8_0, Q.Q4_0])
    loaded = load_model(str(path), keep_quantized=True, use_cache=False)
    settings = engine_config(quantization="gguf", max_num_seqs=2, num_blocks=32,
                             block_size=8)
    engine = LLMEngine(settings, loaded.config, loaded.weights, loaded.tokenizer)
    model = engine.runner.model
    assert not loaded.config.tie_word_embeddings
    assert isinstance(model.embed_tokens, BlockEmbedding)
    assert model.embed_tokens.kernel is not model.lm_head.kernel
    assert all(isinstance(m.kernel, (GGUFBlockLinear, SegmentedLinear)) for m in model.modules()
               if isinstance(m, Linear))
    reference = load_model(str(path), use_cache=False)  # fp32, the table as it dequantizes
    ids = torch.arange(loaded.config.vocab_size)
    assert torch.equal(model.embed_tokens(ids), reference.weights["model.embed_tokens.weight"])
    prompts = [[258, 5, 77, 140, 33], [258, 200, 201]]
    fp32_table = LLMEngine(settings, *_with_fp32_table(loaded, reference))
    assert _greedy(engine, prompts) == _greedy(fp32_table, prompts)


def _with_fp32_table(blocks_model, fp32_model):
    """The blocks model's config, weights and tokenizer, its table replaced by fp32 values."""
    weights = dict(blocks_model.weights)
    weights["model.embed_tokens.weight"] = fp32_model.weights["model.embed_tokens.weight"]
    return blocks_model.config, weights, blocks_model.tokenizer
