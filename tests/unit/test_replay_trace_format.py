"""A replay's trace (`slotserve simulate --trace real.json --save-trace sim.json`) is a real
run's trace in the same format: the loaders of both (the timeline's `build_grid`, the replay's
`requests_from_trace`) read it, its records carry the same fields, and `slotserve timeline
real.json --compare sim.json` draws the pair (the live view's replay panel reads the same files).
"""

from __future__ import annotations

import json

import pytest

from slotserve.cli import main
from slotserve.lab.replay import requests_from_trace
from slotserve.lab.timeline.grid import build_grid, check_trace
from slotserve.sampling import SamplingParams
from tests.conftest import random_prompts, tiny_engine

SETTINGS = dict(batching="continuous", max_num_seqs=3, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def real_and_simulated(tiny_llama, tmp_path_factory):
    """A real engine run's trace and its replay's, as files."""
    folder = tmp_path_factory.mktemp("traces")
    engine = tiny_engine(tiny_llama, kernels="reference", **SETTINGS)
    for i, prompt in enumerate(random_prompts(7, min_len=5, max_len=40, seed=11)):
        engine.add_request(f"req-{i}", prompt,
                           SamplingParams(max_tokens=3 + 2 * i, ignore_eos=True, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    real, simulated = folder / "real.json", folder / "sim.json"
    real.write_text(json.dumps(engine.trace.export()))
    assert main(["replay", str(real), "--clock", "iterations", "--max-num-batched-tokens", "32",
                 "--save-trace", str(simulated)]) == 0
    return real, simulated


def _load(path) -> dict:
    return json.loads(path.read_text())


def test_the_simulated_trace_loads_with_the_real_traces_loaders(real_and_simulated):
    real, simulated = map(_load, real_and_simulated)
    assert (real["source"], simulated["source"]) == ("engine", "replay")
    for trace in (real, simulated):
        check_trace(trace)
        grid = build_grid(trace)
        assert grid.num_slots == SETTINGS["max_num_seqs"]
        assert grid.num_columns == len(trace["iterations"]) > 0
        requests, info = requests_from_trace(trace)
        assert len(requests) == 7 and info["trace_num_slots"] == SETTINGS["max_num_seqs"]
    # The same requests, each with its recorded output (the schedules differ: arrivals a few
    # microseconds apart in the real run are separate instants on the unit clock).
    assert [(r["id"], r["prompt_tokens"], r["output_tokens"]) for r in simulated["requests"]] \
        == [(r["id"], r["prompt_tokens"], r["output_tokens"]) for r in real["requests"]]


def test_the_simulated_trace_has_the_real_traces_fields(real_and_simulated):
    real, simulated = map(_load, real_and_simulated)
    # The replay adds what it assumed (its cost model) and drops nothing; both record the
    # settings they ran with (the replay every one, the engine those beyond the header's).
    assert set(real) <= set(simulated)
    assert set(simulated) - set(real) == {"cost_model"}
    assert set(real["settings"]) <= set(simulated["settings"])
    assert real["settings"]["max_model_len"] == simulated["settings"]["max_model_len"] == 512
    assert {k: simulated[k] for k in ("version", "policy", "num_slots", "kv_blocks_total")} == \
        {k: real[k] for k in ("version", "policy", "num_slots", "kv_blocks_total")}
    assert [set(r) for r in simulated["requests"]] == [set(r) for r in real["requests"]]
    assert [r["id"] for r in simulated["requests"]] == [r["id"] for r in real["requests"]]
    assert {frozenset(it) for it in simulated["iterations"]} == \
        {frozenset(it) for it in real["iterations"]}
    cells = [{frozenset(c) for it in t["iterations"] for c in it["slots"] if c}
             for t in (real, simulated)]
    assert cells[0] == cells[1] == {frozenset({"request", "kind", "tokens"})}
    assert simulated["cost_model"] == {"kind": "unit"}
    assert simulated["settings"]["max_num_batched_tokens"] == 32


def test_timeline_draws_a_real_trace_and_its_replay_together(real_and_simulated, tmp_path,
                                                             capsys):
    real, simulated = real_and_simulated
    html, png = tmp_path / "pair.html", tmp_path / "pair.png"
    assert main(["timeline", str(real), str(simulated), "--html", str(html),
                 "--png", str(png), "--no-color"]) == 0
    out = capsys.readouterr().out
    # The terminal: the real run's strip, then its replay's below it.
    assert out.index(f"== {real}") < out.index("· engine ·") < out.index(f"== {simulated}") \
        < out.index("· replay ·")
    page = html.read_text()
    assert "engine" in page and "replay" in page
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --compare is the same pair; both forms at once is an error.
    again = tmp_path / "again.html"
    assert main(["timeline", str(real), "--compare", str(simulated), "--html", str(again),
                 "--no-color"]) == 0
    assert again.read_text() == page
    capsys.readouterr()
    assert main(["timeline", str(real), str(simulated), "--compare", str(simulated)]) == 2
    assert "give the second trace once" in capsys.readouterr().err
