"""benchmarks/structured_cost.py's mechanics on a tiny random model: both sides produce the
same tokens, the schema side's masks are timed, the free side has none."""

from __future__ import annotations

import pytest

from benchmarks.structured_cost import main, run_rounds, schema_for
from slotserve.config import engine_config
from slotserve.engine.llm import LLM
from slotserve.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def tiny_llm(smollm2_vocab_model):
    """The offline API on tests/unit/conftest.py's tiny model with SmolLM2's vocabulary."""
    cfg, weights, tokenizer = smollm2_vocab_model
    engine = LLMEngine(engine_config(max_model_len=512, num_blocks=64, max_num_seqs=4), cfg,
                       weights, tokenizer=tokenizer)
    return LLM(engine=engine)


def test_rounds_compare_equal_token_counts_and_time_the_masks(tiny_llm):
    lines = []
    report = run_rounds(tiny_llm, requests=2, max_tokens=4, rounds=2, temperature=1.0,
                        log=lines.append)
    assert len(report["rounds"]) == 2 and len(lines) == 2 * 3
    for row in report["rounds"]:
        free, schema = row["free"], row["schema"]
        assert free["output_tokens"] == schema["output_tokens"] == 2 * 4
        assert free["finish_reasons"] == schema["finish_reasons"] == ["length"]
        assert free["mask_compute_s"] == 0 and free["masked_steps"] == 0
        assert schema["mask_compute_s"] > 0 and schema["masked_steps"] >= 4
        assert schema["sample"].lstrip().startswith("{")  # the grammar's first character
        assert row["ratio"] == pytest.approx(schema["output_tok_s"] / free["output_tok_s"])
    ratios = sorted(r["ratio"] for r in report["rounds"])
    assert report["median_ratio"] == pytest.approx(sum(ratios) / 2)
    assert report["met"] == (report["median_ratio"] >= 0.85)


def test_the_schema_needs_more_items_than_max_tokens_allows():
    for max_tokens in (1, 8, 128):
        people = schema_for(max_tokens)["properties"]["people"]
        assert people["minItems"] * 2 > max_tokens


def test_bad_flags_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--rounds", "0"])
    assert exit_info.value.code == 2 and "--rounds" in capsys.readouterr().err

