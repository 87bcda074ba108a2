"""Chaos, the CI variant of benchmarks/chaos.py: a victim beside an adversary that sends every
bad input of issue 14; the victim must not notice and the server must stay whole.

6 victim streams, one solo run then one run beside the adversary (one pass over every
attack, and the slow-loris uploads). Asserted: 0 victim errors, outputs equal to solo,
every attack answered as expected (no 5xx, no hang: each request has a timeout), /health
200, nothing running, every KV block free, no traceback, each abandoned stream aborted.

NOTE: the victim's TPOT ratio (chaos / solo) is only printed here: on a shared 2-core CI
machine one round of 6 streams is too noisy to bound. The benchmark checks it (1.25x over
interleaved rounds; benchmarks/RELIABILITY.md).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from benchmarks import chaos
from tests.e2e.conftest import running_server

VICTIMS, MAX_TOKENS = 6, 16


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """`slotserve serve` with the victim's and the adversary's keys and an admin key."""
    log_dir = tmp_path_factory.mktemp("chaos")
    keys = chaos.write_keys_file(log_dir / "keys.txt")
    with running_server(log_dir, *chaos.server_flags(keys)) as proc:
        yield proc


def test_the_victim_does_not_notice_the_adversary(keyed_server):
    report = chaos.chaos(keyed_server.url, victims=VICTIMS, rounds=1, max_tokens=MAX_TOKENS,
                         gap_s=0.05, min_passes=1, tpot_ratio=None,
                         log_path=keyed_server.log_path)
    print(report.summary())
    assert report.victim_errors == 0 and report.victim_outputs_differing == 0
    assert report.solo_tpot_ms["n"] == report.chaos_tpot_ms["n"] == VICTIMS
    expected = {**chaos.ATTACKS, **chaos.SLOW_LORIS}
    assert set(report.attacks) == set(expected)  # every attack ran
    for name, (_, statuses) in expected.items():
        got = set(report.attacks[name]["statuses"])
        assert got <= {str(s) for s in statuses}, (name, report.attacks[name])
    assert report.health_after == 200
    final = report.final_metrics
    assert final["num_requests_running"] == final["num_requests_waiting"] == 0
    assert final["kv_blocks_free"] == final["kv_blocks_total"] > 0
    assert report.server_log["tracebacks"] == 0
    assert report.server_log["streams_left_aborted"] == report.server_log["streams_left"] >= 1
    assert not report.failures, report.summary()
    assert keyed_server.stop() == 0


# --------------------------------------------------------------------------- found
@pytest.fixture
def two_connection_server(tmp_path):
    keys = chaos.write_keys_file(tmp_path / "keys.txt")
    with running_server(tmp_path, *chaos.server_flags(keys), "--max-connections=2",
                        "--body-timeout=3") as proc:
        yield proc


def test_slow_loris_uploads_do_not_lock_out_other_tenants(two_connection_server):
    """Two slow uploads of one tenant fill --max-connections 2; another tenant's request
    must still be served (a body that stalls should time out, or not count)."""
    url = two_connection_server.url

    async def run() -> int:
        done = asyncio.Event()
        lorises = [asyncio.ensure_future(chaos.slow_loris(url, chaos.ADVERSARY_KEY, done, 30))
                   for _ in range(2)]
        await asyncio.sleep(3)  # both are dribbling their bodies now
        try:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                r = await client.post("/v1/completions", json=chaos.small(temperature=0.0),
                                      headers={"Authorization": f"Bearer {chaos.VICTIM_KEY}"})
            return r.status_code
        finally:
            done.set()
            await asyncio.gather(*lorises)

    assert asyncio.run(run()) == 200


def test_a_body_that_never_completes_gets_408(two_connection_server):
    """A keyed upload dribbled past --body-timeout (3 s here) is answered 408, not kept."""
    url = two_connection_server.url

    async def run():
        return await chaos.slow_loris(url, chaos.ADVERSARY_KEY, asyncio.Event(), 20)

    outcome = asyncio.run(run())
    assert outcome.status == 408, outcome
