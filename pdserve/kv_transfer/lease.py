"""Leases on a prefill worker: the prompt blocks of finished requests, kept for a decode worker.

The engine thread adds a lease when a do_remote_decode request finishes and frees its blocks
when the lease is released or expires; the KV listener's threads read the blocks meanwhile. A
lease being read is never freed under the reader: a release or an expiry during a read takes
effect when the read ends."""
import threading
import time
from dataclasses import dataclass


class LeaseError(Exception):
    """No such lease: never granted, released, or expired."""


@dataclass
class Lease:
    holder: object          # what holds the blocks (the finished Sequence: BlockManager.free takes it)
    block_table: list[int]
    num_tokens: int         # positions whose K/V the blocks hold
    deadline: float
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

    def add(self, request_id: str, holder, num_tokens: int) -> None:
        with self._lock:
            self._leases[request_id] = Lease(holder, list(holder.block_table), num_tokens,
                                             self.clock() + self.lease_s)

    def acquire(self, request_id: str) -> Lease:
        """Start reading a live lease (LeaseError if there is none); end with finish_read."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.released:
                raise LeaseError(f"no KV lease for request {request_id!r} (never granted, released or freed)")
            if self.clock() >= lease.deadline:
                raise LeaseError(f"the KV lease of request {request_id!r} expired (--kv-lease-s {self.lease_s:g})")
            lease.readers += 1
            return lease

    def finish_read(self, lease: Lease) -> None:
        with self._lock:
            lease.readers -= 1
        self.changed.set()

    def release(self, request_id: str) -> bool:
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return False
            lease.released = True
        self.changed.set()
        return True

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
