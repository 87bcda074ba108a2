"""Issue 34's request fields at hostile sizes, on one real server (the embedded SmolLM2,
--max-waiting 16): a huge logit_bias map, 10**5 and 10**6 bad_words and stop strings, 10**4
prompts in one list, echo of a 1 MB prompt. Each is refused at once (400 naming the field,
or 413 for a body past --max-body-bytes) or served, and a victim streaming beside them gets
its solo output, whole. The chaos benchmark (benchmarks/chaos.py) sends the same beside its
victim and bounds the victim's TPOT."""

from __future__ import annotations

import concurrent.futures
import json
import time

import httpx
import pytest

from tests.e2e.conftest import ENGINE_FLAGS, MODEL_NAME, launch_server
from tests.support.launch import cli_flags

MAX_WAITING = 16
REFUSAL_S = 10.0  # a refusal takes milliseconds; this bound only catches a hang or a run
PROMPT = "The capital of France is"
VICTIM = {"model": MODEL_NAME, "prompt": "Once upon a time, in a small village,",
          "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 40)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = launch_server(tmp_path_factory.mktemp("limits"), *cli_flags(**ENGINE_FLAGS),
                         f"--max-waiting={MAX_WAITING}")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def body(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            **fields}


def post(server, payload: dict, timeout: float = 120.0) -> tuple[httpx.Response, float]:
    """The response and its seconds. NOTE: the body is serialized before the clock starts."""
    content = json.dumps(payload).encode()
    start = time.monotonic()
    response = httpx.post(server.url + "/v1/completions", content=content, timeout=timeout,
                          headers={"Content-Type": "application/json"})
    return response, time.monotonic() - start


def victim_text(server) -> str:
    """The victim's streamed text (asserting a whole, error-free stream)."""
    text, done = "", False
    with httpx.stream("POST", server.url + "/v1/completions", json=VICTIM,
                      timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                assert "error" not in event, event
                text += "".join(c["text"] for c in event["choices"])
    assert done
    return text


HOSTILE = {
    "logit_bias of 60k entries": (body(logit_bias={str(i): 1.0 for i in range(60_000)}),
                                  400, "logit_bias"),
    "150k bad_words": (body(bad_words=["w"] * 150_000), 400, "bad_words"),
    "10**6 bad_words": (body(bad_words=["w"] * 1_000_000), 413, None),
    "45k stop strings": (body(stop=[f"s{i}" for i in range(45_000)]), 400, "stop"),
    "10**6 stop strings": (body(stop=["s"] * 1_000_000), 413, None),
    "10**4 prompts": (body(prompt=[PROMPT] * 10_000), 400, "prompt"),
    "10**4 token-id prompts": (body(prompt=[[1, 2, 3]] * 10_000), 400, "prompt"),
    "echo of a 1 MB prompt": (body(prompt="word " * 200_000, echo=True, logprobs=5,
                                   max_tokens=0), 400, "prompt"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_sizes_are_refused_at_once(server, name):
    payload, status, param = HOSTILE[name]
    response, seconds = post(server, payload)
    assert response.status_code == status, response.text[:300]
    assert seconds < REFUSAL_S
    if param is not None:
        assert response.json()["error"]["param"] == param


def test_prompts_past_the_waiting_bound_are_refused_before_queueing(server):
    """20 prompts (or 2 x n=9) can never wait in a queue of 16: a 400 naming prompt before
    any is queued (one by one, they filled the queue every tenant shares: others got 429);
    nothing of it runs. 16 fit."""
    for fields in ({"prompt": [f"{PROMPT} {i}" for i in range(20)]},
                   {"prompt": [PROMPT, PROMPT], "n": 9}):
        response, seconds = post(server, body(**fields))
        assert response.status_code == 400, response.text[:300]
        assert response.json()["error"]["param"] == "prompt" and seconds < REFUSAL_S
    metrics = server.metrics()
    assert metrics["slotserve:num_requests_waiting"] == 0
    assert metrics["slotserve:num_requests_running"] == 0
    ok, _ = post(server, body(prompt=[PROMPT] * MAX_WAITING, max_tokens=1))
    assert ok.status_code == 200 and len(ok.json()["choices"]) == MAX_WAITING


def test_the_victim_gets_its_solo_output_beside_them(server):
    """Every hostile body, a long prompt scored (echo, logprobs, max_tokens 0) and 150k
    allowed_token_ids, sent while the victim streams: its output is its solo output."""
    solo = victim_text(server)
    scored = body(prompt=LONG_PROMPT, echo=True, logprobs=5, max_tokens=0)
    allowed = body(allowed_token_ids=[i % 1000 for i in range(150_000)])
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        victim = pool.submit(victim_text, server)
        answers = {name: post(server, payload)[0].status_code
                   for name, (payload, _, _) in HOSTILE.items()}
        scored_response, _ = post(server, scored)
        allowed_response, _ = post(server, allowed)
        assert victim.result() == solo
    assert answers == {name: status for name, (_, status, _) in HOSTILE.items()}
    assert scored_response.status_code == 200, scored_response.text[:300]
    answer = scored_response.json()
    choice, usage = answer["choices"][0], answer["usage"]
    assert choice["text"] == LONG_PROMPT and usage["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == usage["prompt_tokens"] > 300
    assert allowed_response.status_code in (200, 400), allowed_response.text[:300]
