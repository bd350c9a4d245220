"""A simulated deployment: N colocated replicas behind a router, or xPyD pools of prefill and
decode workers behind a proxy, driven by clients that send a workload (open loop at its arrival
times, or closed loop under a concurrency cap as `pdserve bench --max-concurrency` does).

Disaggregated requests follow the prefill/decode contract of pdserve's proxy: a prefill worker
runs the prompt with max_tokens 1 and keeps its blocks under a lease; the decode worker takes
blocks and a seat, pulls the K/V of all but the last prompt token (latency + bytes / bandwidth),
computes that token itself and decodes; the lease ends when the pull is done."""
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from pdserve.bench.bench_metrics import RequestResult
from pdserve.config import EngineConfig
from pdserve.engine.sequence import Sequence
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
    prefix-aware: the Ray app's own router (pdserve/ray/routing.py), which remembers the prompt
    blocks it sent to each replica and counts the requests it has in flight there."""

    def __init__(self, replicas: list[Replica], kind: str, block_size: int = 16, capacity_blocks: int = 1 << 16):
        if kind not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {kind!r}")
        self.replicas, self.kind = replicas, kind
        self._next = itertools.cycle(range(len(replicas)))
        self._kv = None
        if kind == "prefix-aware":
            from pdserve.ray.routing import Router as KVAwareRouter   # plain Python: no Ray needed
            self._kv, self.block_size, self.capacity_blocks = KVAwareRouter(kind), block_size, capacity_blocks

    def pick(self, prompt: list[int] = ()) -> Replica:
        if self._kv is not None:
            from pdserve.ray.routing import prompt_block_hashes
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
        make = lambda name, st=step_time: Replica(self.loop, name, spec.cfg, st, spec.num_blocks,   # noqa: E731
                                                  spec.max_model_len, spec.vocab_size, self._on_finish)
        if placement.disaggregated:
            self.prefill = [make(f"prefill-{i}", prefill_step_time or step_time) for i in range(placement.prefill)]
            self.decode = [make(f"decode-{i}") for i in range(placement.decode)]
            for r in self.prefill:
                r.hold_kv = True
            self.prefill_router, self.router = self._router(self.prefill, router), self._router(self.decode, router)
        else:
            self.prefill, self.decode = [], [make(f"replica-{i}") for i in range(placement.replicas)]
            self.router = self._router(self.decode, router)
        self.results: list[RequestResult | None] = []
        self._client: dict[int, tuple[int, float, SimRequest]] = {}   # id(seq) -> (index, send time, request)
        self._decode_of: dict[int, tuple[Sequence, int, float, SimRequest]] = {}   # prefill seq -> its decode
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

    # ---- the clients

    def _arrive(self, i: int, r: SimRequest) -> None:
        if self.max_concurrency is not None and self._in_flight >= self.max_concurrency:
            self._backlog.append((i, r))
            return
        self._send(i, r)

    def _send(self, i: int, r: SimRequest) -> None:
        now, spec = self.loop.now, self.spec
        self._in_flight += 1
        n, m = len(r.prompt), r.output_len
        limit = min(spec.max_model_len, spec.kv_capacity)
        if n + m > limit:   # the server's 400: a refusal, as pdserve bench records it
            return self._done(i, RequestResult(prompt_len=n, start_time=now, kind=r.kind,
                                               error=f"prompt ({n}) + max_tokens ({m}) exceeds {limit} tokens"))
        seq = self._sequence(f"req-{i}", r, m, now)
        if self.placement.disaggregated:
            first = self._sequence(f"req-{i}-prefill", r, 1, now)
            self._decode_of[id(first)] = (seq, i, now, r)
            router, seq_to_add = self.prefill_router, first
        else:
            router, seq_to_add = self.router, seq
        target = router.pick(r.prompt)
        why = target.scheduler.policy.refuse(seq_to_add, target.scheduler, now)
        if why is not None:
            self._decode_of.pop(id(seq_to_add), None)
            router.completed(target)
            return self._done(i, RequestResult(prompt_len=n, start_time=now, kind=r.kind, error=why))
        self._client[id(seq)] = (i, now, r)
        if self.router_latency_s > 0:
            seq.metrics.arrival_time = seq_to_add.metrics.arrival_time = now + self.router_latency_s
            self.loop.at(now + self.router_latency_s, target.add, seq_to_add)
        else:
            target.add(seq_to_add)

    def _sequence(self, rid: str, r: SimRequest, max_tokens: int, now: float) -> Sequence:
        obj = RequestObjectives(r.priority, r.ttft_ms, r.tpot_ms) if (r.priority or r.ttft_ms or r.tpot_ms) else None
        seq = Sequence(rid, r.prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, objectives=obj), now)
        cfg = self.spec.cfg
        ttft = r.ttft_ms if r.ttft_ms is not None else cfg.slo_ttft_ms
        tpot = r.tpot_ms if r.tpot_ms is not None else cfg.slo_tpot_ms
        seq.metrics.ttft_target = None if ttft is None else ttft / 1e3
        seq.metrics.tpot_target = None if tpot is None else tpot / 1e3
        return seq

    def _done(self, i: int, result: RequestResult) -> None:
        self.results[i] = result
        self._in_flight -= 1
        if self._backlog:
            self._send(*self._backlog.popleft())

    # ---- the replicas' callbacks

    def _on_finish(self, replica: Replica, seq: Sequence, now: float) -> None:
        handoff = self._decode_of.pop(id(seq), None)
        if handoff is not None:   # a prefill worker's part is done: the proxy sends it on
            self.prefill_router.completed(replica)
            decode_seq = handoff[0]
            target = self.router.pick(decode_seq.prompt_token_ids)
            target.add_remote(decode_seq, self.transfer.seconds(decode_seq.num_tokens - 1),
                              lambda: replica.release(seq))
            return
        self.router.completed(replica)
        i, sent, r = self._client.pop(id(seq))
        m = seq.metrics
        t = m.token_times
        self._done(i, RequestResult(prompt_len=seq.num_prompt_tokens, output_tokens=seq.num_output_tokens,
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
