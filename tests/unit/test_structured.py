"""Structured outputs: StructuredOutputs validation, the llguidance wrapper on the embedded
SmolLM2 tokenizer, and the sampler's per-row masking with hand-made logits."""

from __future__ import annotations

import json

import pytest
import torch

from slotserve.core.outputs import ScheduledSeq
from slotserve.runner.sampler import Sampler, mask_disallowed
from slotserve.sampling import SamplingParams
from slotserve.structured import StructuredOutputs
from slotserve.structured.grammar import (
    GrammarCompiler,
    allocate_bitmask,
    fill_bitmasks,
    unpack_bitmask,
)

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


# ------------------------------------------------------------------ StructuredOutputs
def test_exactly_one_kind_is_required():
    with pytest.raises(ValueError, match="exactly one of .* got none"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputs(json=SCHEMA, regex="a+")


@pytest.mark.parametrize("kwargs, field", [
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": [1, 2]}, "structured_outputs.json"),
    ({"regex": 5}, "structured_outputs.regex"),
    ({"grammar": ""}, "structured_outputs.grammar"),
    ({"choice": "yes"}, "structured_outputs.choice"),
    ({"choice": ["yes", 3]}, "structured_outputs.choice"),
    ({"json_object": 1}, "exactly one|structured_outputs.json_object"),
])
def test_bad_shapes_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StructuredOutputs(**kwargs)


def test_schema_text_and_dict_share_a_key_and_params_stay_hashable():
    a = StructuredOutputs(json=SCHEMA)
    b = StructuredOutputs(json=json.dumps(SCHEMA, indent=2))
    assert a.key == b.key == ("json", json.dumps(SCHEMA, separators=(",", ":")))
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == StructuredOutputs(choice=("a", "b"))
    assert hash(params) == hash(SamplingParams(structured_outputs=StructuredOutputs(
        choice=["a", "b"])))
    assert params.for_choice(1).structured_outputs == params.structured_outputs


def test_sampling_params_rejects_unknown_structured_fields():
    with pytest.raises(ValueError, match="unknown field.*json_schema"):
        SamplingParams(structured_outputs={"json_schema": SCHEMA})
    with pytest.raises(ValueError, match="structured_outputs must be"):
        SamplingParams(structured_outputs="json")


# ------------------------------------------------------------------ the grammar wrapper
# NOTE: the tokenizer and compiler fixtures are tests/unit/conftest.py's (SmolLM2's).
def allowed_now(matcher) -> torch.Tensor:
    bitmask = allocate_bitmask(1, 49152)
    fill_bitmasks([(matcher, 0)], bitmask)
    return torch.from_numpy(unpack_bitmask(bitmask, 49152)[0])


def walk(matcher, token_ids: list[int]) -> None:
    """Feed the tokens the matcher has not consumed, one at a time, checking that the mask
    allowed each."""
    for n in range(matcher.num_consumed, len(token_ids)):
        assert allowed_now(matcher)[token_ids[n]], f"token {n} ({token_ids[n]}) was masked"
        matcher.advance(token_ids[:n + 1])


def test_json_schema_walk_and_eos_only_when_accepting(compiler, tokenizer):
    matcher = compiler.matcher(StructuredOutputs(json=SCHEMA))
    eos = tokenizer.eos_token_ids[0]
    start = allowed_now(matcher)
    assert not start[eos], "EOS before the object is complete"
    assert not start[tokenizer.encode("hello")[0]]
    ids = tokenizer.encode('{"name": "Bo", "age": 7}')
    walk(matcher, ids[:-1])
    assert not matcher.is_accepting and not allowed_now(matcher)[eos]
    walk(matcher, ids)
    matcher.advance(ids)  # consumed already: nothing happens
    assert matcher.num_consumed == len(ids)
    assert matcher.is_accepting and allowed_now(matcher)[eos]


def test_matcher_rejects_a_token_outside_the_grammar(compiler, tokenizer):
    matcher = compiler.matcher(StructuredOutputs(regex=r"[0-9]{3}-[a-z]+"))
    ids = tokenizer.encode("12x")
    with pytest.raises(ValueError, match="rejected"):
        matcher.advance(ids)


def test_regex(compiler, tokenizer):
    matcher = compiler.matcher(StructuredOutputs(regex=r"[0-9]{3}-[a-z]+"))
    assert not allowed_now(matcher)[tokenizer.encode("a")[0]]
    walk(matcher, tokenizer.encode("123-abc"))
    assert matcher.is_accepting and not matcher.is_finished  # more letters may follow


def test_choice_finishes_after_a_whole_choice(compiler, tokenizer):
    matcher = compiler.matcher(StructuredOutputs(choice=["yes", "no"]))
    assert not allowed_now(matcher)[tokenizer.encode("maybe")[0]]
    walk(matcher, tokenizer.encode("yes"))
    assert matcher.is_accepting and matcher.is_finished


def test_json_object_and_grammar(compiler, tokenizer):
    obj = compiler.matcher(StructuredOutputs(json_object=True))
    assert not allowed_now(obj)[tokenizer.encode("[")[0]]
    walk(obj, tokenizer.encode('{"a": [1, 2]}'))
    assert obj.is_accepting
    for grammar in ('start: "ab" | "cd"', 'root ::= "ab" | "cd"'):  # Lark and GBNF
        g = compiler.matcher(StructuredOutputs(grammar=grammar))
        walk(g, tokenizer.encode("cd"))
        assert g.is_finished


@pytest.mark.parametrize("spec, message", [
    (StructuredOutputs(json={"type": "foo"}), r"structured_outputs\.json: .*foo"),
    (StructuredOutputs(json={"type": "string", "minLength": 5, "maxLength": 2}),
     r"structured_outputs\.json: Unsatisfiable"),
    (StructuredOutputs(regex="(ab"), r"structured_outputs\.regex: .*unclosed group"),
    (StructuredOutputs(grammar="start: nope"), r"structured_outputs\.grammar: .*nope"),
])
def test_rejected_specs_raise_value_errors_naming_the_field(compiler, spec, message):
    for _ in range(2):  # the second answer comes from the cache, and is the same
        with pytest.raises(ValueError, match=message):
            compiler.matcher(spec)


def test_compiled_grammars_are_cached_by_key(compiler):
    spec = StructuredOutputs(json=SCHEMA)
    first = compiler.compile(spec)
    assert compiler.compile(StructuredOutputs(json=json.dumps(SCHEMA))) is first
    small = GrammarCompiler(None, 49152, (), cache_size=2)
    small._ll_tokenizer = compiler.ll_tokenizer
    a = small.compile(StructuredOutputs(regex="a"))
    small.compile(StructuredOutputs(regex="b"))
    assert small.compile(StructuredOutputs(regex="a")) is a  # now the most recent
    with pytest.raises(ValueError):
        small.compile(StructuredOutputs(regex="(c"))  # rejected specs are cached too
    assert list(small._cache) == [("regex", "a"), ("regex", "(c")]  # "b" was the oldest


def test_no_tokenizer_is_a_value_error():
    with pytest.raises(ValueError, match="structured_outputs: this model has no tokenizer"):
        GrammarCompiler(None, 512, (2,)).matcher(StructuredOutputs(regex="a"))


# ------------------------------------------------------------------ sampler masking
def seq(request_id: str, params: SamplingParams, step: int = 0) -> ScheduledSeq:
    return ScheduledSeq(request_id, [1], 0, [0], True, params, step, "decode")


def test_unpack_bitmask_bit_order():
    bitmask = allocate_bitmask(2, 40)
    bitmask[0, 0] = 1 << 3
    bitmask[1, 1] = 1 << 5  # token 37
    allowed = unpack_bitmask(bitmask, 40)
    assert allowed.shape == (2, 40)
    assert allowed[0].nonzero()[0].tolist() == [3]
    assert allowed[1].nonzero()[0].tolist() == [37]
    assert unpack_bitmask(bitmask, 70)[:, 64:].sum() == 0  # past the grammar's vocabulary


def test_masked_tokens_are_never_chosen_and_free_rows_are_untouched():
    vocab = 50
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen)
    logits[:, 7] = 30.0  # every row's favourite
    allowed = torch.ones(2, vocab, dtype=torch.bool)
    allowed[:, 7] = False
    allowed[1, :20] = False  # row 3 may only take 20..49
    params = [SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.5, seed=3),
              SamplingParams(temperature=1.5, top_k=5, seed=4)]
    seqs = [seq(f"r{i}", p) for i, p in enumerate(params)]
    sampler = Sampler(torch.device("cpu"))
    free_tokens, _ = sampler(logits, seqs)
    assert free_tokens == [7, 7, 7, 7]
    rows = [0, 3]
    for step in range(200):
        seqs = [seq(f"r{i}", p, step) for i, p in enumerate(params)]
        tokens, logprobs = sampler(logits, seqs, (rows, allowed))
        assert tokens[0] == int(logits[0].masked_fill(~allowed[0], -1e9).argmax())
        assert tokens[1] == 7  # unconstrained greedy row in the same batch
        assert tokens[3] != 7 and tokens[3] >= 20
        assert allowed[1, tokens[3]]
    # log-probabilities are the model's (unmasked): the masked favourite is the top entry
    assert max(logprobs[0], key=logprobs[0].get) == 7
    assert tokens[0] in logprobs[0]


def test_mask_shape_must_match():
    with pytest.raises(ValueError, match="mask of shape"):
        mask_disallowed(torch.zeros(2, 10), [0], torch.ones(1, 9, dtype=torch.bool))


def test_engine_without_tokenizer_refuses_structured_requests(tiny_llama):
    from tests.conftest import tiny_engine

    engine = tiny_engine(tiny_llama, num_blocks=16)
    params = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputs(regex="a+"))
    with pytest.raises(ValueError, match="structured_outputs: this model has no tokenizer"):
        engine.add_request("r", [5, 6, 7], params)
    assert not engine.has_request("r")
    engine.add_request("free", [5, 6, 7], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()


def test_openai_response_format():
    from slotserve.structured.params import from_response_format

    assert from_response_format(None) is None
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == StructuredOutputs(json_object=True)
    wrapped = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA,
                                                      "strict": True}}
    assert from_response_format(wrapped) == StructuredOutputs(json=SCHEMA)
    with pytest.raises(ValueError, match="response_format.type"):
        from_response_format({"type": "xml"})
    with pytest.raises(ValueError, match="response_format.json_schema must"):
        from_response_format({"type": "json_schema", "json_schema": {"name": "p"}})
    with pytest.raises(ValueError, match="response_format.json_schema.schema must"):
        from_response_format({"type": "json_schema", "json_schema": {"schema": [1]}})
