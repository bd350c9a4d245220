"""The flags of `pdserve serve`, for each way it runs (one engine, Ray Serve replicas, a
disaggregated prefill/decode pair), and the checks on them that need no model."""
import argparse

from pdserve.arg_types import int_at_least, number_at_least
from pdserve.engine.args import DEFAULT_MODEL, add_engine_args
from pdserve.errors import ConfigError
from pdserve.proxy.cores import parse_cores
from pdserve.server.config import add_server_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", nargs="?", metavar="MODEL",
                        help="HF-format checkpoint directory or GGUF file, as vLLM takes it (the same as --model)")
    add_engine_args(parser)
    b = parser.add_argument_group("baselines (docs/BASELINES.md)")
    b.add_argument("--baseline", "--backend", dest="baseline", default="engine",
                   choices=["engine", "hf", "static", "nocache"],
                   help="engine: continuous batching over the paged KV cache (default); the origin's paths as "
                        "baselines: hf = one transformers generate() per request, static = static batches "
                        "of --batch-size, nocache = a token loop re-running the whole sequence without a KV cache "
                        "(--backend: its earlier name)")
    b.add_argument("--batch-size", type=int_at_least(1), default=4, help="static baseline: requests per batch (default: 4)")
    b.add_argument("--batch-wait-ms", type=number_at_least(0), default=0.0,
                   help="static baseline: longest wait for a batch to fill (default: 0)")
    add_server_args(parser)
    r = parser.add_argument_group("Ray Serve (docs/RAY.md; needs the ray extra)")
    r.add_argument("--ray", action="store_true",
                   help="serve as a Ray Serve application: --num-replicas engines behind one endpoint")
    r.add_argument("--num-replicas", type=int_at_least(1), default=None, help="engine replicas (default: 1)")
    r.add_argument("--prefill-replicas", type=int_at_least(1), default=None, metavar="X",
                   help="instead of --num-replicas: X prefill-role engines and --decode-replicas decode-role "
                        "engines, the KV pulled between them over TCP (docs/RAY.md, P/D pools)")
    r.add_argument("--decode-replicas", type=int_at_least(1), default=None, metavar="Y",
                   help="decode-role engines of the P/D pools (with --prefill-replicas)")
    r.add_argument("--ray-cpus-per-replica", type=number_at_least(0.01), default=1.0, metavar="CPUS",
                   help="CPUs Ray reserves for each replica; --threads defaults to it (default: %(default)s)")
    r.add_argument("--ray-replicas-per-node", type=int_at_least(1), default=None, metavar="N",
                   help="most replicas Ray places on one node (default: as many as its CPUs hold)")
    r.add_argument("--routing", choices=["prefix-aware", "round-robin", "least-loaded"], default="prefix-aware",
                   help="which replica gets a request: the one holding the longest cached prefix of its prompt "
                        "(else the least-loaded), in turn, or the one with fewest requests in flight "
                        "(default: %(default)s)")
    r.add_argument("--routing-min-match-blocks", type=int_at_least(1), default=1, metavar="N",
                   help="prefix-aware: fewer cached blocks than this on every replica means least-loaded "
                        "(default: %(default)s)")
    r.add_argument("--routing-max-imbalance", type=int_at_least(0), default=8, metavar="N",
                   help="prefix-aware: go to the least-loaded replica instead when the best match has more than "
                        "N requests in flight beyond it (default: %(default)s)")
    r.add_argument("--ray-retry-failed", action="store_true",
                   help="a request whose replica dies before it responded is sent to another replica "
                        "(default: it gets 503 replica_failed)")
    r.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="the Ray cluster to join, as `ray start --head` printed it, or auto (default: "
                        "RAY_ADDRESS, else a new local one)")
    r.add_argument("--ray-scale", type=int_at_least(1), default=None, metavar="N",
                   help="change the running app's replica count to N, in place, and return")
    r.add_argument("--ray-detach", action="store_true",
                   help="deploy and return; the app runs on until `serve shutdown` (default: serve until Ctrl-C)")
    g = parser.add_argument_group("disaggregated serving (docs/API.md)")
    g.add_argument("--disaggregate", action="store_true",
                   help="run a prefill worker, a decode worker and the proxy (on --host/--port), each worker on its "
                        "own cores; the other flags go to both workers")
    g.add_argument("--prefill-cores", type=parse_cores, default=None, metavar="CORES",
                   help="--disaggregate: the prefill worker's cores, e.g. 0 or 0-3 (default: the first half of the "
                        "cores this process may use)")
    g.add_argument("--decode-cores", type=parse_cores, default=None, metavar="CORES",
                   help="--disaggregate: the decode worker's cores (default: the others)")


def resolve_model(args: argparse.Namespace) -> None:
    """`pdserve serve DIR` (vLLM's habit) and `--model DIR` are the same."""
    if args.model_dir is not None:
        if args.model not in (DEFAULT_MODEL, args.model_dir):
            raise ConfigError(f"two models given: {args.model_dir} and --model {args.model}")
        args.model = args.model_dir


def check_ray_flags(args: argparse.Namespace) -> None:
    pools = (args.prefill_replicas, args.decode_replicas)
    if not args.ray:
        if args.num_replicas is not None or pools != (None, None):
            raise ConfigError("--num-replicas, --prefill-replicas and --decode-replicas need --ray")
        return
    if args.disaggregate:
        raise ConfigError("--ray and --disaggregate are two ways to run several engines: for prefill/decode "
                          "pools on Ray use --prefill-replicas X --decode-replicas Y")
    if pools == (None, None):
        args.num_replicas = args.num_replicas or 1
        return
    if None in pools:
        raise ConfigError("--prefill-replicas and --decode-replicas go together: give both")
    if args.num_replicas is not None:
        raise ConfigError("--num-replicas runs colocated engines, --prefill-replicas/--decode-replicas P/D "
                          "pools: give one or the other")
    if args.role != "both":
        raise ConfigError(f"--role {args.role} cannot be combined with --prefill-replicas/--decode-replicas, "
                          "which give each pool its role")
    if args.kv_transport != "tcp":
        raise ConfigError("--kv-transport shm needs both workers on one host; Ray may place the pools on "
                          "different nodes: use tcp")
    if args.ray_scale is not None:
        raise ConfigError("--ray-scale changes a --num-replicas app; redeploy with other --prefill-replicas/"
                          "--decode-replicas to resize the pools")
