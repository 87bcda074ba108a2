"""Issue 29's doors, in process: priority ranges per key, the caps on n, stop_token_ids and
the logprobs volume, --default-max-tokens, whole answers built off the event loop, the Host
check, cross-site admin POSTs, the security headers, RecursionError as a 400, the keys-file
checks and --admin-key-file, and the stop-token hot path. A real server: tests/e2e."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from slotserve.cli import build_parser
from slotserve.engine.async_engine import AsyncEngine
from slotserve.request import Request
from slotserve.runner.sampler import mask_min_tokens
from slotserve.sampling import SamplingParams
from slotserve.server import endpoints
from slotserve.server import protocol as p
from slotserve.server.api import build_app
from slotserve.server.auth import (
    AccessPolicy,
    Tenant,
    access_policy_from,
    load_api_keys_file,
    read_admin_key_file,
)
from slotserve.server.limits import ServerLimits, allowed_hosts_for
from slotserve.server.startup import access_policy, server_limits
from tests.conftest import tiny_engine
from tests.unit.server_fixtures import started

PROMPT = [5, 6, 7, 8]
ADMIN = "adm-hardening"
KEYS = (("sk-alice", Tenant("alice", 2.0, (-5, 5))), ("sk-bob", Tenant("bob")))
APP_JS = Path(__file__).resolve().parents[2] / "src/slotserve/server/dashboard/app.js"


@pytest.fixture(scope="module")
def engine(tiny_llama):
    """NOTE: the apps below are used without their lifespan (no `with TestClient`), so none
    of them stops the shared engine accepting requests."""
    with started(AsyncEngine(tiny_engine(tiny_llama, num_blocks=64, max_num_seqs=4))) as engine:
        yield engine


def client_of(engine, limits: ServerLimits | None = None, access: AccessPolicy | None = None,
              base_url: str = "http://testserver") -> TestClient:
    return TestClient(build_app(engine, "tiny", limits=limits, access=access),
                      raise_server_exceptions=False, base_url=base_url)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def complete(client, headers=None, **extra):
    return client.post("/v1/completions", headers=headers or {},
                       json={"prompt": PROMPT, "max_tokens": 2, **extra})


def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ------------------------------------------------------------------ priority per key
def test_priority_must_lie_in_the_keys_range(engine):
    client = client_of(engine, access=AccessPolicy(api_keys=KEYS, admin_key=ADMIN))
    for key, priority in (("sk-alice", -5), ("sk-alice", 5), ("sk-bob", 0), (ADMIN, -9999)):
        assert complete(client, bearer(key), priority=priority).status_code == 200
    for key, priority in (("sk-alice", 6), ("sk-alice", -6), ("sk-bob", 1),
                          ("sk-bob", -2147483647)):
        error = error_of(complete(client, bearer(key), priority=priority), 400)
        assert error["param"] == "priority" and "priority" in error["message"]
    chat = client.post("/v1/chat/completions", headers=bearer("sk-bob"),
                       json={"messages": [{"role": "user", "content": "x"}], "priority": -1})
    assert error_of(chat, 400)["param"] == "priority"


def test_without_keys_any_priority_goes(engine):
    assert complete(client_of(engine), priority=-2147483647).status_code == 200


def test_keys_file_priority_ranges(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-a alice 2 priority=-10..3\nsk-b bob priority=4\n"
                    "sk-c carol priority=1..2 0.5\nsk-d dave\n")
    assert load_api_keys_file(path) == [
        ("sk-a", Tenant("alice", 2.0, (-10, 3))), ("sk-b", Tenant("bob", 1.0, (4, 4))),
        ("sk-c", Tenant("carol", 0.5, (1, 2))), ("sk-d", Tenant("dave", 1.0, (0, 0)))]


@pytest.mark.parametrize("line,words", [
    ("sk-a alice priority=3..1", "LO <= HI"),
    ("sk-a alice priority=1..x", "expected priority=LO..HI"),
    ("sk-a alice priority=-9999999999..0", "LO <= HI"),
    ("sk-a alice priority=1 priority=2", "priority= is given twice"),
    ("sk-a alice 1 2", "got 4 fields"),
    ("sk-a alice 1 priority=0 x", "got 5 fields"),
])
def test_keys_file_bad_priority_options(tmp_path, line, words):
    path = tmp_path / "keys"
    path.write_text(f"{line}\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:1: ") + ".*" + re.escape(words)):
        load_api_keys_file(path)


# ------------------------------------------------------------------ the keys-file checks
@pytest.mark.parametrize("text,words", [
    ("#sk-secret alice\n", "reads as a key starting with '#'"),
    ("   #sk-secret alice 2 priority=1\n", "reads as a key starting with '#'"),
    ("sk-secret default\n", "'default' is reserved"),
    ("sk-secret admin\n", "'admin' is reserved"),
    ("sk-secret other 2\n", "'other' is reserved"),
])
def test_keys_file_refuses_hash_keys_and_reserved_tenants(tmp_path, text, words):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(words)) as caught:
        load_api_keys_file(path)
    assert f"{path}:1:" in str(caught.value) and "sk-secret" not in str(caught.value)


def test_comments_are_whole_lines(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# key tenant weight\n#\n#----- team a -----\n  # sk-old bob\nsk-a alice\n")
    assert load_api_keys_file(path) == [("sk-a", Tenant("alice"))]


def test_a_key_in_the_flags_and_the_file_is_an_error(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-one alice\nsk-secret bob\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: this key is also given as "
                                                   "--api-key #2")) as caught:
        access_policy_from(["sk-x", "sk-secret"], path)
    assert "sk-secret" not in str(caught.value)
    with pytest.raises(ValueError, match=re.escape("--api-key #2: this key is also given "
                                                   "as --api-key #1")):
        access_policy_from(["sk-secret", "sk-secret"])


def test_an_api_key_equal_to_the_admin_key_is_an_error(tmp_path):
    path = tmp_path / "keys"
    path.write_text("sk-one alice\nsk-secret bob\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: this API key equals the "
                                                   "admin key")) as caught:
        access_policy_from([], path, admin_key="sk-secret")
    assert "sk-secret" not in str(caught.value)
    with pytest.raises(ValueError, match=re.escape("--api-key #1: this API key equals")):
        access_policy_from(["sk-secret"], admin_key="sk-secret")
    with pytest.raises(ValueError, match="must differ"):
        AccessPolicy(api_keys=(("sk-secret", Tenant()),), admin_key="sk-secret")


def test_keys_may_not_start_with_a_hash():
    with pytest.raises(ValueError, match=re.escape("--api-key #1 must not start with '#'")):
        access_policy_from(["#sk"])
    with pytest.raises(ValueError, match=re.escape("--admin-key must not start with '#'")):
        access_policy_from([], admin_key="#adm")


def test_admin_key_file(tmp_path):
    path = tmp_path / "admin"
    path.write_text("\n  adm-from-file \n")
    assert read_admin_key_file(path) == "adm-from-file"
    args = build_parser().parse_args(["serve", "--api-key", "sk-1", "--admin-key-file",
                                      str(path)])
    policy = access_policy(args)
    assert policy.admin_key == "adm-from-file" and policy.is_admin("adm-from-file")
    for text, words in (("two words\n", "got 2 words"), ("", "got 0 words"),
                        ("#adm\n", "must not start with '#'")):
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(f"--admin-key-file {path}: ") + ".*"
                           + re.escape(words)):
            read_admin_key_file(path)
    path.write_text("adm\n")
    with pytest.raises(ValueError, match="--admin-key or --admin-key-file"):
        access_policy_from([], admin_key="adm", admin_key_file=path)


def test_serve_stops_at_a_key_equal_to_the_admin_key(tmp_path, capsys):
    from slotserve.cli import main

    path = tmp_path / "admin"
    path.write_text("sk-same\n")
    assert main(["serve", "--api-key", "sk-same", "--admin-key-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--api-key #1: this API key equals the admin key" in err and "sk-same" not in err


# ------------------------------------------------------------------ caps on the body
def test_n_cap(engine):
    client = client_of(engine, ServerLimits(max_n=2))
    assert complete(client, n=2).status_code == 200
    error = error_of(complete(client, n=3), 400)
    assert error["param"] == "n" and "--max-n" in error["message"]


def test_stop_token_ids_cap(engine):
    client = client_of(engine)  # NOTE: the default cap, 128
    assert complete(client, stop_token_ids=list(range(128))).status_code == 200
    error = error_of(complete(client, stop_token_ids=list(range(129))), 400)
    assert error["param"] == "stop_token_ids" and "--max-stop-token-ids" in error["message"]
    capped = client_of(engine, ServerLimits(max_stop_token_ids=3))
    assert error_of(complete(capped, stop_token_ids=[1, 2, 3, 4]), 400)["param"] == (
        "stop_token_ids")


def _chat(**fields) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **fields)


def test_logprobs_volume_default_sizes():
    limits = ServerLimits()
    limits.sampling_params(_chat(n=16, max_tokens=256, logprobs=True, top_logprobs=20), 8192)
    limits.sampling_params(_chat(n=1, max_tokens=4096, logprobs=True, top_logprobs=20), 8192)
    with pytest.raises(p.APIError) as caught:
        limits.sampling_params(_chat(n=128, max_tokens=4095, logprobs=True, top_logprobs=20),
                               8192)
    assert caught.value.param == "top_logprobs" and "--max-logprobs-volume" in str(caught.value)
    with pytest.raises(p.APIError) as caught:  # logprobs: true alone counts one per token
        limits.sampling_params(_chat(n=128, max_tokens=4096, logprobs=True), 8192)
    assert caught.value.param == "logprobs"
    # no logprobs asked: no bound; a huge max_tokens counts only up to the context
    limits.sampling_params(_chat(n=128, max_tokens=4095), 8192)
    limits.sampling_params(_chat(max_tokens=10**9, logprobs=True, top_logprobs=20), 8192)


def test_logprobs_volume_over_http(engine):
    client = client_of(engine, ServerLimits(max_logprobs_volume=100))
    ok = complete(client, n=2, max_tokens=10, logprobs=5, ignore_eos=True)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["tokens"]) == 10
    error = error_of(complete(client, n=3, max_tokens=10, logprobs=5), 400)
    assert error["param"] == "logprobs" and "150" in error["message"]


def test_default_max_tokens():
    body = p.CompletionRequest(prompt=[1])
    assert ServerLimits().sampling_params(body).max_tokens == 16  # OpenAI's legacy default
    assert ServerLimits().sampling_params(_chat()).max_tokens == 1024
    limits = ServerLimits(default_max_tokens=4096)
    assert limits.sampling_params(body).max_tokens == 4096
    assert limits.sampling_params(_chat()).max_tokens == 4096
    assert limits.sampling_params(_chat(max_tokens=9)).max_tokens == 9  # named: kept
    capped = ServerLimits(default_max_tokens=4096, max_tokens=100)
    assert capped.sampling_params(_chat()).max_tokens == 100


def test_limit_flags():
    args = build_parser().parse_args(["serve", "--max-n", "4", "--max-stop-token-ids", "8",
                                      "--max-logprobs-volume", "1000",
                                      "--default-max-tokens", "64"])
    limits = server_limits(args)
    assert (limits.max_n, limits.max_stop_token_ids, limits.max_logprobs_volume,
            limits.default_max_tokens) == (4, 8, 1000, 64)
    defaults = server_limits(build_parser().parse_args(["serve"]))
    assert (defaults.max_n, defaults.max_stop_token_ids, defaults.max_logprobs_volume,
            defaults.default_max_tokens) == (128, 128, 1 << 18, None)


# ------------------------------------------------------------------ whole answers off the loop
def test_whole_answers_are_built_off_the_event_loop(engine, monkeypatch):
    """A slow answer builder (as a 6 MB logprobs answer) must not hold /health up."""
    building = threading.Event()
    threads: list[str] = []

    def slow_build(*args):
        threads.append(threading.current_thread().name)
        building.set()
        time.sleep(1.0)
        return real(*args)

    real = endpoints.completion_response
    monkeypatch.setattr(endpoints, "completion_response", slow_build)
    app = build_app(engine, "tiny")

    async def run() -> float:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            answer = asyncio.create_task(client.post("/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 3, "logprobs": 2}))
            while not building.is_set():
                await asyncio.sleep(0.01)
            start = time.monotonic()
            health = await client.get("/health")
            took = time.monotonic() - start
            assert health.status_code == 200
            r = await answer
            assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) == 3
            return took

    took = asyncio.run(run())
    assert threads and threads[0] != threading.main_thread().name
    assert took < 0.5, f"/health waited {took:.2f} s for an answer being built"


# ------------------------------------------------------------------ Host names
def test_loopback_servers_answer_loopback_host_names_only(engine):
    limits = ServerLimits(allowed_hosts=allowed_hosts_for("127.0.0.1", None))
    client = client_of(engine, limits, base_url="http://127.0.0.1:8000")
    for host in ("127.0.0.1:8000", "localhost", "LOCALHOST:1", "[::1]:8000", "127.0.0.1"):
        assert client.get("/health", headers={"Host": host}).status_code == 200, host
    assert complete(client).status_code == 200
    for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example",
                 "evil@localhost", "localhost:notaport", ""):
        r = client.get("/health", headers={"Host": host})
        assert error_of(r, 400)["code"] == "host_not_allowed", host
        assert r.headers["x-frame-options"] == "DENY"  # the headers on refusals too
    assert error_of(complete(client, headers={"Host": "evil.example"}), 400)["code"] == (
        "host_not_allowed")


def test_allowed_hosts_flag():
    assert allowed_hosts_for("127.0.0.1", None) == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts_for("::1", None) == ("localhost", "127.0.0.1", "::1")
    assert allowed_hosts_for("0.0.0.0", None) is None  # elsewhere: any, unless asked
    assert allowed_hosts_for("10.0.0.5", "api.example.com, *.corp.example") == (
        "localhost", "127.0.0.1", "::1", "10.0.0.5", "api.example.com", "*.corp.example")
    assert allowed_hosts_for("127.0.0.1", "*") is None
    for bad in ("a*b", "*.", "ex ample", "*x.com"):
        with pytest.raises(ValueError, match="allowed host"):
            allowed_hosts_for("127.0.0.1", bad)
    limits = server_limits(build_parser().parse_args(["serve"]))
    assert limits.allowed_hosts == ("localhost", "127.0.0.1", "::1")
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--allowed-hosts",
                                      "llm.example"])
    assert server_limits(args).allowed_hosts == ("localhost", "127.0.0.1", "::1",
                                                 "llm.example")


def test_patterns_match_subdomains(engine):
    limits = ServerLimits(allowed_hosts=allowed_hosts_for("0.0.0.0", "*.corp.example"))
    client = client_of(engine, limits)
    assert client.get("/health", headers={"Host": "llm.corp.example"}).status_code == 200
    assert client.get("/health", headers={"Host": "corp.example.evil"}).status_code == 400


# ------------------------------------------------------------------ cross-site admin POSTs
@pytest.mark.parametrize("headers", [
    {"Content-Type": "application/x-www-form-urlencoded", "Sec-Fetch-Site": "cross-site"},
    {"Content-Type": "multipart/form-data; boundary=x", "Sec-Fetch-Site": "same-site"},
    {"Content-Type": "text/plain"},
    {"Sec-Fetch-Site": "cross-site"},  # a no-cors fetch without a body
])
def test_cross_site_admin_posts_are_refused(engine, headers):
    for access in (None, AccessPolicy(admin_key=ADMIN)):
        client = client_of(engine, access=access)
        auth = bearer(ADMIN) if access else {}
        r = client.post("/reset_prefix_cache", headers={**auth, **headers}, content=b"a=1")
        assert error_of(r, 403)["code"] == "cross_site_request"


@pytest.mark.parametrize("headers", [
    {"Content-Type": "application/json"},
    {"Content-Type": "application/json; charset=utf-8", "Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-origin", "Content-Type": "text/plain"},
    {"Sec-Fetch-Site": "none"},
    {},  # curl -X POST
])
def test_same_site_or_json_admin_posts_go(engine, headers):
    r = client_of(engine).post("/reset_prefix_cache", headers=headers)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_admin_gets_are_not_cross_site_checked(engine):
    r = client_of(engine).get("/debug/trace", headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 200


# ------------------------------------------------------------------ security headers
def test_security_headers_on_every_response(engine):
    client = client_of(engine)
    keyed = client_of(engine, access=AccessPolicy(api_keys=KEYS, admin_key=ADMIN))
    for r in (client.get("/"), client.get("/dashboard/app.js"), client.get("/v1/models"),
              complete(client), keyed.get("/"), keyed.get("/v1/models")):
        csp = r.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["x-content-type-options"] == "nosniff"
    assert keyed.get("/").status_code == 401  # the refusal carried them too
    docs = client.get("/docs")
    assert docs.status_code == 200 and "content-security-policy" not in docs.headers
    assert docs.headers["x-frame-options"] == "DENY"


def test_the_page_has_no_inline_script_or_style():
    """What the strict CSP would block: inline scripts, handlers and style attributes."""
    page = (APP_JS.parent / "index.html").read_text()
    assert not re.search(r"<script(?![^>]*\bsrc=)", page)
    assert not re.search(r"\son[a-z]+=|\sstyle=|javascript:", page)
    assert not re.search(r"\beval\(|new Function\(|setAttribute\(\s*[\"']style", APP_JS.read_text())


# ------------------------------------------------------------------ the live view's file name
def test_the_trace_file_name_is_escaped_in_the_replay_note():
    """showTrace's note goes into innerHTML: the file name (anyone's choice) is escaped.
    (In a real browser: tests/e2e/test_http_hardening.py.)"""
    js = APP_JS.read_text()
    show_trace = js[js.index("async function showTrace("):]
    show_trace = show_trace[:show_trace.index("\n}\n")]
    # NOTE: replayError writes textContent; only the note (HTML) must escape the name
    note = [line for line in show_trace.splitlines() if "note" in line and "source" in line]
    assert note and all("escapeHTML(source)" in line for line in note), note


# ------------------------------------------------------------------ nested too deep
def test_deep_tool_call_arguments_are_kept_as_text():
    call = {"id": "c1", "type": "function", "function": {"name": "f",
                                                         "arguments": "[" * 200_000}}
    message = p.ChatMessage(role="assistant", content=None, tool_calls=[call])
    assert message.as_template_dict()["content"].count("[") == 200_000


def test_recursion_error_is_a_400(engine):
    app = build_app(engine, "tiny")

    @app.post("/v1/deep")
    async def deep():
        def nest(depth):
            return nest(depth + 1)
        return nest(0)

    r = TestClient(app, raise_server_exceptions=False).post("/v1/deep")
    error = error_of(r, 400)
    assert error["code"] == "nesting_too_deep" and error["type"] == "invalid_request_error"


def test_deeply_nested_bodies_are_400(engine):
    body = '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = client_of(engine).post("/v1/completions", content=body,
                               headers={"Content-Type": "application/json"})
    assert error_of(r, 400)["type"] == "invalid_request_error"


# ------------------------------------------------------------------ the stop-token hot path
class CountingTuple(tuple):
    """A tuple that counts how often it is searched or walked."""

    uses = 0

    def __contains__(self, item):
        CountingTuple.uses += 1
        return super().__contains__(item)

    def __iter__(self):
        CountingTuple.uses += 1
        return super().__iter__()


def test_stop_tokens_are_a_frozenset_built_once():
    params = SamplingParams(max_tokens=50, min_tokens=3, stop_token_ids=range(100, 20_100))
    assert isinstance(params.stop_token_set, frozenset)
    assert params.stop_token_set is params.stop_token_set
    assert params == SamplingParams(max_tokens=50, min_tokens=3,
                                    stop_token_ids=range(100, 20_100))
    assert params.for_choice(1).stop_token_set == params.stop_token_set
    _ = params.stop_token_set
    object.__setattr__(params, "stop_token_ids", CountingTuple(params.stop_token_ids))
    CountingTuple.uses = 0
    request = Request("r", [1, 2, 3], params)
    for token in (7, 8, 9, 10, 20_099):  # the per-token stop test
        request.append_token(token, 0.0)
        status = request.check_stop()
    assert status is not None and status.value == "stop"

    import torch

    from slotserve.core.outputs import ScheduledSeq

    seq = ScheduledSeq("r", [1], 3, [0], True, params, 0, "decode")
    logits = torch.zeros(1, 20_000)
    for _ in range(3):  # below min_tokens: every step masks the stop tokens
        masked = mask_min_tokens(logits, [seq], (2,))
    assert CountingTuple.uses == 0, "the tuple was searched per token or per step"
    assert torch.isinf(masked[0, 100:]).all() and torch.isinf(masked[0, 2])  # stops, EOS
    assert not torch.isinf(torch.cat([masked[0, :2], masked[0, 3:100]])).any()
