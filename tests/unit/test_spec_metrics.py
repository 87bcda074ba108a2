"""Speculative decoding's Prometheus metrics, as vLLM names them (obs/metrics.py): drafts,
draft tokens, accepted tokens and accepted tokens per position, under both name sets."""

from __future__ import annotations

from slotserve.obs.metrics import ServerMetrics
from slotserve.sampling import SamplingParams
from tests.conftest import tiny_engine
from tests.unit.test_metrics import samples
from tests.unit.test_spec_engine import SUFFIX, OracleProposer, oracle_for, repetitive_prompts
from tests.unit.test_spec_engine import run as run_engine


def test_spec_decode_counters(tiny_llama):
    prompts = repetitive_prompts(3, seed=21)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    off = run_engine(tiny_engine(tiny_llama), prompts, params)
    engine = tiny_engine(tiny_llama, speculative_config=SUFFIX)
    engine.scheduler.speculator.proposer = OracleProposer(oracle_for(prompts, off), 3)
    metrics = ServerMetrics(engine, model_name="m")
    metrics.attach()
    assert run_engine(engine, prompts, params) == off
    spec = engine.scheduler.speculator
    m = samples(metrics)
    label = '{model_name="m"}'
    for name, value in (("num_drafts", spec.num_drafts),
                        ("num_draft_tokens", spec.num_draft_tokens),
                        ("num_accepted_tokens", spec.num_accepted_tokens)):
        assert m[f"slotserve:spec_decode_{name}_total"] == value > 0
        assert m[f"vllm:spec_decode_{name}_total{label}"] == value
    for position, count in enumerate(spec.accepted_per_position):
        labels = f'{{model_name="m",position="{position}"}}'
        assert m.get(f"vllm:spec_decode_num_accepted_tokens_per_pos_total{labels}", 0) == count
    assert spec.accepted_per_position[0] > 0
    assert m["slotserve:generation_tokens_total"] == 3 * 24
