"""`pdserve serve`: one engine behind the HTTP API (api_server.py), Ray Serve replicas
(ray_serve.py, --ray) or a prefill worker, a decode worker and a proxy (disaggregate.py,
--disaggregate); serve_args.py declares the flags of all three."""
import argparse
import logging

from pdserve.engine.args import check_engine_args
from pdserve.entrypoints import api_server, disaggregate
from pdserve.entrypoints.serve_args import add_arguments, check_ray_flags, resolve_model
from pdserve.errors import ConfigError

__all__ = ["add_arguments", "run"]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    resolve_model(args)
    check_ray_flags(args)
    if args.ray:
        from pdserve.entrypoints.ray_serve import run as run_on_ray   # needs the ray extra: the CLI says so
        return run_on_ray(args)
    if args.disaggregate:
        check_engine_args(args)
        return disaggregate.run(args)
    if args.prefill_cores is not None or args.decode_cores is not None:
        raise ConfigError("--prefill-cores and --decode-cores need --disaggregate")
    return api_server.run(args)
