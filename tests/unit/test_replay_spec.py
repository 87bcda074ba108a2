"""The replay models speculative decoding (issue 35): verifications cost a 1 + k token chunk,
drafts are offered and accepted as the trace recorded them (`lab/replay/speculation.py`).

One engine run with ngram speculation on a tiny model records the trace every test replays.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from slotserve.cli import main
from slotserve.config import SlotKind
from slotserve.core.outputs import ScheduledSeq, SchedulerOutput
from slotserve.lab.replay import (
    ReplayRequest,
    ReplaySettings,
    StepFeatures,
    UnitCost,
    replay,
    requests_from_trace,
)
from slotserve.lab.replay.speculation import DraftOracle, recorded_verifications
from slotserve.sampling import SamplingParams
from tests.conftest import random_prompts, tiny_engine

DRAFTS = 4
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": DRAFTS,
                   "prompt_lookup_min": 1, "prompt_lookup_max": 3})
RUN = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512)


@pytest.fixture(scope="module")
def spec_trace(tiny_llama) -> dict:
    engine = tiny_engine(tiny_llama, kernels="reference", speculative_config=SPEC, **RUN)
    for i, prompt in enumerate(random_prompts(8, min_len=4, max_len=20, seed=1)):
        engine.add_request(f"q{i}", prompt, SamplingParams(max_tokens=12 + 3 * i,
                                                           ignore_eos=True, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    return json.loads(json.dumps(engine.trace.export()))


def _at_once(trace: dict) -> list[ReplayRequest]:
    """The trace's requests, all at t=0 (the run's arrivals are microseconds apart, separate
    instants on the unit clock)."""
    requests, _ = requests_from_trace(trace)
    return [replace(r, arrival=0.0) for r in requests]


def _verified(trace: dict) -> tuple[int, int]:
    slots = [s for it in trace["iterations"] for s in it["slots"] if s and s.get("proposed")]
    return sum(s["proposed"] for s in slots), sum(s["accepted"] for s in slots)


def _outputs(result) -> dict[str, int]:
    return {o.id: len(o.token_times) for o in result.outcomes}


def test_the_run_s_own_settings_replay_its_verifications_exactly(spec_trace):
    proposed, accepted = _verified(spec_trace)
    assert proposed > accepted > 0  # the run speculated, and some drafts were rejected
    result = replay(_at_once(spec_trace), ReplaySettings(**RUN, speculative_config=SPEC),
                    UnitCost(), check=True)
    # Every slot of every iteration: the same request, kind, tokens, proposed and accepted.
    assert [it["slots"] for it in result.trace["iterations"]] == \
        [it["slots"] for it in spec_trace["iterations"]]
    assert _outputs(result) == {r["id"]: r["output_tokens"] for r in spec_trace["requests"]}


@pytest.mark.parametrize("slots", [2, 8])
def test_other_slots_replay_the_same_tokens_in_a_plausible_number_of_steps(spec_trace, slots):
    requests = _at_once(spec_trace)
    settings = ReplaySettings(**{**RUN, "max_num_seqs": slots}, speculative_config=SPEC)
    on = replay(requests, settings, UnitCost(), check=True)
    off = replay(requests, replace(settings, speculative_config=None), UnitCost(), check=True)
    recorded = {r["id"]: r["output_tokens"] for r in spec_trace["requests"]}
    assert _outputs(on) == _outputs(off) == recorded
    proposed, accepted = _verified(on.trace)
    assert 0 < accepted < proposed
    # Each accepted draft saves a decode step at most; the longest request bounds below.
    longest = max(recorded.values())
    assert off.iterations - accepted <= on.iterations < off.iterations
    assert on.iterations >= longest / (1 + DRAFTS)
    assert on.duration < off.duration


def test_a_trace_with_drafts_replays_with_auto_speculation_unless_told(spec_trace, tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(spec_trace))
    requests, info = requests_from_trace(spec_trace)
    assert json.loads(info["trace_settings"]["speculative_config"])[
        "num_speculative_tokens"] == "auto"
    assert info["trace_speculation"]["proposed"] == _verified(spec_trace)[0]

    def iterations(*flags) -> int:
        out = tmp_path / "r.json"
        assert main(["replay", str(path), "--clock", "iterations", "--request-rate", "inf",
                     "--out", str(out), *flags]) == 0
        (row,) = json.loads(out.read_text())["results"]
        return row["iterations"]

    fixed, off = iterations("--speculative-config", SPEC), iterations(
        "--speculative-config", "null")
    assert fixed == len(spec_trace["iterations"]) < off
    assert iterations() < off  # auto, from the trace


def test_a_bad_speculative_config_is_refused_naming_it(spec_trace, tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(spec_trace))
    assert main(["replay", str(path), "--clock", "iterations",
                 "--speculative-config", '{"method": "medusa"}']) != 0
    assert "speculative_config" in capsys.readouterr().err
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        ReplaySettings(speculative_config={"method": "ngram", "num_speculative_tokens": 0})


def test_plan_searches_with_the_trace_s_speculation(spec_trace, tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(spec_trace))
    assert main(["plan", "--workload", str(path), "--slo-ttft-ms", "1e9", "--slo-tpot-ms",
                 "1e9", "--max-num-seqs", "2,4", "--max-num-batched-tokens", "64",
                 "--rates", "inf"]) == 0
    assert "replays of 8 requests" in capsys.readouterr().out


def test_a_verification_among_decodes_costs_decode_rows_with_logits_at_every_row():
    params = SamplingParams(max_tokens=8)
    verify = ScheduledSeq("v", [7, 1, 2, 3], 10, [0], True, params, 3, SlotKind.DECODE,
                          spec_token_ids=[1, 2, 3])
    decode = ScheduledSeq("d", [9], 20, [1], True, params, 5, SlotKind.DECODE)
    plan = SchedulerOutput(0, [verify, decode], [None, None])
    features = StepFeatures.of(plan)
    # decodes only (the decode stack): 2 decodes and 3 draft rows, all decode rows; 4 + 1
    # rows of logits; pairs: 4 tokens after 10 (4*10 + 10) and 1 after 20 (21); of them
    # the verification's rows after its first (50 - 11) are drafted pairs; the two first
    # rows' (11 + 21) are decode pairs.
    assert features == StepFeatures(prefill_tokens=0, decode_seqs=5, attention_pairs=71,
                                    sampled_rows=5, draft_pairs=39, decode_pairs=32)


def test_verifications_are_placed_at_their_output_positions():
    def it(*slots):
        return {"index": 0, "slots": list(slots)}

    iterations = [it({"request": "a", "kind": "prefill", "tokens": 9}),
                  it({"request": "a", "kind": "decode", "tokens": 1}),  # at 1
                  it({"request": "a", "kind": "decode", "tokens": 4, "proposed": 3,
                      "accepted": 2}),  # at 2: 2 + 1 tokens
                  it({"request": "a", "kind": "stalled", "tokens": 0}),
                  it({"request": "a", "kind": "decode", "tokens": 3, "proposed": 2,
                      "accepted": 0}),  # at 5
                  it({"request": "a", "kind": "prefill", "tokens": 15}),  # recomputed: +1
                  it({"request": "a", "kind": "decode", "tokens": 2, "proposed": 1,
                      "accepted": 1})]  # at 7
    found = recorded_verifications(iterations)
    assert found == {"a": [(2, 3, 2), (5, 2, 0), (7, 1, 1)]}
    oracle = DraftOracle(found)
    # Inside an accepted run a replay that drafted fewer finds the rest of what was offered.
    assert [len(oracle.propose("a", [], [0] * t, 8)) for t in range(9)] == \
        [0, 0, 3, 2, 1, 2, 0, 1, 0]
    assert [oracle.accepted("a", t, 8) for t in (2, 3, 4, 5, 7)] == [2, 1, 0, 0, 1]
    assert oracle.accepted("a", 2, 1) == 1 and oracle.accepted("b", 2, 4) == 0


@pytest.mark.parametrize("slot", [{"proposed": 2, "accepted": 3}, {"proposed": -1},
                                  {"proposed": 2, "accepted": "1"}])
def test_bad_draft_counts_in_a_trace_are_an_error_naming_them(slot):
    trace = {"requests": [{"id": "a", "arrival": 0.0, "prompt_tokens": 4,
                           "output_tokens": 3}],
             "iterations": [{"index": 5, "slots": [
                 {"request": "a", "kind": "decode", "tokens": 3, **slot}]}]}
    with pytest.raises(ValueError, match="iteration 5: .*proposed"):
        requests_from_trace(trace)
