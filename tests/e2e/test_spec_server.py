"""Speculative decoding end to end (issue 35): a real server with --speculative-config; its
greedy completions, plain, streamed and with a stop string, equal the offline API's without
speculation (same weights and settings), and /metrics counts the drafts under vLLM's names."""

from __future__ import annotations

import pytest

from slotserve import SamplingParams
from tests.e2e.conftest import ENGINE_FLAGS, MODEL_NAME, running_server
from tests.support.launch import cli_flags

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, ' \
       '"prompt_lookup_max": 5}'
TEXT = ("The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the "
        "fox runs into the forest behind the old farm house.")
MESSAGES = [{"role": "user", "content": f"Repeat this sentence exactly:\n{TEXT}"}]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec")
    with running_server(folder, *cli_flags(**ENGINE_FLAGS), "--speculative-config",
                        SPEC) as proc:
        yield proc


def test_greedy_answers_equal_speculation_off(spec_server, offline_llm):
    client = spec_server.client()
    expected = offline_llm.chat(MESSAGES, SamplingParams(max_tokens=48, temperature=0))
    want = expected[0].outputs[0].text
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=48,
                                         temperature=0)
    assert out.choices[0].message.content == want
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                            max_tokens=48, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    stop = want.split()[5]  # a word inside the copied text
    cut = offline_llm.chat(MESSAGES, SamplingParams(max_tokens=48, temperature=0,
                                                    stop=[stop]))[0].outputs[0]
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=48,
                                         temperature=0, stop=[stop])
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == (cut.text, "stop")
    m = spec_server.metrics()
    drafts = [v for k, v in m.items() if k.startswith("vllm:spec_decode_num_draft_tokens_total")]
    accepted = [v for k, v in m.items()
                if k.startswith("vllm:spec_decode_num_accepted_tokens_total")]
    assert drafts and drafts[0] > 0 and accepted and 0 < accepted[0] <= drafts[0]
