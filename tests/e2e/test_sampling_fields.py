"""Penalties and logit shaping end to end (issue 34, items 1, 2, 6): the official `openai`
client sends OpenAI's fields directly and vLLM's through `extra_body`; greedy completions
equal the offline API's with the same SamplingParams; bad values and unimplemented
output-changing fields are 400s naming the field, and the server goes on serving."""

from __future__ import annotations

import openai
import pytest

from slotserve.sampling import SamplingParams
from tests.e2e.conftest import MODEL_NAME

PROMPT = "List the numbers: one, two, one, two, one,"
MESSAGES = [{"role": "user", "content": "Say hello three times."}]
MAX_TOKENS = 24

CASES = [  # (the request's fields, which go to extra_body)
    (dict(frequency_penalty=1.5), set()),
    (dict(presence_penalty=2.0), set()),
    (dict(repetition_penalty=1.5), {"repetition_penalty"}),
    (dict(frequency_penalty=-1.0, presence_penalty=0.5, repetition_penalty=1.2),
     {"repetition_penalty"}),
    (dict(bad_words=["two", "one"]), {"bad_words"}),
]


def _complete(server, fields: dict, extra: set[str], **kwargs):
    direct = {k: v for k, v in fields.items() if k not in extra}
    return server.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={k: fields[k] for k in extra}, **direct, **kwargs)


@pytest.mark.parametrize("fields,extra", CASES)
def test_greedy_completions_equal_the_offline_api(server, offline_llm, fields, extra):
    out = _complete(server, fields, extra)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, **fields)
    expected = offline_llm.generate([PROMPT], params)[0].outputs[0].text
    plain = offline_llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS,
                                                          temperature=0))[0].outputs[0].text
    assert out.choices[0].text == expected
    assert expected != plain  # the field changed the completion


def test_logit_bias_and_allowed_token_ids(server, offline_llm):
    tokenizer = offline_llm.tokenizer
    (x,) = tokenizer.encode(" X", add_special_tokens=False)
    out = server.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(x): 100})
    assert out.choices[0].text == " X" * 6
    allowed = tokenizer.encode(" yes no", add_special_tokens=False)
    out = server.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=4, n=2,
        logprobs=0, extra_body={"allowed_token_ids": allowed})
    for choice in out.choices:
        assert len(choice.logprobs.tokens) == 8
        ids = tokenizer.encode(choice.text, add_special_tokens=False)
        assert set(ids) <= set(allowed), choice.text


def test_chat_takes_the_fields_too(server, offline_llm):
    """A word of the plain reply banned (with two penalties): the reply equals the offline
    API's and no longer holds the word."""
    client = server.client()
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                           max_tokens=MAX_TOKENS, temperature=0)
    word = max(plain.choices[0].message.content.split(), key=len).strip(".,!?'\"")
    fields = dict(frequency_penalty=0.5, bad_words=[word], repetition_penalty=1.1)
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        frequency_penalty=0.5, extra_body={"bad_words": [word], "repetition_penalty": 1.1})
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, **fields)
    expected = offline_llm.chat(MESSAGES, params)[0].outputs[0].text
    assert out.choices[0].message.content == expected
    assert f" {word}" not in expected and not expected.startswith(word), word


@pytest.mark.parametrize("fields,param", [
    (dict(logit_bias={"49152": 1}), "logit_bias"),  # SmolLM2's vocabulary: 49,152 ids
    (dict(logit_bias={str(i): 1 for i in range(10_000)}), "logit_bias"),
    (dict(logit_bias={"1": 101}), "logit_bias"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"bad_words": [f"w{i}" for i in range(100_000)]}), "bad_words"),
    (dict(extra_body={"bad_words": ["x" * 1000]}), "bad_words"),
    (dict(extra_body={"allowed_token_ids": []}), "allowed_token_ids"),
    (dict(extra_body={"allowed_token_ids": [10**6]}), "allowed_token_ids"),
    (dict(extra_body={"use_beam_search": True}), "use_beam_search"),
    (dict(extra_body={"include_stop_str_in_output": True}), "include_stop_str_in_output"),
    (dict(extra_body={"truncate_prompt_tokens": 8}), "truncate_prompt_tokens"),
])
def test_bad_values_and_unimplemented_fields_are_400s(server, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2,
                                           **fields)
    assert info.value.body["param"] == param, info.value.body


def test_chat_only_fields_are_refused_and_harmless_ones_accepted(server):
    client = server.client()
    for extra, param in [({"chat_template_kwargs": {"messages": []}},
                          "chat_template_kwargs"), ({"reasoning_effort": "low"},
                                                    "reasoning_effort")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                           extra_body=extra)
        assert info.value.body["param"] == param
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=2, user="u1", metadata={"k": "v"},
        extra_body={"use_beam_search": False, "length_penalty": 1.0, "a_field_nobody_knows": 1})
    assert out.choices[0].finish_reason == "length"
