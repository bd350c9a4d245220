"""`pdserve serve --disaggregate`: a prefill worker and a decode worker (`pdserve serve --role
prefill|decode` subprocesses on loopback, each pinned to its own cores with one forward thread per
core) and the proxy on the public --host/--port, in one command.

The workers get every other `pdserve serve` flag given (a --step-log FILE becomes FILE's
.prefill and .decode variants). All three stop together: on SIGINT/SIGTERM the proxy drains, then
the workers get SIGTERM (SIGKILL if they outlast their --shutdown-timeout); if a worker dies, the
others are stopped and the command exits 1. A worker also gets SIGTERM from the kernel if this
process dies (PR_SET_PDEATHSIG), so none is left behind.

The KV channel's secret (--kv-transfer-secret, else a new random one) goes to the workers in
their environment, never on their command lines (which `ps` shows to every user); the decode
worker pulls only from the prefill worker's listener (--kv-transfer-peers).
"""
import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

from pdserve.arg_types import option_fields
from pdserve.errors import ConfigError
from pdserve.kv_transfer import auth
from pdserve.kv_transfer.connector import WILDCARD_HOSTS
from pdserve.entrypoints.serve_args import add_arguments as add_serve_arguments
from pdserve.proxy.cores import format_cores, split_cores
from pdserve.server.config import ServerConfig

# serve flags the launcher sets per worker rather than passing on
OWN = {"disaggregate", "prefill_cores", "decode_cores", "host", "port", "threads", "step_log", "role", "model_dir",
       "kv_transfer_secret", "kv_transfer_port", "kv_transfer_peers", "kv_engine_id"}
READY_TIMEOUT_S = 900.0   # a worker loading a large checkpoint on a busy machine
PR_SET_PDEATHSIG = 1


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The `pdserve serve` flags of `args` that differ from their defaults, as a command line
    (built from the parser's actions, so abbreviations and --flag=value forms need no handling)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_serve_arguments(parser)
    flags = []
    for a in parser._actions:
        if not a.option_strings or a.dest in OWN or a.default == argparse.SUPPRESS:
            continue
        value = getattr(args, a.dest, a.default)
        if value == a.default:
            continue
        name = next(o for o in a.option_strings if o.startswith("--"))
        if isinstance(a, argparse.BooleanOptionalAction):
            flags.append(name if value else "--no-" + name[2:])
        elif isinstance(value, bool):
            flags += [name] if value else []
        elif isinstance(value, (list, tuple)):
            flags += [name, *map(str, value)]
        else:
            flags += [name, str(value)]
    return flags


def step_log_for(path: str | None, role: str) -> list[str]:
    if path is None:
        return []
    root, ext = os.path.splitext(path)
    return ["--step-log", f"{root}.{role}{ext}"]


def _pin(cores: list[int]):
    """Runs in the child before exec: its cores, and SIGTERM if the launcher dies."""
    def setup():
        os.sched_setaffinity(0, cores)
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):   # not Linux: the launcher's own stop still applies
            pass
    return setup


class WorkerProcess:
    def __init__(self, role: str, cores: list[int], port: int, flags: list[str], env: dict | None = None):
        self.role, self.cores, self.port, self.env = role, cores, port, env or {}
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [sys.executable, "-m", "pdserve", "serve", *flags, "--role", role, "--host", "127.0.0.1",
                    "--port", str(port), "--threads", str(len(cores))]
        self.proc: subprocess.Popen | None = None
        self.last_line = ""

    def start(self) -> None:
        # its own session: a Ctrl-C in the terminal reaches the launcher, which stops it in order
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_pin(self.cores),
                                     env={**os.environ, **self.env})
        threading.Thread(target=self._copy_output, daemon=True).start()

    def _copy_output(self) -> None:
        for raw in self.proc.stdout:   # each line, prefixed with the worker's role
            line = raw.decode("utf-8", "replace").rstrip()
            if line:
                self.last_line = line
                print(f"[{self.role}] {line}", file=sys.stderr, flush=True)

    def exited(self) -> int | None:
        return self.proc.poll()



def stop_all(workers: list[WorkerProcess], timeout: float) -> None:
    """SIGTERM to every worker at once, then SIGKILL to any still there after `timeout` seconds."""
    running = [w for w in workers if w.proc is not None and w.proc.poll() is None]
    for w in running:
        w.proc.terminate()
    deadline = time.monotonic() + timeout
    for w in running:
        try:
            w.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


def wait_ready(workers: list[WorkerProcess], stopping: threading.Event) -> None:
    """Until every worker's /health is 200; ConfigError if one exits first or takes too long."""
    import httpx

    deadline, pending = time.monotonic() + READY_TIMEOUT_S, list(workers)
    while pending and not stopping.is_set():
        for w in list(pending):
            rc = w.exited()
            if rc is not None:
                raise ConfigError(f"the {w.role} worker exited with status {rc} before it was ready"
                                  + (f": {w.last_line}" if w.last_line else ""))
            try:
                if httpx.get(w.url + "/health", timeout=2).status_code == 200:
                    pending.remove(w)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise ConfigError(f"the {pending[0].role} worker was not ready after {READY_TIMEOUT_S:.0f} s")
        stopping.wait(0.25)


def proxy_args(args: argparse.Namespace, prefill: WorkerProcess, decode: WorkerProcess) -> argparse.Namespace:
    """`pdserve proxy`'s flags over the two workers just started: its own at their defaults, the
    listening ones (ServerConfig's `listen` fields) and --reasoning-parser as serve was given them."""
    from pdserve.entrypoints.proxy import add_arguments as add_proxy_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_proxy_arguments(parser)
    proxy = parser.parse_args(["--prefill", prefill.url, "--decode", decode.url])
    for f in option_fields(ServerConfig, listen_only=True):
        setattr(proxy, f.name, getattr(args, f.name))
    proxy.reasoning_parser = args.reasoning_parser   # how the workers render chats, should it route by prefix
    proxy.kv_transfer_secret = prefill.env[auth.ENV]
    return proxy


def kv_flags(args: argparse.Namespace, kv_port: int) -> tuple[list[str], list[str]]:
    """The prefill and the decode worker's KV channel flags: the listener's port, and the decode
    worker's one peer (unless the listener binds every interface: then the signed params decide)."""
    host = args.kv_transfer_host
    peers = [] if host in WILDCARD_HOSTS else ["--kv-transfer-peers", f"{host}:{kv_port}"]
    return ["--kv-transfer-port", str(kv_port)], peers


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.servers import free_port
    from pdserve.entrypoints.network import bind

    if getattr(args, "role", "both") != "both":
        raise ConfigError(f"--role {args.role} cannot be combined with --disaggregate, which starts one worker "
                          "of each role")
    if args.baseline != "engine":
        raise ConfigError(f"--disaggregate needs pdserve's engine (the paged KV cache), not --baseline {args.baseline}")
    if args.threads is not None:
        raise ConfigError("--threads cannot be combined with --disaggregate: each worker runs one thread per core "
                          "of its --prefill-cores / --decode-cores")
    prefill_cores, decode_cores = split_cores(args.prefill_cores, args.decode_cores, os.sched_getaffinity(0))
    sock = bind(args.host, args.port)   # the public port first: a taken one is reported before anything starts
    flags = worker_flags(args)
    env = {auth.ENV: auth.secret_from(args.kv_transfer_secret) or auth.new_secret()}   # not in `ps`
    prefill_kv, decode_kv = kv_flags(args, args.kv_transfer_port or free_port())
    prefill = WorkerProcess("prefill", prefill_cores, free_port(), flags + prefill_kv + step_log_for(args.step_log,
                            "prefill"), env)
    decode = WorkerProcess("decode", decode_cores, free_port(), flags + decode_kv + step_log_for(args.step_log,
                           "decode"), env)
    workers = [prefill, decode]
    stopping = threading.Event()
    # until uvicorn takes over: a signal stops the start; after it, uvicorn re-raises the signal
    # under these handlers, where it is a no-op
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        for w in workers:
            w.start()
        wait_ready(workers, stopping)
        if stopping.is_set():
            return 0
        return _serve(args, sock, prefill, decode)
    finally:
        stop_all(workers, args.shutdown_timeout + 5)


def _serve(args, sock, prefill: WorkerProcess, decode: WorkerProcess) -> int:
    from pdserve.entrypoints.proxy import build, serve

    app, pairing = build(proxy_args(args, prefill, decode))
    server = serve(app, args)
    died: list[WorkerProcess] = []

    def watch():
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:   # listening: say where everything is
            for w in (prefill, decode):
                print(f"{w.role} worker: {w.url} (cores {format_cores(w.cores)}, {len(w.cores)} thread"
                      f"{'s' if len(w.cores) > 1 else ''}, pid {w.proc.pid})", flush=True)
            print(f"proxy: http://{args.host}:{args.port} (model {pairing.model}; KV blocks of {pairing.block_size} "
                  f"tokens in {pairing.dtype})", flush=True)
        while not server.should_exit:   # a worker that dies takes the whole service down
            for w in (prefill, decode):
                if w.exited() is not None:
                    died.append(w)
                    server.should_exit = True
                    return
            time.sleep(0.2)
    threading.Thread(target=watch, daemon=True).start()
    server.run(sockets=[sock])
    if died:
        w = died[0]
        print(f"pdserve serve: error: the {w.role} worker exited with status {w.exited()}; stopped the others",
              file=sys.stderr, flush=True)
        return 1
    return 0 if server.started else 1
