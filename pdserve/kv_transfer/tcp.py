"""The prefill worker's KV listener (--kv-transfer-port) and the decode worker's side of a pull.

One connection per pull: first the handshake of auth.py (the decode worker proves its engine id
with the deployment's secret; a peer that fails it gets ERROR and is dropped); then the decode
worker sends PULL {request_id (the lease's token), start, end, transport, prompt_hash}; the
prefill worker answers one LAYER frame per layer (tcp) or SHM_READY {path, bytes} (shm), then
DONE, or ERROR {error}; the decode worker then sends RELEASE and gets DONE. A RELEASE may also
come alone (an abort before any pull). Each connection is served on its own thread. Nothing here
logs a lease's token."""
import logging
import socket
import socketserver
import threading
import time

from pdserve.kv_transfer import auth, frames, shm
from pdserve.kv_transfer.layout import KVLayout, slot_runs
from pdserve.kv_transfer.lease import LeaseError, LeaseTable

log = logging.getLogger("pdserve.kv_transfer")
CONNECT_TIMEOUT_S = 5.0
IO_TIMEOUT_S = 30.0     # longest silence inside one transfer before it counts as failed


class TransferStats:
    """Totals since start, updated by transfer threads (under a lock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes = 0
        self.seconds = 0.0
        self.transfers = 0
        self.failures = 0

    def add(self, nbytes: int, seconds: float, ok: bool = True) -> None:
        with self._lock:
            if ok:
                self.bytes += nbytes
                self.seconds += seconds
                self.transfers += 1
            else:
                self.failures += 1


class KVServer:
    """The listener: serves pulls of leased blocks from `layout`."""

    def __init__(self, host: str, port: int, leases: LeaseTable, layout: KVLayout, block_size: int,
                 stats: TransferStats, secret: str, cache_file: str | None = None):
        self.leases, self.layout, self.block_size, self.stats = leases, layout, block_size, stats
        self.secret = secret
        self.cache_file = cache_file   # the shared-memory file the cache lives in (--kv-transport shm)
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                server.serve_connection(self.request)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True
            address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

        self._server = Server((host, port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="pdserve-kv-listener", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def serve_connection(self, conn: socket.socket) -> None:
        conn.settimeout(auth.HANDSHAKE_TIMEOUT_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            try:
                peer = auth.accept(conn, self.secret)
            except auth.AuthError as e:   # one line, no traceback: anyone on the network can knock
                log.warning("KV listener: refused a connection from %s: %s", _address(conn), e)
                _try_send_error(conn, str(e))
                return
            conn.settimeout(IO_TIMEOUT_S)
            while True:
                try:
                    kind, msg = frames.recv_json(conn, expect=(frames.PULL, frames.RELEASE))
                except frames.FrameError as e:
                    if "closed the connection after 0 of" not in str(e):   # not just the end of the conversation
                        log.warning("KV listener: refused a frame: %s", e)
                        _try_send_error(conn, str(e))
                    return
                lease_id = msg.get("request_id")
                if not isinstance(lease_id, str):
                    frames.send_json(conn, frames.ERROR, {"error": "request_id must be a string"})
                    return
                if kind == frames.RELEASE:
                    try:
                        self.leases.release(lease_id, peer)
                    except LeaseError as e:   # another worker's lease stays
                        frames.send_json(conn, frames.ERROR, {"error": str(e)})
                        return
                    frames.send_json(conn, frames.DONE, {})
                else:
                    self._serve_pull(conn, lease_id, peer, msg)
        except OSError as e:   # the decode worker went away: its lease expires if it never releases
            log.warning("KV listener: connection failed: %s", e)
        finally:
            conn.close()

    def _serve_pull(self, conn: socket.socket, lease_id: str, peer: str, msg: dict) -> None:
        t0 = time.perf_counter()
        try:
            lease = self.leases.acquire(lease_id, peer, str(msg.get("prompt_hash")))
        except LeaseError as e:
            frames.send_json(conn, frames.ERROR, {"error": str(e)})
            return
        sent = 0
        try:
            start, end, transport = msg.get("start"), msg.get("end"), msg.get("transport", "tcp")
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= lease.num_tokens):
                frames.send_json(conn, frames.ERROR, {"error": f"positions [{start}, {end}) are not within the "
                                                               f"{lease.num_tokens} leased tokens"})
                return
            runs = slot_runs(lease.block_table, self.block_size, start, end)
            if transport == "shm":
                if self.cache_file is None:
                    frames.send_json(conn, frames.ERROR, {"error": "this worker's KV cache is not in shared memory "
                                                                   "(it runs --kv-transport tcp)"})
                    return
                frames.send_json(conn, frames.SHM_READY, {"path": self.cache_file, "num_slots": self.layout.num_slots,
                                                          "runs": runs})
                frames.recv_json(conn, expect=(frames.DONE,))   # the decode worker has copied them
                sent = self.layout.layer_bytes(runs) * self.layout.num_layers
            else:
                for layer in range(self.layout.num_layers):
                    sent += frames.send_frame(conn, frames.LAYER, self.layout.read_layer(layer, runs), layer)
                frames.send_json(conn, frames.DONE, {})
            self.stats.add(sent, time.perf_counter() - t0)
        except (OSError, frames.FrameError) as e:   # ends the connection (serve_connection logs it)
            self.stats.add(0, 0.0, ok=False)
            raise OSError(f"a pull failed: {e}") from None
        finally:
            self.leases.finish_read(lease)


def _address(conn) -> str:
    try:
        return "%s:%s" % conn.getpeername()[:2]
    except OSError:
        return "a peer gone"


def _try_send_error(conn, why: str) -> None:
    try:
        frames.send_json(conn, frames.ERROR, {"error": why})
    except OSError:
        pass


class PullError(Exception):
    """A pull that did not deliver the K/V (the prefill worker is gone, refused, or sent bad frames)."""


REMOTE_CACHES = shm.RemoteCaches()


class Peer:
    """Where a decode worker pulls from, and who it is there: the listener's address, the
    deployment's secret, this worker's engine id (the lease must have been made for it)."""

    def __init__(self, host: str, port: int, secret: str, engine_id: str):
        self.host, self.port, self.secret, self.engine_id = host, port, secret, engine_id

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    def connect(self, timeout: float = IO_TIMEOUT_S) -> socket.socket:
        """An authenticated connection (OSError, frames.FrameError or auth.AuthError if not)."""
        conn = socket.create_connection((self.host, self.port), timeout=CONNECT_TIMEOUT_S)
        try:
            conn.settimeout(timeout)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            auth.connect(conn, self.secret, self.engine_id)
        except BaseException:
            conn.close()
            raise
        return conn


def pull(peer: Peer, lease_id: str, prompt_hash: str, start: int, end: int, layout: KVLayout, runs, transport: str,
         handle=None) -> int:
    """Fetch positions [start, end) of the remote lease into `runs` of this worker's cache and
    release the lease; the bytes received. PullError on any failure (the lease is then released
    if the prefill worker can still be reached). `handle` (optional) has `cancelled`, an Event
    checked between layers, and gets `conn`, the socket, which cancel() shuts down to stop a
    pull waiting for bytes."""
    cancelled = handle.cancelled if handle is not None else None
    try:
        conn = peer.connect()
    except (OSError, frames.FrameError, auth.AuthError) as e:
        raise PullError(f"cannot reach the prefill worker's KV listener at {peer}: {e}") from None
    if handle is not None:
        handle.conn = conn
    with conn:
        try:
            got = _pull_on(conn, lease_id, prompt_hash, start, end, layout, runs, transport, cancelled)
            _release_on(conn, lease_id)
            return got
        except (OSError, frames.FrameError, ValueError, InterruptedError) as e:
            failure = "the request was aborted" if cancelled is not None and cancelled.is_set() else e
    release(peer, lease_id)   # on a fresh connection: this one may be mid-frame
    raise PullError(str(failure)) from None


def _pull_on(conn, lease_id, prompt_hash, start, end, layout, runs, transport, cancelled) -> int:
    frames.send_json(conn, frames.PULL, {"request_id": lease_id, "start": start, "end": end, "transport": transport,
                                         "prompt_hash": prompt_hash})
    size = layout.layer_bytes(runs)
    if transport == "shm":
        kind, msg = frames.recv_json(conn, expect=(frames.SHM_READY, frames.ERROR))
        if kind == frames.ERROR:
            raise ValueError(f"the prefill worker refused: {msg.get('error')}")
        num_slots, src_runs = msg.get("num_slots"), msg.get("runs")
        if not (isinstance(num_slots, int) and isinstance(src_runs, list) and all(
                isinstance(r, list) and len(r) == 2 and 0 <= r[0] and 0 < r[1] and r[0] + r[1] <= num_slots
                for r in src_runs)):
            raise frames.FrameError("SHM_READY frame with malformed slot runs")
        remote = REMOTE_CACHES.layout(str(msg.get("path")), num_slots, layout)
        got = shm.copy_runs(remote, src_runs, layout, runs, cancelled)
        frames.send_json(conn, frames.DONE, {})
        return got
    staging = None if layout.on_cpu else memoryview(bytearray(size))
    got = 0
    for layer in range(layout.num_layers):
        if cancelled is not None and cancelled.is_set():
            raise InterruptedError("the request was aborted")
        # into the blocks themselves (they are this request's alone: a frame that then fails its
        # checksum leaves bytes nobody trusts, the request recomputes or fails)
        got += frames.recv_layer(conn, layout.write_views(layer, runs) or [staging], layer)
        if staging is not None:
            layout.write_layer(layer, runs, staging)
    frames.recv_json(conn, expect=(frames.DONE,))
    return got


def _release_on(conn, lease_id: str) -> None:
    frames.send_json(conn, frames.RELEASE, {"request_id": lease_id})
    kind, msg = frames.recv_json(conn, expect=(frames.DONE, frames.ERROR))
    if kind == frames.ERROR:
        raise ValueError(f"the prefill worker refused: {msg.get('error')}")


def release(peer: Peer, lease_id: str) -> bool:
    """Tell the prefill worker to free the lease (best effort: False if it cannot be reached)."""
    try:
        with peer.connect(CONNECT_TIMEOUT_S) as conn:
            _release_on(conn, lease_id)
        return True
    except (OSError, frames.FrameError, auth.AuthError, ValueError) as e:
        log.warning("could not release a KV lease at %s: %s", peer, e)
        return False
