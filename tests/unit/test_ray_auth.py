"""`serve --replicas`: Ray's token authentication and the keys file's weights (issue 29,
items 4 and 11).

`--ray-address` refuses a cluster that runs code for anyone (no token authentication)
unless `--allow-unauthenticated-ray`; the check asks the cluster's GCS from a process
without a token. The clusters here are a bare `gcs_server` (Ray's own binary, under a
second to start), one with RAY_AUTH_MODE=disabled and one with a token: what a
`ray start --head` runs with and without RAY_AUTH_MODE=token. And a replica's engine gets
the keys file's tenant weights, as the single-process server's does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import subprocess
import time
from pathlib import Path

import pytest

from slotserve.sampling import SamplingParams
from slotserve.scaleout import launch
from slotserve.scaleout.launch import (
    RayClusterError,
    check_cluster_auth,
    cluster_accepts_anyone,
    start_ray,
)
from tests.support.launch import cli_flags, free_port

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

GCS_SERVER = Path(ray.__file__).parent / "core" / "src" / "ray" / "gcs" / "gcs_server"


def _start_gcs(tmp: Path, auth: dict) -> tuple[subprocess.Popen, str]:
    """A bare GCS with the auth environment `auth`; (process, address). NOTE: on this
    machine's address, as `ray start --head`: Ray's clients resolve 127.0.0.1 to it."""
    from ray._private.services import get_node_ip_address

    host, port = get_node_ip_address(), free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    proc = subprocess.Popen(
        [str(GCS_SERVER), f"--gcs_server_port={port}", f"--node-ip-address={host}",
         "--session-name=slotserve-test", f"--session-dir={tmp}", f"--log_dir={tmp}",
         f"--node-id={secrets.token_hex(28)}", "--metrics-agent-port=0"],
        env={**env, **auth}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        with socket.socket() as s:
            if s.connect_ex((host, port)) == 0:
                return proc, f"{host}:{port}"
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"gcs_server did not start (exit {proc.poll()})")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    """{"open": address, "token": address}: GCSs without and with token authentication."""
    if not GCS_SERVER.exists():
        pytest.skip(f"no {GCS_SERVER}")
    root = tmp_path_factory.mktemp("gcs")
    token = secrets.token_hex(32)
    procs, addresses = [], {}
    try:
        for name, auth in (("open", {"RAY_AUTH_MODE": "disabled"}),
                           ("token", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})):
            proc, addresses[name] = _start_gcs(root / name, auth)
            procs.append(proc)
        yield addresses
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


@pytest.fixture
def token_in_env(monkeypatch, tmp_path):
    """This process has a token of its own (the check must not send it)."""
    path = tmp_path / "auth_token"
    path.write_text(secrets.token_hex(32))
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path))


def test_a_cluster_without_token_authentication_accepts_anyone(clusters, token_in_env):
    assert cluster_accepts_anyone(clusters["open"]) is True


def test_a_cluster_with_token_authentication_does_not(clusters, token_in_env):
    assert cluster_accepts_anyone(clusters["token"]) is False


def test_an_unreachable_cluster_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("RAY_py_gcs_connect_timeout_s", "1")
    with pytest.raises(RayClusterError, match="cannot reach the Ray cluster at 127.0.0.1"):
        cluster_accepts_anyone(f"127.0.0.1:{free_port()}")


def _joined(monkeypatch) -> list[str]:
    """Record join_cluster's calls instead of joining (and starting Serve there)."""
    calls: list[str] = []
    monkeypatch.setattr(launch, "join_cluster", calls.append)
    return calls


def test_ray_address_refuses_a_cluster_without_token_authentication(clusters, monkeypatch):
    joined = _joined(monkeypatch)
    with pytest.raises(RayClusterError) as refused:
        start_ray(clusters["open"])
    message = str(refused.value)
    assert "does not use token authentication" in message
    assert "RAY_AUTH_MODE=token" in message and "--allow-unauthenticated-ray" in message
    assert joined == []


def test_serve_replicas_exits_2_on_a_cluster_without_token_authentication(clusters,
                                                                         monkeypatch, caplog):
    from slotserve.cli import main

    joined = _joined(monkeypatch)
    with caplog.at_level(logging.ERROR, logger="slotserve.scaleout"):
        status = main(["serve", "--replicas", "1", "--ray-address", clusters["open"],
                       "--threads-per-replica", "1"])
    assert status == 2 and joined == []
    assert "does not use token authentication" in caplog.text


def _serve_calls(monkeypatch) -> list:
    from ray import serve

    calls: list = []
    monkeypatch.setattr(serve, "start", lambda **kw: calls.append(kw))
    return calls


def test_ray_address_joins_a_cluster_with_token_authentication(clusters, monkeypatch,
                                                               caplog):
    joined, served = _joined(monkeypatch), _serve_calls(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="slotserve.scaleout"):
        start_ray(clusters["token"])
    assert joined == [clusters["token"]] and len(served) == 1
    assert "WARNING" not in caplog.text


def test_allow_unauthenticated_ray_joins_with_a_loud_warning(clusters, monkeypatch, caplog):
    joined, served = _joined(monkeypatch), _serve_calls(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="slotserve.scaleout"):
        start_ray(clusters["open"], allow_unauthenticated=True)
    assert joined == [clusters["open"]] and len(served) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("does not use token authentication" in w and "anyone" in w for w in warnings)


# --------------------------------------------------------------------------- the decision
def test_the_decision_with_a_fake_cluster(caplog):
    def open_cluster(address):
        return True

    def token_cluster(address):
        return False

    check_cluster_auth("h:1", False, token_cluster)  # nothing to say
    with pytest.raises(RayClusterError, match="--allow-unauthenticated-ray"):
        check_cluster_auth("h:1", False, open_cluster)
    with caplog.at_level(logging.WARNING, logger="slotserve.scaleout"):
        check_cluster_auth("h:1", True, open_cluster)
    assert "WARNING: the Ray cluster at h:1 does not use token authentication" in caplog.text


def test_a_ray_client_address_cannot_be_checked_so_it_needs_the_flag(caplog):
    with pytest.raises(RayClusterError, match="ray:// one"):
        check_cluster_auth("ray://h:10001", False)
    with caplog.at_level(logging.WARNING, logger="slotserve.scaleout"):
        check_cluster_auth("ray://h:10001", True)
    assert "could not be checked for token authentication" in caplog.text


def test_an_unreachable_cluster_is_refused_even_with_the_flag():
    def unreachable(address):
        raise RayClusterError(f"cannot reach the Ray cluster at {address}")

    with pytest.raises(RayClusterError, match="cannot reach"):
        check_cluster_auth("h:1", True, unreachable)


# --------------------------------------------------------------------------- replicas
TINY_ENGINE = cli_flags(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128,
                        num_blocks=32, block_size=16, scheduling_policy="fair")


def _replica_args(tmp_path, model: str | None = None):
    from slotserve.cli import build_parser
    from slotserve.server.startup import access_policy

    keys = tmp_path / "keys"
    keys.write_text("sk-alice-0001 alice\nsk-bob-0002 bob 2\n")
    args = build_parser().parse_args(
        ["serve", *(["--model", model] if model else []), "--replicas", "2",
         "--threads-per-replica", "1", "--api-keys-file", str(keys), *TINY_ENGINE])
    return args, access_policy(args)


def test_the_replicas_spec_carries_the_keys_files_weights(tmp_path):
    from slotserve.config import engine_config

    args, policy = _replica_args(tmp_path)
    spec = launch._replica_spec(args, policy)
    assert dict(spec.engine_kwargs["tenant_weights"]) == {"alice": 1.0, "bob": 2.0}
    config = engine_config(spec.model, **spec.engine_kwargs)
    assert dict(config.scheduler.tenant_weights) == {"alice": 1.0, "bob": 2.0}


def test_a_replicas_engine_schedules_with_the_keys_files_weights(tmp_path):
    """EngineReplica's own build (in this process, without Ray): its scheduler has bob's
    weight 2 (what /debug/state showed as 1.0)."""
    from slotserve.scaleout.replica import EngineReplica
    from tests.conftest import tiny_hf_model

    model_dir = tmp_path / "tiny-hf"
    tiny_hf_model().save_pretrained(model_dir, safe_serialization=True)
    args, policy = _replica_args(tmp_path, str(model_dir))
    replica = EngineReplica.func_or_class(launch._replica_spec(args, policy), "replica-0")

    async def as_each_tenant():
        for tenant in ("alice", "bob"):
            async for _ in replica.generate(f"{tenant}-1", [5, 6, 7],
                                            SamplingParams(max_tokens=2), tenant=tenant):
                pass

    try:
        snapshot = replica.async_engine.snapshot()
        assert set(snapshot.configured_tenants) == {"alice", "bob"}
        asyncio.run(asyncio.wait_for(as_each_tenant(), 60))
        tenants = {t.name: t.weight for t in replica.async_engine.snapshot().tenants}
        assert tenants == {"alice": 1.0, "bob": 2.0}
    finally:
        replica.async_engine.stop()
