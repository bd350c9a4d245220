"""The flags of `pdserve serve`, for each way it runs (one engine, Ray Serve replicas, a
disaggregated prefill/decode pair), and the checks on them that need no model."""
import argparse
import os

from pdserve.arg_types import int_at_least, number_at_least, seconds
from pdserve.engine.args import DEFAULT_MODEL, add_engine_args
from pdserve.errors import ConfigError
from pdserve.proxy.cores import parse_cores
from pdserve.server.reasoning import PARSERS as REASONING_PARSERS
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
    b.add_argument("--batch-size", type=int_at_least(1), default=4, help="static backend: requests per batch (default: 4)")
    b.add_argument("--batch-wait-ms", type=number_at_least(0), default=0.0,
                   help="static backend: longest wait for a batch to fill (default: 0)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default: %(default)s, loopback only; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=int_at_least(0, 65535), default=8000,
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
    g.add_argument("--max-waiting", type=int_at_least(0), default=256,
                   help="most requests admitted beyond the free seats (--max-num-seqs); beyond it requests get "
                        "503 with Retry-After (default: %(default)s)")
    g.add_argument("--max-connections", type=int_at_least(1), default=1000,
                   help="most open connections; a new one beyond gets 503 and is closed (default: %(default)s)")
    g.add_argument("--header-timeout", type=seconds, default=10.0, metavar="SECONDS",
                   help="a request's headers must arrive within this, or the connection is closed "
                        "(slow clients; default: %(default)s)")
    g.add_argument("--body-timeout", type=seconds, default=30.0, metavar="SECONDS",
                   help="a request's body must arrive within this after its headers, or the connection is "
                        "closed (default: %(default)s)")
    g.add_argument("--max-body-bytes", type=int_at_least(1), default=1 << 20,
                   help="largest request body; larger ones get 413 (default: %(default)s = 1 MiB)")
    g.add_argument("--max-stop-strings", type=int_at_least(0), default=16,
                   help="most stop strings one request may give (default: %(default)s)")
    g.add_argument("--max-stop-length", type=int_at_least(1), default=256,
                   help="longest stop string, in characters (default: %(default)s)")
    g.add_argument("--max-stop-token-ids", type=int_at_least(0), default=256,
                   help="most stop_token_ids one request may give (default: %(default)s)")
    g.add_argument("--max-prompt-tokens", type=int_at_least(1), default=None,
                   help="longest prompt, in tokens; longer ones get 400 (default: the model's context length)")
    g.add_argument("--max-tokens-cap", type=int_at_least(1), default=None,
                   help="largest max_tokens a request may ask for; larger ones get 400, and defaults (chat: "
                        "the rest of the context) are lowered to it (default: no cap beyond the context)")
    g.add_argument("--max-n", type=int_at_least(1), default=64, help="most choices (n) per request (default: %(default)s)")
    g.add_argument("--max-logprobs", type=int_at_least(0, 20), default=20,
                   help="most logprobs / top_logprobs per token, at most 20 (default: %(default)s)")
    g.add_argument("--max-request-cost", type=int_at_least(1), default=1 << 17,
                   help="most token entries one request may make the server generate and send: prompts x n x "
                        "max_tokens x (1 + logprobs); over it a request gets 400, and defaults are lowered to "
                        "fit (default: %(default)s)")
    g.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                   help="how answers become tool_calls with tool_choice \"auto\": hermes (= qwen2.5: "
                        "<tool_call> blocks) or llama3_json (default: none; \"auto\" is then refused, "
                        "\"required\" and named functions work without one)")
    g.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="split a thinking model's output, as vLLM does: the thinking goes to the message's "
                        "reasoning_content (and reasoning), the answer to content; tool calls and structured "
                        "outputs apply to the answer. qwen3 (<think>...</think>; chat_template_kwargs "
                        "{\"enable_thinking\": false} turns thinking off) or deepseek_r1 (the output starts "
                        "inside <think>); the tags must be tokens of the checkpoint (default: none)")
    g.add_argument("--max-stored-responses", type=int_at_least(0), default=1000, metavar="N",
                   help="/v1/responses kept in memory for previous_response_id: the last N (older ones, and "
                        "those made with store: false, are refused by name; default: %(default)s)")
    g.add_argument("--request-timeout", type=seconds, default=None, metavar="SECONDS",
                   help="abort a request still unfinished this long after it arrived and free its KV blocks; "
                        "the client gets 504 request_timeout, or an error event in a stream (default: none)")
    g.add_argument("--shutdown-timeout", type=number_at_least(0), default=30.0,
                   help="seconds running requests get to finish after SIGTERM before they are aborted "
                        "(default: %(default)s)")
    g.add_argument("--step-log", default=None, metavar="FILE",
                   help="append one JSON line per engine step (time, duration, prefill and decode tokens, "
                        "sequences, preemptions, forward time) to FILE, for `pdserve report` (default: off)")
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
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="log level of the server and its access log (default: %(default)s)")
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
