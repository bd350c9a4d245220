"""Engine steps as server-sent events: the web page's live view, readable by any client.

The engine thread publishes one event per step into a bounded ring buffer and wakes the event
loop, with at most one wake-up pending. Each subscriber reads the ring from its own cursor: one
that falls behind (a slow client) skips the steps the ring no longer holds, seen as a gap in the
events' `seq`, and neither holds memory nor slows the engine. The JSON is written on the event
loop, once per event; the per-request detail is taken on the engine thread only while someone is
subscribed. docs/API.md describes the events.
"""
import asyncio
import collections
import itertools
import json
import logging
import threading
import time

from pdserve.engine.interface import paged
from pdserve.engine.sequence import SequenceStatus

log = logging.getLogger("pdserve.server")

RING_SIZE = 1024      # steps kept for subscribers (and for a new one's history)
MAX_REQUESTS = 64     # per-request entries in one event; the rest are counted in requests_omitted
KEEPALIVE_S = 15.0    # an SSE comment this often while idle, so proxies keep the stream open


class StepEvent:
    __slots__ = ("seq", "time", "step", "stats", "requests", "omitted", "_text")

    def __init__(self, seq, time, step, stats, requests, omitted):
        self.seq, self.time, self.step, self.stats = seq, time, step, stats
        self.requests, self.omitted = requests, omitted
        self._text = None

    def as_dict(self) -> dict:
        s, st = self.step, self.stats
        step = None if s is None else {
            "duration_s": s.duration, "forward_s": s.forward_time, "num_seqs": s.num_seqs,
            "prefill_tokens": s.num_prefill_tokens, "decode_tokens": s.num_decode_tokens,
            "preemptions": s.num_preemptions}
        return {"seq": self.seq, "time": self.time, "step": step, "running": st.num_running,
                "waiting": st.num_waiting, "kv_cache_usage": st.kv_cache_usage,
                "kv_free_blocks": st.num_free_blocks, "kv_total_blocks": st.num_total_blocks,
                "requests": _as_dicts(self.requests), "requests_omitted": self.omitted}

    def text(self) -> str:
        if self._text is None:
            data = json.dumps(self.as_dict(), separators=(",", ":"), allow_nan=False)
            self._text = f"event: step\nid: {self.seq}\ndata: {data}\n\n"
        return self._text


class StepEvents:
    def __init__(self, ring_size: int = RING_SIZE):
        self._ring: collections.deque[StepEvent] = collections.deque(maxlen=ring_size)
        self._lock = threading.Lock()          # the ring: appended by the engine thread, read on the loop
        self._next_seq = 0
        self._t0 = time.perf_counter()
        self._last_step = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiters: set[asyncio.Event] = set()   # one per subscriber; loop thread only
        self._wake_pending = False
        self._failed = False
        self.closed = False

    @property
    def ring_size(self) -> int:
        return self._ring.maxlen

    @property
    def num_subscribers(self) -> int:
        return len(self._waiters)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def close(self) -> None:
        """End every subscriber's stream (the server is shutting down). Any thread, even a signal handler."""
        self.closed = True
        self._wake()

    # ---- the engine thread

    def publish(self, engine, stats, outputs) -> None:
        """After engine.step(): an event if it ran a step or ended requests (aborts run no step).
        A failure here is logged, never raised: the live view must not stop the engine."""
        try:
            self._publish(engine, stats, outputs)
        except Exception:
            if not self._failed:
                log.exception("publishing an engine step event failed (reported once)")
            self._failed = True

    def _publish(self, engine, stats, outputs) -> None:
        step = engine.last_step
        if step is self._last_step:
            step = None
        if step is None and not any(out.finished for out in outputs):
            return
        self._last_step = step or self._last_step
        requests = omitted = None
        if self._waiters:
            requests, omitted = _requests(engine, step is not None, outputs)
        event_time = (step.start_time if step is not None else time.perf_counter()) - self._t0
        with self._lock:
            self._ring.append(StepEvent(self._next_seq, event_time, step, stats, requests, omitted))
            self._next_seq += 1
        if self._waiters:
            self._wake()

    def _wake(self) -> None:
        if self._wake_pending or self._loop is None:
            return
        self._wake_pending = True
        try:
            self._loop.call_soon_threadsafe(self._notify)
        except RuntimeError:   # the loop has closed: nobody is left to read
            pass

    # ---- the event loop

    def _notify(self) -> None:
        self._wake_pending = False   # first: a publish from now on schedules another wake-up
        for waiter in self._waiters:
            waiter.set()

    def _since(self, seq: int) -> list[StepEvent]:
        with self._lock:
            if not self._ring or self._ring[-1].seq < seq:
                return []
            out = []
            for event in reversed(self._ring):
                if event.seq < seq:
                    break
                out.append(event)
        out.reverse()
        return out

    async def subscribe(self, history: int = 0, greeting: str = ""):
        """SSE text: `greeting`, the last `history` steps still in the ring, then each new one as it
        happens, until close(). A keepalive comment while idle. Subscribed before the greeting is
        sent: every step after it carries per-request detail."""
        waiter = asyncio.Event()
        self._waiters.add(waiter)
        try:
            with self._lock:
                cursor = self._next_seq - min(history, len(self._ring))
            if greeting:
                yield greeting
            while not self.closed:
                waiter.clear()   # before reading: a step published after the read sets it again
                events = self._since(cursor)
                if events:
                    cursor = events[-1].seq + 1
                    yield "".join(e.text() for e in events)
                    continue
                try:
                    await asyncio.wait_for(waiter.wait(), KEEPALIVE_S)
                except TimeoutError:
                    yield ": keepalive\n\n"
        finally:
            self._waiters.discard(waiter)


def _requests(engine, stepped: bool, outputs) -> tuple[tuple[list, list], int]:
    """Each live request's phase and counters after the step, and what it did in it, as tuples
    (dicts only on the event loop, in _as_dicts: this runs on the engine thread)."""
    p = paged(engine)
    sched = p.last_schedule if stepped and p is not None else None   # None: a baseline
    scheduled, preempted = {}, ()
    if sched is not None:
        scheduled = {seq.request_id: (n, p) for seq, n, p in zip(sched.seqs, sched.num_tokens, sched.is_prefill)}
        preempted = {seq.request_id for seq in sched.preempted}
    none = (0, False)
    finished = []
    ended = [out for out in outputs if out.finished]
    for out in ended[:MAX_REQUESTS]:
        m = out.metrics
        finished.append((out.request_id, out.finish_reason, *scheduled.get(out.request_id, none),
                         len(out.prompt_token_ids), len(m.token_times), m.num_preemptions, m.ttft, m.tpot))
    live = []
    seqs = engine.seqs   # in arrival order
    waiting = (SequenceStatus.WAITING, SequenceStatus.WAITING_FOR_REMOTE_KVS)   # (the latter: its KV is pulled)
    for seq in itertools.islice(seqs.values(), MAX_REQUESTS - len(finished)):
        rid = seq.request_id
        if seq.status in waiting:
            state = "waiting"
        elif sched is None:
            state = "running"
        else:
            state = "prefill" if seq.num_computed_tokens < seq.prefill_len else "decode"
        live.append((rid, state, *scheduled.get(rid, none), rid in preempted, seq.num_prompt_tokens,
                     seq.num_computed_tokens, len(seq.token_ids) - seq.num_prompt_tokens, seq.metrics.num_preemptions))
    return (finished, live), len(ended) + len(seqs) - len(finished) - len(live)


def _as_dicts(requests) -> list[dict] | None:
    if requests is None:
        return None
    finished, live = requests
    return ([{"id": r, "state": "finished", "finish_reason": why, "step_tokens": n, "step_prefill": p,
              "prompt_tokens": prompt, "output_tokens": out, "preemptions": pre, "ttft_s": ttft, "tpot_s": tpot}
             for r, why, n, p, prompt, out, pre, ttft, tpot in finished]
            + [{"id": r, "state": state, "step_tokens": n, "step_prefill": p, "preempted": x, "prompt_tokens": prompt,
                "computed_tokens": computed, "output_tokens": out, "preemptions": pre}
               for r, state, n, p, x, prompt, computed, out, pre in live])
