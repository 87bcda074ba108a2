"""The replay lab names the admission rule `batching`, as the engine's config does (issue 33:
"policy" also named the queue order). A trace still records it under its header's `policy`
(trace format version 1), and `slotserve replay` keeps reading it from there."""

from __future__ import annotations

import json

import pytest

from slotserve.cli import main
from slotserve.lab.replay import ReplayRequest, ReplaySettings, UnitCost, replay
from slotserve.lab.replay.plan import SLO, format_plan, search

OUTPUTS = [8, 1, 8, 1]  # on 2 slots, static waits for each pair's long one


def _write_trace(path, policy: str) -> None:
    """A version-1 engine trace of OUTPUTS' requests on two slots, its rule under `policy`."""
    records = [{"id": str(i), "arrival": 0.0, "prompt_tokens": 4, "output_tokens": n}
               for i, n in enumerate(OUTPUTS)]
    path.write_text(json.dumps({"version": 1, "source": "engine", "policy": policy,
                                "num_slots": 2, "kv_blocks_total": 16, "requests": records,
                                "iterations": []}))


def _replayed(tmp_path, trace, *flags) -> tuple[dict, dict]:
    """(the bench row's config, the replay's own trace) of `slotserve replay`."""
    out, saved = tmp_path / "r.json", tmp_path / "s.json"
    assert main(["replay", str(trace), "--clock", "iterations", "--out", str(out),
                 "--save-trace", str(saved), *flags]) == 0
    (row,) = json.loads(out.read_text())["results"]
    return row["config"], json.loads(saved.read_text())


def test_replay_settings_name_the_admission_rule_batching():
    settings = ReplaySettings(batching="static", max_num_seqs=2)
    assert settings.scheduler_config().policy == "static"
    with pytest.raises(TypeError, match="policy"):
        ReplaySettings(policy="static")  # type: ignore[call-arg]  # the old name: loud
    with pytest.raises(ValueError, match="policy must be one of"):
        ReplaySettings(batching="fair").scheduler_config()


def test_a_replay_records_its_rule_as_batching_in_settings_and_policy_in_the_header():
    requests = [ReplayRequest(str(i), 4, n) for i, n in enumerate(OUTPUTS)]
    static = replay(requests, ReplaySettings(batching="static", max_num_seqs=2), UnitCost())
    assert static.trace["policy"] == "static"  # the trace format's header key
    assert static.trace["settings"]["batching"] == "static"
    assert "policy" not in static.trace["settings"]
    assert static.config()["batching"] == "static"
    assert static.bench_result().label == "static"
    continuous = replay(requests, ReplaySettings(max_num_seqs=2), UnitCost())
    assert continuous.iterations < static.iterations  # the rule took effect


@pytest.mark.parametrize("recorded", ["static", "continuous"])
def test_replay_takes_the_rule_from_an_old_traces_policy_header(tmp_path, recorded):
    trace = tmp_path / "t.json"
    _write_trace(trace, recorded)
    config, saved = _replayed(tmp_path, trace)
    assert config["batching"] == saved["policy"] == saved["settings"]["batching"] == recorded
    other = "continuous" if recorded == "static" else "static"
    config, saved = _replayed(tmp_path, trace, "--batching", other)  # the flag wins
    assert config["batching"] == saved["policy"] == other
    # a replay's own trace replays again with the same rule
    again = tmp_path / "again.json"
    again.write_text(json.dumps(saved))
    config, _ = _replayed(tmp_path, again)
    assert config["batching"] == other


def test_plan_searches_batching_rules_and_names_them_so():
    requests = [ReplayRequest(str(i), 4, 3) for i in range(6)]
    slo = SLO(ttft_ms=10_000, tpot_ms=10_000)
    candidates = search(requests, slo, UnitCost(), batching=("static", "continuous"),
                        max_num_seqs=(2,), max_num_batched_tokens=(64,), rates=(float("inf"),))
    assert sorted(c.settings.batching for c in candidates) == ["continuous", "static"]
    text = format_plan(candidates, slo)
    assert text.splitlines()[1].startswith("batching")
    assert f"best: --batching {candidates[0].settings.batching} " in text
