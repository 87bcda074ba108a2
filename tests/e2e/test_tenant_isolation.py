"""Issue 29 end to end, the engine's side: a real server with two API keys (tenants A and
B), the official `openai` client. B cannot see A's prompts through the prefix cache, and
cannot keep A from its first token by taking every slot (n = the slots) or by a tiny TPOT
SLO under `--scheduling-policy deadline`."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from tests.e2e.conftest import ENGINE_FLAGS, MODEL_NAME, running_server
from tests.support.launch import cli_flags

SLOTS = 16
# A "patient record" of about 150 tokens: several full 16-token blocks to hit.
RECORD = ("Patient record 4471. Name: Jane Q. Example. Born 1961 in Lyon. Diagnosis: "
          "type 2 diabetes, controlled with metformin 500 mg twice daily; mild "
          "hypertension treated with lisinopril 10 mg. Allergies: penicillin (rash), "
          "shellfish. Last HbA1c 6.9 percent. Blood pressure 132 over 84. Next review in "
          "three months with the endocrinology clinic at the north campus; the patient "
          "asked that her employer not be told of the diagnosis. Emergency contact: her "
          "brother, telephone on file. Notes: ")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tenants")
    keys = folder / "keys.txt"
    keys.write_text("sk-tenant-a ta\nsk-tenant-b tb\n")
    flags = cli_flags(**{**ENGINE_FLAGS, "max_num_seqs": SLOTS})
    policy = ("--scheduling-policy", "deadline", "--max-waiting-per-tenant", "64")
    with running_server(folder, *flags, "--api-keys-file", str(keys), *policy) as proc:
        yield proc


def client(server, key: str, cls=openai.OpenAI):
    return cls(base_url=server.base_url, api_key=key, max_retries=0)


def cached_tokens(server, key: str, prompt: str) -> int:
    out = client(server, key).completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1,
                                                 temperature=0)
    assert out.usage.prompt_tokens > 100
    return out.usage.prompt_tokens_details.cached_tokens


def test_a_tenant_never_hits_another_tenants_prefix_cache(server):
    assert cached_tokens(server, "sk-tenant-a", RECORD) == 0
    assert cached_tokens(server, "sk-tenant-b", RECORD) == 0  # A's blocks are not B's
    assert cached_tokens(server, "sk-tenant-a", RECORD) > 100  # A's own: a hit
    assert cached_tokens(server, "sk-tenant-b", RECORD) > 100  # and B's own, now


async def _ttft_beside(server, n: int = 1, **hog_fields) -> tuple[float, bool]:
    """B streams a long request (n completions, hog_fields in the body); once its tokens
    flow, A sends a short one.
    Returns A's time to first token and whether B's request was still generating when A's
    answer was complete."""
    async with client(server, "sk-tenant-b", openai.AsyncOpenAI) as b, \
            client(server, "sk-tenant-a", openai.AsyncOpenAI) as a:
        hog = await b.completions.create(
            model=MODEL_NAME, prompt="Once upon a time", max_tokens=400, temperature=0,
            n=n, stream=True, extra_body={"ignore_eos": True, **hog_fields})
        chunks = hog.__aiter__()
        await asyncio.wait_for(anext(chunks), 120)  # B's sequences hold their slots

        async def drain() -> None:
            async for _ in chunks:
                pass

        hog_task = asyncio.create_task(drain())
        try:
            start = time.monotonic()
            ttft = None
            stream = await a.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                temperature=0, stream=True)
            async for chunk in stream:
                if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                    ttft = time.monotonic() - start
            assert ttft is not None
            return ttft, not hog_task.done()
        finally:
            hog_task.cancel()
            await hog.close()


def test_n_equal_to_the_slots_does_not_keep_another_tenant_waiting(server):
    ttft, hog_running = asyncio.run(_ttft_beside(server, n=SLOTS))
    assert hog_running, "A's request waited for B's n=16 request to finish"
    assert ttft < 10.0


def test_a_tiny_tpot_slo_does_not_stop_another_tenants_prefill(server):
    ttft, hog_running = asyncio.run(_ttft_beside(server, slo_tpot_ms=0.001))
    assert hog_running, "A's prefill waited for B's request with slo_tpot_ms 0.001 to finish"
    assert ttft < 10.0


def test_slos_above_an_hour_and_n_past_the_tenants_waiting_bound_are_400s(server):
    b = client(server, "sk-tenant-b")
    with pytest.raises(openai.BadRequestError, match="slo_ttft_ms"):
        b.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1,
                             extra_body={"slo_ttft_ms": 1e300})
    with pytest.raises(openai.BadRequestError, match="n=65 completions can never be queued"):
        b.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1, n=65)
