"""One "prompt + one output token must fit" check (core.context_fit) with one message:
the scheduler, AsyncEngine.validate and the server's 400 all refuse the same prompt the
same way, and take the longest prompt that fits."""

from __future__ import annotations

import pytest

from slotserve.config import SchedulerConfig
from slotserve.core.context_fit import (
    ContextOverflowError,
    check_fits_context,
    max_prompt_tokens,
)
from slotserve.core.kv_manager import KVCacheManager
from slotserve.core.scheduler import Scheduler
from slotserve.engine.async_engine import AsyncEngine
from slotserve.request import Request
from slotserve.sampling import SamplingParams
from tests.unit.server_fixtures import app_client, text_engine

LIMIT = 64
TAIL = "tokens per sequence; the prompt and at least one output token must fit"
PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def test_the_rule_and_its_message():
    assert max_prompt_tokens(LIMIT) == LIMIT - 1
    check_fits_context(LIMIT - 1, LIMIT)
    with pytest.raises(ContextOverflowError) as caught:
        check_fits_context(LIMIT, LIMIT, field="messages", why=" (a reason)")
    assert str(caught.value) == (f"messages has {LIMIT} tokens, but this server fits at most "
                                 f"{LIMIT} tokens per sequence (a reason); the prompt and at "
                                 "least one output token must fit")
    assert (caught.value.num_tokens, caught.value.limit) == (LIMIT, LIMIT)
    assert isinstance(caught.value, ValueError)


def test_the_scheduler_uses_it():
    sched = Scheduler(SchedulerConfig(max_model_len=LIMIT), KVCacheManager(64, 4))
    sched.add_request(Request("ok", list(range(1, LIMIT)), PARAMS))
    with pytest.raises(ContextOverflowError, match=f"prompt has {LIMIT} tokens, but this "
                       f"engine fits at most {LIMIT} tokens per sequence \\(max_model_len"):
        sched.add_request(Request("big", list(range(1, LIMIT + 1)), PARAMS))


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return AsyncEngine(text_engine(tiny_llama, max_model_len=LIMIT))


def test_the_async_engine_uses_it(engine):
    assert len(engine.validate(list(range(1, LIMIT)), PARAMS)) == LIMIT - 1
    with pytest.raises(ContextOverflowError) as caught:
        engine.validate(list(range(1, LIMIT + 1)), PARAMS)
    assert str(caught.value) == f"prompt has {LIMIT} tokens, but this server fits at most " \
                                f"{LIMIT} {TAIL}"


def test_the_server_uses_it(engine):
    with app_client(engine) as client:
        r = client.post("/v1/completions", json={"model": "tiny", "max_tokens": 1,
                                                 "prompt": list(range(1, LIMIT + 1))})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
        assert error["message"] == (f"prompt has {LIMIT} tokens, but this server fits at "
                                    f"most {LIMIT} {TAIL}")
        r = client.post("/v1/completions", json={"model": "tiny", "max_tokens": 1,
                                                 "prompt": list(range(1, LIMIT))})
        assert r.status_code == 200, r.text
