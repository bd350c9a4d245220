"""The Ray Serve application: N EngineReplica deployments' replicas (each an engine on its own CPUs)
behind one Ingress, routed by KVAwareRequestRouter; or P/D pools, X prefill-role and Y decode-role
replicas behind a PDIngress; and `pdserve serve --ray`, which deploys it."""
import argparse
import logging
import os
import signal
import threading
import uuid

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from pdserve.engine.args import engine_kwargs
from pdserve.errors import ConfigError
from pdserve.kv_transfer import auth
from pdserve.proxy.pairing import check_described
from pdserve.proxy.workers import Worker
from pdserve.ray.ingress import ingress_class
from pdserve.ray.listen import local_ray_options
from pdserve.ray.pd_ingress import pd_ingress_class
from pdserve.ray.replica import EngineReplica
from pdserve.ray.request_router import KVAwareRequestRouter
from pdserve.server.config import ServerConfig

APP_NAME = "pdserve"
ENGINES = "EngineReplica"   # the engine deployment's name
POOLS = {"prefill": "PrefillEngine", "decode": "DecodeEngine"}   # the P/D pools' deployments
log = logging.getLogger("pdserve.ray")


def build_application(args: argparse.Namespace, num_replicas: int | None = None) -> serve.Application:
    """The application for parsed `pdserve serve --ray` arguments (num_replicas: instead of --num-replicas)."""
    cpus = args.ray_cpus_per_replica
    kwargs = engine_kwargs(args)
    kwargs["threads"] = kwargs["threads"] or max(1, int(cpus))   # the forward uses the CPUs Ray reserved
    config = ServerConfig.from_args(args, os.path.basename(os.path.normpath(args.model)))

    def deployment(name: str, policy: str, replicas: int):
        router = RequestRouterConfig(request_router_class=KVAwareRequestRouter,
                                     request_router_kwargs=dict(policy=policy,
                                                                min_match_blocks=args.routing_min_match_blocks,
                                                                max_imbalance=args.routing_max_imbalance))
        options = dict(ray_actor_options={"num_cpus": cpus}, num_replicas=replicas,
                       # the engine's own admission refuses overload (503); Serve's cap only has to be above it
                       max_ongoing_requests=args.max_num_seqs + args.max_waiting + 1,
                       request_router_config=router, graceful_shutdown_timeout_s=args.shutdown_timeout)
        if args.ray_replicas_per_node is not None:
            options["max_replicas_per_node"] = args.ray_replicas_per_node
        return serve.deployment(EngineReplica, name=name).options(**options)

    ingress = dict(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=args.max_connections)
    if getattr(args, "prefill_replicas", None) is None:
        engines = deployment(ENGINES, args.routing, num_replicas or args.num_replicas or 1).bind(kwargs, config)
        return serve.deployment(ingress_class(), name="Ingress").options(**ingress).bind(
            engines, args.model, args.block_size, args.ray_retry_failed, reasoning_parser=args.reasoning_parser)
    # P/D pools: the prompt's cached blocks live where it was prefilled, so prefill is routed by
    # --routing (prefix-aware by default); a decode replica only needs room: least-loaded. A
    # loopback --kv-transfer-host (the default) would be unreachable from other nodes: the node's IP.
    node_kv_host = args.kv_transfer_host in ("127.0.0.1", "localhost", "::1")
    # The KV channel's secret (given, else new) and the decode pool's one engine id (the ingress
    # cannot choose a decode replica before the prefill call: a lease is for the pool) reach the
    # replicas as deployment arguments, held by Ray, not on any command line.
    secret, pool_id = auth.secret_from(args.kv_transfer_secret) or auth.new_secret(), f"decode-pool-{uuid.uuid4().hex}"
    prefill = deployment(POOLS["prefill"], args.routing, args.prefill_replicas).bind(
        {**kwargs, "role": "prefill", "kv_transfer_secret": secret}, config, node_kv_host)
    decode = deployment(POOLS["decode"], "least-loaded", args.decode_replicas).bind(
        {**kwargs, "role": "decode", "kv_transfer_secret": secret, "kv_engine_id": pool_id}, config)
    return serve.deployment(pd_ingress_class(), name="Ingress").options(**ingress).bind(
        prefill, decode, args.model, args.block_size, args.ray_retry_failed, decode_engine_id=pool_id, kv_secret=secret,
        reasoning_parser=args.reasoning_parser)


def check_pools(args: argparse.Namespace, max_calls: int = 64) -> None:
    """The pools' pairing check, as `pdserve proxy` makes it (pairing.py): every replica has its
    pool's role, and all agree on the model, the KV block size and the KV dtype (a heterogeneous
    cluster may resolve --dtype auto differently). Each replica is asked through its pool's handle,
    which takes idle replicas in turn, until all have answered. ConfigError if they do not agree."""
    workers, info = [], {}
    for role, name in POOLS.items():
        handle, want = serve.get_deployment_handle(name, APP_NAME), getattr(args, f"{role}_replicas")
        seen = {}
        for _ in range(max_calls):
            if len(seen) == want:
                break
            r = handle.info.remote().result()
            seen[r["replica"]] = r["kv_transfer"]
        for replica, kv in seen.items():
            w = Worker(f"Ray replica {replica}", role)
            workers.append(w)
            info[w.url] = kv
    check_described(workers, info)


def deploy(args: argparse.Namespace) -> None:
    # external_scaler_enabled: scale() may change the replica count of the running app
    serve.run(build_application(args), name=APP_NAME, route_prefix="/", external_scaler_enabled=True)
    if getattr(args, "prefill_replicas", None) is not None:
        check_pools(args)


def scale(num_replicas: int) -> None:
    """Set the running app's engine replicas to `num_replicas`, in place: the running ones keep
    serving, new ones are added or the surplus drained (what Ray's REST API .../scale does)."""
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    ray.get(controller.update_deployment_replicas.remote(DeploymentID(name=ENGINES, app_name=APP_NAME),
                                                         num_replicas))


def check_args(args: argparse.Namespace) -> None:
    if args.baseline != "engine":
        raise ConfigError(f"--ray serves pdserve's engine only, not --baseline {args.baseline}")
    if not os.path.isdir(args.model):
        raise ConfigError(f"model directory not found: {args.model} (with --ray it must exist at this path on "
                          "every node)")


def run(args: argparse.Namespace) -> int:
    """Deploy on the Ray cluster (--ray-address, else RAY_ADDRESS, else a local one) and serve until
    SIGTERM or Ctrl-C (then delete the app), or return at once with --ray-detach; --ray-scale N
    changes the running app's replica count instead."""
    check_args(args)
    # Without an address ray.init joins the cluster another process on this machine last started
    # (/tmp/ray/ray_current_cluster): right for --ray-scale (the running app's), but serving
    # starts a local instance of its own, as the flag's help says.
    address = args.ray_address or os.environ.get("RAY_ADDRESS") or (None if args.ray_scale is not None else "local")
    # a local instance listens on --host where Ray allows it (listen.py); a cluster's own are its `ray start`'s
    local = local_ray_options(args.host) if address == "local" else {}
    ray.init(address=address, logging_level=args.log_level.upper(), **local)
    if args.ray_scale is not None:
        scale(args.ray_scale)
        log.warning("%s: scaling to %d replica(s)", APP_NAME, args.ray_scale)
        return 0
    serve.start(http_options={"host": args.host, "port": args.port})
    try:
        deploy(args)
    except ConfigError:
        serve.delete(APP_NAME)
        raise
    replicas = (f"{args.num_replicas} Ray Serve replica(s)" if args.prefill_replicas is None else
                f"{args.prefill_replicas} prefill and {args.decode_replicas} decode Ray Serve replica(s)")
    log.warning("serving %s on http://%s:%d with %s, routing %s", args.model, args.host, args.port, replicas,
                args.routing)
    if args.ray_detach:
        return 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.delete(APP_NAME)
    ray.shutdown()
    return 0
