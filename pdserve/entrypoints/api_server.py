"""`pdserve serve` with one engine: load a checkpoint and serve it over HTTP until SIGTERM or Ctrl-C.

On the first SIGTERM/SIGINT the server stops admitting (new requests get 503, /health
says so, the listening socket closes), lets running requests finish for up to
--shutdown-timeout seconds, ends what is left with a shutdown_timeout error, and exits 0.
"""
import argparse
import asyncio
import logging
import signal

import uvicorn

from pdserve.engine.args import check_engine_args, engine_kwargs
from pdserve.engine.interface import paged
from pdserve.entrypoints.network import bind
from pdserve.server.config import ServerConfig


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
    """The engine (or a baseline), built on the thread that will step it (async_engine.EngineThread says why)."""
    from pdserve.engine.llm_engine import LLMEngine   # heavy (torch): only when serving
    from pdserve.server.async_engine import EngineThread

    if args.baseline == "engine":
        cls, extra = LLMEngine, {}
    else:
        from pdserve.baselines import BASELINES
        cls = BASELINES[args.baseline]
        extra = dict(batch_size=args.batch_size, batch_wait_ms=args.batch_wait_ms) if args.baseline == "static" else {}
    thread = EngineThread()
    return thread.call(cls, **engine_kwargs(args), **extra), thread


def capacity(engine, args: argparse.Namespace) -> str:
    """One line on what this server can hold, for the startup log."""
    import resource

    import torch
    if paged(engine) is None:   # a baseline
        return f"baseline {args.baseline}, max_model_len {engine.max_model_len}"
    runner = engine.runner   # the LLMEngine build_engine made
    tokens = runner.num_blocks * runner.block_size
    if runner.device.type == "cuda":
        memory = f"{torch.cuda.memory_allocated(runner.device) / 2**30:.2f} GiB on the GPU"
    else:   # ru_maxrss is in KiB on Linux
        memory = f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB resident"
    return (f"dtype {str(runner.dtype).removeprefix('torch.')} on {runner.device}, {runner.backend.describe()}, "
            f"{torch.get_num_threads()} threads; KV cache {runner.num_blocks} blocks x {runner.block_size} = "
            f"{tokens} tokens: {tokens // engine.max_model_len} sequences at the full {engine.max_model_len} "
            f"tokens (--max-num-seqs {engine.config.max_num_seqs}); memory {memory}")


def check_reasoning_parser(args: argparse.Namespace) -> None:
    """--reasoning-parser against the checkpoint's tokenizer, before the model loads (one-line ConfigError)."""
    if args.reasoning_parser is not None:
        from pdserve.server.reasoning_parsers import build
        from pdserve.tokenizer import Tokenizer
        build(args.reasoning_parser, Tokenizer.from_dir(args.model))


def run(args: argparse.Namespace) -> int:
    from pdserve.server.app import build_app
    from pdserve.server.connections import guarded_protocol

    """One engine behind the HTTP API, on --host/--port, until SIGTERM or Ctrl-C."""
    sock = bind(args.host, args.port)
    check_engine_args(args)
    check_reasoning_parser(args)
    engine, engine_thread = build_engine(args)
    config = ServerConfig.from_args(args, engine.model_name)
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
