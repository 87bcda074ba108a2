"""OpenAI request schemas -> SamplingParams, error mapping, logprob shapes (no model)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from slotserve.server import protocol as p
from slotserve.server.protocol import APIError, request_model


def completion(**kwargs) -> p.CompletionRequest:
    return p.CompletionRequest.model_validate({"prompt": "hi", **kwargs})


def chat(**kwargs) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], **kwargs})


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "5"), ("max_tokens", 2.5), ("max_tokens", True), ("temperature", "0.5"),
    ("n", "2"), ("stream", "yes"), ("stop", 3), ("seed", 1.5), ("prompt", [1, "a"]),
])
def test_types_are_strict(field, value):
    with pytest.raises(ValidationError):
        completion(**{field: value})


def test_completion_defaults_are_openai_legacy():
    params = completion().to_sampling_params()
    assert params.max_tokens == 16 and params.temperature == 1.0 and params.top_p == 1.0
    assert params.n == 1 and params.logprobs is None and params.stop == ()


def test_completion_fields_reach_sampling_params():
    params = completion(max_tokens=7, temperature=0, top_p=0.5, top_k=3, min_p=0.1, seed=4,
                        stop="\n", n=2, logprobs=3, ignore_eos=True,
                        unknown_field="ignored").to_sampling_params()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (7, 0, 0.5, 3)
    assert (params.min_p, params.seed, params.stop, params.n) == (0.1, 4, ("\n",), 2)
    assert params.logprobs == 3 and params.ignore_eos


def test_null_means_default():
    params = completion(max_tokens=None, temperature=None, top_p=None, n=None,
                        stop=None).to_sampling_params()
    assert params.max_tokens == 16 and params.temperature == 1.0 and params.n == 1


@pytest.mark.parametrize("prompt,expected", [
    ("text", ["text"]), ([1, 2, 3], [[1, 2, 3]]), (["text"], ["text"]), ([[4, 5]], [[4, 5]]),
    (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_engine_prompts(prompt, expected):
    assert completion(prompt=prompt).engine_prompts() == expected
    assert completion(prompt=prompt).num_prompts == len(expected)


@pytest.mark.parametrize("prompt", [[], ["a", "b", "c"]])
def test_empty_or_too_many_prompts_are_refused(prompt):
    with pytest.raises(APIError) as err:
        completion(prompt=prompt).engine_prompts(max_prompts=2)
    assert err.value.param == "prompt" and err.value.status == 400


def test_echo_with_logprobs_asks_for_prompt_logprobs():
    assert completion(echo=True).to_sampling_params().prompt_logprobs is None
    assert completion(echo=True, logprobs=3).to_sampling_params().prompt_logprobs == 3
    assert completion(echo=True, logprobs=1, prompt_logprobs=4).to_sampling_params(
        ).prompt_logprobs == 4
    assert completion(prompt_logprobs=0).to_sampling_params().prompt_logprobs == 0
    with pytest.raises(APIError) as err:
        completion(echo=True, logprobs=5, prompt_logprobs=-1).to_sampling_params()
    assert err.value.param == "prompt_logprobs"
    with pytest.raises(APIError) as err:  # chat does not implement it: refused, not ignored
        chat(prompt_logprobs=2).to_sampling_params()
    assert err.value.param == "prompt_logprobs"


@pytest.mark.parametrize("field,value", [("slo_ttft_ms", 1e300), ("slo_tpot_ms", 3_600_001)])
def test_slos_past_an_hour_are_refused_naming_the_field(field, value):
    """Validated with the request (a 400 whose param is the field), before the engine."""
    import pydantic

    with pytest.raises(pydantic.ValidationError) as err:
        completion(**{field: value})
    assert err.value.errors()[0]["loc"] == (field,)
    assert completion(**{field: 3_600_000}).model_dump()[field] == 3_600_000


@pytest.mark.parametrize("field,value,param", [
    ("temperature", -1.0, "temperature"), ("top_p", 0.0, "top_p"), ("top_k", -2, "top_k"),
    ("min_p", 1.5, "min_p"), ("n", 0, "n"), ("max_tokens", 0, "max_tokens"),
    ("logprobs", 21, "logprobs"), ("stop", [""], "stop"), ("prompt_logprobs", 21,
                                                              "prompt_logprobs"),
    ("presence_penalty", 2.5, "presence_penalty"), ("best_of", 3, "best_of"),
    ("logit_bias", {"x": 2.0}, "logit_bias"), ("use_beam_search", True, "use_beam_search"),
])
def test_bad_values_name_their_field(field, value, param):
    with pytest.raises(APIError) as err:
        completion(**{field: value}).to_sampling_params()
    assert err.value.status == 400 and err.value.param == param
    assert err.value.type == "invalid_request_error"


def test_zero_penalties_are_accepted():
    completion(presence_penalty=0.0, frequency_penalty=0.0, logit_bias={}).to_sampling_params()


def test_chat_max_tokens_precedence_and_default():
    assert chat().to_sampling_params().max_tokens == p.DEFAULT_CHAT_MAX_TOKENS
    assert chat(max_tokens=5).to_sampling_params().max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=9).to_sampling_params().max_tokens == 9


def test_chat_errors_use_chat_names():
    with pytest.raises(APIError) as err:
        chat(max_completion_tokens=0).to_sampling_params()
    assert err.value.param == "max_completion_tokens"
    assert err.value.message.startswith("max_completion_tokens ")
    with pytest.raises(APIError) as err:
        chat(logprobs=True, top_logprobs=50).to_sampling_params()
    assert err.value.param == "top_logprobs"
    with pytest.raises(APIError) as err:
        chat(top_logprobs=2).to_sampling_params()
    assert err.value.param == "top_logprobs"


def test_chat_logprobs_mapping():
    assert chat().to_sampling_params().logprobs is None
    assert chat(logprobs=True).to_sampling_params().logprobs == 0
    assert chat(logprobs=True, top_logprobs=4).to_sampling_params().logprobs == 4


def test_chat_messages():
    request = chat(messages=[
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}])
    assert request.template_messages() == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""}]
    with pytest.raises(ValidationError):
        chat(messages=[])
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_include_usage():
    assert not completion().include_usage
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not completion(stream_options={"continuous_usage_stats": True}).continuous_usage
    assert completion(stream_options={"include_usage": True,
                                      "continuous_usage_stats": True}).continuous_usage


IGNORED = "The following fields were present in the request but ignored"


def ignored_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "slotserve.server" and r.levelname == "WARNING"]


@pytest.fixture
def ignored(monkeypatch, caplog) -> p.IgnoredFields:
    """A fresh process-wide record of logged names (the real one remembers every test's)."""
    fresh = p.IgnoredFields(max_names=4, max_chars=8)
    monkeypatch.setattr(request_model, "IGNORED_FIELDS", fresh)  # where the models read it
    caplog.set_level("WARNING", logger="slotserve.server")
    return fresh


def test_ignored_fields_are_logged_once_each(ignored, caplog):
    request = chat(frobnicate=1, messages=[{"role": "user", "content": "hi", "name": "bob",
                                            "refusal": None}],
                   stream_options={"include_usage": True, "chunky": True})
    assert request.messages[0].content == "hi"  # the request stands
    lines = ignored_lines(caplog)
    assert all(line.startswith(IGNORED) for line in lines)
    assert sorted(ignored.logged) == ["frobnica", "messages", "stream_o"]  # cut to 8 chars
    chat(frobnicate=2)  # the same name again: no new line
    assert len(ignored_lines(caplog)) == len(lines)
    assert "'frobnica'" in " ".join(lines) and "'messages" in " ".join(lines)
    chat(messages=[{"role": "user", "content": "hi", "name": None}])  # unset: nothing to say
    assert len(ignored_lines(caplog)) == len(lines)


def test_declared_fields_are_not_reported(ignored, caplog):
    completion(max_tokens=3, min_tokens=1, stream=True, cache_salt="s",
               stream_options={"include_usage": True, "continuous_usage_stats": True})
    chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
         tool_choice="required")
    assert ignored_lines(caplog) == [] and not ignored.logged


def test_the_ignored_field_log_is_bounded(ignored, caplog):
    completion(**{f"field{i}\nforged": i for i in range(10)})
    completion(another=1)
    lines = ignored_lines(caplog)
    assert len(ignored.logged) == 4 and len(lines) == 2  # the names, then "not logged"
    assert "later ones are not logged" in lines[1]
    assert "\n" not in lines[0]  # repr() escapes what a client sends


def test_error_body_shape():
    error = APIError("nope", 404, param="model", code="model_not_found")
    assert error.body() == {"error": {"message": "nope", "type": "invalid_request_error",
                                      "param": "model", "code": "model_not_found"}}


def test_invalid_request_finds_the_param():
    assert p.invalid_request("top_p must be in (0, 1], got 0").param == "top_p"
    assert p.invalid_request("prompt must not be empty", {"prompt": "messages"}).param == \
        "messages"
    assert p.invalid_request("something else went wrong").param is None


# ------------------------------------------------------------------------- logprobs
class ByteLevelTokenizer:
    """Ids 0..: 'ĠParis', 'é' split in two byte tokens, a special token."""

    vocab = {0: "ĠParis", 1: "Ã", 2: "©", 3: "<|im_end|>", 4: "."}

    def id_to_token(self, token_id):
        return self.vocab.get(token_id)

    def decode(self, ids, skip_special_tokens=True):  # pragma: no cover - not reached
        raise AssertionError("byte-level spellings need no decode")


def test_token_bytes_inverts_the_byte_level_alphabet():
    tok = ByteLevelTokenizer()
    assert p.token_bytes(tok, 0) == b" Paris"
    assert p.token_bytes(tok, 1) + p.token_bytes(tok, 2) == "é".encode()
    assert p.token_text(tok, 3) == "<|im_end|>"
    assert p.token_text(tok, 1) == "\ufffd"  # half a character
    assert p.token_bytes(tok, 99) == b""


def test_completion_logprobs_shape():
    tok = ByteLevelTokenizer()
    lp = p.completion_logprobs(tok, [0, 4], [{0: -0.1, 4: -2.5}, {4: -0.2, 0: -1.0, 3: -3.0}])
    assert lp.tokens == [" Paris", "."]
    assert lp.token_logprobs == [-0.1, -0.2]
    assert lp.top_logprobs == [{" Paris": -0.1, ".": -2.5}, {".": -0.2, " Paris": -1.0,
                                                              "<|im_end|>": -3.0}]
    assert lp.text_offset == [0, 6]


def test_chat_logprobs_shape():
    tok = ByteLevelTokenizer()
    lp = p.chat_logprobs(tok, [4], [{0: -0.5, 4: -1.5, 3: float("-inf")}], top_n=1)
    (entry,) = lp.content
    assert (entry.token, entry.logprob, entry.bytes) == (".", -1.5, [46])
    assert [(t.token, t.logprob) for t in entry.top_logprobs] == [(" Paris", -0.5)]
    lp = p.chat_logprobs(tok, [3], [{3: float("-inf")}], top_n=0)
    assert lp.content[0].logprob == p.MIN_LOGPROB and lp.content[0].top_logprobs == []
