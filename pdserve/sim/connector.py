"""A simulated replica's KV connector: the scheduler-side contract of PDConnector (what a decode
worker pulls, the prefill worker's lease), with the pulls timed on the event loop instead of
moving bytes. The engine calls it as it calls PDConnector: park, start the loads at the step's
schedule, see the ended ones at the next step's start (LLMEngine._poll_connector)."""
import itertools
from collections.abc import Callable

from pdserve.kv_transfer.connector import KVConnectorBase, LoadResult, tokens_to_pull
from pdserve.sim.events import EventLoop

_lease_ids = itertools.count()


class SimConnector(KVConnectorBase):
    def __init__(self, role: str, loop: EventLoop, engine_id: str, block_size: int, kick: Callable[[], None],
                 pull_seconds: Callable[[int], float] | None = None, pulled: Callable | None = None):
        """kick(): the replica's engine has something new to see (a pull ended, a lease was freed);
        pull_seconds(tokens): a decode worker's pull time; pulled(params): a pull ended or was not
        needed, so the prefill worker's lease named in params may go."""
        self.role, self.loop, self.engine_id, self.block_size = role, loop, engine_id, block_size
        self.kick, self.pull_seconds, self.pulled = kick, pull_seconds, pulled
        self.leases: dict[str, object] | None = {} if role == "prefill" else None   # lease id -> sequence
        self._pending: list[tuple] = []
        self._loads: dict[str, tuple] = {}
        self._ended: list[LoadResult] = []
        self._freed: list = []

    # ---- scheduler side (PDConnector's rules)

    def get_num_new_matched_tokens(self, seq, num_computed_tokens):
        if seq.kv_transfer is None:
            return 0
        n = tokens_to_pull(seq, num_computed_tokens)
        if not n:
            self.discard(seq)
        return n

    def update_state_after_alloc(self, seq, num_external_tokens):
        start = seq.num_computed_tokens
        self._pending.append((seq, start, start + num_external_tokens, seq.kv_transfer))
        seq.kv_transfer = None   # loaded once: a later preemption recomputes

    def request_finished(self, seq):
        p = seq.params.kv_transfer_params
        if self.leases is None or p is None or not p.do_remote_decode or seq.finish_reason not in ("stop", "length"):
            return None
        return {"do_remote_prefill": True, "remote_engine_id": self.engine_id, "remote_host": "simulated",
                "remote_port": 1, "remote_request_id": f"lease-{next(_lease_ids)}", "num_tokens": seq.num_prompt_tokens,
                "block_size": self.block_size, "decode_engine_id": p.decode_engine_id, "prompt_hash": "simulated",
                "signature": "simulated"}

    def check_params(self, p, prompt_token_ids):
        """Nothing to check: the simulation made the params."""

    # ---- worker side

    def start_load_kv(self):
        for seq, start, end, params in self._pending:
            self._loads[seq.request_id] = (seq, start, end, params)
            self.loop.at(self.loop.now + self.pull_seconds(end - start), self._load_ended, seq.request_id)
        self._pending = []

    def _load_ended(self, request_id: str) -> None:
        seq, start, end, params = self._loads.pop(request_id)
        self._ended.append(LoadResult(seq, start, end))
        self.pulled(params)
        self.kick()

    def save_kv(self, seq, params):
        self.leases[params["remote_request_id"]] = seq

    def release(self, lease_id: str) -> None:
        """The decode worker has pulled (or will not): the lease's blocks are freed at the next step."""
        seq = self.leases.pop(lease_id, None)
        if seq is not None:
            self._freed.append(seq)
            self.kick()

    def get_finished(self):
        ended, freed, self._ended, self._freed = self._ended, self._freed, [], []
        return ended, freed

    def discard(self, seq):
        p, seq.kv_transfer = seq.kv_transfer, None
        if p is not None and self.pulled is not None:
            self.pulled(p)

    def has_pending(self):
        return bool(self._pending or self._loads or self._ended or self._freed or self.leases)
