"""The live view marks speculative decoding per slot (issue 35): a decode verified with drafts
gets a band at the foot of its cell (accepted drafts light, rejected dark) and the page lists
each slot's drafts accepted of proposed, from the iteration events' `proposed` / `accepted`.

One server (test_dashboard's test app) over a tiny random Llama with ngram speculation (its
greedy output repeats itself, so prompt lookup finds drafts, some right, some wrong), paced
so the page sees the batch; headless Chromium as in test_dashboard (skips without it).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import tiny_engine, tiny_hf_model
from tests.e2e.test_dashboard import (  # noqa: F401 (browser and page are fixtures)
    BLOCK_SIZE,
    browser,
    open_dashboard,
    page,
    screenshot,
    serve_slowed,
    start_requests,
    wait_idle,
)

NUM_SLOTS = 4
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 3})
STEP_DELAY_S = 0.03

# Opaque pure-white pixels of the live strip: only accepted drafts' bands are drawn white.
ACCEPTED_PIXELS = """() => {
    const c = document.querySelector('#live-strip');
    const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
    let n = 0;
    for (let i = 0; i < d.length; i += 4) {
        if (d[i] === 255 && d[i + 1] === 255 && d[i + 2] === 255 && d[i + 3] === 255) n++;
    }
    return n;
}"""
PER_SLOT = """() => Object.fromEntries([...document.querySelectorAll('#live-spec li[data-slot]')]
    .map(li => [li.dataset.slot, [Number(li.dataset.proposed), Number(li.dataset.accepted)]]))"""


@pytest.fixture(scope="module")
def spec_server():
    yield from serve_slowed(tiny_engine(tiny_hf_model(), kernels="reference",
                                        max_num_seqs=NUM_SLOTS, num_blocks=64,
                                        block_size=BLOCK_SIZE, max_model_len=256,
                                        speculative_config=SPEC), STEP_DELAY_S)


def _per_slot_totals(trace: dict) -> dict[str, list[int]]:
    totals: dict[str, list[int]] = {}
    for iteration in trace["iterations"]:
        for s, cell in enumerate(iteration["slots"]):
            if cell and cell.get("proposed"):
                entry = totals.setdefault(str(s), [0, 0])
                entry[0] += cell["proposed"]
                entry[1] += cell["accepted"]
    return totals


def test_the_live_strip_marks_drafts_per_slot(page, spec_server):  # noqa: F811
    open_dashboard(page, spec_server)
    assert page.locator("#live-spec").is_hidden()  # no speculation in view yet
    start_requests(spec_server, "spec", n=6, max_tokens=24)
    page.wait_for_function("() => Number(document.querySelector('#live-spec')"
                           ".dataset.proposed) > 0")
    assert page.locator("#live-spec").is_visible()
    assert page.locator("#live-spec-key").is_visible()
    wait_idle(spec_server)
    trace = httpx.get(f"{spec_server.url}/debug/trace").json()
    expected = _per_slot_totals(trace)
    proposed = sum(p for p, _ in expected.values())
    accepted = sum(a for _, a in expected.values())
    assert proposed > accepted > 0, "the run should verify drafts, some right, some wrong"
    # The whole run fits in the strip: the page's per-slot counts are the trace's.
    page.wait_for_function(f"() => Number(document.querySelector('#live-spec')"
                           f".dataset.proposed) === {proposed}")
    assert page.evaluate(PER_SLOT) == {s: [p, a] for s, (p, a) in expected.items()}
    assert page.locator("#live-spec").get_attribute("data-accepted") == str(accepted)
    assert page.locator("#live-spec li").first.inner_text().endswith("%)")
    assert page.evaluate(ACCEPTED_PIXELS) > 0
    screenshot(page, "dashboard-speculation.png")
    assert page.errors == []
