"""The runner's lookups (runner/lookups.py) reach it through its constructor: the engine
builds them (grammar matchers, logit shaping, prompt logprobs, EOS ids) before the runner and
never assigns into it afterwards; a runner built without them samples unconstrained."""

from __future__ import annotations

import dataclasses

import pytest

from slotserve.config import CacheConfig, ModelConfig, SlotKind, engine_config
from slotserve.core.outputs import ScheduledSeq, SchedulerOutput
from slotserve.engine.llm import LLM
from slotserve.engine.llm_engine import LLMEngine
from slotserve.runner.logit_shaping import SequenceShaping, ShapingSpec
from slotserve.runner.lookups import NO_LOOKUPS, RequestLookups
from slotserve.runner.model_runner import ModelRunner
from slotserve.sampling import SamplingParams
from tests.conftest import tiny_engine

PROMPT = [5, 6, 7, 8, 9]
BLOCK_SIZE = 16


def tiny_runner(hf_model, lookups: RequestLookups | None = None) -> ModelRunner:
    """A ModelRunner on the HF model's fp32 weights, with `lookups` if given."""
    cfg = ModelConfig.from_hf_dict(hf_model.config.to_dict())
    weights = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    extra = {} if lookups is None else {"lookups": lookups}
    return ModelRunner(cfg, weights, CacheConfig(block_size=BLOCK_SIZE), num_blocks=4, **extra)


def prefill_plan(params: SamplingParams) -> SchedulerOutput:
    """One request's whole prompt in one chunk, sampling its first output token."""
    seq = ScheduledSeq("r", list(PROMPT), 0, [0], True, params, 0, SlotKind.PREFILL)
    return SchedulerOutput(iteration=0, seqs=[seq], slots=[None])


def greedy_first_token(runner: ModelRunner) -> int:
    """The argmax of the prompt's last row: what an unconstrained greedy row must take."""
    return int(runner.score(PROMPT, [0])[-1].argmax())


# --------------------------------------------------------------------------- the runner
def test_a_runner_without_lookups_samples_unconstrained(tiny_llama):
    runner = tiny_runner(tiny_llama)
    assert runner.lookups is NO_LOOKUPS and runner.sampler.eos_token_ids == ()
    free = greedy_first_token(runner)
    # min_tokens has no EOS ids to mask, so the argmax stands
    params = SamplingParams(max_tokens=4, temperature=0, min_tokens=4)
    assert runner.execute(prefill_plan(params)).sampled == {"r": free}


def test_the_constructor_lookups_reach_the_sampler(tiny_llama):
    free = greedy_first_token(tiny_runner(tiny_llama))
    runner = tiny_runner(tiny_llama, RequestLookups(eos_token_ids=[free]))
    assert runner.sampler.eos_token_ids == (free,)
    params = SamplingParams(max_tokens=4, temperature=0, min_tokens=4)
    assert runner.execute(prefill_plan(params)).sampled["r"] != free  # EOS masked
    params = SamplingParams(max_tokens=4, temperature=0)
    assert runner.execute(prefill_plan(params)).sampled["r"] == free  # min_tokens met


def test_the_constructor_shaping_lookup_is_asked_by_request_id(tiny_llama):
    free = greedy_first_token(tiny_runner(tiny_llama))
    only = (free + 1) % 512
    params = SamplingParams(max_tokens=4, temperature=0, allowed_token_ids=[only])
    shaping = SequenceShaping(ShapingSpec.build(params, None, 512), PROMPT, [])
    asked: list[str] = []

    def shaping_of(request_id: str) -> SequenceShaping | None:
        asked.append(request_id)
        return shaping

    runner = tiny_runner(tiny_llama, RequestLookups(shaping_of=shaping_of))
    assert runner.execute(prefill_plan(params)).sampled == {"r": only}
    assert asked == ["r"]


def test_lookups_are_frozen_and_the_runner_has_no_lookup_attributes(tiny_llama):
    lookups = RequestLookups(eos_token_ids=[3, 4])
    assert lookups.eos_token_ids == (3, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lookups.grammar_of = lambda request_id: None  # type: ignore[misc]
    runner = tiny_runner(tiny_llama)
    for name in ("grammar_of", "shaping_of", "prompt_logprobs_of"):
        assert not hasattr(runner, name), f"ModelRunner.{name} is an assignment side channel"


# --------------------------------------------------------------------------- the engine
def test_the_engine_gives_the_runner_its_lookups_at_construction(tiny_llama):
    engine = tiny_engine(tiny_llama, num_blocks=16, max_num_seqs=2)
    lookups = engine.runner.lookups
    assert lookups is not NO_LOOKUPS
    assert lookups.eos_token_ids == engine.eos_token_ids == engine.runner.sampler.eos_token_ids
    assert engine.eos_token_ids  # the tiny model's eos_token_id (2)
    for name in ("grammar_of", "shaping_of", "prompt_logprobs_of"):
        assert getattr(lookups, name).__self__ is engine


def test_min_tokens_through_the_engine_masks_the_models_eos(tiny_llama):
    probe = tiny_engine(tiny_llama, num_blocks=16, max_num_seqs=2)
    first = LLM(engine=probe).generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))
    eos = first[0].outputs[0].token_ids[0]
    cfg = ModelConfig.from_hf_dict({**tiny_llama.config.to_dict(), "eos_token_id": eos})
    weights = {k: v.detach().clone() for k, v in tiny_llama.state_dict().items()}
    engine = LLMEngine(engine_config(num_blocks=16, max_num_seqs=2, max_model_len=512,
                                     quantization="none"), cfg, weights)
    llm = LLM(engine=engine)
    stops = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    assert (stops.token_ids, stops.finish_reason) == ([eos], "stop")
    held = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, min_tokens=4))
    assert eos not in held[0].outputs[0].token_ids[:4]


def test_a_constrained_request_through_the_engine_follows_its_grammar(smollm2_vocab_model):
    cfg, weights, tokenizer = smollm2_vocab_model
    engine = LLMEngine(engine_config(max_model_len=512, num_blocks=64, max_num_seqs=4), cfg,
                       weights, tokenizer=tokenizer)
    choices = ["yes", "no"]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1, n=4,
                            structured_outputs={"choice": choices})
    out = LLM(engine=engine).generate(["Answer:"], params)[0]
    assert [c.text in choices for c in out.outputs] == [True] * 4, [c.text for c in out.outputs]
    # the same request unconstrained: random weights do not say yes or no by themselves
    free = LLM(engine=engine).generate(
        ["Answer:"], dataclasses.replace(params, structured_outputs=None))[0]
    assert not all(c.text in choices for c in free.outputs)
