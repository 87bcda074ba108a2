"""Fixtures of the structured-output tests: the embedded SmolLM2's tokenizer (loaded once per
session), a grammar compiler over it, and a tiny random-weight Llama with SmolLM2's
vocabulary (grammars need a real tokenizer; a 135M forward per token does not)."""

from __future__ import annotations

import pytest

from slotserve.config import ModelConfig
from tests.conftest import tiny_hf_model

SMOLLM2_VOCAB = 49152  # the embedded SmolLM2's vocabulary size


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded SmolLM2's tokenizer. NOTE: shared by every module: never changed."""
    from slotserve.loader import load_model

    return load_model().tokenizer


@pytest.fixture(scope="module")
def compiler(tokenizer):
    """A GrammarCompiler over the tokenizer, one per module (its cache is the module's)."""
    from slotserve.structured.grammar import GrammarCompiler

    return GrammarCompiler(tokenizer, SMOLLM2_VOCAB, tuple(tokenizer.eos_token_ids))


@pytest.fixture(scope="module")
def smollm2_vocab_model(tokenizer):
    """(ModelConfig, weights, tokenizer): a tiny random Llama with SmolLM2's vocabulary and
    tokenizer; engines built on it share the weights (they never change them)."""
    hf = tiny_hf_model("llama")
    hf.resize_token_embeddings(SMOLLM2_VOCAB)
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return cfg, weights, tokenizer
