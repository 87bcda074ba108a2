"""`slotserve serve --replicas N`: N engine replicas on Ray Serve behind one ingress.

The ingress is this process: the same FastAPI app as the single-process server
(`build_app`), over a ReplicaFront instead of an AsyncEngine, under the same uvicorn server
with the same drain on SIGTERM. Ray is imported only here (the `ray` extra).

    ray.init (local, or --ray-address)  ->  serve.start (no Serve HTTP proxy)
    -> one Serve application per replica (EngineReplica, --threads-per-replica CPUs each)
    -> ReplicaFront + Router  ->  build_app  ->  uvicorn

Ray's authentication: a cluster without it runs any code that anyone who reaches its ports
sends (as the user that runs Ray). `--ray-address` first asks the cluster's GCS, from a
process without a token, whether it answers (`cluster_accepts_anyone`), and refuses to join
one that does unless `--allow-unauthenticated-ray` (then a loud warning). A local Ray
(`--replicas` alone) has Ray's default: a token of its own (Ray >= 2.52).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys

from slotserve.scaleout.router import POLICIES

logger = logging.getLogger("slotserve.scaleout")

APP_PREFIX = "slotserve-replica-"
STARTUP_TIMEOUT_S = 600.0
LOCAL_OBJECT_STORE_BYTES = 256 << 20  # outputs are small; a local Ray needs little


def add_replica_flags(parser: argparse.ArgumentParser) -> None:
    """The scale-out flags of `slotserve serve`."""
    g = parser.add_argument_group("replicas (Ray Serve; needs `pip install slotserve[ray]`)")
    g.add_argument("--replicas", type=_at_least_one, default=None, metavar="N",
                   help="serve N engine replicas on Ray Serve behind one ingress "
                        "(default: one engine in this process, no Ray)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --replicas: join this Ray cluster (e.g. 10.0.0.1:6379) "
                        "instead of starting a local one; it must use Ray's token "
                        "authentication (RAY_AUTH_MODE=token; this process needs its token)")
    g.add_argument("--allow-unauthenticated-ray", action="store_true",
                   help="with --ray-address: join a Ray cluster even if it does not use "
                        "token authentication, with a warning (anyone who reaches its ports "
                        "can run code on its machines; default: refuse)")
    g.add_argument("--threads-per-replica", type=_at_least_one, default=None, metavar="N",
                   help="with --replicas: torch threads (and Ray CPUs) of each replica "
                        "(default: the cluster's CPUs / N)")
    g.add_argument("--router", default="prefix", choices=POLICIES,
                   help="with --replicas: prefix (cache-aware with a load margin, default), "
                        "least_loaded or round_robin")


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def start_ray(address: str | None, num_cpus: int | None = None, temp_dir: str | None = None,
              object_store_bytes: int = LOCAL_OBJECT_STORE_BYTES, *,
              allow_unauthenticated: bool = False) -> None:
    """Join `address`, or start a local Ray (no dashboard); then Serve without its proxy.

    RayClusterError (its message says what to do) if the cluster at `address` cannot be
    joined: not there, it wants an authentication token that this process lacks, or it
    does not use token authentication and `allow_unauthenticated` is False.
    """
    import ray
    from ray import serve

    if address:
        check_cluster_auth(address, allow_unauthenticated)
        join_cluster(address)
    else:
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
            logger.warning("RAY_AUTH_MODE=disabled: the local Ray runs without its token; "
                           "any local user who reaches its ports can run code as this one")
        # NOTE: "local": a new Ray of our own even when RAY_ADDRESS is set or a `ray start`
        # cluster runs here (ray.init() would join that one, and the server's exit would
        # then leave its replicas there).
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 log_to_driver=False,
                 object_store_memory=object_store_bytes, _temp_dir=temp_dir)
    serve.start(proxy_location="Disabled")


class RayClusterError(RuntimeError):
    """The Ray cluster named by --ray-address cannot be joined (the message says why)."""


class UncheckedClusterError(RayClusterError):
    """Whether the cluster uses token authentication cannot be checked (a ray:// address)."""


# Run in a fresh interpreter, without this process's token: exit 0 if the cluster's GCS
# answers it, 3 if it refuses it for want of a token, anything else if it is unreachable.
# NOTE: Ray's own client of the GCS and address resolution (`ray._raylet`, `ray._private`:
# Ray 2.60): 127.0.0.1 resolves to this machine's address, as in ray.init.
_PROBE = """
import sys
from ray._private.services import canonicalize_bootstrap_address_or_die
from ray._raylet import GcsClient
from ray.exceptions import AuthenticationError
try:
    client = GcsClient(address=canonicalize_bootstrap_address_or_die(sys.argv[1]))
    client.internal_kv_get(b"slotserve-auth-probe", None)
except AuthenticationError:
    sys.exit(3)
"""
PROBE_TIMEOUT_S = 60.0
PROBE_CONNECT_TIMEOUT_S = "5"  # RAY_py_gcs_connect_timeout_s: Ray tries 3 times (~15 s)
TOKEN_SOURCES = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def cluster_accepts_anyone(address: str) -> bool:
    """Whether the Ray cluster at `address` answers a client without a token (its GCS,
    asked by a new interpreter with RAY_AUTH_MODE=disabled and no token). RayClusterError
    if it does not answer at all, or `address` is a Ray Client one (ray://), which this
    check cannot ask."""
    if address.startswith("ray://"):
        raise UncheckedClusterError(
            f"cannot check whether the Ray cluster at {address} uses token authentication: "
            "give its GCS address (HOST:PORT, 6379 by default) instead of a ray:// one, or "
            "--allow-unauthenticated-ray")
    env = {k: v for k, v in os.environ.items() if k not in TOKEN_SOURCES}
    env["RAY_AUTH_MODE"] = "disabled"  # NOTE: then no token is sent, not even ~/.ray's
    env.setdefault("RAY_py_gcs_connect_timeout_s", PROBE_CONNECT_TIMEOUT_S)
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE, address], env=env,
                               capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RayClusterError(f"the Ray cluster at {address} did not answer within "
                              f"{PROBE_TIMEOUT_S:g} s") from None
    if probe.returncode == 3:
        return False
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise RayClusterError(f"cannot reach the Ray cluster at {address} (is `ray start "
                              f"--head` running there, and is the port right?): {last}")
    return True


def check_cluster_auth(address: str, allow_unauthenticated: bool,
                       accepts_anyone=cluster_accepts_anyone) -> None:
    """Refuse (RayClusterError) a cluster that runs code for anyone, unless
    `allow_unauthenticated`: then warn loudly. A cluster that cannot be checked counts as
    one without authentication."""
    try:
        open_to_all = accepts_anyone(address)
        reason = "does not use token authentication"
    except UncheckedClusterError:
        if not allow_unauthenticated:
            raise
        open_to_all, reason = True, "could not be checked for token authentication"
    if not open_to_all:
        return
    if not allow_unauthenticated:
        raise RayClusterError(
            f"the Ray cluster at {address} {reason}: anyone who reaches its ports can run "
            "code on its machines. Start it with RAY_AUTH_MODE=token (`ray get-auth-token "
            "--generate`, then `RAY_AUTH_MODE=token ray start --head ...` and the same token "
            "on every machine), or pass --allow-unauthenticated-ray to join it anyway")
    logger.warning("!" * 78)
    logger.warning("WARNING: the Ray cluster at %s %s: anyone who reaches its ports can run "
                   "code on its machines (--allow-unauthenticated-ray). Use RAY_AUTH_MODE="
                   "token on every machine of it.", address, reason)
    logger.warning("!" * 78)


def join_cluster(address: str) -> None:
    """ray.init(address): join a running cluster (`ray start --head` made it).

    NOTE: Ray enables token authentication on a cluster whose head has a token (Ray >= 2.52
    makes one for every new local cluster), and a driver that names an address explicitly
    never turns it on by itself: it needs RAY_AUTH_MODE=token and the cluster's token
    (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token).
    """
    import ray

    try:
        ray.init(address=address, log_to_driver=False)
    except ConnectionError as exc:
        if "authentication" in _causes(exc).lower():
            raise RayClusterError(
                f"the Ray cluster at {address} refused this process: it uses token "
                "authentication; set RAY_AUTH_MODE=token and give the cluster's token "
                "(RAY_AUTH_TOKEN=..., RAY_AUTH_TOKEN_PATH=FILE or ~/.ray/auth_token)") from exc
        raise RayClusterError(f"cannot join the Ray cluster at {address} (is `ray start "
                              f"--head` running there, and is the port right?): {exc}") from exc


def _causes(exc: BaseException) -> str:
    """The messages of an exception and its causes."""
    parts = []
    while exc is not None and len(parts) < 10:
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return " | ".join(parts)


def default_threads(num_replicas: int) -> int:
    """The cluster's CPUs shared among the replicas (at least one each)."""
    import ray

    return max(1, int(ray.cluster_resources().get("CPU", 1)) // num_replicas)


def deploy_replicas(spec, num_replicas: int) -> dict[str, object]:
    """Deploy the replicas (each its own Serve application) and wait until they run;
    name -> DeploymentHandle."""
    from ray import serve

    from slotserve.scaleout.replica import EngineReplica

    names = [f"{APP_PREFIX}{i}" for i in range(num_replicas)]
    targets = [serve.RunTarget(EngineReplica.options(
        ray_actor_options={"num_cpus": spec.threads}).bind(spec, name), name=name,
        route_prefix=None) for name in names]
    handles = serve.run_many(targets)
    return dict(zip(names, handles))


def delete_replicas(names) -> None:
    from ray import serve

    for name in names:
        try:
            serve.delete(name)
        except Exception:  # shutting down anyway: say so, go on
            logger.warning("could not delete %s", name, exc_info=True)


def build_front(handles: dict[str, object], policy: str, **router_kwargs):
    """A ReplicaFront over the handles, its router keyed on the replicas' block size."""
    from slotserve.scaleout.front import ReplicaFront
    from slotserve.scaleout.router import Router

    describe = next(iter(handles.values())).describe.remote().result()
    router = Router(list(handles), describe["snapshot"].block_size, policy, **router_kwargs)
    return ReplicaFront(handles, describe, router)


def serve_replicas(args: argparse.Namespace) -> int:
    """`slotserve serve --replicas N ...`: deploy, serve until SIGTERM / SIGINT, clean up."""
    import ray

    from slotserve.server.startup import access_policy, server_limits, setup_logging

    setup_logging(args.log_level)
    policy = access_policy(args)
    limits = server_limits(args)
    try:
        start_ray(args.ray_address,
                  allow_unauthenticated=getattr(args, "allow_unauthenticated_ray", False))
    except RayClusterError as exc:
        logger.error("%s", exc)
        return 2
    spec = _replica_spec(args, policy)
    handles = {}
    try:
        handles = deploy_replicas(spec, args.replicas)
        _serve_front(args, handles, policy, limits)
    finally:
        # NOTE: a local Ray goes with ray.shutdown() (its raylet may have had the terminal's
        # SIGINT already, and then Serve calls would hang); a cluster keeps running, so
        # the replicas are deleted from it.
        if args.ray_address:
            delete_replicas(handles)
        ray.shutdown()
        logger.info("replicas stopped")
    return 0


def _replica_spec(args: argparse.Namespace, policy):
    """The ReplicaSpec every replica of `serve --replicas` is deployed from: the engine flags
    and what the access policy gives the engine (the keys file's tenant weights), as
    the single-process `serve` builds its engine."""
    from slotserve.config import resolve_prefix_cache_scope
    from slotserve.engine_args import engine_kwargs
    from slotserve.scaleout.replica import ReplicaSpec
    from slotserve.server.startup import tenant_weights

    threads = args.threads_per_replica or default_threads(args.replicas)
    kwargs = {**engine_kwargs(args), "tenant_weights": tenant_weights(policy),
              "prefix_cache_scope": resolve_prefix_cache_scope(args.prefix_cache_scope,
                                                               policy.keys_required)}
    spec = ReplicaSpec(model=args.model, engine_kwargs=kwargs, threads=threads,
                       max_waiting=args.max_waiting)
    logger.info("deploying %d replicas, %d threads each, router %s", args.replicas, threads,
                args.router)
    return spec


def _serve_front(args: argparse.Namespace, handles: dict, policy, limits) -> None:
    """Serve the OpenAI API over the deployed replicas until SIGTERM / SIGINT."""
    import uvicorn

    from slotserve.scaleout.metrics import ReplicaSetMetrics
    from slotserve.server.api import build_app
    from slotserve.server.startup import CLOSE_GRACE_S, listen_host, served_model_names

    front = build_front(handles, args.router)
    name, aliases = served_model_names(front.model_name, args.model, args.served_model_name)
    app = build_app(front, name, aliases=aliases, limits=limits, access=policy,
                    metrics=ReplicaSetMetrics(front))
    host = listen_host(args, policy)
    logger.info("access: %s", policy.describe())
    logger.info("serving %s from %d replicas at http://%s:%d/v1", name, args.replicas,
                host, args.port)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    config = uvicorn.Config(app, host=host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=CLOSE_GRACE_S)
    server = ReplicaServer(config, app.state.server, args.drain_timeout, front)
    try:
        server.run()
    except KeyboardInterrupt:
        pass


def _draining_server_class():
    from slotserve.server.startup import DrainingServer

    return DrainingServer


class ReplicaServer(_draining_server_class()):
    """The single-process server's uvicorn server (drain included), polling the replicas
    while it runs; the drain also tells each replica to stop accepting."""

    def __init__(self, config, api_server, drain_timeout_s: float, front) -> None:
        super().__init__(config, api_server, drain_timeout_s)
        self.front = front

    async def serve(self, sockets=None) -> None:
        self.front.start()
        try:
            await super().serve(sockets)
        finally:
            await self.front.stop()

    async def drain(self) -> None:
        for replica in self.front.replicas.values():
            replica.handle.stop_accepting.remote()
        await super().drain()

