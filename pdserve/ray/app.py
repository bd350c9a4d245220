"""The Ray Serve application: N EngineReplica deployments' replicas (each an engine on its own CPUs)
behind one Ingress, routed by KVAwareRequestRouter; and `pdserve serve --ray`, which deploys it."""
import argparse
import logging
import os
import signal
import threading

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from pdserve.engine.args import engine_kwargs
from pdserve.errors import ConfigError
from pdserve.ray.ingress import ingress_class
from pdserve.ray.replica import EngineReplica
from pdserve.ray.request_router import KVAwareRequestRouter

APP_NAME = "pdserve"
log = logging.getLogger("pdserve.ray")


def build_application(args: argparse.Namespace, num_replicas: int | None = None) -> serve.Application:
    """The application for parsed `pdserve serve --ray` arguments (num_replicas: instead of --num-replicas)."""
    from pdserve.server.launch import server_config
    cpus = args.ray_cpus_per_replica
    kwargs = engine_kwargs(args)
    kwargs["threads"] = kwargs["threads"] or max(1, int(cpus))   # the forward uses the CPUs Ray reserved
    config = server_config(args, os.path.basename(os.path.normpath(args.model)))
    router = RequestRouterConfig(request_router_class=KVAwareRequestRouter,
                                 request_router_kwargs=dict(policy=args.routing,
                                                            min_match_blocks=args.routing_min_match_blocks,
                                                            max_imbalance=args.routing_max_imbalance))
    engines = serve.deployment(EngineReplica, name="EngineReplica").options(
        num_replicas=num_replicas or args.num_replicas, ray_actor_options={"num_cpus": cpus},
        # the engine's own admission refuses overload (503); Serve's cap only has to be above it
        max_ongoing_requests=args.max_num_seqs + args.max_waiting + 1,
        request_router_config=router, graceful_shutdown_timeout_s=args.shutdown_timeout)
    ingress = serve.deployment(ingress_class(), name="Ingress").options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=args.max_connections)
    return ingress.bind(engines.bind(kwargs, config), args.model, args.block_size, args.ray_retry_failed)


def check_args(args: argparse.Namespace) -> None:
    if args.backend != "engine":
        raise ConfigError(f"--ray serves pdserve's engine only, not --backend {args.backend}")
    if not os.path.isdir(args.model):
        raise ConfigError(f"model directory not found: {args.model} (with --ray it must exist at this path on "
                          "every node)")


def run(args: argparse.Namespace) -> int:
    """Deploy on the Ray cluster (--ray-address, else RAY_ADDRESS, else a local one) and serve until
    SIGTERM or Ctrl-C (then delete the app), or return at once with --ray-detach. Run again with a
    different --num-replicas, the running app is scaled in place."""
    check_args(args)
    ray.init(address=args.ray_address, logging_level=args.log_level.upper())
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_application(args), name=APP_NAME, route_prefix="/")
    log.warning("serving %s on http://%s:%d with %d Ray Serve replica(s), routing %s", args.model, args.host,
                args.port, args.num_replicas, args.routing)
    if args.ray_detach:
        return 0
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.delete(APP_NAME)
    ray.shutdown()
    return 0
