"""`slotserve serve`: the OpenAI API over HTTP (one engine, or Ray replicas with --replicas)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import uvicorn

from slotserve.commands.common import chat_template_arg
from slotserve.config import resolve_prefix_cache_scope
from slotserve.engine_args import add_engine_args, build_engine, parse_size
from slotserve.server.startup import (
    CLOSE_GRACE_S,
    DEFAULT_HOST,
    DrainingServer,
    access_policy,
    listen_host,
    log_startup,
    served_model_names,
    server_limits,
    setup_logging,
    shutdown,
    tenant_weights,
)

logger = logging.getLogger("slotserve.server")


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
    p.add_argument("--default-max-tokens", type=_positive_int, default=None, metavar="N",
                   help="max_tokens of a request that names none (--max-tokens-cap caps it; "
                        "the context still ends a sequence; default: chat 1024, completions "
                        "16 as OpenAI's)")
    p.add_argument("--max-n", type=_positive_int, default=128, metavar="N",
                   help="requests asking for more than N completions (n) get 400 "
                        "(default: 128, OpenAI's bound)")
    p.add_argument("--max-stop-token-ids", type=_positive_int, default=128, metavar="N",
                   help="requests with more than N stop_token_ids get 400 (default: 128)")
    p.add_argument("--max-logprobs-volume", type=_positive_int, default=1 << 18, metavar="N",
                   help="a request asking for logprobs gets 400 when n x max_tokens (at most "
                        "the context) x max(top logprobs, 1) is above N: what one answer "
                        "may carry (default: 262144, about 20 MB of JSON); prompt logprobs "
                        "(prompt_logprobs, echo with logprobs) count prompt tokens x max(top "
                        "N, 1), and a list of prompts multiplies the completions' volume")
    p.add_argument("--max-prompts", type=_positive_int, default=1024, metavar="N",
                   help="/v1/completions requests with a list of more than N prompts get 400 "
                        "(default: 1024)")
    p.add_argument("--chat-template", type=chat_template_arg, default=None,
                   metavar="FILE_OR_TEMPLATE",
                   help="the Jinja chat template of /v1/chat/completions and /tokenize, "
                        "instead of the model's: a file, or the template itself (as vLLM's; "
                        "a value with {, } or a newline that is no file is the template). "
                        "Checked at start-up (default: the model's, from its tokenizer "
                        "config or GGUF metadata)")
    add_structured_args(p)
    add_access_args(p)
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    from slotserve.scaleout.launch import add_replica_flags  # NOTE: imports no Ray

    add_replica_flags(p)
    p.set_defaults(func=cmd_serve)


def add_structured_args(p) -> None:
    from slotserve.structured import limits as sl

    g = p.add_argument_group("structured outputs (caps: past one, 400 naming the field)")
    g.add_argument("--max-schema-bytes", type=_positive_size,
                   default=sl.DEFAULT_MAX_SCHEMA_BYTES, metavar="SIZE",
                   help="largest JSON schema (response_format, structured_outputs.json, "
                        "guided_json, the tools' schema), as compact JSON (default: 128K)")
    g.add_argument("--max-regex-bytes", type=_positive_size, default=sl.DEFAULT_MAX_REGEX_BYTES,
                   metavar="SIZE", help="largest regex constraint (default: 16K)")
    g.add_argument("--max-grammar-bytes", type=_positive_size,
                   default=sl.DEFAULT_MAX_GRAMMAR_BYTES, metavar="SIZE",
                   help="largest Lark or GBNF grammar constraint (default: 64K)")
    g.add_argument("--max-choices", type=_positive_int, default=sl.DEFAULT_MAX_CHOICES,
                   metavar="N", help="most choices of a choice constraint (default: 1024)")
    g.add_argument("--max-choice-bytes", type=_positive_size,
                   default=sl.DEFAULT_MAX_CHOICE_BYTES, metavar="SIZE",
                   help="longest choice of a choice constraint (default: 1K)")
    g.add_argument("--max-constrained-n", type=_positive_int,
                   default=sl.DEFAULT_MAX_CONSTRAINED_N, metavar="N",
                   help="most completions (n) of a constrained request: each computes a "
                        "grammar mask every step (default: 16)")


def add_access_args(p) -> None:
    g = p.add_argument_group("access")
    g.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="/v1 requests need 'Authorization: Bearer KEY' (repeatable; tenant "
                        "'default'). Visible in the process list: prefer --api-keys-file")
    g.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="API keys, one 'KEY TENANT [WEIGHT] [priority=LO..HI]' per line: "
                        "WEIGHT the tenant's fair share (default 1), priority=LO..HI (or "
                        "priority=N) the `priority` values the key may ask for (default 0, "
                        "others get 400). Lines starting with '#' are comments; keys may not "
                        "start with '#', nor be given twice (here or with --api-key); "
                        "tenants 'default', 'admin' and 'other' are reserved")
    g.add_argument("--admin-key", default=None, metavar="KEY",
                   help="the live view (/), /debug/* and /metrics need this key (Bearer, or "
                        "HTTP Basic with it as the password); with API keys and no admin "
                        "key they are off. Visible in the process list: prefer "
                        "--admin-key-file")
    g.add_argument("--admin-key-file", default=None, metavar="FILE",
                   help="read the admin key from FILE (its only word) instead of "
                        "--admin-key; it must differ from every API key")
    g.add_argument("--allowed-hosts", default=None, metavar="HOSTS",
                   help="comma-separated Host names requests may carry (a name, *.domain, "
                        "an IP; any port), others get 400; '*' allows any. Loopback names "
                        "and the --host address always pass (default: on a loopback "
                        "address only loopback names, elsewhere any)")
    g.add_argument("--disable-admin-routes", action="store_true",
                   help="the live view, /debug/* and /metrics answer 404")
    g.add_argument("--max-user-tenants", type=_non_negative_int, default=1024, metavar="N",
                   help="without API keys, a request's OpenAI `user` field names its tenant "
                        "(--scheduling-policy fair, per-tenant metrics): the first N distinct "
                        "names get their own, later ones share tenant 'other'; 0 ignores the "
                        "field (default: 1024). With API keys the key's tenant counts")


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


def cmd_serve(args: argparse.Namespace) -> int:
    from slotserve.engine.async_engine import AsyncEngine
    from slotserve.server.api import build_app

    if getattr(args, "replicas", None):  # Ray Serve replicas (slotserve.scaleout)
        from slotserve.scaleout.launch import serve_replicas

        return serve_replicas(args)
    setup_logging(args.log_level)
    policy = access_policy(args)  # NOTE: a bad keys file fails before the model loads
    limits = server_limits(args)
    weights = tenant_weights(policy)
    scope = resolve_prefix_cache_scope(args.prefix_cache_scope, policy.keys_required)
    async_engine = AsyncEngine.launch(lambda: build_engine(
        args, tenant_weights=weights, prefix_cache_scope=scope))
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
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        shutdown(async_engine, args.trace)
    return 0


