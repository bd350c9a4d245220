"""Leases on a prefill worker: the prompt blocks of finished requests, kept for a decode worker.

The engine thread adds a lease when a do_remote_decode request finishes and frees its blocks
when the lease is released or expires; the KV listener's threads read the blocks meanwhile. A
lease being read is never freed under the reader: a release or an expiry during a read takes
effect when the read ends.

A lease is keyed by a random token (auth.new_lease_id) that only the prefill response carries,
never the request id the worker's endpoints show; it is made for one decode worker (the engine
id it proves on the KV channel) and one prompt (the hash of its token ids): only that worker may
read or release it, and only for that prompt."""
import threading
import time
from dataclasses import dataclass

from pdserve.kv_transfer.auth import same


class LeaseError(Exception):
    """No such lease (never granted, released, or expired), or not the asker's."""


@dataclass
class Lease:
    holder: object          # what holds the blocks (the finished Sequence: BlockManager.free takes it)
    block_table: list[int]
    num_tokens: int         # positions whose K/V the blocks hold
    deadline: float
    decode_id: str          # the engine id of the decode worker it was made for
    prompt_hash: str        # auth.prompt_hash of the prompt whose K/V the blocks hold
    readers: int = 0
    released: bool = False


class LeaseTable:
    def __init__(self, lease_s: float, clock=time.monotonic):
        self.lease_s = lease_s
        self.clock = clock
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self.changed = threading.Event()   # set when a lease may be freed now (a release, a read's end)

    def __len__(self) -> int:
        return len(self._leases)

    def add(self, lease_id: str, holder, num_tokens: int, decode_id: str, prompt_hash: str) -> None:
        with self._lock:
            self._leases[lease_id] = Lease(holder, list(holder.block_table), num_tokens, self.clock() + self.lease_s,
                                           decode_id, prompt_hash)

    def _get(self, lease_id: str, peer: str) -> Lease | None:
        """(Under the lock.) The lease of that id if it is live, LeaseError if it is another
        worker's (messages never name the token: they are logged)."""
        lease = self._leases.get(lease_id)
        if lease is not None and not same(lease.decode_id, peer):
            raise LeaseError("the KV lease was made for another decode worker")
        return None if lease is None or lease.released else lease

    def acquire(self, lease_id: str, peer: str, prompt_hash: str) -> Lease:
        """Start reading a live lease of `peer` for the prompt of that hash (LeaseError if there
        is none); end with finish_read."""
        with self._lock:
            lease = self._get(lease_id, peer)
            if lease is None:
                raise LeaseError("no such KV lease (never granted, released or freed)")
            if self.clock() >= lease.deadline:
                raise LeaseError(f"the KV lease expired (--kv-lease-s {self.lease_s:g})")
            if not same(lease.prompt_hash, prompt_hash):
                raise LeaseError("the KV lease holds another prompt's K/V")
            lease.readers += 1
            return lease

    def finish_read(self, lease: Lease) -> None:
        with self._lock:
            lease.readers -= 1
        self.changed.set()

    def release(self, lease_id: str, peer: str) -> None:
        """End `peer`'s lease (one already gone: nothing to do; LeaseError if it is another's)."""
        with self._lock:
            lease = self._get(lease_id, peer)
            if lease is None:
                return
            lease.released = True
        self.changed.set()

    def collect(self, everything: bool = False) -> list:
        """Remove the leases that are released or expired (all, with everything) and not being
        read; their holders, whose blocks the caller frees."""
        self.changed.clear()
        now = self.clock()
        with self._lock:
            done = [rid for rid, lease in self._leases.items() if lease.readers == 0
                    and (everything or lease.released or now >= lease.deadline)]
            return [self._leases.pop(rid).holder for rid in done]

    def next_deadline(self) -> float | None:
        with self._lock:
            return min((lease.deadline for lease in self._leases.values()), default=None)
