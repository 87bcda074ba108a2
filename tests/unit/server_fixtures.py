"""A tiny text model for the server's tests: a byte-level BPE tokenizer (built with the
`tokenizers` library, vocabulary inside the tiny model's 512 rows) on the tiny random Llama;
and the in-process server the tests share: an AsyncEngine running (`started`), and a
TestClient of its app (`app_client`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fastapi.testclient import TestClient
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from slotserve.config import ModelConfig, engine_config
from slotserve.engine.async_engine import AsyncEngine
from slotserve.engine.llm_engine import LLMEngine
from slotserve.loader import Tokenizer
from slotserve.server.api import build_app

SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
# A ChatML template that writes BOS itself, as many Llama-family templates do.
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                "{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, how are you today?",
          "name three colours: red, green and blue", "once upon a time there was a server"]


def tiny_tokenizer(add_bos_token: bool = True, template: str = BOS_TEMPLATE) -> Tokenizer:
    """A BOS-adding byte-level BPE tokenizer (ids < 300) with a `{{ bos_token }}` template."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS * 10, trainer)
    assert backend.get_vocab_size() <= 512
    return Tokenizer(backend, bos_token_id=backend.token_to_id("<s>"),
                     eos_token_ids=[backend.token_to_id("</s>")], add_bos_token=add_bos_token,
                     chat_template=template)


def text_engine(hf_model, tokenizer: Tokenizer | None = None, **kwargs) -> LLMEngine:
    """An LLMEngine on the tiny HF model's weights with `tokenizer` (default tiny_tokenizer).

    NOTE: fp32 weights unless asked otherwise: outputs are compared across paths.
    """
    cfg = ModelConfig.from_hf_dict(hf_model.config.to_dict())
    weights = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    kwargs.setdefault("max_model_len", 512)
    kwargs.setdefault("quantization", "none")
    return LLMEngine(engine_config(**kwargs), cfg, weights,
                     tokenizer=tokenizer or tiny_tokenizer())


@contextmanager
def started(engine: AsyncEngine) -> Iterator[AsyncEngine]:
    """The AsyncEngine with its loop running; stopped when the block ends."""
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


@contextmanager
def app_client(engine: AsyncEngine, **app_kwargs) -> Iterator[TestClient]:
    """A TestClient of build_app(engine, "tiny", **app_kwargs), its lifespan running and the
    engine `started` around it; a server error comes back as a 500, not an exception."""
    with started(engine), TestClient(build_app(engine, "tiny", **app_kwargs),
                                     raise_server_exceptions=False) as client:
        yield client
