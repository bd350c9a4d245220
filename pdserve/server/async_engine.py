"""The engine loop in its own thread, and the asyncio side the HTTP handlers talk to.

LLMEngine is not thread-safe, so handlers never touch it. They post "add" and "abort"
commands to a queue that the engine thread drains between steps, and read outputs from one
asyncio.Queue per HTTP request, which the engine thread feeds with loop.call_soon_threadsafe.
Every live request, whatever endpoint it came through, is in every step.

The thread that steps the engine is the one that built it (EngineThread): see there why.
"""
import asyncio
import collections
import logging
import queue
import threading
import time
from concurrent.futures import Future, wait

from pdserve.engine.interface import EngineClient, paged
from pdserve.engine.outputs import RequestOutput
from pdserve.errors import RequestError
from pdserve.sampling_params import SamplingParams
from pdserve.server.errors import APIError, Overloaded
from pdserve.server.limits import queue_full

log = logging.getLogger("pdserve.server")


class EngineDead(APIError):
    def __init__(self, why: str):
        super().__init__(503, f"the engine is not running: {why}", type="server_error", code="engine_dead")


class RequestTimeout(APIError):
    def __init__(self, timeout: float):
        super().__init__(504, f"the request did not finish within --request-timeout ({timeout:g} s) and was aborted",
                         type="server_error", code="request_timeout")


class ShutdownTimeout(APIError):
    def __init__(self, timeout: float):
        super().__init__(503, f"the server shut down: the request did not finish within --shutdown-timeout "
                              f"({timeout:g} s) and was aborted", type="server_error", code="shutdown_timeout")


class StepFailed(APIError):
    def __init__(self):
        super().__init__(500, "the engine failed while generating this request (see the server log)",
                         type="server_error", code="engine_error")


class KVTransferFailed(APIError):
    def __init__(self, why: str):
        super().__init__(502, why + " (--kv-load-failure-policy fail)", type="server_error", code="kv_transfer_failed")


class EngineThread:
    """One daemon thread that runs the calls it is given, in order: building the engine, then its loop.

    Why one thread for both: OpenMP (torch's CPU ops and pdserve's kernels) gives every thread that
    opens a parallel region a worker pool of its own. A model loaded on the main thread and stepped
    on another leaves two pools; with more pool threads than cores libgomp stops spinning between
    regions and puts its workers to sleep, so each of a step's hundreds of regions waits for a
    wake-up: a 0.5B batch-32 decode step took up to 7% longer (docs/PERFORMANCE.md)."""

    def __init__(self):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="pdserve-engine", daemon=True)
        self.thread.start()

    def submit(self, fn, *args, **kwargs) -> Future:
        future = Future()
        self._calls.put((future, fn, args, kwargs))
        return future

    def call(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on this thread; waits for it and returns (or raises) what it did."""
        return self.submit(fn, *args, **kwargs).result()

    def _serve(self) -> None:
        while True:
            future, fn, args, kwargs = self._calls.get()
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:   # handed to whoever waits on the future
                future.set_exception(e)


class Submission:
    """The engine requests of one HTTP request (its prompts x n choices), read as one stream."""

    def __init__(self, engine: "AsyncEngine", request_ids: list[str]):
        self._engine = engine
        self.request_ids = request_ids
        self.index = {rid: i for i, rid in enumerate(request_ids)}   # request id -> choice index
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(request_ids)
        self._aborted = False
        self._timer: asyncio.TimerHandle | None = None

    async def outputs(self):
        """RequestOutputs of all its engine requests, in step order, until all have finished.

        Raises the APIError that ended it early: a failed engine step (500), --request-timeout
        (504), a dead engine (503). The caller's cancel() then aborts the other choices."""
        while self.unfinished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.unfinished.discard(item.request_id)
                if item.finish_reason == "error":
                    if item.error is not None:   # its own fault (its grammar failed): a 400 saying why
                        raise APIError(400, str(item.error), param=item.error.param,
                                       code=getattr(item.error, "code", None))
                    kv = item.kv_transfer_params
                    raise KVTransferFailed(kv["error"]) if kv and "error" in kv else StepFailed()
            yield item
        self._stop_timer()

    async def collect(self) -> list[RequestOutput]:
        """Wait for all to finish; their final outputs in request_ids order."""
        finals: list[RequestOutput | None] = [None] * len(self.request_ids)
        try:
            async for out in self.outputs():
                if out.finished:
                    finals[self.index[out.request_id]] = out
        finally:
            self.cancel()
        return finals

    def cancel(self) -> None:
        """Abort whatever has not finished (the client left, the handler failed, the time ran
        out). Idempotent."""
        self._stop_timer()
        if self.unfinished and not self._aborted:
            self._aborted = True
            self._engine.abort(list(self.unfinished))

    def start_timer(self, seconds: float, timeout: float) -> None:
        """Abort and raise RequestTimeout in outputs() after `seconds`, whether or not anyone
        is reading: a stalled client must not keep its KV blocks."""
        self._timer = asyncio.get_running_loop().call_later(max(0.0, seconds), self._expire, timeout)

    def _expire(self, timeout: float) -> None:
        self._timer = None
        if self.unfinished:
            self.cancel()
            self.queue.put_nowait(RequestTimeout(timeout))

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class AsyncEngine:
    def __init__(self, engine, max_waiting: int, metrics=None, request_timeout: float | None = None,
                 thread: EngineThread | None = None, step_events=None):
        self.engine = engine
        self.thread = thread           # the one that built the engine; start() makes one if None
        self.max_waiting = max_waiting
        self.request_timeout = request_timeout   # seconds from arrival; None = no limit
        self.metrics = metrics
        self.step_events = step_events   # StepEvents: /v1/engine/steps
        self.accepting = True          # False once shutdown began: new requests get 503
        self.error: BaseException | None = None
        self._commands: collections.deque = collections.deque()  # loop thread appends, engine thread pops
        self._wake = threading.Event()
        self._stopping = False
        # What admission counts: requests posted but not yet handed to the engine, and the engine's
        # own waiting and running ones, updated as soon as the engine thread changes them (after
        # each drain and step, before the step's outputs reach the handlers). Written by both
        # threads, so under a lock.
        self._lock = threading.Lock()
        self._num_posted = 0
        self._num_engine_waiting = 0
        self._num_engine_running = 0
        self.max_num_seqs = engine.config.max_num_seqs
        self._paged = paged(engine)
        self._subs: dict[str, Submission] = {}   # request id -> its Submission; loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: Future | None = None   # the engine loop, on self.thread

    # ---- lifecycle (called on the event loop)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.step_events is not None:
            self.step_events.start(self._loop)
        if self.thread is None:
            self.thread = EngineThread()
        self._running = self.thread.submit(self._run)

    def stop(self, timeout: float = 10.0) -> None:
        self.accepting = False
        self._stopping = True
        self._wake.set()
        if self.step_events is not None:
            self.step_events.close()
        if self._running is not None:
            wait([self._running], timeout)
        self._fail_all(EngineDead("the server stopped"))

    def end_unfinished(self, timeout: float) -> None:
        """At the end of --shutdown-timeout: abort every request still running and end it with
        ShutdownTimeout (a stream sends it as its last event), so no client is cut off unawares."""
        for sub in set(self._subs.values()):
            sub.cancel()
        self._fail_all(ShutdownTimeout(timeout))

    @property
    def alive(self) -> bool:
        return self._running is not None and not self._running.done() and self.error is None

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return self._num_posted + self._num_engine_waiting

    def has_room(self, num_seqs: int) -> bool:
        """Whether `num_seqs` more requests fit: --max-waiting waiting slots plus the seats the next
        step will fill. Counting the seats is what lets as many clients as seats be served
        without ever being refused: a request posted into a free seat never waits."""
        with self._lock:
            return self._has_room(num_seqs)

    def _has_room(self, num_seqs: int) -> bool:
        free_seats = max(0, self.max_num_seqs - self._num_engine_running)
        return self._num_posted + self._num_engine_waiting + num_seqs <= self.max_waiting + free_seats

    # ---- the handlers' side

    async def submit(self, prompts: list[list[int]], params: list[SamplingParams], request_ids: list[str],
                     arrival_time: float) -> Submission:
        """Admit one engine request per (prompt, params, id); all or none.

        Raises Overloaded when the waiting queue is full, EngineDead, or the engine's RequestError.
        Refusals happen here, on the event loop, without waiting for the engine thread.
        """
        if self.error is not None or not self.alive:
            raise EngineDead(repr(self.error) if self.error else "the engine thread is not running")
        if not self.accepting:
            raise Overloaded("the server is shutting down", code="shutting_down")
        with self._lock:
            if not self._has_room(len(request_ids)):
                raise queue_full(self.max_waiting, self._num_posted + self._num_engine_waiting)
            self._num_posted += len(request_ids)
        sub = Submission(self, request_ids)
        for rid in request_ids:
            self._subs[rid] = sub
        admitted = self._loop.create_future()
        self._post(("add", list(zip(request_ids, prompts, params)), arrival_time, admitted))
        try:
            await admitted
        except asyncio.CancelledError:
            self.abort(request_ids)   # the add may still happen: the abort is queued behind it
            raise
        except BaseException:
            for rid in request_ids:
                self._subs.pop(rid, None)
            raise
        if self.request_timeout is not None:
            sub.start_timer(self.request_timeout - (time.perf_counter() - arrival_time), self.request_timeout)
        return sub

    def abort(self, request_ids: list[str]) -> None:
        self._post(("abort", request_ids))

    async def call(self, fn):
        """fn() on the engine thread between two steps (the engine is not thread-safe); its result."""
        if self.error is not None or not self.alive:
            raise EngineDead(repr(self.error) if self.error else "the engine thread is not running")
        done = self._loop.create_future()
        self._post(("call", fn, done))
        return await done

    def _post(self, command) -> None:
        self._commands.append(command)
        self._wake.set()
        if self._paged is not None:   # a step waiting for a KV pull returns at once
            self._paged.wake()

    # ---- the engine thread

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()   # before draining: a command posted after the drain sets it again
                self._drain()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait()
                    continue
                outputs = self.engine.step()
                stats = self.engine.get_stats()
                self._record(stats)
                if self.metrics is not None:
                    self.metrics.record_step(self.engine.last_step, stats, outputs)
                if self.step_events is not None:
                    self.step_events.publish(self.engine, stats, outputs)
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except BaseException as e:
            log.exception("engine loop failed; the server can no longer generate")
            self.error = e
            self._loop.call_soon_threadsafe(self._fail_all, EngineDead(f"{type(e).__name__}: {e}"))

    def _drain(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "abort":
                for rid in command[1]:
                    self.engine.abort_request(rid)
                continue
            if command[0] == "call":
                try:
                    result, error = command[1](), None
                except Exception as e:
                    result, error = None, e
                self._loop.call_soon_threadsafe(_resolve, command[2], error, result)
                continue
            _, items, arrival_time, admitted = command
            added, error = [], None
            try:
                for rid, prompt, params in items:
                    self.engine.add_request(rid, prompt, params, arrival_time=arrival_time)
                    added.append(rid)
            except Exception as e:   # RequestError, or a bug that must reach the client as a 500
                error = e
                for rid in added:    # all or none
                    self.engine.abort_request(rid)
                if not isinstance(e, RequestError):
                    log.exception("add_request failed")
            self._record(self.engine.get_stats(), handed_over=len(items))
            self._loop.call_soon_threadsafe(_resolve, admitted, error)

    def _record(self, stats, handed_over: int = 0) -> None:
        with self._lock:
            self._num_posted -= handed_over
            self._num_engine_waiting = stats.num_waiting
            self._num_engine_running = stats.num_running

    # ---- back on the event loop

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sub = self._subs.pop(out.request_id, None) if out.finished else self._subs.get(out.request_id)
            if sub is not None:
                sub.queue.put_nowait(out)

    def _fail_all(self, error: APIError) -> None:
        for sub in set(self._subs.values()):
            sub.queue.put_nowait(error)
        self._subs.clear()
        while self._commands:   # adds nobody will drain any more
            command = self._commands.popleft()
            if command[0] in ("add", "call"):
                _resolve(command[-1], error)




def _resolve(future: asyncio.Future, error: BaseException | None, result=None) -> None:
    if not future.done():   # the handler may have been cancelled meanwhile
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
