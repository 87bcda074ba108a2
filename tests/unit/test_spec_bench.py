"""benchmarks/speculative.py's mechanics on a tiny random model: every setting runs every
round, greedy tokens equal the off run's, ratios and the summary come out; bad flags exit 2."""

from __future__ import annotations

import pytest

from benchmarks.speculative import format_summary, main, run_cell
from slotserve.engine.llm import LLM
from tests.conftest import tiny_engine
from tests.unit.test_spec_engine import NGRAM, repetitive_prompts


def test_run_cell_interleaves_and_compares(tiny_llama):
    engines = {"off": LLM(engine=tiny_engine(tiny_llama)),
               "auto": LLM(engine=tiny_engine(tiny_llama, speculative_config=NGRAM))}
    lines = []
    cell = run_cell(engines, repetitive_prompts(2, seed=31), 12, rounds=2, log=lines.append)
    assert len(lines) == 4 and len(cell["off"]["runs"]) == len(cell["auto"]["runs"]) == 2
    assert cell["auto"]["identical_to_off"] and cell["auto"]["median_ratio"] > 0
    assert all(r["output_tokens"] == 2 * 12 for r in cell["auto"]["runs"])
    assert sum(r["draft_tokens"] for r in cell["auto"]["runs"]) > 0
    report = {"settings": {"off": None, "auto": NGRAM}, "results": {"grounded": {"2": cell}}}
    assert "| grounded | 2 |" in format_summary(report)


@pytest.mark.parametrize("flags", [["--rounds", "0"], ["--batches", "0"], ["--fixed", "x"]])
def test_bad_flags_are_usage_errors(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    assert exit_info.value.code == 2
