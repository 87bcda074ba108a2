"""The live view's replay panel with any two traces, in headless Chromium: a real run's trace
(this server's /debug/trace, saved to a file) and its replay (`slotserve simulate --trace
real.json --max-num-seqs 2 --save-trace sim.json`), read by the page from files (nothing
uploaded), drawn side by side; then the server's own trace, live, and a file dropped on a pane.

The server, browser and page come from test_dashboard (the same tiny engine, paced).
"""

from __future__ import annotations

import json

import httpx

from slotserve.cli import main
from tests.e2e import test_dashboard as dashboard
from tests.e2e.test_dashboard import ARTIFACTS, open_dashboard, start_requests, wait_idle

# The dashboard tests' fixtures (this module gets its own server).
browser, page, live_server = dashboard.browser, dashboard.page, dashboard.live_server

SIM_SLOTS = 2

PANES = """() => ['static', 'continuous'].map((side) => {
    const pane = document.querySelector('#replay-' + side);
    const canvas = pane.querySelector('canvas');
    const g = canvas.geometry;
    const d = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
    let colored = 0; // request-colored pixels: saturated (idle, ghosts and text are grey)
    for (let i = 0; i < d.length; i += 4) {
        const hi = Math.max(d[i], d[i + 1], d[i + 2]), lo = Math.min(d[i], d[i + 1], d[i + 2]);
        if (d[i + 3] === 255 && hi - lo > 60) colored++;
    }
    return {iterations: Number(pane.dataset.iterations), policy: pane.dataset.policy,
            title: pane.querySelector('h3').textContent,
            source: pane.querySelector('.source').textContent,
            drawn: g ? g.columns.length : 0, revealed: g ? g.revealed : 0,
            slots: g ? g.numSlots : 0, colored};
})"""


def real_and_simulated(server, folder):
    """This server's trace after a few requests, and its replay on fewer slots, as files."""
    start_requests(server, "panel", n=4, max_tokens=6)
    wait_idle(server)
    real_trace = httpx.get(f"{server.url}/debug/trace").json()
    real, simulated = folder / "real.json", folder / "sim.json"
    real.write_text(json.dumps(real_trace))
    assert main(["replay", str(real), "--clock", "iterations", "--max-num-seqs", str(SIM_SLOTS),
                 "--save-trace", str(simulated)]) == 0
    return real, simulated


DROP = """([selector, text]) => {
    const transfer = new DataTransfer();
    transfer.items.add(new File([text], 'dropped.json', {type: 'application/json'}));
    document.querySelector(selector).dispatchEvent(
        new DragEvent('drop', {dataTransfer: transfer, bubbles: true, cancelable: true}));
}"""


def wait_for_title(page, side: str, title: str) -> None:
    page.wait_for_function(
        "([side, title]) => document.querySelector(`#replay-${side} h3`).textContent === title",
        arg=[side, title])


def test_panel_draws_a_real_trace_and_its_replay_side_by_side(page, live_server, tmp_path):
    real, simulated = real_and_simulated(live_server, tmp_path)
    real_trace, sim_trace = json.loads(real.read_text()), json.loads(simulated.read_text())
    assert sim_trace["source"] == "replay" and sim_trace["num_slots"] == SIM_SLOTS
    open_dashboard(page, live_server)

    page.set_input_files("#rp-file-a", str(real))
    wait_for_title(page, "static", "real.json")
    left, right = page.evaluate(PANES)
    assert left["iterations"] == left["drawn"] == left["revealed"] == len(real_trace["iterations"])
    assert right["iterations"] == 0 and right["title"] == "(no trace)"  # the seed's pair is gone
    assert "sim.json" in page.locator("#replay-note").inner_text()  # says how to make one

    page.set_input_files("#rp-file-b", str(simulated))
    wait_for_title(page, "continuous", "sim.json")
    left, right = page.evaluate(PANES)
    assert left["iterations"] == left["drawn"] == left["revealed"] == len(real_trace["iterations"])
    assert right["iterations"] == right["drawn"] == right["revealed"] == \
        len(sim_trace["iterations"])
    assert (left["slots"], right["slots"]) == (real_trace["num_slots"], SIM_SLOTS)
    assert left["colored"] > 0 and right["colored"] > 0
    assert left["source"].startswith("real run (engine) · continuous")
    assert right["source"].startswith("simulated (replay, unit clock) · continuous · 2 slots")
    assert "512-token budget" in right["source"]
    assert page.locator("#replay-title").inner_text() == "Replay: two traces side by side"
    note = page.locator("#replay-note")
    assert "error" not in note.get_attribute("class")
    assert "right / left" in note.inner_text() and "real.json" in note.inner_text()
    assert page.locator("#replay-step").get_attribute("data-step") == \
        str(max(left["iterations"], right["iterations"]))
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#replay").screenshot(path=str(ARTIFACTS / "dashboard-replay-real-vs-sim.png"))

    page.keyboard.press("Home")  # both step together from the start
    page.keyboard.press("ArrowRight")
    left, right = page.evaluate(PANES)
    assert left["revealed"] == right["revealed"] == 1
    assert page.errors == []


def test_panel_takes_the_live_trace_a_dropped_file_and_refuses_a_bad_one(page, live_server,
                                                                         tmp_path):
    real, simulated = real_and_simulated(live_server, tmp_path)
    open_dashboard(page, live_server)
    page.set_input_files("#rp-file-a", str(simulated))
    wait_for_title(page, "static", "sim.json")
    page.evaluate(DROP, ["#replay-note", real.read_text()])  # on the card: the free pane
    wait_for_title(page, "continuous", "dropped.json")
    assert page.evaluate(PANES)[0]["title"] == "sim.json"

    page.click("#rp-server-b")
    wait_for_title(page, "continuous", "this server, live")
    live_iterations = len(httpx.get(f"{live_server.url}/debug/trace").json()["iterations"])
    left, right = page.evaluate(PANES)
    assert left["title"] == "sim.json"  # the other pane keeps its trace
    assert right["iterations"] == right["drawn"] == live_iterations
    assert right["source"].startswith("real run (engine)")

    page.evaluate(DROP, ["#replay-static canvas", real.read_text()])  # on a pane: that pane
    wait_for_title(page, "static", "dropped.json")
    assert page.evaluate(PANES)[0]["iterations"] == len(json.loads(real.read_text())["iterations"])

    page.set_input_files("#rp-file-b", files=[{"name": "bad.json", "mimeType": "application/json",
                                              "buffer": b'{"version": 2, "iterations": []}'}])
    page.wait_for_selector("#replay-note.error")
    assert "bad.json" in page.locator("#replay-note").inner_text()
    assert "version must be 1" in page.locator("#replay-note").inner_text()
    assert page.evaluate(PANES)[1]["title"] == "this server, live"  # nothing replaced

    page.click("#rp-form button[type=submit]")  # the seed's pair again
    wait_for_title(page, "static", "Static batching")
    assert page.evaluate(PANES)[0]["iterations"] == 12
    assert page.errors == []
