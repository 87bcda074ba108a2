"""The live view of a replica set without Ray: each replica's IterationTap, the ingress's
ReplicaFront forwarding their iterations (tagged with the replica) to the live view's
LiveFeed, over in-process engines (tests.support.replicas)."""

from __future__ import annotations

import asyncio

import pytest

from slotserve.engine.async_engine import AsyncEngine
from slotserve.engine.events import FinishedCompletion, IterationEvent
from slotserve.engine.outputs import RequestMetrics
from slotserve.obs.live_feed import LiveFeed
from slotserve.sampling import SamplingParams
from slotserve.scaleout.feed import IterationTap
from tests.conftest import random_prompts, tiny_engine
from tests.support.replicas import InProcessReplica, in_process_front

pytest.importorskip("ray", reason="the ray extra is not installed")  # ReplicaFront's errors

BLOCK_SIZE = 16
GREEDY = dict(temperature=0.0, ignore_eos=True)


class _Engine:
    """Just `subscribe` (what IterationTap asks of an engine)."""

    def subscribe(self, callback) -> None:
        self.callback = callback


def _event(index: int, ttft: float | None = None) -> IterationEvent:
    finished = ()
    if ttft is not None:
        metrics = RequestMetrics(0.0, 0.0, ttft, 1.0, ttft, 0.01, 0.0, 1.0, [0.01] * 50, 0)
        finished = (FinishedCompletion(f"r{index}", "length", 4, 51, 0, metrics),)
    return IterationEvent({"index": index, "slots": [None]}, finished)


def test_the_tap_answers_each_cursor_with_the_events_after_it():
    engine = _Engine()
    tap = IterationTap(engine, capacity=3)
    tap.attach()
    first = tap.since(0, None)
    assert first["events"] == [] and first["cursor"] == 0 and first["missed"] == 0
    for i in range(2):
        engine.callback(_event(i, ttft=0.5 if i == 1 else None))
    answer = tap.since(0, tap.instance)
    assert [e.index for e in answer["events"]] == [0, 1] and answer["cursor"] == 2
    done = answer["events"][1].finished[0]
    assert done.metrics.ttft == 0.5 and done.metrics.itls == []  # not sent
    assert tap.since(2, tap.instance)["events"] == []
    for i in range(2, 6):
        engine.callback(_event(i))
    answer = tap.since(2, tap.instance)  # 4 new, 3 kept: the oldest one was dropped
    assert [e.index for e in answer["events"]] == [3, 4, 5] and answer["missed"] == 1
    # Another instance's cursor (the replica restarted) means nothing here: all kept ones.
    assert [e.index for e in tap.since(5, "old")["events"]] == [3, 4, 5]


def _engine(hf_model, seed: int) -> AsyncEngine:
    return AsyncEngine(tiny_engine(hf_model, max_num_seqs=2, num_blocks=64,
                                   block_size=BLOCK_SIZE, seed=seed))


def _replica(hf_model, seed: int) -> InProcessReplica:
    return InProcessReplica(_engine(hf_model, seed))


async def _serve(replica: InProcessReplica, request_id: str, prompt: list[int]) -> None:
    params = SamplingParams(max_tokens=5, **GREEDY)
    async for _ in replica.async_engine.generate(request_id, prompt, params):
        pass


def test_the_live_feed_of_a_replica_set_carries_each_replicas_iterations(tiny_llama):
    """Each replica's iterations reach the live feed's pages tagged with that replica, with
    the requests it ran; the hello has the replicas and their recent iterations; the
    latency percentiles come back; a restarted replica's first record says so."""
    replicas = {"replica-0": _replica(tiny_llama, 0), "replica-1": _replica(tiny_llama, 1)}
    front = in_process_front(replicas, BLOCK_SIZE)
    feed = LiveFeed(front)
    feed.attach()
    prompts = random_prompts(4, min_len=20, max_len=30, seed=3)

    async def main():
        for replica in replicas.values():
            replica.async_engine.start()
        client = feed.connect(asyncio.get_running_loop())
        try:
            await asyncio.gather(*(_serve(replicas[f"replica-{i % 2}"], f"req-{i}", p)
                                   for i, p in enumerate(prompts)))
            for state in front.replicas.values():
                await front.poll(state)
            return client.drain()
        finally:
            for replica in replicas.values():
                replica.async_engine.stop()

    records = asyncio.run(asyncio.wait_for(main(), 120))
    by_replica = {name: [r for r in records if r["replica"] == name] for name in replicas}
    for i, name in enumerate(replicas):
        ran = {cell["request"] for r in by_replica[name] for cell in r["slots"] if cell}
        assert ran == {f"req-{j}" for j in range(i, 4, 2)}
        indices = [r["index"] for r in by_replica[name]]
        assert indices == list(range(len(indices))) and indices  # all, in order
        assert "restarted" not in by_replica[name][0]
    hello = feed.hello(backfill=600)
    assert [v["name"] for v in hello["replicas"]] == list(replicas)
    assert all(v["up"] and v["num_slots"] == 2 for v in hello["replicas"])
    assert len(hello["iterations"]) == len(records)
    assert hello["ttft_p50"] is not None and hello["finished_in_window"] == 4
    trace = front.export_trace()
    assert trace["replicas"]["replica-1"]["iterations"] == by_replica["replica-1"]
    assert "replica" not in replicas["replica-0"].async_engine.export_trace()["iterations"][0]

    # Serve restarts replica-0: its new engine numbers iterations from 0 again.
    replicas["replica-0"].restart(_engine(tiny_llama, 2))

    async def after_restart():
        replicas["replica-0"].async_engine.start()
        client = feed.connect(asyncio.get_running_loop())
        try:
            await _serve(replicas["replica-0"], "again", prompts[0])
            await front.poll(front.replicas["replica-0"])
            return client.drain()
        finally:
            replicas["replica-0"].async_engine.stop()

    again = asyncio.run(asyncio.wait_for(after_restart(), 120))
    assert again and all(r["replica"] == "replica-0" for r in again)
    assert again[0]["restarted"] is True and again[0]["index"] == 0
    assert "restarted" not in again[1]
    assert front.recent_iterations(600)[0] is again[0]  # replica-0's old records dropped


def test_a_failing_subscriber_does_not_stop_the_forwarding(tiny_llama):
    replicas = {"replica-0": _replica(tiny_llama, 0)}
    front = in_process_front(replicas, BLOCK_SIZE)
    seen = []

    def broken(event):
        raise RuntimeError("a broken page")

    front.subscribe(broken)
    front.subscribe(seen.append)

    async def main():
        replica = replicas["replica-0"]
        replica.async_engine.start()
        try:
            await _serve(replica, "one", random_prompts(1, seed=1)[0])
            await front.poll(front.replicas["replica-0"])
        finally:
            replica.async_engine.stop()

    asyncio.run(asyncio.wait_for(main(), 120))
    assert seen and all(e.record["replica"] == "replica-0" for e in seen)
    assert front.replicas["replica-0"].up
