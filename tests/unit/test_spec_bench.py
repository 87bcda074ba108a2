"""benchmarks/speculative.py's mechanics on a tiny random model: every setting runs every
round, greedy tokens equal the off run's, ratios and the summary come out; bad flags exit 2."""

from __future__ import annotations

import pytest

from benchmarks.speculative import (
    cell_groups,
    format_first_groups,
    format_summary,
    main,
    run_cell,
)
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


def test_cell_groups_send_every_prompt_batch_at_a_time():
    prompts = [[1], [2], [3], [4]]
    assert cell_groups(prompts, 1) == [[[1]], [[2]], [[3]], [[4]]]
    assert cell_groups(prompts, 3) == [[[1], [2], [3]], [[4], [1], [2]]]
    assert cell_groups(prompts, 4) == [prompts]
    assert cell_groups(prompts, 6) == [[[1], [2], [3], [4], [1], [2]]]
    with pytest.raises(ValueError, match="batch >= 1"):
        cell_groups(prompts, 0)


def test_a_batch_1_cell_runs_each_prompt_in_turn(tiny_llama):
    engines = {"off": LLM(engine=tiny_engine(tiny_llama)),
               "auto": LLM(engine=tiny_engine(tiny_llama, speculative_config=NGRAM))}
    traces: dict = {}
    cell = run_cell(engines, repetitive_prompts(3, seed=37), 10, rounds=1,
                    log=lambda _: None, traces=traces, batch=1)
    run = cell["auto"]["runs"][0]
    assert [g["output_tokens"] for g in run["groups"]] == [10, 10, 10]
    assert run["output_tokens"] == 30
    assert run["seconds"] == pytest.approx(sum(g["seconds"] for g in run["groups"]))
    assert cell["auto"]["identical_to_off"]
    # one trace per group, each of one request
    assert [len(t["requests"]) for t in traces["auto"][0]] == [1, 1, 1]
    first = run["groups"][0]["output_tok_s"] / cell["off"]["runs"][0]["groups"][0][
        "output_tok_s"]
    assert cell["auto"]["first_group_ratio"] == pytest.approx(first)
    report = {"settings": {"off": None, "auto": NGRAM}, "results": {"grounded": {"1": cell}}}
    assert format_first_groups(report).startswith("grounded batch 1: auto / off")


@pytest.mark.parametrize("flags", [["--rounds", "0"], ["--batches", "0"], ["--fixed", "x"]])
def test_bad_flags_are_usage_errors(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    assert exit_info.value.code == 2
