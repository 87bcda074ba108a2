"""The HTTP API fuzzed from its own OpenAPI spec (/openapi.json) with schemathesis, over
loopback against a real `slotserve serve`: no 500, no hang, and every rejection is a
400 / 404 / 413 / 422 / 429 with OpenAI's error body {"error": {message, type, param, code}}.

Bounded: EXAMPLES schema-valid and EXAMPLES // 2 schema-invalid cases per operation (more
with SLOTSERVE_FUZZ_EXAMPLES=N), no shrinking, derandomized (the same cases every run).
The server caps max_tokens at 8 (`--max-tokens-cap`) and contexts at 256 tokens, and n is
clamped to 4, so each generation costs little.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import cli_flags, running_server

schemathesis = pytest.importorskip("schemathesis")  # a dev dependency

EXAMPLES = int(os.environ.get("SLOTSERVE_FUZZ_EXAMPLES", "60"))
REQUEST_TIMEOUT_S = 60  # a hang fails the case
REJECTIONS = {400, 404, 413, 422, 429}
MAX_N = 4
CAP = 8  # --max-tokens-cap
VOCAB = 49_152  # SmolLM2's
MAX_PREFILL = 1000
# Every operation of the spec but /debug/events, an endless event stream by design.
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("POST", "/v1/responses"), ("GET", "/v1/models"),
              ("GET", "/v1/models/{model_id}"), ("GET", "/health"),
              ("GET", "/metrics"), ("GET", "/debug/trace"), ("GET", "/debug/state"),
              ("GET", "/debug/simulate"), ("POST", "/tokenize"), ("POST", "/detokenize"),
              ("HEAD", "/health"), ("HEAD", "/metrics"), ("POST", "/reset_prefix_cache")]
# Schema-invalid cases exist only where there is something to break: a body or parameters.
NEGATIVE = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
            ("POST", "/v1/responses"), ("GET", "/debug/simulate"), ("POST", "/tokenize"),
            ("POST", "/detokenize")]
# (method, path, mode, HTTP status, the error's param) -> cases: printed at the end (-s).
STATUSES: Counter = Counter()
CASES = [(m, p, "positive") for m, p in OPERATIONS] + [(m, p, "negative") for m, p in NEGATIVE]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    flags = cli_flags(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                      num_blocks=128, block_size=16, seed=0)
    with running_server(tmp_path_factory.mktemp("fuzz"), *flags, f"--max-tokens-cap={CAP}") as proc:
        yield proc


@pytest.fixture(scope="module")
def schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


def test_the_spec_covers_the_api(schema):
    documented = {(method.upper(), path) for path, methods in schema.raw_schema["paths"].items()
                  for method in methods}
    assert set(OPERATIONS) | {("GET", "/debug/events")} == documented
    errors = schema.raw_schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "404", "413", "429", "500", "503"} <= set(errors)


def keep_cheap(case, fit: bool):
    """n above MAX_N becomes MAX_N (n x max_tokens tokens per request), and /debug/simulate's
    prefill is kept under MAX_PREFILL: see test_simulate_bounds_the_default_workload.

    fit: integer max_tokens / max_completion_tokens are brought into [1, CAP] and token ids
    into the vocabulary, so that half the cases get past those checks (the other half test
    them) and generate.
    """
    body, query = case.body, case.query
    if isinstance(body, dict) and isinstance(body.get("n"), int) and body["n"] > MAX_N:
        body["n"] = MAX_N
    if fit and isinstance(body, dict):
        fit_body(body)
    prefill = (query or {}).get("prefill")
    if isinstance(prefill, int) and prefill > MAX_PREFILL:
        query["prefill"] = MAX_PREFILL
    return case


def fit_body(body: dict) -> None:
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if type(body.get(name)) is int:
            body[name] = body[name] % CAP + 1
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        body["prompt"] = [t % VOCAB for t in prompt]


def check_response(case, response) -> None:
    """No server error, and a rejection is one of REJECTIONS with OpenAI's error body."""
    where = f"{case.method} {case.formatted_path} body={case.body!r:.300}"
    assert response.status_code < 500, f"{where} -> {response.status_code} {response.text:.500}"
    if response.status_code >= 400 and case.method != "HEAD":
        assert response.status_code in REJECTIONS, f"{where} -> {response.status_code}"
        assert content_type(response) == "application/json", where
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, f"{where} -> {error}"
        assert isinstance(error["message"], str) and error["message"], where
        return
    kind = content_type(response)
    if kind == "text/event-stream":
        check_stream(where, response.text, case.path == "/v1/responses")
    else:
        assert kind in ("application/json", "text/plain"), f"{where}: {kind}"
        if case.method == "HEAD":
            assert not response.content, f"{where}: HEAD answered with a body"
        elif kind == "application/json":
            response.json()


def content_type(response) -> str:
    """The media type (schemathesis' headers map names to lists of values)."""
    values = response.headers.get("content-type") or [""]
    return values[0].split(";")[0].strip()


# The Responses API's last event (its streams end with it; no [DONE] line).
RESPONSE_ENDS = {"response.completed", "response.incomplete", "response.failed"}


def check_stream(where: str, text: str, responses_api: bool = False) -> None:
    """A stream ends with [DONE] (the Responses API: with its final event) and carries no
    error event."""
    data = [chunk.split("data: ", 1)[-1] for chunk in text.split("\n\n") if "data: " in chunk]
    if responses_api:
        events = [json.loads(payload) for payload in data]
        assert events and events[-1]["type"] in RESPONSE_ENDS, (
            f"{where}: unterminated stream {text[-300:]!r}")
        assert all(e["type"] != "error" for e in events), f"{where}: {events}"
        return
    assert data and data[-1] == "[DONE]", f"{where}: unterminated stream {text[-300:]!r}"
    for payload in data[:-1]:
        assert "error" not in json.loads(payload), f"{where}: {payload}"


@pytest.mark.parametrize("method,path,mode", CASES)
def test_fuzz_operation(schema, fuzz_server, method, path, mode):
    operation = schema[path][method]
    strategy = operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode))
    examples = EXAMPLES if mode == "positive" else EXAMPLES // 2
    if method == "GET":
        examples = max(10, examples // 3)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=st.builds(keep_cheap, strategy, st.booleans()))
    def run(case):
        response = case.call(base_url=fuzz_server.url, timeout=REQUEST_TIMEOUT_S)
        check_response(case, response)
        param = (response.json()["error"]["param"]
                 if response.status_code >= 400 and method != "HEAD" else "")
        STATUSES[method, path, mode, response.status_code, param or ""] += 1

    run()


def test_the_server_is_whole_after_the_fuzz(fuzz_server):
    print()
    for key, count in sorted(STATUSES.items()):
        print(*key, count)
    print("cases:", sum(STATUSES.values()))
    m = fuzz_server.metrics()
    assert m["slotserve:num_requests_running"] == 0 == m["slotserve:num_requests_waiting"]
    assert m["slotserve:kv_blocks_free"] == m["slotserve:kv_blocks_total"]
    assert m.get('slotserve:request_success_total{finished_reason="error"}', 0) == 0
    assert "Traceback" not in fuzz_server.log()
    fuzz_server.stop()
    assert fuzz_server.proc.returncode == 0


def test_simulate_bounds_the_default_workload(monkeypatch):
    from slotserve.server import live

    monkeypatch.setattr(live, "simulate", lambda *args: pytest.fail("simulated, unbounded"))
    with pytest.raises(ValueError):
        live.simulate_workload("continuous", None, 3, None, prefill=47_066_413)
