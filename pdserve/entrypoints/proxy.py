"""`pdserve proxy`: serve the OpenAI API over prefill and decode workers until SIGTERM or Ctrl-C.

Before it listens, it checks every worker's GET /v1/kv_transfer (pairing.py) and refuses to
start, in one line, if one is unreachable, has the wrong role, or disagrees on the model, the
KV block size or the KV dtype."""
import argparse
import asyncio
import logging

import uvicorn

from pdserve.errors import ConfigError
from pdserve.kv_transfer import auth
from pdserve.proxy.metrics import ProxyMetrics
from pdserve.proxy.pairing import check_pairing
from pdserve.proxy.relay import Proxy
from pdserve.proxy.workers import Pool, Worker, worker_url
from pdserve.routing import POLICIES, PromptHasher, Router
from pdserve.server.reasoning_parsers import PARSERS as REASONING_PARSERS
from pdserve.tokenizer import Tokenizer
from pdserve.arg_types import seconds
from pdserve.entrypoints.network import bind
from pdserve.server.config import add_server_args, allowed_hosts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("workers")
    w.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill workers (`pdserve serve --role prefill`), e.g. http://127.0.0.1:8100")
    w.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode workers (`pdserve serve --role decode`)")
    w.add_argument("--routing", choices=POLICIES, default="round-robin",
                   help="which worker of a role gets a request: in turn, the one with the fewest requests in "
                        "flight at this proxy, or (prefix-aware, needs --tokenizer) the prefill worker that was "
                        "sent most of the prompt's leading KV blocks, the decode worker least-loaded "
                        "(default: %(default)s)")
    w.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="the workers' checkpoint directory: --routing prefix-aware renders each prompt with its "
                        "tokenizer and chat template, as the workers do")
    w.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS), metavar="NAME",
                   help="the workers' --reasoning-parser: with gpt_oss they render chats with harmony, and so "
                        "does --routing prefix-aware (default: none)")
    w.add_argument("--connect-timeout", type=seconds, default=5.0, metavar="SECONDS",
                   help="a worker that does not accept a connection within this is unavailable: 503 "
                        "(default: %(default)s)")
    w.add_argument("--read-timeout", type=seconds, default=300.0, metavar="SECONDS",
                   help="a worker that sends nothing for this long has failed the request: 504, or an error "
                        "event in a stream (default: %(default)s)")
    w.add_argument("--kv-transfer-secret", default=None, metavar="SECRET",
                   help="the workers' KV transfer secret, with which the proxy releases at once the lease of a "
                        "decode call refused or whose client left (default: $PDSERVE_KV_TRANSFER_SECRET; unset: "
                        "such a lease waits for the prefill worker's --kv-lease-s)")
    add_server_args(parser, listen_only=True)   # serve's own declarations: one default, one help


def build(args: argparse.Namespace):
    """(app, pairing): the proxy's app over the workers in args, after checking their pairing."""
    from pdserve.proxy.app import build_app

    try:
        prefill = [Worker(worker_url(u), "prefill") for u in args.prefill]
        decode = [Worker(worker_url(u), "decode") for u in args.decode]
    except ValueError as e:
        raise ConfigError(f"--prefill/--decode: {e}") from None
    prefix = args.routing == "prefix-aware"
    if prefix and args.tokenizer is None:
        raise ConfigError("--routing prefix-aware needs --tokenizer DIR (the workers' checkpoint directory)")
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    pairing = check_pairing(prefill, decode, headers, timeout=args.connect_timeout)
    hasher = PromptHasher(Tokenizer.from_dir(args.tokenizer), pairing.block_size, args.reasoning_parser) \
        if prefix else None
    # the prompt's cached blocks live where it was prefilled; a decode worker only needs room
    pools = Pool(prefill, Router(args.routing)), Pool(decode, Router("least-loaded" if prefix else args.routing))
    proxy = Proxy(*pools, ProxyMetrics(pairing.model, pools), args.read_timeout, args.api_key or None,
                  auth.secret_from(args.kv_transfer_secret), hasher)
    app = build_app(proxy, connect_timeout=args.connect_timeout, max_body_bytes=args.max_body_bytes,
                    allowed_hosts=allowed_hosts(args.host, args.allowed_hosts), max_connections=args.max_connections)
    return app, pairing


class ProxyServer(uvicorn.Server):
    """uvicorn's server, ending the forwarded calls still waiting on a worker when
    --shutdown-timeout runs out (503 shutdown_timeout), before uvicorn's own timeout, FLUSH_S
    later, cancels what is left (with a traceback in the log)."""
    FLUSH_S = 5.0   # for the 503s to be sent, on a loaded machine too

    def __init__(self, app, shutdown_timeout: float, **config):
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=shutdown_timeout + self.FLUSH_S, **config))
        self.forwarder, self.shutdown_timeout = app.state.forwarder, shutdown_timeout

    async def shutdown(self, sockets=None):
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self.forwarder.stopping.set)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def serve(app, args: argparse.Namespace) -> uvicorn.Server:
    """A uvicorn server for the proxy's app (run it with .run(sockets=[sock]))."""
    from pdserve.server.connections import guarded_protocol

    protocol = guarded_protocol(args.header_timeout, args.body_timeout, args.max_connections)
    logging.getLogger("httpx").setLevel(logging.WARNING)   # not a line per call to a worker
    return ProxyServer(app, args.shutdown_timeout, http=protocol, log_level=args.log_level)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    sock = bind(args.host, args.port)
    app, pairing = build(args)
    log = logging.getLogger("pdserve.proxy")
    log.info("model %s, KV blocks of %d tokens in %s; prefill %s; decode %s; routing %s", pairing.model,
             pairing.block_size, pairing.dtype, " ".join(args.prefill), " ".join(args.decode), args.routing)
    log.info("proxy on http://%s:%d", args.host, args.port)
    server = serve(app, args)
    server.run(sockets=[sock])
    return 0 if server.started else 1
