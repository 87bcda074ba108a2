"""Speculative decoding in the engine (issue 35): greedy output is token-identical to
speculation off, with every proposer, with chunked prefill, prefix-cache hits, preemption,
stop strings and stop tokens inside accepted drafts, max_tokens reached mid-proposal,
min_tokens, logprobs, penalties and logit shaping, structured outputs (drafts cut to what
the grammar accepts, each row masked) and n > 1; the trace and the totals count drafts.
Tiny random fp32 models (tests/conftest.py); an "oracle" proposer that knows the reference
output (with chosen mistakes) makes acceptance and rejection happen where a test needs
them. check_integrity after every step."""

from __future__ import annotations

import pytest

from slotserve.config import ModelConfig, engine_config
from slotserve.engine.llm_engine import LLMEngine
from slotserve.sampling import SamplingParams
from tests.conftest import random_prompts, tiny_engine, tiny_hf_model

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, ' \
        '"prompt_lookup_max": 3}'
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 5}'
AUTO = '{"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama")


class LetterTokenizer:
    """id i >= 3 decodes to one letter (a..z by i mod 26); 0..2 are special (no text)."""

    eos_token_ids = (2,)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids if i >= 3)


def text_engine(hf_model, **kwargs) -> LLMEngine:
    cfg = ModelConfig.from_hf_dict(hf_model.config.to_dict())
    weights = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    kwargs.setdefault("max_model_len", 512)
    kwargs.setdefault("quantization", "none")
    return LLMEngine(engine_config(**kwargs), cfg, weights, tokenizer=LetterTokenizer())


class OracleProposer:
    """Proposes the reference continuation of each request (by its prompt), with every
    `wrong_every`-th draft position replaced by a wrong token (0: never)."""

    def __init__(self, reference: dict[tuple, list[int]], wrong_every: int = 0) -> None:
        self.reference = reference
        self.wrong_every = wrong_every
        self.calls = 0

    def propose(self, seq_id, prompt_ids, output_ids, max_tokens):
        self.calls += 1
        ref = self.reference.get(tuple(prompt_ids), [])
        drafts = list(ref[len(output_ids):len(output_ids) + max_tokens])
        if self.wrong_every:
            for i in range(len(drafts)):
                if (len(output_ids) + i) % self.wrong_every == self.wrong_every - 1:
                    drafts[i] = (drafts[i] + 1) % 512
        return drafts

    def finish(self, seq_id, output_ids):
        pass

    def forget(self, seq_id):
        pass


def run(engine: LLMEngine, prompts, params, max_steps: int = 2000):
    """Every completion's (token ids, text, finish reason, logprobs) by request and index."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params[i] if isinstance(params, list) else params)
    results = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                if c.finish_reason is not None:
                    results[(out.request_id, c.index)] = (
                        c.token_ids, c.text, c.finish_reason, c.logprobs)
        engine.check_integrity()
        steps += 1
        assert steps < max_steps
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return results


def repetitive_prompts(count: int, seed: int = 1) -> list[list[int]]:
    """Random prompts that repeat a piece of themselves (so n-grams find matches)."""
    return [p + p[:12] + p[3:9] for p in random_prompts(count, min_len=20, max_len=60,
                                                          seed=seed)]


def reference_outputs(hf_model, prompts, params, **kwargs):
    return run(tiny_engine(hf_model, **kwargs), prompts, params)


def oracle_for(prompts, results) -> dict[tuple, list[int]]:
    return {tuple(p): results[(f"r{i}", 0)][0] for i, p in enumerate(prompts)}


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX, AUTO], ids=["ngram", "suffix", "auto"])
def test_greedy_identical_with_chunked_prefill_and_prefix_hits(hf, spec):
    # a shared system prefix (prefix-cache hits) and prompts longer than the budget (chunks)
    system = random_prompts(1, min_len=40, max_len=40, seed=9)[0]
    prompts = [system + p for p in repetitive_prompts(6)]
    settings = dict(max_num_batched_tokens=48, max_num_seqs=4, block_size=8, num_blocks=200)
    off = reference_outputs(hf, prompts, GREEDY, **settings)
    engine = tiny_engine(hf, speculative_config=spec, **settings)
    on = run(engine, prompts, GREEDY)
    assert on == off
    spec_state = engine.scheduler.speculator
    assert spec_state.num_draft_tokens > 0, "nothing was proposed: the test tests nothing"
    assert engine.kv.prefix_cache_hits > 0
    trace = engine.export_trace()
    drafted = [s for it in trace["iterations"] for s in it["slots"] if s and s.get("proposed")]
    assert sum(s["proposed"] for s in drafted) == spec_state.num_draft_tokens
    assert sum(s["accepted"] for s in drafted) == spec_state.num_accepted_tokens
    assert engine.stats.generation_tokens == sum(len(r[0]) for r in on.values())


def test_oracle_drafts_accepted_and_rejected_under_preemption(hf):
    prompts = repetitive_prompts(6, seed=3)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    # few blocks: running requests preempt each other while they verify drafts
    settings = dict(max_num_seqs=6, block_size=8, num_blocks=40, max_num_batched_tokens=128)
    off = reference_outputs(hf, prompts, params, **settings)
    engine = tiny_engine(hf, speculative_config=SUFFIX, **settings)
    engine.scheduler.speculator.proposer = OracleProposer(oracle_for(prompts, off), 4)
    on = run(engine, prompts, params)
    assert on == off
    spec = engine.scheduler.speculator
    assert engine.scheduler.num_preemptions > 0
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # both happened
    # every 4th output position is a wrong draft: at most 3 accepted in a row
    per_position = spec.accepted_per_position
    assert per_position[0] >= per_position[1] >= per_position[2] > 0 == per_position[3]


def test_max_tokens_and_stop_tokens_inside_drafts(hf):
    prompts = repetitive_prompts(3, seed=5)
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = reference_outputs(hf, prompts, long)
    oracle = oracle_for(prompts, ref)
    stop_at = ref[("r1", 0)][0][6]  # a token of r1's output: stops it there
    params = [SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[stop_at]),
              SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[stop_at], min_tokens=12)]
    off = reference_outputs(hf, prompts, params)
    engine = tiny_engine(hf, speculative_config='{"method": "suffix", '
                         '"num_speculative_tokens": 8}')
    engine.scheduler.speculator.proposer = OracleProposer(oracle)
    on = run(engine, prompts, params)
    assert on == off
    assert len(on[("r0", 0)][0]) == 7 and on[("r0", 0)][2] == "length"
    assert on[("r1", 0)][0][-1] == stop_at and on[("r1", 0)][2] == "stop"
    assert engine.scheduler.speculator.num_accepted_tokens > 0


def test_stop_strings_inside_accepted_drafts(hf):
    prompts = repetitive_prompts(3, seed=7)
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref = run(text_engine(hf), prompts, long)
    texts = {key: value[1] for key, value in ref.items()}
    stops = [texts[(f"r{i}", 0)][8 + i:10 + i] for i in range(3)]
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[s])
              for s in stops]
    off = run(text_engine(hf), prompts, params)
    engine = text_engine(hf, speculative_config='{"method": "suffix", '
                         '"num_speculative_tokens": 8}')
    engine.scheduler.speculator.proposer = OracleProposer(oracle_for(prompts, ref))
    on = run(engine, prompts, params)
    assert on == off
    assert any(reason == "stop" for _, _, reason, _ in on.values())  # a grammar's end
    assert engine.scheduler.speculator.num_accepted_tokens > 0


def test_logprobs_and_n_completions(hf):
    prompts = repetitive_prompts(2, seed=11)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3, n=2)
    off = reference_outputs(hf, prompts, params)
    engine = tiny_engine(hf, speculative_config=NGRAM)
    oracle = {tuple(p): off[(f"r{i}", 0)][0] for i, p in enumerate(prompts)}
    engine.scheduler.speculator.proposer = OracleProposer(oracle, 5)
    on = run(engine, prompts, params)
    assert on.keys() == off.keys()
    for key in off:
        assert on[key][0] == off[key][0]
        for got, want in zip(on[key][3], off[key][3], strict=True):
            assert got.keys() == want.keys()
            assert all(got[t] == pytest.approx(want[t], abs=1e-4) for t in want)
    assert engine.scheduler.speculator.num_accepted_tokens > 0


def test_sampled_n_completions_run_with_drafts(hf):
    prompts = repetitive_prompts(2, seed=13)
    params = SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True, n=3, seed=5)
    engine = tiny_engine(hf, speculative_config=NGRAM)
    on = run(engine, prompts, params)
    assert sorted(on) == [(f"r{i}", j) for i in range(2) for j in range(3)]
    assert all(len(v[0]) == 16 for v in on.values())
    again = run(tiny_engine(hf, speculative_config=NGRAM), prompts, params)
    assert again == on  # seeded: reproducible with drafts too


def test_penalties_and_logit_shaping_with_drafts(hf):
    """Row i of a verification counts the first i drafts as output: penalties, logit_bias
    and bad words give what one token per step gives."""
    prompts = repetitive_prompts(4, seed=17)
    common = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
    params = [SamplingParams(**common, presence_penalty=0.8),
              SamplingParams(**common, frequency_penalty=1.5, repetition_penalty=1.3),
              SamplingParams(**common, logit_bias={7: 3.0, 9: -50.0}),
              SamplingParams(**common)]
    off = reference_outputs(hf, prompts, params)
    engine = tiny_engine(hf, speculative_config=SUFFIX)
    engine.scheduler.speculator.proposer = OracleProposer(oracle_for(prompts, off), 5)
    on = run(engine, prompts, params)
    assert on == off
    slots = [s for it in engine.export_trace()["iterations"] for s in it["slots"] if s]
    for rid in ("r0", "r1", "r2"):
        assert any(s.get("accepted") for s in slots if s["request"] == rid), rid


@pytest.fixture(scope="module")
def grammar_engines():
    """Two engines (speculation off, on) on a tiny random model with the embedded SmolLM2's
    vocabulary and tokenizer, for structured outputs."""
    from slotserve.loader import load_model

    model = tiny_hf_model("llama", seed=5)
    model.resize_token_embeddings(49152)
    cfg = ModelConfig.from_hf_dict(model.config.to_dict())
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tokenizer = load_model().tokenizer

    def build(spec):
        return LLMEngine(engine_config(max_model_len=256, num_blocks=64, max_num_seqs=4,
                                       quantization="none", speculative_config=spec),
                         cfg, weights, tokenizer=tokenizer)

    return build(None), build(SUFFIX)


def test_structured_outputs_with_drafts(grammar_engines):
    """Drafts are cut to what the grammar accepts, every row is masked by the grammar after
    the drafts before it, and the tokens after the grammar's end are dropped: the output
    equals speculation off."""
    from slotserve.structured import StructuredOutputs

    off_engine, on_engine = grammar_engines
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 12},
                                               "b": {"type": "integer"}},
              "required": ["a", "b"], "additionalProperties": False}
    specs = [StructuredOutputs(json=schema), StructuredOutputs(regex="(ab|cd){2,9}x"),
             StructuredOutputs(choice=("yes please", "no thanks"))]
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4, [12, 13] * 5]
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=spec)
              for spec in specs]
    off = run(off_engine, prompts, params)
    # past the reference's end: EOS and more (a draft after the grammar's end must go)
    tail = [on_engine.eos_token_ids[0]] * 2 + [300, 301]
    oracle = {prompt: [*ref, *tail] for prompt, ref in oracle_for(prompts, off).items()}
    on_engine.scheduler.speculator.proposer = OracleProposer(oracle, 3)
    on = run(on_engine, prompts, params)
    assert on == off
    spec = on_engine.scheduler.speculator
    assert 0 < spec.num_accepted_tokens <= spec.num_draft_tokens
    assert any(reason == "stop" for _, _, reason, _ in on.values())  # a grammar's end


def test_sampled_structured_outputs_keep_their_distribution(grammar_engines):
    """Sampled choices under a grammar, with drafts of one choice: the same distribution of
    answers as without speculation (chi-square), so the grammar masks every verified row."""
    from scipy.stats import chi2_contingency

    from slotserve.structured import StructuredOutputs

    off_engine, on_engine = grammar_engines
    choices = ("red apple", "green pear", "blue plum")
    count = 80
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s,
                             structured_outputs=StructuredOutputs(choice=choices))
              for s in range(count)]
    prompt = [[5, 6, 7]] * count
    off = run(off_engine, prompt, params)
    draft = on_engine.tokenizer.encode("red apple")

    class Fixed(OracleProposer):
        def propose(self, seq_id, prompt_ids, output_ids, max_tokens):
            return list(draft[len(output_ids):len(output_ids) + max_tokens])

    on_engine.scheduler.speculator.proposer = Fixed({})
    before = on_engine.scheduler.speculator.num_draft_tokens
    on = run(on_engine, prompt, params)
    assert on_engine.scheduler.speculator.num_draft_tokens > before
    answers = [[v[1] for v in side.values()] for side in (off, on)]
    assert all(set(a) <= set(choices) for a in answers)
    table = [[a.count(c) for c in choices] for a in answers]
    assert chi2_contingency(table).pvalue > 1e-3, table


def test_drafts_the_grammar_rejects_are_cut(grammar_engines):
    from slotserve.structured import StructuredOutputs

    _, engine = grammar_engines
    params = SamplingParams(max_tokens=8, temperature=0.0,
                            structured_outputs=StructuredOutputs(choice=("ab", "cd")))
    engine.add_request("g", [5, 6, 7], params)
    seq = engine._sequences["g"]
    tokenizer = engine.tokenizer
    good = tokenizer.encode("ab")
    assert engine._filter_drafts(seq.request, good + [7, 7]) == good[:len(good)]
    assert engine._filter_drafts(seq.request, tokenizer.encode("zz")) == []
    free = SamplingParams(max_tokens=8, temperature=0.0)
    engine.add_request("f", [5, 6, 7], free)
    assert engine._filter_drafts(engine._sequences["f"].request, [1, 2, 3]) == [1, 2, 3]
    engine.abort_request("g")
    engine.abort_request("f")
    engine.step()


def test_length_cap_mid_proposal(hf):
    prompts = [p[:40] for p in repetitive_prompts(2, seed=19)]
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    off = reference_outputs(hf, prompts, params, max_model_len=56)
    engine = tiny_engine(hf, max_model_len=56, speculative_config='{"method": "suffix", '
                         '"num_speculative_tokens": 8}')
    engine.scheduler.speculator.proposer = OracleProposer(oracle_for(prompts, off))
    on = run(engine, prompts, params)
    assert on == off
    assert all(len(v[0]) == 16 and v[2] == "length" for v in on.values())
    assert engine.scheduler.speculator.num_accepted_tokens > 0


def test_a_failing_request_with_drafts_fails_alone(hf):
    prompts = repetitive_prompts(4, seed=23)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    off = reference_outputs(hf, prompts, params)
    engine = tiny_engine(hf, speculative_config=SUFFIX)
    engine.scheduler.speculator.proposer = OracleProposer(oracle_for(prompts, off), 3)
    execute = engine.runner.execute

    def faulty(plan):  # r2 raises once it verifies drafts; bisection finds it
        if any(s.request_id == "r2" and s.spec_token_ids for s in plan.seqs):
            raise RuntimeError("boom")
        return execute(plan)

    engine.runner.execute = faulty
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].finish_reason is not None:
                done[out.request_id] = out
        engine.check_integrity()
    assert done["r2"].error is not None and "boom" in done["r2"].error
    for rid in ("r0", "r1", "r3"):
        assert done[rid].error is None
        assert done[rid].outputs[0].token_ids == off[(rid, 0)][0]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
