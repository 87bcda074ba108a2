"""benchmarks/speculative.py's W and online cells (issue 35) on a tiny random model: fresh
warmed engines through `run_bench`, interleaved, TPOT and tok/s ratios; issue 35's targets
checked; the traces saved and predicted from again without a model."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.speculative import (
    CONTROL,
    WarmedTarget,
    check_targets,
    format_latency,
    format_summary,
    format_targets,
    load_traces,
    main,
    online_workload,
    run_bench_cell,
    run_cell,
    save_traces,
)
from slotserve.config import ModelConfig
from slotserve.engine.llm import LLM
from slotserve.lab.bench import BenchSampling
from slotserve.lab.workload import BenchRequest, Workload, with_poisson_arrivals
from tests.unit.test_spec_engine import NGRAM, repetitive_prompts


@pytest.fixture(scope="module")
def targets(tiny_llama) -> dict[str, WarmedTarget]:
    cfg = ModelConfig.from_hf_dict(tiny_llama.config.to_dict())
    weights = {k: v.detach().clone() for k, v in tiny_llama.state_dict().items()}
    base = WarmedTarget(cfg, weights, None, dict(max_model_len=256, max_num_seqs=4,
                                                 quantization="none"))
    return {"off": base.configured(speculative_config=None),
            "auto": base.configured(speculative_config=NGRAM)}


def _poisson(count: int, rate: float) -> Workload:
    requests = tuple(BenchRequest(id=str(i), max_tokens=12, prompt=prompt)
                     for i, prompt in enumerate(repetitive_prompts(count, seed=7)))
    return with_poisson_arrivals(Workload(requests, {}), rate, seed=0)


def test_a_bench_cell_runs_every_setting_each_round_on_warmed_engines(targets):
    traces: dict = {}
    lines: list[str] = []
    cell = run_bench_cell(targets, _poisson(4, 200.0), BenchSampling(), 2, lines.append,
                          traces)
    assert len(lines) == 4 and [len(traces[n]) for n in ("off", "auto")] == [2, 2]
    for name in ("off", "auto"):
        for run in cell[name]["runs"]:
            assert run["completed"] == 4 and run["failed"] == 0
            assert run["output_tokens"] == 4 * 12 and run["tpot_p99_ms"] > 0
    assert all(r["draft_tokens"] == 0 for r in cell["off"]["runs"])
    assert sum(r["draft_tokens"] for r in cell["auto"]["runs"]) > 0
    assert cell["auto"]["median_ratio"] > 0 and cell["auto"]["tpot_p99_ratio"] > 0
    # the warm-up request is not in the run's trace; the engine is let go after the run
    ids = {str(r["id"]) for t in traces["auto"] for r in t["requests"]}
    assert ids == {"0", "1", "2", "3"}
    assert targets["auto"].last_engine is None


def test_online_workloads_cycle_the_prompts_on_one_arrival_schedule():
    texts = ("a", "b", "c")
    first, again = (online_workload(texts, 7, 2.0, 64) for _ in range(2))
    assert [r.arrival for r in first.requests] == [r.arrival for r in again.requests]
    arrivals = [r.arrival for r in first.requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert [r.messages[0]["content"] for r in first.requests] == list("abcabca")
    assert all(r.max_tokens == 64 for r in first.requests)


def _cell(ratio: float, p99: float) -> dict:
    run = {"output_tok_s": 100.0, "tpot_p50_ms": 5.0, "tpot_p99_ms": 8.0,
           "draft_tokens": 0, "accepted_tokens": 0}
    on = dict(run, output_tok_s=100.0 * ratio, tpot_p99_ms=8.0 * p99, draft_tokens=9,
              accepted_tokens=6)
    return {"off": {"runs": [run]},
            "auto": {"runs": [on], "median_ratio": ratio, "tpot_p99_ratio": p99}}


def test_the_issue_s_targets_are_checked_per_cell():
    report = {"settings": {"off": None, "auto": "{}"},
              "results": {"grounded": {"1": _cell(2.1, 0.5), "4": _cell(1.4, 0.9),
                                       "64": _cell(0.98, 1.1)},
                          "W": {"64": _cell(0.96, 1.0)}},
              "online": {"free": {"2": _cell(1.0, 1.2)}}}
    checks = {c["target"]: c["met"] for c in check_targets(report)}
    assert checks == {
        "grounded batch 1 tok/s >= 2.0x": True, "grounded batch 4 tok/s >= 1.5x": False,
        "grounded batch 64 tok/s >= 0.97x": True, "W tok/s >= 0.97x": False,
        "grounded batch 1 TPOT p99 <= 1.0x off": True,
        "grounded batch 4 TPOT p99 <= 1.0x off": True,
        "grounded batch 64 TPOT p99 <= 1.0x off": False,
        "W 64 TPOT p99 <= 1.0x off": True, "free 2 req/s TPOT p99 <= 1.0x off": False}
    table = format_latency(report)
    assert "| W | 64 | auto | 96 | 0.96x | 5.0 | 8.0 | 1.00x | 6 / 9 |" in table
    assert "| free | 2 req/s | auto |" in table
    assert "| W | 64 | 0.96x | - |" in format_summary(report)  # identity not checked


def test_the_control_s_tpot_p99_ratio_stands_beside_each_target():
    """--control: off2 / off is reported beside auto's TPOT p99 ratio, which alone decides
    whether the target is met."""
    cell = _cell(1.0, 1.03)
    cell[CONTROL] = {"runs": cell["off"]["runs"], "median_ratio": 1.0, "tpot_p99_ratio": 1.05}
    report = {"settings": {"off": None, "auto": "{}", CONTROL: None},
              "results": {"free": {"4": cell, "16": _cell(1.0, 0.99)}}}
    checks = {c["target"]: c for c in check_targets(report)}
    assert checks["free batch 4 TPOT p99 <= 1.0x off"] == {
        "target": "free batch 4 TPOT p99 <= 1.0x off", "value": 1.03, "met": False,
        "control": 1.05}
    assert "control" not in checks["free batch 16 TPOT p99 <= 1.0x off"]
    lines = format_targets(list(checks.values())).splitlines()
    assert "NOT met  free batch 4 TPOT p99 <= 1.0x off: 1.03x (off2 / off 1.05x)" in lines
    assert "met      free batch 16 TPOT p99 <= 1.0x off: 0.99x" in lines
    # the replay predicts auto's ratio, not the control's: no prediction columns for it
    report["replay"] = {}
    for each in report["results"]["free"].values():
        each["auto"]["replay"] = {"predicted_ratio": 1.0, "error": 0.0}
        each.setdefault(CONTROL, {"runs": [], "median_ratio": 1.0})
    summary = format_summary(report).splitlines()
    assert summary[0] == ("| workload | batch | auto / off | auto predicted | error | "
                          "off2 / off | identical |")
    assert summary[2] == "| free | 4 | 1.00x | 1.00x | +0% | 1.00x | - |"


def test_saved_traces_predict_again_without_a_model(tiny_llama, tmp_path, capsys):
    from tests.conftest import tiny_engine

    engines = {"off": LLM(engine=tiny_engine(tiny_llama, max_num_seqs=4)),
               "auto": LLM(engine=tiny_engine(tiny_llama, max_num_seqs=4,
                                              speculative_config=NGRAM))}
    traces: dict = {"grounded": {}}
    results = {"grounded": {}}
    for batch in (1, 4):  # two batch sizes: the fit tells a row's cost from a step's
        traces["grounded"][str(batch)] = {}
        # NOTE: batch 1 sends 2 prompts in turn: a run of two groups, predicted as one
        results["grounded"][str(batch)] = run_cell(
            engines, repetitive_prompts(max(batch, 2), seed=5), 16, 1, lambda _: None,
            traces["grounded"][str(batch)], batch)
    report = {"settings": {"off": None, "auto": NGRAM}, "results": results, "rounds": 1}
    path, out = tmp_path / "traces.json.gz", tmp_path / "report.json"
    save_traces(str(path), report, traces)
    assert load_traces(str(path)) == (json.loads(json.dumps(report)),
                                      json.loads(json.dumps(traces)))
    assert main(["--from-traces", str(path), "--clock", "linear", "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["replay"]["clock"].startswith("linear fit")
    assert written["replay"]["within"]["auto"][1] == 2
    for batch in ("1", "4"):
        replayed = written["results"]["grounded"][batch]["auto"]["replay"]
        assert math.isfinite(replayed["predicted_ratio"]) and replayed["predicted_ratio"] > 0
    rounds = written["results"]["grounded"]["1"]["auto"]["replay"]["rounds"]
    assert rounds[0]["output_tokens"] == 2 * 16  # the two groups' tokens, replayed as one run
    assert any(t["target"].startswith("grounded batch 1 tok/s") for t in written["targets"])
    assert "| grounded | 4 |" in capsys.readouterr().out


@pytest.mark.parametrize("content", [b"not gzip", None])
def test_a_bad_traces_file_is_a_usage_error(content, tmp_path, capsys):
    path = tmp_path / "traces.json.gz"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as exit_info:
        main(["--from-traces", str(path)])
    assert exit_info.value.code == 2 and "--from-traces" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--online", "0"], ["--online", "inf"],
                                   ["--online-requests", "0"]])
def test_bad_online_flags_are_usage_errors(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    assert exit_info.value.code == 2
