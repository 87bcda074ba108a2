"""Server start-up and shutdown, shared by `slotserve serve` (`slotserve.commands.serve`) and
its Ray replicas (`slotserve.scaleout.launch`): the access policy, limits and listen address
the flags describe, the served model names, the start-up log, the drain on SIGTERM / SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import signal
import time
from pathlib import Path

import uvicorn

from slotserve.engine.events import EngineSnapshot

logger = logging.getLogger("slotserve.server")

# Quantisation suffixes of GGUF file names ("SmolLM2-135M-Instruct.Q4_1").
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)
# After the drain: how long uvicorn lets connections finish writing (the last SSE events,
# a dashboard's event stream) before it cancels them.
CLOSE_GRACE_S = 3
# After a timed-out drain aborts what is left: how long the aborts have to reach the clients.
ABORT_GRACE_S = 2.0
DEFAULT_HOST = "127.0.0.1"


def access_policy(args: argparse.Namespace):
    """The AccessPolicy the access flags describe; ValueError (naming the flag, or the file
    and line, never the key) for a malformed key or keys file, a key given twice, an API
    key equal to the admin key (auth.access_policy_from)."""
    from slotserve.server.auth import access_policy_from

    return access_policy_from(args.api_key, args.api_keys_file or None, args.admin_key,
                              getattr(args, "admin_key_file", None),
                              admin_routes=not args.disable_admin_routes)


def tenant_weights(policy) -> tuple[tuple[str, float], ...]:
    """(tenant, weight) of every tenant of the API keys (SchedulerConfig.tenant_weights, for
    --scheduling-policy fair; listing all of them also gives each its metrics from the
    start). ValueError if one tenant's keys give it different weights."""
    weights: dict[str, set[float]] = {}
    for _, tenant in policy.api_keys:
        weights.setdefault(tenant.name, set()).add(tenant.weight)
    for name, found in weights.items():
        if len(found) > 1:
            raise ValueError(f"--api-keys-file: tenant {name!r} has keys with different "
                             f"weights ({', '.join(f'{w:g}' for w in sorted(found))}); give "
                             "all of its keys one weight")
    return tuple((name, found.pop()) for name, found in sorted(weights.items()))


def listen_host(args: argparse.Namespace, policy) -> str:
    """--host, else loopback; the log says who can reach the API."""
    host = args.host or DEFAULT_HOST
    if policy.keys_required:
        return host
    if _is_loopback(host):
        logger.info("no --api-key: listening on %s only (this machine); pass --host to "
                    "listen elsewhere", host)
    else:
        logger.warning("no --api-key: anyone who reaches %s:%d can use the model", host,
                       args.port)
    return host


def _is_loopback(host: str) -> bool:
    from slotserve.server.limits import is_loopback

    return is_loopback(host)


def server_limits(args: argparse.Namespace):
    """The ServerLimits the limit flags describe."""
    from slotserve.server.api import ServerLimits
    from slotserve.server.limits import allowed_hosts_for, structured_limits

    return ServerLimits(max_tokens=args.max_tokens_cap, max_body_bytes=args.max_body_bytes,
                        max_connections=args.max_connections,
                        max_stop_strings=args.max_stop_strings,
                        max_stop_chars=args.max_stop_chars, body_timeout_s=args.body_timeout,
                        max_user_tenants=args.max_user_tenants,
                        structured=structured_limits(args), max_n=args.max_n,
                        max_stop_token_ids=args.max_stop_token_ids,
                        max_logprobs_volume=args.max_logprobs_volume,
                        default_max_tokens=args.default_max_tokens,
                        max_prompts=args.max_prompts,
                        chat_template=getattr(args, "chat_template", None),
                        allowed_hosts=allowed_hosts_for(args.host or DEFAULT_HOST,
                                                        args.allowed_hosts))


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain before its graceful shutdown.

    The first SIGTERM or SIGINT starts the drain: new generations get 503 (the listener
    stays open, so clients hear why), running ones go on. When none is left, or after
    `drain_timeout_s` (the rest are aborted: their clients get a 503 error), uvicorn's own
    shutdown closes the listener and the connections. A second signal skips the drain.
    """

    def __init__(self, config: uvicorn.Config, api_server, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.api_server = api_server
        self.drain_timeout_s = drain_timeout_s
        self.drain_started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None  # NOTE: held, or the loop may drop it

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """Signal handler (main thread): the first signal drains, the next one is uvicorn's."""
        if self.drain_started or not self.started or self._loop is None:
            return super().handle_exit(sig, frame)
        self.drain_started = True
        # NOTE: a signal handler may interrupt the event loop anywhere: it only schedules.
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, signal_name: str) -> None:
        self.api_server.begin_drain()
        logger.info("%s: draining %d running requests (up to %gs; new ones get 503)",
                    signal_name, self.api_server.num_in_flight, self.drain_timeout_s)
        self._drain_task = asyncio.ensure_future(self.drain())

    async def drain(self) -> None:
        """Wait for the running generations; abort what is left at the timeout; then exit."""
        drained = await self._wait_in_flight(self.drain_timeout_s)
        if not drained:
            aborted = self.api_server.abort_in_flight()
            logger.warning("drain timed out after %gs: aborted %d requests",
                           self.drain_timeout_s, aborted)
            await self._wait_in_flight(ABORT_GRACE_S)
        else:
            logger.info("drained: no request running")
        self.should_exit = True

    async def _wait_in_flight(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.api_server.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.api_server.num_in_flight


def shutdown(async_engine, trace_path: str | None) -> None:
    """Stop the engine thread; write the trace if asked."""
    async_engine.stop_accepting()
    async_engine.stop()
    if trace_path:
        Path(trace_path).write_text(json.dumps(async_engine.export_trace()))
        logger.info("trace written to %s", trace_path)
    logger.info("engine stopped")


def served_model_names(model_name: str, model_arg: str | None, override: str | None
                       ) -> tuple[str, tuple[str, ...]]:
    """(the API's model name, other names requests may use).

    The name is --served-model-name, else the model's name without a quantisation suffix
    ("SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct"). The full name and the
    --model argument are accepted too.
    """
    name = override or _QUANT_SUFFIX.sub("", model_name) or model_name
    aliases = {model_name, _QUANT_SUFFIX.sub("", model_name)}
    if model_arg:
        aliases.add(model_arg)
    aliases.discard(name)
    return name, tuple(sorted(a for a in aliases if a))


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s", datefmt="%H:%M:%S")


def log_startup(snap: EngineSnapshot, name: str, url: str) -> None:
    """Model, device, KV pool and URL: what an operator checks first."""
    logger.info("model %s (%s, %.0fM parameters) on %s (%s), %s", name, snap.model,
                snap.num_parameters / 1e6, snap.device, snap.dtype, snap.kernels)
    logger.info("KV pool: %d blocks x %d tokens = %d tokens (%.0f MiB, %s); policy %s, "
                "%d slots, token budget %d, max_model_len %d", snap.kv_blocks_total,
                snap.block_size, snap.kv_blocks_total * snap.block_size,
                snap.kv_pool_bytes / 2**20, snap.kv_cache_dtype, snap.policy, snap.num_slots,
                snap.max_num_batched_tokens, snap.max_model_len)
    logger.info("scheduling policy %s; SLOs: TTFT %s ms, TPOT %s ms%s; %d tenants weighted",
                snap.scheduling_policy, snap.slo_ttft_ms, snap.slo_tpot_ms,
                ", rejecting unattainable" if snap.slo_reject else "",
                len(snap.configured_tenants))
    logger.info("serving %s at %s", name, url)


