"""Replicas on Ray Serve (slotserve.scaleout): a local Ray on loopback, 2 replicas of a tiny
random model saved as an HF directory; the offline engine on the same directory is the
oracle. Slow: Ray and the replicas take ~20-60 s to start."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from slotserve import LLM, SamplingParams
from tests.conftest import random_prompts, tiny_hf_model

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ENGINE = dict(max_num_seqs=2, max_num_batched_tokens=256, max_model_len=512, num_blocks=256,
              block_size=16, seed=0, device="cpu", dtype=None, batching="continuous",
              kv_cache_memory=None, quantization=None, kernels="auto")
GREEDY = dict(temperature=0.0, ignore_eos=True)
REPO = Path(__file__).resolve().parents[2]
KILL_MAX_TOKENS = 240  # NOTE: prompts (<= 70) + this fit max_model_len


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-hf")
    tiny_hf_model().save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def oracle(model_dir):
    return LLM(model_dir, **ENGINE)


@pytest.fixture(scope="module")
def handles(model_dir):
    from ray import serve

    from slotserve.scaleout.launch import delete_replicas, deploy_replicas, start_ray
    from slotserve.scaleout.replica import ReplicaSpec

    temp_dir = tempfile.mkdtemp(prefix="/tmp/ray-test-")  # NOTE: short: Ray's socket paths
    start_ray(None, num_cpus=2, temp_dir=temp_dir, object_store_bytes=200 << 20)
    try:
        spec = ReplicaSpec(model=model_dir, engine_kwargs=ENGINE, threads=1)
        found = deploy_replicas(spec, 2)
        yield found
        delete_replicas(found)
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 300))


def _front(handles, policy="prefix"):
    """A ReplicaFront (built outside an event loop: it reads a replica synchronously)."""
    from slotserve.scaleout.launch import build_front

    return build_front(handles, policy)


async def _generate(front, request_id, prompt, max_tokens):
    final = None
    async for out in front.generate(request_id, prompt, SamplingParams(max_tokens=max_tokens,
                                                                       **GREEDY)):
        final = out
    return final


def test_serve_replicas_answers_like_the_single_process_server(model_dir, tmp_path,
                                                              monkeypatch):
    """`slotserve serve --replicas 2`: the same API (JSON, SSE, errors), /health, /metrics
    with a replica label, and a clean exit on SIGTERM (greedy equality: the tests below).

    NOTE: first in the module: its own local Ray, before the fixture's."""
    import httpx

    from tests.support.launch import ServerProcess, cli_flags, scrape_metrics

    flags = cli_flags(**{k: v for k, v in ENGINE.items() if k in (
        "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_blocks", "block_size")})
    ray_dir = tempfile.mkdtemp(prefix="/tmp/ray-cli-")  # NOTE: short: Ray's socket paths
    monkeypatch.setenv("RAY_TMPDIR", ray_dir)
    server = ServerProcess.launch(tmp_path / "server.log", "--model", model_dir, "--replicas",
                                  "2", "--threads-per-replica", "1", *flags, cwd=REPO)
    try:
        server.wait_ready()
        prompt = random_prompts(1, min_len=40, max_len=40, seed=9)[0]
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
        assert reply["usage"] == {"prompt_tokens": 40, "completion_tokens": 6,
                                  "total_tokens": 46,
                                  "prompt_tokens_details": {"cached_tokens": 0}}
        events = httpx.post(server.base_url + "/completions", json={**body, "stream": True},
                            timeout=60).text.split("\n\n")
        assert events[-2] == "data: [DONE]" and len(events) >= 3
        bad = httpx.post(server.base_url + "/completions", json={**body, "prompt": [10**6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        trace = httpx.get(server.url + "/debug/trace").json()
        assert sum(r["served"] for r in trace["replicas"].values()) == 2
        time.sleep(1.5)  # NOTE: the ingress polls the replicas' metrics every 0.5 s
        metrics = scrape_metrics(server.url)
        assert sum(v for k, v in metrics.items()
                   if k.startswith("slotserve:prompt_tokens_total{replica=")) == 80
        state = httpx.get(server.url + "/debug/state").json()  # the live view's, summed
        assert state["num_slots"] == 4 and state["blocks"] is None
        _check_live_feed(server.url, trace)
        reset = httpx.post(server.url + "/reset_prefix_cache")
        assert reset.status_code == 200 and reset.json()["blocks_dropped"] >= 0
    finally:
        status = server.stop()
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert status == 0, server.log()[-3000:]
    assert "replicas stopped" in server.log()


def _check_live_feed(url: str, trace: dict) -> None:
    """The live view's stream: its hello lists both replicas and carries their iterations,
    each tagged with the replica that ran it, which is the one the router chose (the trace's
    routing) for every request in it; the replicas' finished requests reach the latency
    percentiles; /debug/trace holds each replica's records too."""
    import httpx

    with httpx.stream("GET", url + "/debug/events", timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: hello"
        hello = json.loads(next(lines).removeprefix("data: "))
    assert [(v["name"], v["up"], v["num_slots"]) for v in hello["replicas"]] == [
        ("slotserve-replica-0", True, 2), ("slotserve-replica-1", True, 2)]
    routed = {r["request_id"]: r["replica"] for r in trace["routing"]}
    ran = {}
    for record in hello["iterations"]:
        for cell in record["slots"]:
            if cell:
                ran.setdefault(cell["request"].split("#")[0], set()).add(record["replica"])
    assert set(ran) == set(routed)  # both requests, each on its replica only
    assert all(ran[request] == {replica} for request, replica in routed.items())
    assert hello["finished_in_window"] == 2 and hello["ttft_p50"] is not None
    replicas = httpx.get(url + "/debug/trace").json()["replicas"]
    assert sum(len(r["iterations"]) for r in replicas.values()) == len(hello["iterations"])


def _own_processes(marker: str) -> list[str]:
    """Processes whose command line names `marker` (a test's own Ray temp dir): 'pid cmd'."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it exited meanwhile
            continue
        if marker in cmd:
            found.append(f"{proc.name} {cmd[:200]}")
    return found


def _port_is_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def external_ray_cluster(num_cpus: int = 2):
    """A one-node Ray cluster of our own, as `ray start --head` makes it for a real
    cluster, with token authentication (its own token): yields (address, temp_dir, auth:
    the environment a driver needs to join it). Its processes run in their own session,
    ended by that session's id (never `ray stop`: that would end every Ray on the machine)."""
    import secrets

    from tests.support.launch import free_port

    temp_dir = tempfile.mkdtemp(prefix="/tmp/ray-ext-")  # NOTE: short: Ray's socket paths
    token_path = Path(temp_dir) / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}
    port = free_port()
    ports = {flag: free_port() for flag in (
        "--ray-client-server-port", "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port",
        "--node-manager-port", "--object-manager-port")}
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
           f"--port={port}", f"--num-cpus={num_cpus}", f"--temp-dir={temp_dir}",
           "--include-dashboard=false", "--disable-usage-stats",
           "--object-store-memory=200000000", *(f"{k}={v}" for k, v in ports.items())]
    log = open(Path(temp_dir) / "ray-start.log", "wb")
    head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **auth})
    try:
        address = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while "Ray runtime started" not in (Path(temp_dir) / "ray-start.log").read_text():
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("ray start failed: "
                                   + (Path(temp_dir) / "ray-start.log").read_text()[-2000:])
            time.sleep(1)
        yield address, temp_dir, auth
    finally:
        _end_session(head)
        assert not _session_alive(head.pid), "the cluster's processes outlived SIGKILL"
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _end_session(head: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM to `ray start --block`'s session (its Ray processes, as `ray stop` sends),
    SIGKILL what stays after `timeout` (`ray start --block` itself ignores SIGTERM)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _session_alive(head.pid):
            time.sleep(0.5)
        if not _session_alive(head.pid):
            break
    head.wait(10)


def _session_alive(sid: int) -> bool:
    """Any process of session `sid` still there (a zombie child of ours does not count)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # state, ppid, pgrp, session
                return True
    return False


def test_serve_replicas_joins_an_existing_ray_cluster(tmp_path, monkeypatch):
    """`slotserve serve --replicas 2 --ray-address ADDR` on a cluster that `ray start` made
    (token authentication on): without the token it exits at once saying what to set; with
    it, it deploys there, answers a chat request (the embedded model: it has a chat
    template), and on SIGTERM removes its replicas but leaves the cluster running;
    afterwards no process of the cluster or the server is left, and their ports are free."""
    import httpx

    from tests.support.launch import ServerProcess, cli_flags

    flags = cli_flags(max_num_seqs=2, max_num_batched_tokens=256, max_model_len=256,
                      num_blocks=64, block_size=16)
    args = ("--replicas", "2", "--ray-address", None, "--threads-per-replica", "1", *flags)
    with external_ray_cluster() as (address, temp_dir, auth):
        args = tuple(address if a is None else a for a in args)
        for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", *auth):
            monkeypatch.delenv(name, raising=False)
        refused = ServerProcess.launch(tmp_path / "refused.log", *args, cwd=REPO)
        assert refused.proc.wait(120) == 2, refused.log()[-3000:]
        assert "set RAY_AUTH_MODE=token" in refused.log()

        for name, value in auth.items():
            monkeypatch.setenv(name, value)
        server = ServerProcess.launch(tmp_path / "server.log", *args, cwd=REPO)
        try:
            server.wait_ready()
            body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4,
                    "temperature": 0, "ignore_eos": True}
            reply = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 4
            assert reply.json()["choices"][0]["message"]["role"] == "assistant"
            apps = _serve_apps(address)
            assert sorted(a for a in apps if a.startswith("slotserve-replica-")) == [
                "slotserve-replica-0", "slotserve-replica-1"]
        finally:
            status = server.stop()
        assert status == 0, server.log()[-3000:]
        assert "replicas stopped" in server.log()
        # The cluster still answers a new driver, without the server's replicas.
        assert not [a for a in _serve_apps(address) if a.startswith("slotserve-replica-")]
        port = int(server.url.rsplit(":", 1)[1])
    assert _own_processes(temp_dir) == []
    assert _port_is_free(int(address.rsplit(":", 1)[1])) and _port_is_free(port)


def _serve_apps(address: str) -> list[str]:
    """The Serve applications on the cluster at `address` (asked from a separate driver;
    the environment has the cluster's token)."""
    script = ("import ray, json; from ray import serve; "
              f"ray.init(address={address!r}, log_to_driver=False); "
              "print(json.dumps(sorted(serve.status().applications)))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_greedy_outputs_equal_a_single_engine(handles, oracle):
    prompts = random_prompts(8, seed=3)
    expected = oracle.generate(prompts, SamplingParams(max_tokens=12, **GREEDY))

    front = _front(handles, "round_robin")  # NOTE: both replicas serve

    async def main():
        await front.wait_all_up(120)
        outs = await asyncio.gather(*(_generate(front, f"g{i}", p, 12)
                                      for i, p in enumerate(prompts)))
        return outs

    outs = run(main())
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    assert {r["replica"] for r in front.routing} == set(handles)


def _hits(snapshots):
    return sum(s["engine"].prefix_cache_hits for s in snapshots)


def test_prefix_routing_keeps_a_conversation_on_one_replica(handles, model_dir):
    """Each conversation's turns (prompt = the last prompt + its answer + a new message) go to
    one replica, and the prefix cache hits as much as one engine serving them all."""
    conversations = [random_prompts(3, min_len=20, max_len=40, seed=10 + c)
                     for c in range(4)]

    front = _front(handles, "prefix")

    async def main():
        await front.wait_all_up(120)
        before = [await h.snapshot.remote() for h in handles.values()]
        transcripts = []
        for c, messages in enumerate(conversations):
            prompt = []
            for t, message in enumerate(messages):
                prompt = prompt + message
                out = await _generate(front, f"c{c}t{t}", prompt, 8)
                transcripts.append(list(prompt))
                prompt = prompt + out.token_ids
        after = [await h.snapshot.remote() for h in handles.values()]
        return transcripts, _hits(after) - _hits(before)

    transcripts, hits = run(main())
    by_conversation = {}
    for record in front.routing:
        by_conversation.setdefault(record["request_id"].split("t")[0], set()).add(
            record["replica"])
    assert all(len(replicas) == 1 for replicas in by_conversation.values()), by_conversation
    assert {r["reason"] for r in front.routing if not r["request_id"].endswith("t0")} == {
        "affinity"}
    single = LLM(model_dir, **ENGINE)
    for prompt in transcripts:
        single.generate([prompt], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)
    assert hits > 0
    assert hits == single.engine.stats.prefix_cache_hits


def test_the_front_reads_the_replicas_as_one_engine(handles):
    """snapshot() sums the replicas' last polled snapshots; reset_prefix_cache() resets
    every replica's cache (after the conversations above, some blocks are cached)."""
    front = _front(handles, "prefix")

    async def main():
        await front.wait_all_up(120)
        each = [r.snapshot["engine"] for r in front.replicas.values()]
        whole = front.snapshot(include_blocks=True)
        dropped = await front.reset_prefix_cache()
        await front.wait_all_up(120)
        return each, whole, dropped, front.snapshot()

    each, whole, dropped, after = run(main())
    assert whole.num_slots == sum(s.num_slots for s in each) == 2 * ENGINE["max_num_seqs"]
    assert whole.kv_blocks_total == 2 * ENGINE["num_blocks"]
    assert whole.prefix_cache_hits == sum(s.prefix_cache_hits for s in each) > 0
    assert whole.generation_tokens == sum(s.generation_tokens for s in each)
    assert dict(whole.finished_by_reason)["length"] == sum(
        dict(s.finished_by_reason).get("length", 0) for s in each)
    assert whole.block_map is None and whole.model == each[0].model
    assert dropped == whole.kv_blocks_cached_free > 0
    assert after.kv_blocks_cached_free == 0


def test_a_replicas_own_errors_reach_the_ingress_unwrapped(handles):
    """The engine's ValueError comes out of Ray's RayTaskError (the server maps it to 400)."""
    from ray.exceptions import RayTaskError

    front = _front(handles, "prefix")  # NOTE: the same prompt goes to the same replica
    prompt = random_prompts(1, min_len=40, max_len=40, seed=4)[0]

    async def main():
        await front.wait_all_up(120)
        first = front.generate("same-id", prompt, SamplingParams(max_tokens=200, **GREEDY))
        await anext(first)
        with pytest.raises(ValueError, match="already in use") as caught:
            await _generate(front, "same-id", prompt, 4)
        await first.aclose()
        return caught.value

    error = run(main())
    assert not isinstance(error, RayTaskError)
    assert front.num_active == 0 and all(r.in_flight == 0 for r in front.replicas.values())


def test_a_killed_replica_loses_no_request_that_had_not_streamed(handles, oracle):
    """12 requests over 2 replicas of 2 slots: most wait in a replica's queue. Killing one
    replica fails only the requests it had streamed; the rest finish elsewhere, correct.

    NOTE: the victim's process gets SIGKILL from here, which lands at once: ray.kill lands
    some time after it is called, on a loaded 2-core host once after the victim had finished
    all 6 of its requests of 240 tokens (nothing left to retry). The victim's queued requests
    start only after its first two ran KILL_MAX_TOKENS steps, so the kill lands while some
    have not streamed."""
    prompts = random_prompts(12, seed=5)
    expected = oracle.generate(prompts, SamplingParams(max_tokens=KILL_MAX_TOKENS, **GREEDY))

    front = _front(handles, "round_robin")

    async def main():
        await front.wait_all_up(120)
        victim = "slotserve-replica-0"
        pid = (await handles[victim].describe.remote())["pid"]
        streamed_on_victim: set[str] = set()

        async def one(i, prompt):
            final = None
            async for out in front.generate(f"k{i}", prompt,
                                            SamplingParams(max_tokens=KILL_MAX_TOKENS,
                                                           **GREEDY)):
                # NOTE: outputs the victim sent before it died may arrive after the kill
                if front._active.get(f"k{i}") is front.replicas[victim]:
                    streamed_on_victim.add(f"k{i}")
                final = out
            return final

        async def killer():
            while not streamed_on_victim:
                await asyncio.sleep(0.01)
            os.kill(pid, signal.SIGKILL)

        results = await asyncio.gather(killer(), *(one(i, p) for i, p in enumerate(prompts)),
                                       return_exceptions=True)
        return results[1:], set(streamed_on_victim)

    results, streamed = run(main())
    assert front.healthy  # the other replica serves
    failed = {f"k{i}" for i, r in enumerate(results) if isinstance(r, BaseException)}
    assert failed <= streamed, (failed, streamed)
    assert all(isinstance(results[int(k[1:])], RuntimeError) for k in failed)
    for i, result in enumerate(results):
        if f"k{i}" not in failed:
            assert result.token_ids == expected[i].token_ids
    assert any(r["retry"] for r in front.routing), "no request was retried on the other replica"


def test_a_replica_that_refuses_new_requests_sends_them_elsewhere(handles, oracle):
    """A replica whose engine stopped accepting (it drains) answers EngineClosedError: the
    ingress retries on the other replica. NOTE: last: that replica stays closed."""
    prompts = random_prompts(4, seed=6)
    expected = oracle.generate(prompts, SamplingParams(max_tokens=5, **GREEDY))
    front = _front(handles, "round_robin")

    async def main():
        await front.wait_all_up(300)  # NOTE: Serve may still restart the killed replica
        await handles["slotserve-replica-1"].stop_accepting.remote()
        return [await _generate(front, f"d{i}", p, 5) for i, p in enumerate(prompts)]

    outs = run(main())
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    retried = [r for r in front.routing if r["retry"]]
    assert retried and all(r["replica"] == "slotserve-replica-0" for r in retried)
