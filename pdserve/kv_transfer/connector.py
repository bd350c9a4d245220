"""The KV connector: how an engine takes part in prefill/decode disaggregation.

The interface follows vLLM's KVConnectorBase_V1, pared down. Scheduler side: how many prompt
tokens a remote worker holds for a request beyond what is cached here, the note made once the
scheduler has allocated blocks for them, and, when a request finishes, whether its blocks are
kept for a remote worker (and the kv_transfer_params that say where). Worker side: start the
loads noted, wait for one to end, save (lease) a finished request's blocks, and report what
ended since the last step.

PDConnector is the one implementation: a prefill worker leases blocks and serves them from its
KV listener (tcp.py); a decode worker pulls them on background threads, so the engine's steps
go on while bytes move, and only checks in each step which pulls have ended. Both hold the
deployment's secret (auth.py): the listener serves only peers that prove it, the prefill worker
signs the kv_transfer_params it returns, and the decode worker takes only signed params for its
own engine id and its own prompt (check_params), so a client cannot point it anywhere else."""
import logging
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pdserve.errors import RequestError
from pdserve.kv_transfer import auth, tcp
from pdserve.kv_transfer.layout import KVLayout, slot_runs
from pdserve.kv_transfer.lease import LeaseTable

log = logging.getLogger("pdserve.kv_transfer")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class KVConnectorBase:
    # ---- scheduler side

    def get_num_new_matched_tokens(self, seq, num_computed_tokens: int) -> int:
        """Prompt tokens after the first num_computed_tokens whose K/V a remote worker holds for
        seq, to be loaded asynchronously (0: none; compute them here)."""
        return 0

    def update_state_after_alloc(self, seq, num_external_tokens: int) -> None:
        """seq now holds blocks for its prompt: load num_external_tokens positions from
        seq.num_computed_tokens on."""

    def request_finished(self, seq) -> dict | None:
        """seq finished: kv_transfer_params for its response if its blocks are kept for a remote
        worker (the engine then calls save_kv instead of freeing them), else None."""
        return None

    # ---- worker side

    def start_load_kv(self) -> None:
        """Start the loads noted since the last call (they run in the background)."""

    def wait_for_load(self, timeout: float) -> None:
        """Block until a load ends or a kept request's blocks may be freed, at most timeout seconds."""

    def save_kv(self, seq, params: dict) -> None:
        """Keep seq's blocks for a remote worker (request_finished said so, with these params)."""

    def get_finished(self) -> tuple[list["LoadResult"], list]:
        """(loads that ended since the last call, kept requests whose blocks are to be freed now)."""
        return [], []

    def wake(self) -> None:
        """End a wait_for_load now (any thread: new work has come)."""

    def cancel(self, seq) -> None:
        """seq was aborted while loading: stop its load (it still ends in get_finished)."""

    def discard(self, seq) -> None:
        """seq ended before its load was noted (aborted or failed while waiting): let the remote
        worker free what it keeps for it."""

    def has_pending(self) -> bool:
        return False

    def close(self) -> list:
        """Stop; the kept requests whose blocks the engine frees."""
        return []


def tokens_to_pull(seq, num_computed_tokens: int) -> int:
    """The prompt tokens a decode worker pulls for seq after the first num_computed_tokens (cached
    here): all but the last, which it computes itself, for its logits."""
    return max(0, seq.num_prompt_tokens - 1 - num_computed_tokens)


@dataclass
class LoadResult:
    seq: object
    start: int
    end: int
    error: str | None = None


@dataclass
class _Load:
    seq: object
    start: int
    end: int
    params: object
    runs: list
    cancelled: threading.Event = field(default_factory=threading.Event)
    conn: socket.socket | None = None   # the pull's connection, once made


class PDConnector(KVConnectorBase):
    def __init__(self, role: str, layout: KVLayout, block_size: int, dtype: str, *, secret: str,
                 host: str = "127.0.0.1", port: int = 0, transport: str = "tcp", lease_s: float = 60.0,
                 pull_threads: int = 2, cache_file: str | None = None, engine_id: str | None = None,
                 peers: set[tuple[str, int]] | None = None):
        self.role, self.layout, self.block_size, self.dtype, self.transport = role, layout, block_size, dtype, transport
        self.secret, self.peers = secret, peers
        self.engine_id = engine_id or uuid.uuid4().hex
        self.stats = tcp.TransferStats()
        self.leases: LeaseTable | None = None
        self.server: tcp.KVServer | None = None
        self.host = host if host not in WILDCARD_HOSTS else socket.gethostbyname(socket.gethostname())
        if role == "prefill":
            self.leases = LeaseTable(lease_s)
            self.server = tcp.KVServer(host, port, self.leases, layout, block_size, self.stats, secret, cache_file)
            log.info("KV listener on %s:%d (%s transport), leases of %g s", host, self.server.port, transport, lease_s)
        self._pool = ThreadPoolExecutor(pull_threads, thread_name_prefix="pdserve-kv-pull") if role == "decode" else None
        self._pending: list[_Load] = []
        self._loads: dict[str, _Load] = {}      # engine thread only
        self._ended: list[LoadResult] = []      # appended by pull threads
        self._lock = threading.Lock()
        self._event = self.leases.changed if self.leases is not None else threading.Event()

    @property
    def port(self) -> int | None:
        return None if self.server is None else self.server.port

    def info(self) -> dict:
        return {"role": self.role, "engine_id": self.engine_id, "block_size": self.block_size, "dtype": self.dtype,
                "transport": self.transport, "kv_host": self.host if self.server else None, "kv_port": self.port}

    def check_params(self, p, prompt_token_ids: list[int]) -> None:
        """A decode worker's check of a request's do_remote_prefill params before it takes them:
        issued (signed) by a prefill worker of this deployment, for this worker and this prompt,
        from an allowed listener. RequestError (400) otherwise: no connection is made."""
        def bad(name, why):
            raise RequestError(f"kv_transfer_params.{name} {why}", param=f"kv_transfer_params.{name}")

        if not auth.signed(self.secret, p.signed_fields() | {"signature": p.signature}):
            bad("signature", "is not a prefill worker's of this deployment (the params were changed, or the "
                             "workers have different --kv-transfer-secret)")
        if p.decode_engine_id != self.engine_id:
            bad("decode_engine_id", f"names another decode worker than this one ({self.engine_id})")
        if p.prompt_hash != auth.prompt_hash(prompt_token_ids):
            bad("prompt_hash", "is another prompt's: the lease holds the K/V of other tokens than this request's")
        if self.peers is not None and (p.remote_host, p.remote_port) not in self.peers:
            bad("remote_host", f"{p.remote_host}:{p.remote_port} is not one of this worker's --kv-transfer-peers")

    def _peer(self, p) -> tcp.Peer:
        return tcp.Peer(p.remote_host, p.remote_port, self.secret, self.engine_id)

    # ---- scheduler side

    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        p = seq.kv_transfer
        if p is None:
            return 0
        n = tokens_to_pull(seq, num_computed_tokens)
        if not n:   # all of it is cached here already: only the lease to free
            self.discard(seq)
        return n

    def discard(self, seq):
        p, seq.kv_transfer = seq.kv_transfer, None
        if p is not None and self._pool is not None:
            try:
                self._pool.submit(tcp.release, self._peer(p), p.remote_request_id)
            except RuntimeError:   # closing: the lease expires on the prefill worker
                pass

    def update_state_after_alloc(self, seq, num_external_tokens):
        start = seq.num_computed_tokens
        end = start + num_external_tokens
        runs = slot_runs(seq.block_table, self.block_size, start, end)
        self._pending.append(_Load(seq, start, end, seq.kv_transfer, runs))
        seq.kv_transfer = None   # loaded once: a later preemption recomputes

    def request_finished(self, seq):
        p = seq.params.kv_transfer_params
        if self.leases is None or p is None or not p.do_remote_decode or seq.finish_reason not in ("stop", "length"):
            return None
        params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                  "remote_host": self.host, "remote_port": self.port, "remote_request_id": auth.new_lease_id(),
                  "num_tokens": seq.num_prompt_tokens, "transport": self.transport, "block_size": self.block_size,
                  "dtype": self.dtype, "decode_engine_id": p.decode_engine_id,
                  "prompt_hash": auth.prompt_hash(seq.prompt_token_ids)}
        return {**params, "signature": auth.sign(self.secret, params)}

    # ---- worker side

    def start_load_kv(self):
        for load in self._pending:
            self._loads[load.seq.request_id] = load
            self._pool.submit(self._pull, load)
        self._pending = []

    def _pull(self, load: _Load) -> None:
        p, error, t0 = load.params, None, time.perf_counter()
        try:
            nbytes = tcp.pull(self._peer(p), p.remote_request_id, p.prompt_hash, load.start, load.end, self.layout,
                              load.runs, p.transport, load)
            self.stats.add(nbytes, time.perf_counter() - t0)
        except tcp.PullError as e:
            error = str(e)
            self.stats.add(0, 0.0, ok=False)
        except Exception as e:   # a bug: the request must still leave the loading state
            log.exception("KV pull of %s failed", load.seq.request_id)
            error = f"{type(e).__name__}: {e}"
        with self._lock:
            self._ended.append(LoadResult(load.seq, load.start, load.end, error))
        self._event.set()

    def wait_for_load(self, timeout):
        if self.leases is not None:
            deadline = self.leases.next_deadline()
            if deadline is not None:
                timeout = max(0.0, min(timeout, deadline - self.leases.clock()))
        self._event.wait(timeout)

    def wake(self):
        self._event.set()

    def save_kv(self, seq, params):
        self.leases.add(params["remote_request_id"], seq, seq.num_computed_tokens, params["decode_engine_id"],
                        params["prompt_hash"])

    def get_finished(self):
        freed = self.leases.collect() if self.leases is not None else []
        if self._pool is None:
            return [], freed
        self._event.clear()
        with self._lock:
            ended, self._ended = self._ended, []
        for r in ended:
            del self._loads[r.seq.request_id]
        return ended, freed

    def cancel(self, seq):
        load = self._loads.get(seq.request_id)
        if load is not None:
            load.cancelled.set()
            if load.conn is not None:   # wake a pull blocked on the socket
                try:
                    load.conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def has_pending(self):
        return bool(self._loads) or (self.leases is not None and len(self.leases) > 0)

    def close(self):
        if self.server is not None:
            self.server.close()
        if self._pool is not None:
            for load in list(self._loads.values()):
                self.cancel(load.seq)
            self._pool.shutdown(wait=True)
        return self.leases.collect(everything=True) if self.leases is not None else []
