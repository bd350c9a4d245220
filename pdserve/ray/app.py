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
ENGINES = "EngineReplica"   # the engine deployment's name
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
    options = dict(ray_actor_options={"num_cpus": cpus},
                   # the engine's own admission refuses overload (503); Serve's cap only has to be above it
                   max_ongoing_requests=args.max_num_seqs + args.max_waiting + 1,
                   request_router_config=router, graceful_shutdown_timeout_s=args.shutdown_timeout)
    if args.ray_replicas_per_node is not None:
        options["max_replicas_per_node"] = args.ray_replicas_per_node
    engines = serve.deployment(EngineReplica, name=ENGINES).options(num_replicas=num_replicas or args.num_replicas,
                                                                    **options)
    ingress = serve.deployment(ingress_class(), name="Ingress").options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=args.max_connections)
    return ingress.bind(engines.bind(kwargs, config), args.model, args.block_size, args.ray_retry_failed)


def deploy(args: argparse.Namespace) -> None:
    # external_scaler_enabled: scale() may change the replica count of the running app
    serve.run(build_application(args), name=APP_NAME, route_prefix="/", external_scaler_enabled=True)


def scale(num_replicas: int) -> None:
    """Set the running app's engine replicas to `num_replicas`, in place: the running ones keep
    serving, new ones are added or the surplus drained (what Ray's REST API .../scale does)."""
    from ray.serve._private.common import DeploymentID
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    ray.get(controller.update_deployment_replicas.remote(DeploymentID(name=ENGINES, app_name=APP_NAME),
                                                         num_replicas))


def check_args(args: argparse.Namespace) -> None:
    if args.backend != "engine":
        raise ConfigError(f"--ray serves pdserve's engine only, not --backend {args.backend}")
    if not os.path.isdir(args.model):
        raise ConfigError(f"model directory not found: {args.model} (with --ray it must exist at this path on "
                          "every node)")


def run(args: argparse.Namespace) -> int:
    """Deploy on the Ray cluster (--ray-address, else RAY_ADDRESS, else a local one) and serve until
    SIGTERM or Ctrl-C (then delete the app), or return at once with --ray-detach; --ray-scale N
    changes the running app's replica count instead."""
    check_args(args)
    ray.init(address=args.ray_address, logging_level=args.log_level.upper())
    if args.ray_scale is not None:
        scale(args.ray_scale)
        log.warning("%s: scaling to %d replica(s)", APP_NAME, args.ray_scale)
        return 0
    serve.start(http_options={"host": args.host, "port": args.port})
    deploy(args)
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
