"""EngineClient: what the server asks of the engine it serves (a typing.Protocol).

Two classes implement it: `AsyncEngine` (one engine in a background thread) and
`scaleout.front.ReplicaFront` (Ray replicas behind a router). `build_app` and the endpoints'
`Server` are typed with it, so a method the server starts to use must exist in both (a type
checker says so; tests/unit/test_grammar_limits.py checks the names at run time). The server
imports it through `slotserve.engine.async_engine`, the one engine module besides the read
side's that server/ may import (tests/unit/test_layering.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

from slotserve.engine.events import EngineSnapshot
from slotserve.engine.outputs import RequestOutput
from slotserve.sampling import SamplingParams
from slotserve.structured import StructuredOutputs


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the HTTP server sees it: generation, admission checks, the drain and
    the read side (snapshots, iteration events, the trace)."""

    @property
    def tokenizer(self):
        """The model's tokenizer (None: the model has none; prompts must be token ids)."""

    @property
    def max_total_tokens(self) -> int:
        """Longest sequence (prompt + output) a request may reach."""

    @property
    def healthy(self) -> bool:
        """False once the engine cannot serve (/health answers 503)."""

    @property
    def num_active(self) -> int:
        """Requests admitted and not finished."""

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 **request_fields) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come (request_fields: cache_salt, priority,
        tenant, slo_ttft_ms, slo_tpot_ms); closing the iterator aborts the request."""

    def incoming(self) -> AbstractContextManager:
        """A context the server holds while it tokenizes a request for `generate`: an
        engine may wait for such requests before it starts a burst."""

    def abort(self, request_id: str) -> None:
        """Abort a request (by the next iteration boundary)."""

    def queue_bound(self, tenant: str) -> int | None:
        """The most sequences one request of `tenant` could ever have waiting (None:
        unbounded); one that asks for more can never be queued whole (HTTP 400, not 429)."""

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids); ValueError on an unusable prompt."""

    async def check_structured(self, spec: StructuredOutputs) -> None:
        """Compile a constraint off the event loop and the engine thread (cached);
        ValueError naming the field if the grammar engine rejects it."""

    async def reset_prefix_cache(self) -> int:
        """Drop the cached free blocks; how many."""

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (the drain)."""

    def snapshot(self, include_blocks: bool = False) -> EngineSnapshot:
        """The engine's state now (frozen)."""

    def subscribe(self, callback) -> None:
        """callback(IterationEvent) for each iteration."""

    def unsubscribe(self, callback) -> None:
        """Stop calling `callback`."""

    def export_trace(self) -> dict:
        """The engine's recent iteration trace (/debug/trace)."""
