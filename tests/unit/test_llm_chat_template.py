"""The offline LLM.chat takes a chat template and template variables, as vLLM's LLM.chat."""

from __future__ import annotations

import pytest

from slotserve import SamplingParams
from slotserve.config import engine_config
from slotserve.engine.llm import LLM
from slotserve.engine.llm_engine import LLMEngine

# NOTE: smollm2_vocab_model: tests/unit/conftest.py's (SmolLM2's tokenizer, a tiny model).
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}{% if think %}<think>{% else %}<answer>{% endif %}"
            "{% endif %}")
PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def llm(smollm2_vocab_model):
    cfg, weights, tokenizer = smollm2_vocab_model
    engine = LLMEngine(engine_config(quantization="none", max_model_len=256, num_blocks=64),
                       cfg, weights, tokenizer)
    return LLM(engine=engine)


def test_a_template_and_its_variables_make_the_prompt(llm):
    tokenizer = llm.tokenizer
    for think, tail in ((True, "<think>"), (False, "<answer>")):
        out = llm.chat(CHAT, PARAMS, chat_template=TEMPLATE,
                       chat_template_kwargs={"think": think})[0]
        assert out.prompt_token_ids == tokenizer.encode(f"<user>Hi{tail}",
                                                        add_special_tokens=False)


def test_the_model_template_is_the_default(llm):
    out = llm.chat(CHAT, PARAMS)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode_chat(CHAT)


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "chat_template"])
def test_a_variable_llm_chat_sets_itself_is_refused_naming_the_field(llm, key):
    with pytest.raises(ValueError, match="chat_template_kwargs"):
        llm.chat(CHAT, PARAMS, chat_template_kwargs={key: 1})
