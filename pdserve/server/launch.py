"""`pdserve serve`: load a checkpoint and serve it over HTTP until SIGTERM or Ctrl-C.

On the first SIGTERM/SIGINT the server stops admitting (new requests get 503, /health
says so, the listening socket closes), lets running requests finish for up to
--shutdown-timeout seconds, ends what is left with a shutdown_timeout error, and exits 0.
"""
import argparse
import asyncio
import logging
import math
import os
import signal
import socket

import uvicorn

from pdserve.engine.args import DEFAULT_MODEL, add_engine_args, check_engine_args, engine_kwargs
from pdserve.errors import ConfigError
from pdserve.proxy import disaggregate
from pdserve.server.tool_parsers import PARSERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", nargs="?", metavar="MODEL",
                        help="HF-format checkpoint directory or GGUF file, as vLLM takes it (the same as --model)")
    add_engine_args(parser)
    b = parser.add_argument_group("backend (docs/BACKENDS.md)")
    b.add_argument("--backend", default="engine", choices=["engine", "hf", "static", "nocache"],
                   help="engine: continuous batching over the paged KV cache (default); the origin's paths as "
                        "baselines: hf = one transformers generate() per request, static = static batches "
                        "of --batch-size, nocache = a token loop re-running the whole sequence without a KV cache")
    b.add_argument("--batch-size", type=_at_least(1), default=4, help="static backend: requests per batch (default: 4)")
    b.add_argument("--batch-wait-ms", type=_number_at_least(0), default=0.0,
                   help="static backend: longest wait for a batch to fill (default: 0)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: %(default)s, loopback only; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=_at_least(0, 65535), default=8000,
                   help="TCP port, bound before the model loads (default: %(default)s)")
    g.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="Host header names accepted; others get 400, so a web page that points its own DNS "
                        "name at this server cannot use it ('*' = any; default: the --host address and "
                        "localhost names, or any when --host is 0.0.0.0 or ::)")
    g.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="web origins allowed to call the API from a browser (CORS), e.g. "
                        "https://app.example.com or '*' (default: none, no CORS headers)")
    g.add_argument("--allowed-methods", nargs="+", default=["GET", "POST"], metavar="METHOD",
                   help="CORS: methods allowed (default: GET POST)")
    g.add_argument("--allowed-headers", nargs="+", default=["Authorization", "Content-Type"], metavar="HEADER",
                   help="CORS: request headers allowed (default: Authorization Content-Type)")
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow cookies and HTTP authentication (default: off)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the checkpoint "
                        "directory's basename)")
    g.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every endpoint except /health, /metrics, "
                        "/version, the web page / and the API docs (default: the PDSERVE_API_KEY environment "
                        "variable; unset = no key)")
    g.add_argument("--max-waiting", type=_at_least(0), default=256,
                   help="most requests admitted beyond the free seats (--max-num-seqs); beyond it requests get "
                        "503 with Retry-After (default: %(default)s)")
    g.add_argument("--max-connections", type=_at_least(1), default=1000,
                   help="most open connections; a new one beyond gets 503 and is closed (default: %(default)s)")
    g.add_argument("--header-timeout", type=_seconds, default=10.0, metavar="SECONDS",
                   help="a request's headers must arrive within this, or the connection is closed "
                        "(slow clients; default: %(default)s)")
    g.add_argument("--body-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                   help="a request's body must arrive within this after its headers, or the connection is "
                        "closed (default: %(default)s)")
    g.add_argument("--max-body-bytes", type=_at_least(1), default=1 << 20,
                   help="largest request body; larger ones get 413 (default: %(default)s = 1 MiB)")
    g.add_argument("--max-stop-strings", type=_at_least(0), default=16,
                   help="most stop strings one request may give (default: %(default)s)")
    g.add_argument("--max-stop-length", type=_at_least(1), default=256,
                   help="longest stop string, in characters (default: %(default)s)")
    g.add_argument("--max-stop-token-ids", type=_at_least(0), default=256,
                   help="most stop_token_ids one request may give (default: %(default)s)")
    g.add_argument("--max-prompt-tokens", type=_at_least(1), default=None,
                   help="longest prompt, in tokens; longer ones get 400 (default: the model's context length)")
    g.add_argument("--max-tokens-cap", type=_at_least(1), default=None,
                   help="largest max_tokens a request may ask for; larger ones get 400, and defaults (chat: "
                        "the rest of the context) are lowered to it (default: no cap beyond the context)")
    g.add_argument("--max-n", type=_at_least(1), default=64, help="most choices (n) per request (default: %(default)s)")
    g.add_argument("--max-logprobs", type=_at_least(0, 20), default=20,
                   help="most logprobs / top_logprobs per token, at most 20 (default: %(default)s)")
    g.add_argument("--max-request-cost", type=_at_least(1), default=1 << 17,
                   help="most token entries one request may make the server generate and send: prompts x n x "
                        "max_tokens x (1 + logprobs); over it a request gets 400, and defaults are lowered to "
                        "fit (default: %(default)s)")
    g.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="how answers become tool_calls with tool_choice \"auto\": hermes (= qwen2.5: "
                        "<tool_call> blocks) or llama3_json (default: none; \"auto\" is then refused, "
                        "\"required\" and named functions work without one)")
    g.add_argument("--request-timeout", type=_seconds, default=None, metavar="SECONDS",
                   help="abort a request still unfinished this long after it arrived and free its KV blocks; "
                        "the client gets 504 request_timeout, or an error event in a stream (default: none)")
    g.add_argument("--shutdown-timeout", type=_number_at_least(0), default=30.0,
                   help="seconds running requests get to finish after SIGTERM before they are aborted "
                        "(default: %(default)s)")
    g.add_argument("--step-log", default=None, metavar="FILE",
                   help="append one JSON line per engine step (time, duration, prefill and decode tokens, "
                        "sequences, preemptions, forward time) to FILE, for `pdserve report` (default: off)")
    r = parser.add_argument_group("Ray Serve (docs/RAY.md; needs the ray extra)")
    r.add_argument("--ray", action="store_true",
                   help="serve as a Ray Serve application: --num-replicas engines behind one endpoint")
    r.add_argument("--num-replicas", type=_at_least(1), default=None, help="engine replicas (default: 1)")
    r.add_argument("--prefill-replicas", type=_at_least(1), default=None, metavar="X",
                   help="instead of --num-replicas: X prefill-role engines and --decode-replicas decode-role "
                        "engines, the KV pulled between them over TCP (docs/RAY.md, P/D pools)")
    r.add_argument("--decode-replicas", type=_at_least(1), default=None, metavar="Y",
                   help="decode-role engines of the P/D pools (with --prefill-replicas)")
    r.add_argument("--ray-cpus-per-replica", type=_number_at_least(0.01), default=1.0, metavar="CPUS",
                   help="CPUs Ray reserves for each replica; --threads defaults to it (default: %(default)s)")
    r.add_argument("--ray-replicas-per-node", type=_at_least(1), default=None, metavar="N",
                   help="most replicas Ray places on one node (default: as many as its CPUs hold)")
    r.add_argument("--routing", choices=["prefix-aware", "round-robin", "least-loaded"], default="prefix-aware",
                   help="which replica gets a request: the one holding the longest cached prefix of its prompt "
                        "(else the least-loaded), in turn, or the one with fewest requests in flight "
                        "(default: %(default)s)")
    r.add_argument("--routing-min-match-blocks", type=_at_least(1), default=1, metavar="N",
                   help="prefix-aware: fewer cached blocks than this on every replica means least-loaded "
                        "(default: %(default)s)")
    r.add_argument("--routing-max-imbalance", type=_at_least(0), default=8, metavar="N",
                   help="prefix-aware: go to the least-loaded replica instead when the best match has more than "
                        "N requests in flight beyond it (default: %(default)s)")
    r.add_argument("--ray-retry-failed", action="store_true",
                   help="a request whose replica dies before it responded is sent to another replica "
                        "(default: it gets 503 replica_failed)")
    r.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="the Ray cluster to join, as `ray start --head` printed it, or auto (default: "
                        "RAY_ADDRESS, else a new local one)")
    r.add_argument("--ray-scale", type=_at_least(1), default=None, metavar="N",
                   help="change the running app's replica count to N, in place, and return")
    r.add_argument("--ray-detach", action="store_true",
                   help="deploy and return; the app runs on until `serve shutdown` (default: serve until Ctrl-C)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="log level of the server and its access log (default: %(default)s)")
    disaggregate.add_arguments(parser)


def _at_least(low: int, high: int | None = None):
    """An argparse type: an integer >= low (and <= high)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if v < low or (high is not None and v > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {v}")
        return v
    return parse


def _number_at_least(low: float):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not v >= low or math.isinf(v):
            raise argparse.ArgumentTypeError(f"must be a number >= {low:g}, got {text!r}")
        return v
    return parse


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not 0 < v < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return v


WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# Names that always reach a server bound to loopback, whatever --host says.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")


def allowed_hosts(args: argparse.Namespace) -> list[str] | None:
    """--allowed-hosts, or its default; None means any Host."""
    if args.allowed_hosts is not None:
        return None if "*" in args.allowed_hosts else args.allowed_hosts
    if args.host in WILDCARD_HOSTS:   # every interface: names this machine goes by are not known here
        return None
    return list(dict.fromkeys([args.host, *LOCAL_HOSTS]))


def server_config(args: argparse.Namespace, model_name: str):
    from pdserve.server.admission import ServerConfig
    return ServerConfig(served_model_name=args.served_model_name or model_name, max_waiting=args.max_waiting,
                        max_body_bytes=args.max_body_bytes, max_stop_strings=args.max_stop_strings,
                        max_stop_length=args.max_stop_length,
                        max_stop_token_ids=args.max_stop_token_ids, max_prompt_tokens=args.max_prompt_tokens,
                        max_tokens_cap=args.max_tokens_cap, max_n=args.max_n, max_logprobs=args.max_logprobs,
                        request_timeout=args.request_timeout, api_key=args.api_key or None, step_log=args.step_log,
                        max_request_cost=args.max_request_cost, allowed_hosts=allowed_hosts(args),
                        cors_origins=args.allowed_origins, cors_methods=args.allowed_methods,
                        cors_headers=args.allowed_headers, cors_credentials=args.allow_credentials,
                        tool_call_parser=args.tool_call_parser)


class _Server(uvicorn.Server):
    """uvicorn's server, telling the engine when shutdown begins and when its time is up.

    On the signal the engine stops admitting. At --shutdown-timeout every request still running is
    ended with an explicit shutdown_timeout error (a stream gets it as its last event, then
    [DONE]); uvicorn's own timeout, FLUSH_S later, only cancels handlers that could not send it
    (a stalled client)."""
    FLUSH_S = 2.0

    def __init__(self, app, async_engine, shutdown_timeout: float, **config):
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=shutdown_timeout + self.FLUSH_S, **config))
        self.async_engine, self.shutdown_timeout = async_engine, shutdown_timeout

    def handle_exit(self, sig, frame):
        self.async_engine.accepting = False
        if self.async_engine.step_events is not None:   # endless streams would hold the shutdown up
            self.async_engine.step_events.close()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None):
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self.async_engine.end_unfinished,
                                                      self.shutdown_timeout)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def build_engine(args: argparse.Namespace):
    """The backend, built on the thread that will step it (async_engine.EngineThread says why)."""
    from pdserve.engine.llm_engine import LLMEngine   # heavy (torch): only when serving
    from pdserve.server.async_engine import EngineThread

    if args.backend == "engine":
        cls, extra = LLMEngine, {}
    else:
        from pdserve.baselines import BACKENDS
        cls = BACKENDS[args.backend]
        extra = dict(batch_size=args.batch_size, batch_wait_ms=args.batch_wait_ms) if args.backend == "static" else {}
    thread = EngineThread()
    return thread.call(cls, **engine_kwargs(args), **extra), thread


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a taken port is reported at once."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def resolve_model(args: argparse.Namespace) -> None:
    """`pdserve serve DIR` (vLLM's habit) and `--model DIR` are the same."""
    if args.model_dir is not None:
        if args.model not in (DEFAULT_MODEL, args.model_dir):
            raise ConfigError(f"two models given: {args.model_dir} and --model {args.model}")
        args.model = args.model_dir


def capacity(engine, args: argparse.Namespace) -> str:
    """One line on what this server can hold, for the startup log."""
    import resource

    import torch
    runner = getattr(engine, "runner", None)
    if runner is None:   # a baseline backend
        return f"backend {args.backend}, max_model_len {engine.max_model_len}"
    tokens = runner.num_blocks * runner.block_size
    if runner.device.type == "cuda":
        memory = f"{torch.cuda.memory_allocated(runner.device) / 2**30:.2f} GiB on the GPU"
    else:   # ru_maxrss is in KiB on Linux
        memory = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB resident"
    return (f"dtype {str(runner.dtype).removeprefix('torch.')} on {runner.device}, {runner.backend.describe()}, "
            f"{torch.get_num_threads()} threads; KV cache {runner.num_blocks} blocks x {runner.block_size} = "
            f"{tokens} tokens: {tokens // engine.max_model_len} sequences at the full {engine.max_model_len} "
            f"tokens (--max-num-seqs {engine.config.max_num_seqs}); memory {memory}")


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


def run(args: argparse.Namespace) -> int:
    from pdserve.server.app import build_app
    from pdserve.server.connections import guarded_protocol

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    resolve_model(args)
    check_ray_flags(args)
    if args.ray:
        from pdserve.ray.app import run as run_on_ray   # needs the ray extra: the CLI says so if missing
        return run_on_ray(args)
    if args.disaggregate:
        check_engine_args(args)
        return disaggregate.run(args)
    if args.prefill_cores is not None or args.decode_cores is not None:
        raise ConfigError("--prefill-cores and --decode-cores need --disaggregate")
    sock = bind(args.host, args.port)
    check_engine_args(args)
    engine, engine_thread = build_engine(args)
    config = server_config(args, engine.model_name)
    app = build_app(engine, config, engine_thread)

    protocol = guarded_protocol(args.header_timeout, args.body_timeout, args.max_connections)
    server = _Server(app, app.state.pdserve.async_engine, args.shutdown_timeout, http=protocol,
                     log_level=args.log_level)
    # uvicorn re-raises the signal after its graceful shutdown, under the handlers that were there
    # before it; with these the re-raise is a no-op and we exit 0 instead of dying of SIGTERM.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    log = logging.getLogger("pdserve.server")
    log.info("model %s: %s", config.served_model_name, capacity(engine, args))
    log.info("generation defaults: %s", app.state.pdserve.generation.describe())
    log.info("serving %s on http://%s:%d", config.served_model_name, args.host, args.port)
    server.run(sockets=[sock])
    return 0 if server.started else 1
