"""`slotserve serve` (the OpenAI API over HTTP) and `slotserve chat` (a terminal chat)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

import uvicorn

from slotserve.engine.events import EngineSnapshot
from slotserve.engine_args import add_engine_args, build_engine, parse_size

logger = logging.getLogger("slotserve.server")

# Quantisation suffixes of GGUF file names ("SmolLM2-135M-Instruct.Q4_1").
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)
# After the drain: how long uvicorn lets connections finish writing (the last SSE events,
# a dashboard's event stream) before it cancels them.
CLOSE_GRACE_S = 3
# After a timed-out drain aborts what is left: how long the aborts have to reach the clients.
ABORT_GRACE_S = 2.0
DEFAULT_HOST = "127.0.0.1"


# --------------------------------------------------------------------------- serve
def add_serve_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI API (completions, chat) over HTTP")
    p.add_argument("--host", default=None,
                   help=f"address to listen on (default: {DEFAULT_HOST}, this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-waiting", type=int, default=None,
                   help="bound on waiting requests; beyond it requests get 429 (default: none)")
    p.add_argument("--served-model-name", default=None,
                   help="model name of the API (default: from the model file or directory)")
    p.add_argument("--trace", default=None, metavar="PATH",
                   help="write the engine's iteration trace to this JSON file at shutdown")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM / SIGINT: refuse new requests (503) and let running ones "
                        "finish for up to this long, then abort the rest and exit "
                        "(default: 30; a second signal exits at once)")
    p.add_argument("--max-tokens-cap", type=_positive_int, default=None, metavar="N",
                   help="requests asking for more than N tokens (max_tokens) get 400; it also "
                        "caps the default (default: no cap)")
    p.add_argument("--max-body-bytes", type=_positive_size, default="1M",
                   metavar="SIZE", help="larger request bodies get 413 (default: 1M)")
    p.add_argument("--max-connections", type=_positive_int, default=None, metavar="N",
                   help="HTTP requests served at once; beyond it 503, /health and /metrics "
                        "excepted (default: no limit)")
    p.add_argument("--max-stop-strings", type=_positive_int, default=64, metavar="N",
                   help="requests with more than N stop strings get 400 (default: 64)")
    p.add_argument("--max-stop-chars", type=_positive_int, default=512, metavar="N",
                   help="requests with a stop string longer than N characters get 400 "
                        "(default: 512)")
    p.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="a request body not complete S seconds after the request began gets "
                        "408; only complete requests count against --max-connections "
                        "(default: 30)")
    add_access_args(p)
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    from slotserve.scaleout.launch import add_replica_flags  # NOTE: imports no Ray

    add_replica_flags(p)
    p.set_defaults(func=cmd_serve)


def add_access_args(p) -> None:
    g = p.add_argument_group("access")
    g.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="/v1 requests need 'Authorization: Bearer KEY' (repeatable; tenant "
                        "'default'). Visible in the process list: prefer --api-keys-file")
    g.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="API keys, one 'KEY TENANT [WEIGHT]' per line (# comments)")
    g.add_argument("--admin-key", default=None, metavar="KEY",
                   help="the live view (/), /debug/* and /metrics need this key (Bearer, or "
                        "HTTP Basic with it as the password); with API keys and no admin "
                        "key they are off")
    g.add_argument("--disable-admin-routes", action="store_true",
                   help="the live view, /debug/* and /metrics answer 404")
    g.add_argument("--max-user-tenants", type=_non_negative_int, default=1024, metavar="N",
                   help="without API keys, a request's OpenAI `user` field names its tenant "
                        "(--scheduling-policy fair, per-tenant metrics): the first N distinct "
                        "names get their own, later ones share tenant 'other'; 0 ignores the "
                        "field (default: 1024). With API keys the key's tenant counts")


def access_policy(args: argparse.Namespace):
    """The AccessPolicy the access flags describe; ValueError (naming the file and line)
    for a malformed keys file."""
    from slotserve.server.auth import AccessPolicy, Tenant, load_api_keys_file

    keys = [(key, Tenant()) for key in args.api_key]
    if args.api_keys_file:
        keys += load_api_keys_file(args.api_keys_file)
    return AccessPolicy(api_keys=tuple(keys), admin_key=args.admin_key,
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
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_size(text: str) -> int:
    value = parse_size(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 byte, got {text!r}")
    return value


def server_limits(args: argparse.Namespace):
    """The ServerLimits the limit flags describe."""
    from slotserve.server.api import ServerLimits

    return ServerLimits(max_tokens=args.max_tokens_cap, max_body_bytes=args.max_body_bytes,
                        max_connections=args.max_connections,
                        max_stop_strings=args.max_stop_strings,
                        max_stop_chars=args.max_stop_chars, body_timeout_s=args.body_timeout,
                        max_user_tenants=args.max_user_tenants)


def cmd_serve(args: argparse.Namespace) -> int:
    from slotserve.engine.async_engine import AsyncEngine
    from slotserve.server.api import build_app

    if getattr(args, "replicas", None):  # Ray Serve replicas (slotserve.scaleout)
        from slotserve.scaleout.launch import serve_replicas

        return serve_replicas(args)
    setup_logging(args.log_level)
    policy = access_policy(args)  # NOTE: a bad keys file fails before the model loads
    limits = server_limits(args)
    async_engine = AsyncEngine(build_engine(args, tenant_weights=tenant_weights(policy)))
    snapshot = async_engine.snapshot()  # NOTE: the waiting bound is in the engine config
    name, aliases = served_model_names(snapshot.model, args.model, args.served_model_name)
    app = build_app(async_engine, name, aliases=aliases, limits=limits, access=policy)
    host = listen_host(args, policy)
    logger.info("access: %s", policy.describe())
    log_startup(snapshot, name, f"http://{host}:{args.port}/v1")
    # NOTE: a second signal makes uvicorn shut down at once and re-raise the signal with
    # the handler it found: make that one a clean exit, so the `finally` runs.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    config = uvicorn.Config(app, host=host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=CLOSE_GRACE_S)
    server = DrainingServer(config, app.state.server, args.drain_timeout)
    async_engine.start()
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        shutdown(async_engine, args.trace)
    return 0


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
    logger.info("KV pool: %d blocks x %d tokens = %d tokens (%.0f MiB); policy %s, "
                "%d slots, token budget %d, max_model_len %d", snap.kv_blocks_total,
                snap.block_size, snap.kv_blocks_total * snap.block_size,
                snap.kv_pool_bytes / 2**20, snap.policy, snap.num_slots,
                snap.max_num_batched_tokens, snap.max_model_len)
    logger.info("scheduling policy %s; SLOs: TTFT %s ms, TPOT %s ms%s; %d tenants weighted",
                snap.scheduling_policy, snap.slo_ttft_ms, snap.slo_tpot_ms,
                ", rejecting unattainable" if snap.slo_reject else "",
                len(snap.configured_tenants))
    logger.info("serving %s at %s", name, url)


# --------------------------------------------------------------------------- chat
def add_chat_parser(subparsers) -> None:
    p = subparsers.add_parser("chat", help="chat in the terminal (in-process, or with --url)")
    p.add_argument("--url", default=None,
                   help="a running slotserve / OpenAI-compatible server, e.g. "
                        "http://127.0.0.1:8000 (default: an in-process engine)")
    p.add_argument("--model-name", default=None,
                   help="with --url: the model to ask for (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("SLOTSERVE_API_KEY"),
                   help="with --url: the server's API key (default: $SLOTSERVE_API_KEY)")
    p.add_argument("--system", default=None, help="a system message")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    add_engine_args(p)
    # One conversation needs one slot; this also keeps the default KV pool small.
    p.set_defaults(func=cmd_chat, max_num_seqs=1)


def cmd_chat(args: argparse.Namespace) -> int:
    from slotserve.server.chat import LocalChat, RemoteChat, run_chat

    if args.url:
        backend = RemoteChat(args.url, args.model_name, api_key=args.api_key)
    else:
        print("loading the model...", flush=True)
        backend = LocalChat(build_engine(args))
    print(f"chatting with {backend.model_name} (/exit or Ctrl-D quits, /reset forgets)")
    run_chat(backend, system=args.system, max_tokens=args.max_tokens,
             temperature=args.temperature)
    return 0
