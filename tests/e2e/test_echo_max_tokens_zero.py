"""echo with max_tokens 0 on /v1/completions (OpenAI's and vLLM's way to score a text, what
evaluation harnesses send): the prompt, with its logprobs when asked, is the whole answer.
One real server (the embedded SmolLM2), the official `openai` client."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import ENGINE_FLAGS, MODEL_NAME, running_server
from tests.support.launch import cli_flags

PROMPT = "The capital of France is Paris"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("echo"), *cli_flags(**ENGINE_FLAGS)) as proc:
        yield proc


def complete(client, **kwargs):
    return client.completions.create(model=MODEL_NAME, temperature=0, **kwargs)


def test_echo_without_generation_is_the_prompt_and_its_logprobs(client):
    scored = complete(client, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    (choice,) = scored.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    lp = choice.logprobs
    prompt_tokens = scored.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == prompt_tokens
    assert "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    # the same numbers as echo with one generated token (lm-eval's request), that token left out
    generated = complete(client, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1)
    reference = generated.choices[0].logprobs
    assert lp.tokens == reference.tokens[:prompt_tokens]
    assert lp.token_logprobs == reference.token_logprobs[:prompt_tokens]
    assert lp.top_logprobs == reference.top_logprobs[:prompt_tokens]
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[token] == logprob  # the prompt token itself, as OpenAI lists the chosen one
        assert max(top.values()) >= logprob and len(top) <= 2


def test_echo_without_generation_streams_the_prompt_once(client):
    text, tokens, finish, usage = "", [], None, None
    for chunk in complete(client, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0,
                          stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            text += choice.text
            tokens += choice.logprobs.tokens if choice.logprobs else []
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
    assert text == PROMPT and "".join(tokens) == PROMPT and finish == "length"
    assert usage.completion_tokens == 0 and usage.prompt_tokens == len(tokens)


def test_token_id_prompt_lists_are_scored_each(server, client):
    """What lm-eval's local-completions sends: token ids, several prompts; and n."""
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    scored = complete(client, prompt=[ids, ids[:3]], n=2, max_tokens=0, echo=True,
                      logprobs=1)
    assert [c.index for c in scored.choices] == [0, 1, 2, 3]
    whole, part = scored.choices[0].logprobs, scored.choices[2].logprobs
    assert scored.choices[1].logprobs.token_logprobs == whole.token_logprobs
    assert len(whole.tokens) == len(ids) and len(part.tokens) == 3
    assert part.token_logprobs[0] is None  # causal: a prefix scores alike
    assert part.token_logprobs[1:] == pytest.approx(whole.token_logprobs[1:3], abs=1e-4)
    assert scored.usage.completion_tokens == 0
    assert scored.usage.prompt_tokens == len(ids) + 3  # each prompt once, as OpenAI counts


@pytest.mark.parametrize("fields,param", [
    ({"max_tokens": 0}, "max_tokens"),  # no echo: nothing to answer
    ({"max_tokens": 0, "echo": True, "extra_body": {"min_tokens": 2}}, "min_tokens"),
])
def test_max_tokens_zero_that_asks_for_nothing_or_for_output_is_a_400(client, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        complete(client, prompt=PROMPT, **fields)
    assert err.value.body["param"] == param
