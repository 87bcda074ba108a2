"""Issue 29's doors on a real server: two API keys (one with a priority range) and an admin
key read from a file; the priority range, the caps, a tool call nested too deeply, the Host
check, a cross-site admin POST, the security headers, and the live view in headless
Chromium under its Content-Security-Policy (a trace file named like HTML stays text)."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from tests.e2e.conftest import ENGINE_FLAGS, MODEL_NAME, running_server
from tests.support.launch import cli_flags

ADMIN = "adm-hardening-e2e"
ALICE, BOB = "sk-h-alice", "sk-h-bob"
CHROMIUM = "/usr/bin/chromium"
XSS_NAME = '<img src=x onerror="window.__owned=1">.json'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hardening")
    keys = folder / "keys.txt"
    keys.write_text(f"# key tenant [weight] [priority=LO..HI]\n{ALICE} alice 2 priority=-5..5\n"
                    f"{BOB} bob\n")
    admin = folder / "admin.txt"
    admin.write_text(ADMIN + "\n")
    with running_server(folder, *cli_flags(**ENGINE_FLAGS), "--api-keys-file", str(keys),
                        "--admin-key-file", str(admin)) as proc:
        yield proc


def post(server, key: str, path: str, body: dict, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}", **kwargs.pop("headers", {})}
    return httpx.post(server.base_url + path, json={"model": MODEL_NAME, **body},
                      headers=headers, timeout=120, **kwargs)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_priority_within_the_keys_range(server):
    """The issue's attack: bob's -2147483647 would preempt alice under `priority`."""
    small = {"prompt": "Hello", "max_tokens": 2}
    assert post(server, ALICE, "/completions", {**small, "priority": -5}).status_code == 200
    error = error_of(post(server, BOB, "/completions", {**small, "priority": -2147483647}),
                     400)
    assert error["param"] == "priority"
    assert error_of(post(server, ALICE, "/completions", {**small, "priority": 6}),
                    400)["param"] == "priority"
    assert post(server, BOB, "/completions", small).status_code == 200
    for path, body in [("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 2}),
                       ("/responses", {"input": "Hi", "max_output_tokens": 2})]:
        error = error_of(post(server, BOB, path, {**body, "priority": -2147483647}), 400)
        assert error["param"] == "priority", path


def test_caps_name_their_fields(server):
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    huge = {**chat, "n": 128, "max_tokens": 4095, "logprobs": True, "top_logprobs": 20}
    assert error_of(post(server, ALICE, "/chat/completions", huge), 400)["param"] == (
        "top_logprobs")
    ok = post(server, ALICE, "/chat/completions", {**chat, "n": 2, "max_tokens": 4,
                                                   "logprobs": True, "top_logprobs": 5})
    assert ok.status_code == 200
    assert len(ok.json()["choices"][1]["logprobs"]["content"][0]["top_logprobs"]) == 5
    error = error_of(post(server, ALICE, "/completions", {
        "prompt": "Hi", "max_tokens": 2, "stop_token_ids": list(range(129))}), 400)
    assert error["param"] == "stop_token_ids"


def test_tool_call_arguments_nested_too_deeply_are_400_not_500(server):
    call = {"id": "c1", "type": "function", "function": {"name": "f",
                                                         "arguments": "[" * 200_000}}
    body = {"max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
    error = error_of(post(server, ALICE, "/chat/completions", body), 400)
    assert error["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/health").status_code == 200


def test_foreign_host_headers_are_refused(server):
    port = server.url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "attacker.test"):
        r = httpx.get(server.url + "/health", headers={"Host": host})
        assert error_of(r, 400)["code"] == "host_not_allowed", host
    for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
        assert httpx.get(server.url + "/health", headers={"Host": host}).status_code == 200
    r = post(server, ALICE, "/completions", {"prompt": "Hi", "max_tokens": 1},
             headers={"Host": "evil.example"})
    assert error_of(r, 400)["code"] == "host_not_allowed"


def test_cross_site_admin_posts_are_refused(server):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    form = {**admin, "Content-Type": "application/x-www-form-urlencoded",
            "Sec-Fetch-Site": "cross-site"}
    r = httpx.post(server.url + "/reset_prefix_cache", headers=form, content=b"x=1")
    assert error_of(r, 403)["code"] == "cross_site_request"
    r = httpx.post(server.url + "/reset_prefix_cache", headers=admin, json={}, timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_security_headers(server):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    for r in (httpx.get(server.url + "/", headers=admin), httpx.get(server.url + "/health"),
              httpx.get(server.base_url + "/models")):  # the last one: a 401
        assert "default-src 'self'" in r.headers["content-security-policy"]
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["x-content-type-options"] == "nosniff"


# --------------------------------------------------------------------------- the browser
@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no {CHROMIUM}: install Debian's browser (apt-get install -y chromium)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="no playwright: .venv/bin/pip install playwright")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM,
                                     args=["--headless", "--no-sandbox", "--disable-gpu"])
        yield browser
        browser.close()


def test_live_view_under_its_csp_keeps_a_file_name_as_text(server, browser):
    """The page works under the strict CSP (no violation, the event stream connects), and a
    trace file named like HTML is shown as text: no element is made of its name."""
    assert post(server, ALICE, "/completions", {"prompt": "Once", "max_tokens": 4,
                                                "ignore_eos": True}).status_code == 200
    trace = httpx.get(server.url + "/debug/trace", timeout=60,
                      headers={"Authorization": f"Bearer {ADMIN}"}).json()
    assert trace["iterations"]
    context = browser.new_context(http_credentials={"username": "ops", "password": ADMIN},
                                  viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    page.set_default_timeout(60_000)
    try:
        page.goto(server.url + "/")
        page.wait_for_selector('body[data-connected="true"]')
        page.set_input_files("#rp-file", files=[{
            "name": XSS_NAME, "mimeType": "application/json",
            "buffer": json.dumps(trace).encode()}])
        # NOTE: the note already says "... iterations" of the simulator's pair at load: wait
        # for the file's own note, which names it
        page.wait_for_function("() => document.querySelector('#replay-note')"
                               ".textContent.includes('onerror')")
        assert not page.evaluate(
            "() => document.querySelector('#replay-note').classList.contains('error')")
        assert " iterations" in page.locator("#replay-note").inner_text()
        assert page.evaluate("() => document.querySelector('#replay-note img')") is None
        assert page.evaluate("() => window.__owned") is None
        assert XSS_NAME in page.locator("#replay-note").inner_text()
        assert errors == []
    finally:
        context.close()
