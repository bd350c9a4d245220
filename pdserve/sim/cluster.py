"""A simulated deployment: N colocated replicas behind a router, or xPyD pools of prefill and
decode workers behind a proxy, driven by clients that send a workload (open loop at its arrival
times, or closed loop under a concurrency cap as `pdserve bench --max-concurrency` does).

Disaggregated requests go as pdserve's proxy sends them (proxy/relay.py): the decode worker is
chosen first; the prefill worker runs the prompt with max_tokens 1 and keeps its blocks under a
lease for it; the decode worker is then called with the kv_transfer_params the prefill worker
returned, and its engine does what a --role decode engine does (the scheduler parks the request
with blocks for its prompt, outside budget and seats, while the K/V of all but the last prompt
token is pulled in latency + bytes / bandwidth; then it waits for a seat at the front of the
queue, computes that token and decodes). The lease ends when the pull is done."""
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from pdserve.bench.bench_metrics import RequestResult
from pdserve.config import EngineConfig
from pdserve.kv_transfer.params import KVTransferParams
from pdserve.objectives import RequestObjectives
from pdserve.sampling_params import SamplingParams
from pdserve.sim.events import EventLoop
from pdserve.sim.replica import Replica
from pdserve.sim.workload import SimRequest

ROUTERS = ("round-robin", "least-loaded", "prefix-aware")


@dataclass(frozen=True)
class Placement:
    replicas: int = 1   # colocated engines (prefill and decode in each)
    prefill: int = 0    # xPyD: prefill and decode workers (both > 0), replicas unused
    decode: int = 0

    def __post_init__(self):
        if (self.prefill > 0) != (self.decode > 0):
            raise ValueError("a disaggregated placement needs at least one prefill and one decode worker")
        if self.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {self.replicas}")

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    @property
    def machines(self) -> int:
        return self.prefill + self.decode if self.disaggregated else self.replicas

    @property
    def label(self) -> str:
        return f"{self.prefill}P{self.decode}D" if self.disaggregated else f"{self.replicas}x colocated"


@dataclass(frozen=True)
class KVTransfer:
    bytes_per_token: int
    bandwidth: float = 10e9   # bytes/s
    latency_s: float = 0.002  # the proxy's hop and the pull's round trip

    def seconds(self, tokens: int) -> float:
        return self.latency_s + tokens * self.bytes_per_token / self.bandwidth


@dataclass(frozen=True)
class ReplicaSpec:
    cfg: EngineConfig
    num_blocks: int
    max_model_len: int
    vocab_size: int

    @property
    def kv_capacity(self) -> int:
        return self.num_blocks * self.cfg.block_size


@dataclass
class SimResult:
    results: list[RequestResult]   # in send order, as pdserve bench keeps them
    duration: float
    replicas: list[dict] = field(default_factory=list)


class Router:
    """round-robin; least-loaded (fewest requests waiting, running or loading; ties: the first);
    prefix-aware: the Ray app's and the proxy's router (pdserve/routing.py), which remembers the prompt
    blocks it sent to each replica and counts the requests it has in flight there."""

    def __init__(self, replicas: list[Replica], kind: str, block_size: int = 16, capacity_blocks: int = 1 << 16):
        if kind not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {kind!r}")
        self.replicas, self.kind = replicas, kind
        self._next = itertools.cycle(range(len(replicas)))
        self._kv = None
        if kind == "prefix-aware":
            from pdserve.routing import Router as KVAwareRouter   # plain Python: no Ray needed
            self._kv, self.block_size, self.capacity_blocks = KVAwareRouter(kind), block_size, capacity_blocks

    def pick(self, prompt: list[int] = ()) -> Replica:
        if self._kv is not None:
            from pdserve.routing import prompt_block_hashes
            hashes = prompt_block_hashes(prompt, self.block_size)
            replica, _ = self._kv.choose(self.replicas, hashes)
            self._kv.record(replica, hashes, self.capacity_blocks)
            self._kv.sent(replica)
            return replica
        if self.kind == "round-robin":
            return self.replicas[next(self._next)]
        return min(self.replicas, key=lambda r: r.load)   # ties: the first

    def completed(self, replica: Replica) -> None:
        """A request sent to `replica` has its answer (or its refusal)."""
        if self._kv is not None:
            self._kv.completed(replica)


class Simulation:
    def __init__(self, spec: ReplicaSpec, placement: Placement, step_time, router: str = "round-robin",
                 transfer: KVTransfer | None = None, max_concurrency: int | None = None, prefill_step_time=None,
                 router_latency_s: float = 0.0):
        """prefill_step_time: the prefill workers' own step-time model (default: step_time);
        router_latency_s: what the router's (or proxy's) hops add to each request, there and back
        (a Ray ingress, an HTTP proxy): the request reaches its replica that much later."""
        if placement.disaggregated and transfer is None:
            raise ValueError("a disaggregated placement needs a KV transfer model")
        self.loop, self.spec, self.placement, self.transfer = EventLoop(), spec, placement, transfer
        self.max_concurrency = max_concurrency
        self.router_latency_s = router_latency_s

        def make(name, role="both", st=step_time):
            return Replica(self.loop, name, spec.cfg, st, spec.num_blocks, spec.max_model_len, spec.vocab_size,
                           self._on_output, role, transfer.bytes_per_token if transfer else 0,
                           transfer.seconds if transfer else None, self._pulled)
        if placement.disaggregated:
            self.prefill = [make(f"prefill-{i}", "prefill", prefill_step_time or step_time)
                            for i in range(placement.prefill)]
            self.decode = [make(f"decode-{i}", "decode") for i in range(placement.decode)]
            self.prefill_router, self.router = self._router(self.prefill, router), self._router(self.decode, router)
        else:
            self.prefill, self.decode = [], [make(f"replica-{i}") for i in range(placement.replicas)]
            self.router = self._router(self.decode, router)
        self.workers = {r.name: r for r in self.prefill + self.decode}
        self.results: list[RequestResult | None] = []
        self._client: dict[str, tuple[int, float, SimRequest]] = {}   # request id -> (index, send time, request)
        self._decode_of: dict[str, Replica] = {}   # a prefill request's id -> the decode worker chosen for it
        self._backlog: deque = deque()
        self._in_flight = 0

    def _router(self, replicas: list[Replica], kind: str) -> Router:
        return Router(replicas, kind, self.spec.cfg.block_size, self.spec.num_blocks)

    def run(self, requests: list[SimRequest]) -> SimResult:
        self.results = [None] * len(requests)
        for i, r in enumerate(requests):
            self.loop.at(r.arrival, self._arrive, i, r)
        self.loop.run()
        missing = [i for i, r in enumerate(self.results) if r is None]
        if missing:   # a bug, not a workload: every request ends as a result or a refusal
            raise RuntimeError(f"{len(missing)} requests never finished (first: {missing[0]})")
        ends = [r.start_time + r.latency for r in self.results if r.success]
        stats = [{"name": r.name, "steps": r.num_steps, "busy_s": r.busy_time, "preemptions": r.num_preemptions}
                 for r in self.prefill + self.decode]
        return SimResult(self.results, max(ends, default=0.0), stats)

    # ---- the clients and the proxy

    def _arrive(self, i: int, r: SimRequest) -> None:
        if self.max_concurrency is not None and self._in_flight >= self.max_concurrency:
            self._backlog.append((i, r))
            return
        self._send(i, r)

    def _send(self, i: int, r: SimRequest) -> None:
        """The request leaves its client; as pdserve's proxy does, the decode worker is chosen
        before the prefill call (its lease is made for that worker)."""
        now, rid = self.loop.now, f"req-{i}"
        self._in_flight += 1
        self._client[rid] = (i, now, r)
        decode = self.router.pick(r.prompt)
        call = (decode, rid, r, r.output_len, None)
        if self.placement.disaggregated:
            prefill = self.prefill_router.pick(r.prompt)
            self._decode_of[f"{rid}-prefill"] = decode
            call = (prefill, f"{rid}-prefill", r, 1, KVTransferParams(do_remote_decode=True, decode_engine_id=decode.name))
        if self.router_latency_s > 0:
            self.loop.at(now + self.router_latency_s, self._call, *call)
        else:   # now, before a step ending at this instant starts the next
            self._call(*call)

    def _call(self, replica: Replica, request_id: str, r: SimRequest, max_tokens: int, kv) -> None:
        """The request reaches a replica; a refusal is the client's answer (the server's 400)."""
        obj = RequestObjectives(r.priority, r.ttft_ms, r.tpot_ms) if (r.priority or r.ttft_ms or r.tpot_ms) else None
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, final_only=True, objectives=obj,
                                kv_transfer_params=kv)
        why = replica.add(request_id, r.prompt, params)
        if why is None:
            return
        if kv is not None and kv.do_remote_prefill:   # the proxy ends the lease of a refused decode call
            self._pulled(kv)
        rid = request_id.removesuffix("-prefill")
        decode = self._decode_of.pop(request_id, None)
        if decode is not None:   # the prefill call was refused: the decode worker chosen is not called
            self.prefill_router.completed(replica)
            replica = decode
        self.router.completed(replica)
        i, sent, _ = self._client.pop(rid)
        self._done(i, RequestResult(prompt_len=len(r.prompt), start_time=sent, kind=r.kind, error=why))

    def _done(self, i: int, result: RequestResult) -> None:
        self.results[i] = result
        self._in_flight -= 1
        if self._backlog:
            self._send(*self._backlog.popleft())

    # ---- the replicas' callbacks

    def _pulled(self, kv) -> None:
        """A decode worker has pulled a prompt's KV (or needs it no more): the lease ends."""
        self.workers[kv.remote_engine_id].connector.release(kv.remote_request_id)

    def _on_output(self, replica: Replica, out, now: float) -> None:
        decode = self._decode_of.pop(out.request_id, None)
        rid = out.request_id.removesuffix("-prefill")
        i, sent, r = self._client[rid]
        if decode is not None:   # a prefill worker's part is done: the proxy calls the decode worker
            self.prefill_router.completed(replica)
            if out.kv_transfer_params is not None:
                kv = KVTransferParams.from_dict(out.kv_transfer_params)
                return self._call(decode, rid, r, r.output_len, kv)
            replica = decode
        self.router.completed(replica)
        del self._client[rid]
        if out.finish_reason == "error" or out.kv_transfer_params is None and decode is not None:
            return self._done(i, RequestResult(prompt_len=len(r.prompt), start_time=sent, kind=r.kind,
                                               error=f"{out.request_id} failed"))
        m = out.metrics
        t = m.token_times
        self._done(i, RequestResult(prompt_len=len(r.prompt), output_tokens=len(out.token_ids),
                                    ttft=m.first_token_time - sent, itl=[b - a for a, b in zip(t, t[1:])],
                                    latency=m.finished_time - sent, start_time=sent, success=True, kind=r.kind))


def kv_blocks(spec_cfg: EngineConfig, bytes_per_block: int, max_model_len: int, memory: float | None = None) -> int:
    """The KV cache's blocks as the engine sizes them (ModelRunner._num_blocks), or those that
    `memory` bytes hold when given (a GPU's memory left after the weights)."""
    from pdserve.engine.model_runner import DEFAULT_KV_CACHE_CAP
    c = spec_cfg
    if c.num_kv_blocks is not None:
        return c.num_kv_blocks
    if c.kv_cache_memory is not None:
        return max(1, c.kv_cache_memory // bytes_per_block)
    if memory is not None:
        return max(1, int(memory // bytes_per_block))
    want = c.max_num_seqs * math.ceil(max_model_len / c.block_size)
    return max(1, min(want, DEFAULT_KV_CACHE_CAP // bytes_per_block))
